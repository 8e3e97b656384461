"""Sampling: temperature, top-k, top-p, penalties, and lossless speculative sampling.

Everything here is a pure function of tensors (plus ``SamplingState``, which owns the
seeded random stream and the token counts of one request), so the reference backend calls
it eagerly and the graph backends call the very same functions inside captured graphs,
with the random numbers and the parameters as static device inputs.

Random numbers are uniforms in [0, 1) drawn on the host from one ``torch.Generator``
seeded per request, a fixed number per step (AR 1, draft D, verify D + 1), so the same
seed and request give the same text on every backend and device.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft d_j ~ q_j, accept
it with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection sample from
norm(max(0, p_j − q_j)); when all D are accepted sample the bonus token from p_{D+1}.
The committed tokens are then distributed exactly as AR sampling from p.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    """A sampling parameter out of range (the message names it and its valid range)."""


def _whole(value) -> bool:
    """An int and not a bool (``True`` is an int to Python, and a seed of True is a typo)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens with mass >= top_p
    top_k: int = 0  # keep the k most likely tokens; 0: all
    repetition_penalty: float = 1.0  # CTRL / transformers: prompt and generated tokens
    frequency_penalty: float = 0.0  # OpenAI: minus penalty x count, generated tokens
    presence_penalty: float = 0.0  # OpenAI: minus penalty once a token was generated
    seed: int | None = None  # None: a fresh random seed per request

    def __post_init__(self) -> None:
        checks = (
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "a number >= 0 (0 = greedy)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", _whole(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             "a number > 0 (1 = off)"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
        )
        for name, ok, what in checks:
            if not ok:
                raise SamplingError(f"{name} must be {what}, got {getattr(self, name)!r}")
        if self.seed is not None and not (_whole(self.seed) and 0 <= self.seed < 2 ** 63):
            raise SamplingError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits: the decoding path that existed before sampling."""
        return self.temperature == 0.0 and not self.penalized


# --- pure functions ---------------------------------------------------------------------------

def penalize(logits, seen, generated, repetition, frequency, presence):
    """logits [R, V]; seen [R, V] counts of prompt + generated tokens; generated [R, V]
    counts of generated tokens -> [R, V]. Neutral values leave the logits bit for bit."""
    rep = torch.where(logits > 0, logits / repetition, logits * repetition)
    out = torch.where(seen > 0, rep, logits)
    return out - frequency * generated - presence * (generated > 0).to(logits.dtype)


def filtered_probs(logits, temperature, top_k, top_p):
    """logits [R, V] -> probabilities [R, V] after temperature, top-k then top-p.

    ``temperature`` 0 gives the one-hot argmax row. ``top_k`` counts tokens (>= V: off).
    Scalars may be Python numbers or 0-dim tensors (static graph inputs)."""
    temperature = torch.as_tensor(temperature, dtype=logits.dtype, device=logits.device)
    scaled = logits / torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [R, V] each
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    keep = ranks < top_k  # [V] -> broadcast [R, V]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    p_sorted = torch.softmax(sorted_logits, dim=-1)
    # Nucleus: keep a token while the mass before it is below top_p (the first always stays).
    keep = keep & ((p_sorted.cumsum(dim=-1) - p_sorted) < top_p)
    p_sorted = torch.where(keep, p_sorted, torch.zeros_like(p_sorted))
    p_sorted = p_sorted / p_sorted.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(p_sorted).scatter(-1, order, p_sorted)
    greedy = torch.zeros_like(probs).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(temperature > 0, probs, greedy)


def inverse_cdf(weights, uniforms):
    """weights [R, V] >= 0 (need not be normalised); uniforms [R] in [0, 1) -> tokens [R].

    Token i is drawn with probability weights[i] / sum: it is the first index whose
    cumulative weight exceeds u x total, so a zero-weight token is never chosen."""
    cdf = weights.cumsum(dim=-1)  # [R, V]
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)  # [R, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [R]
    return idx.clamp(max=weights.shape[-1] - 1)


def _one_hot(tokens, vocab: int, dtype):
    """tokens [N] -> [N, V]; a comparison, not F.one_hot, whose range check syncs the host."""
    return (tokens.unsqueeze(-1) == torch.arange(vocab, device=tokens.device)).to(dtype)


def one_hot_counts(tokens, vocab: int, dtype):
    """tokens [N] -> [N + 1, V]: row r counts tokens[:r] (row 0 is all zeros)."""
    hot = _one_hot(tokens, vocab, dtype)  # [N, V]
    return torch.cat([torch.zeros_like(hot[:1]), hot.cumsum(dim=0)])


def sample_drafts(logits, seen, generated, params, uniforms, penalized: bool, calibration=None):
    """Draft-role logits [D, V] -> (drafts [D] int64, q [D, V], confidences [D]).

    d_j ~ q_j; with penalties q_j counts d_1..d_{j-1} as generated (sampled one row at a
    time), without them all rows are sampled at once. confidence_j = min(q_j(d_j), c_j), c_j
    the softmax of the (penalised) logits at d_j mapped by ``calibration`` (the artifact's
    ``ConfidenceCalibration`` from slot 0, as greedy drafts get it): temperature < 1, top-k and top-p
    sharpen q, and a confidence read from q alone let hybrid commit whole blocks unverified
    (top_k = 1: every q_j(d_j) = 1); c_j is the greedy confidence τ was chosen for. At
    temperature 0 (q one-hot) the confidence is exactly the greedy one."""
    temperature, top_k, top_p, rep, freq, pres = params
    if not penalized:
        q = filtered_probs(logits, temperature, top_k, top_p)
        drafts = inverse_cdf(q, uniforms)
        plain = torch.softmax(logits, dim=-1)
    else:
        rows, picks, plains = [], [], []
        seen_j, gen_j = seen, generated  # [V] each
        for j in range(logits.shape[0]):
            row = penalize(logits[j:j + 1], seen_j, gen_j, rep, freq, pres)
            q_j = filtered_probs(row, temperature, top_k, top_p)  # [1, V]
            d_j = inverse_cdf(q_j, uniforms[j:j + 1])  # [1]
            hot = _one_hot(d_j, logits.shape[-1], seen.dtype)[0]  # [V]
            seen_j, gen_j = seen_j + hot, gen_j + hot
            rows.append(q_j)
            picks.append(d_j)
            plains.append(torch.softmax(row, dim=-1))
        q, drafts, plain = torch.cat(rows), torch.cat(picks), torch.cat(plains)
    at = drafts.unsqueeze(1)
    greedy_confidence = plain.gather(1, at).squeeze(1)
    if calibration is not None:
        greedy_confidence = calibration(greedy_confidence, 0)
    return drafts, q, torch.minimum(q.gather(1, at).squeeze(1), greedy_confidence)


def target_probs(logits, drafts, seen, generated, params, penalized: bool):
    """Verify-role logits [D + 1, V] over [anchor, d_1..d_D] -> p [D + 1, V]; row r is
    the distribution of the token after d_r, so its counts include d_1..d_r."""
    temperature, top_k, top_p, rep, freq, pres = params
    if penalized:
        extra = one_hot_counts(drafts, logits.shape[-1], seen.dtype)  # [D + 1, V]
        logits = penalize(logits, seen + extra, generated + extra, rep, freq, pres)
    return filtered_probs(logits, temperature, top_k, top_p)


def speculative_accept(p, q, drafts, accept_uniforms, final_uniform):
    """p [D + 1, V] target rows, q [D, V] draft rows, drafts [D], accept_uniforms [D],
    final_uniform [1] -> (accepted a [1] int64, next token [1] int64).

    Accept d_j while u_j < p_j(d_j) / q_j(d_j) (as u_j·q < p: q(d_j) > 0 since d_j ~ q_j);
    the next token comes from norm(max(0, p_a − q_a)) after a rejection at row a, or from
    p_{D+1} when every draft is accepted."""
    d = q.shape[0]
    p_d = p[:d].gather(1, drafts.unsqueeze(1)).squeeze(1)  # [D]
    q_d = q.gather(1, drafts.unsqueeze(1)).squeeze(1)  # [D]
    accept = (accept_uniforms.to(p.dtype) * q_d < p_d).long()
    accepted = accept.cumprod(0).sum().view(1)  # [1]
    rows = torch.cat([(p[:d] - q).clamp(min=0), p[d:]])  # [D + 1, V]
    dist = rows.index_select(0, accepted)  # [1, V]
    # p_a = q_a leaves no residual mass, but then d_a is never rejected; rounding can
    # still empty it, and then p_a itself is the right distribution.
    empty = dist.sum(dim=-1, keepdim=True) <= 0
    dist = torch.where(empty, p.index_select(0, accepted), dist)
    return accepted, inverse_cdf(dist, final_uniform)


# --- one request's state ----------------------------------------------------------------------

class SamplingState:
    """The seeded uniforms, token counts and parameter tensors of one generation."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, device,
                 dtype=torch.float32):
        self.params = params
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator().manual_seed(self.seed)
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.seen = torch.zeros(vocab_size, dtype=dtype, device=self.device)  # [V]
        self.generated = torch.zeros(vocab_size, dtype=dtype, device=self.device)  # [V]
        if params.repetition_penalty != 1.0:
            self._add(self.seen, prompt_ids)
        top_k = params.top_k if params.top_k > 0 else vocab_size
        self.values = (params.temperature, top_k, params.top_p, params.repetition_penalty,
                       params.frequency_penalty, params.presence_penalty)

    @property
    def penalized(self) -> bool:
        return self.params.penalized

    def uniforms(self, n: int) -> torch.Tensor:
        """[n] float64 uniforms in [0, 1) on the host, the next n of this request's stream."""
        return torch.rand(n, generator=self.generator, dtype=torch.float64)

    def _add(self, counts: torch.Tensor, tokens: list[int]) -> None:
        if tokens:
            idx = torch.tensor(tokens, dtype=torch.long, device=counts.device)
            counts.index_add_(0, idx, torch.ones(len(tokens), dtype=counts.dtype, device=counts.device))

    def commit(self, tokens: list[int]) -> None:
        """Committed tokens join the penalty counts (untouched when penalties are off)."""
        if self.penalized:
            self._add(self.seen, tokens)
            self._add(self.generated, tokens)

    # -- eager steps (the reference backend) ---------------------------------------------------
    def next_token(self, logits: torch.Tensor) -> int:
        """One AR step: logits [1, V] -> the sampled token."""
        logits = logits.to(self.seen.dtype) if logits.dtype != self.seen.dtype else logits
        if self.penalized:
            logits = penalize(logits, self.seen, self.generated, *self.values[3:])
        probs = filtered_probs(logits, *self.values[:3])
        return int(inverse_cdf(probs, self.uniforms(1).to(logits.device))[0])

    def draft(self, logits: torch.Tensor, calibration=None):
        """Draft logits [D, V] -> (drafts [D], q [D, V], confidences [D]); ``calibration``:
        the artifact's confidence map, or None (see ``sample_drafts``)."""
        u = self.uniforms(logits.shape[0]).to(logits.device)
        return sample_drafts(logits.to(self.seen.dtype), self.seen, self.generated, self.values, u, self.penalized,
                             calibration)

    def verify(self, logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor) -> tuple[int, int]:
        """Verify logits [D + 1, V], drafts [D], q [D, V] -> (accepted a, next token)."""
        u = self.uniforms(drafts.shape[0] + 1).to(logits.device)
        p = target_probs(logits.to(self.seen.dtype), drafts, self.seen, self.generated, self.values, self.penalized)
        a, nxt = speculative_accept(p, q, drafts, u[:-1], u[-1:])
        return int(a[0]), int(nxt[0])
