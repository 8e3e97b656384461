"""Decoding policies: turn draft blocks into committed tokens (docs/decoding.md).

Vocabulary used throughout:

* **history**: tokens whose KV is materialised, positions [0, L);
* **pending**: committed tokens whose KV is not materialised yet, p_1..p_k; p_k is the
  **anchor** the next draft block hangs from;
* **drafts** d_1..d_D with confidences c_j from one draft step; **h** = the longest prefix
  with c_j ≥ τ;
* **verify**: an AR-causal pass over [anchor, d_1..d_D]; **accepted** a = the longest
  prefix with d_j == the verifier's greedy token of row j-1; the **verifier token** v =
  the greedy token of row a.

With sampling (``DecodeOptions.sampling``, temperature > 0 or penalties) "greedy token"
reads "sampled token", and a verify accepts by speculative sampling (``runtime/sampling.py``).

Policies: ``ar`` (one token per width-1 verify step), ``confidence`` (commit max(h, 1)),
``speculative`` (always verify: lossless), ``hybrid`` (commit h if h ≥ m, else verify),
``fused`` (lossless like speculative, one forward pass per iteration: each verify carries
the draft blocks of the c most probable acceptance lengths, so when the real a is among
them the next drafts are already there; otherwise the next iteration drafts first; c fixed,
or picked per pass on the device by ``runtime/candidates.py``).
The same loop drives every backend.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..backends.base import NON_FINITE_TOKEN, Backend, DraftResult
from ..format.config import DEFAULT_CANDIDATES, DEFAULT_MIN_PREFIX, DEFAULT_TAU, MTPConfig
from .candidates import CandidateChooser
from .decoding_rules import accepted_prefix, confident_prefix  # noqa: F401  (re-exported)
from .policies import POLICIES
from .sampling import SamplingParams, SamplingState


class DecodingError(ValueError):
    """A generation request that cannot be served (bad policy, block size, prompt...)."""


class NonFiniteError(DecodingError):
    """A step produced NaN/Inf hidden states or logits; generation stopped rather than
    emitting the garbage an argmax over NaN would pick."""


@dataclass(frozen=True)
class DecodeOptions:
    policy: str
    max_new_tokens: int
    block_size: int | None = None
    tau: float = DEFAULT_TAU
    min_prefix: int = DEFAULT_MIN_PREFIX
    stop_token_ids: frozenset[int] = frozenset()
    candidates: int = DEFAULT_CANDIDATES  # c: draft blocks per fused pass (policy "fused")
    hybrid_fused: bool = False  # hybrid verifies with fused passes (and may commit their drafts)
    # Polled once per iteration (before each step): True ends the generation with
    # finish_reason "cancelled" (a server's client went away). Must be cheap, never block.
    should_stop: Callable[[], bool] | None = field(default=None, compare=False)
    sampling: SamplingParams | None = None  # None or plain greedy: argmax, the original path
    # Policy fused: picks c per pass from the device's step costs and what each c committed so
    # far (``runtime/candidates.py``), in place of ``candidates``; the engine passes its own
    # when a generation does not fix c and its backend timed the costs.
    chooser: CandidateChooser | None = field(default=None, compare=False)

    @classmethod
    def for_model(cls, mtp: MTPConfig | None, policy: str, max_new_tokens: int, *, tau: float | None = None,
                  min_prefix: int | None = None, stop_token_ids: frozenset[int] = frozenset(),
                  should_stop: Callable[[], bool] | None = None, candidates: int | None = None,
                  sampling: SamplingParams | None = None,
                  chooser: CandidateChooser | None = None) -> "DecodeOptions":
        """The options for a model with this MTP block (None: AR-only): τ and m default to the
        model's, the block size is the model's D. ``chooser`` picks c for policy fused when
        ``candidates`` is None (else c is ``candidates`` or the default)."""
        return cls(
            policy=policy, max_new_tokens=max_new_tokens,
            block_size=mtp.block_size if mtp else None,
            tau=tau if tau is not None else (mtp.tau if mtp else DEFAULT_TAU),
            min_prefix=min_prefix if min_prefix is not None else (mtp.min_prefix if mtp else 1),
            stop_token_ids=stop_token_ids, should_stop=should_stop, sampling=sampling,
            candidates=candidates if candidates is not None else DEFAULT_CANDIDATES,
            chooser=chooser if candidates is None and policy == "fused" and mtp is not None else None,
        )

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise DecodingError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        _check_int("max_new_tokens", self.max_new_tokens)
        if self.sampling is not None and not self.sampling.plain_greedy and (
                self.policy == "fused" or (self.policy == "hybrid" and self.hybrid_fused)):
            raise DecodingError("sampling (temperature > 0 or penalties) is not implemented for fused passes; "
                                "use policy 'speculative' or 'hybrid' (speculative sampling), or temperature 0")
        _check_int("min_prefix", self.min_prefix)
        if self.block_size is not None:
            _check_int("block_size", self.block_size)
        if isinstance(self.tau, bool) or not isinstance(self.tau, numbers.Real) or not math.isfinite(self.tau):
            raise DecodingError(f"tau must be a number in (0, 1], got {self.tau!r} ({type(self.tau).__name__})")
        if self.should_stop is not None and not callable(self.should_stop):
            raise DecodingError(f"should_stop must be a callable returning bool, got {type(self.should_stop).__name__}")
        if self.max_new_tokens < 1:
            raise DecodingError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.policy != "ar" and self.block_size is None:
            raise DecodingError(f"policy {self.policy!r} needs a block size (the model's MTP block)")
        if not 0.0 < self.tau <= 1.0:
            raise DecodingError(f"tau must be in (0, 1], got {self.tau}")
        if self.block_size is not None and not 1 <= self.min_prefix <= self.block_size:
            raise DecodingError(f"min_prefix must be in 1..{self.block_size}, got {self.min_prefix}")
        _check_int("candidates", self.candidates)
        if self.chooser is not None and self.policy != "fused":
            raise DecodingError(f"a candidate chooser picks c for policy 'fused' only, not {self.policy!r}")
        if self.block_size is not None and not 1 <= self.candidates <= self.block_size + 1:
            raise DecodingError(f"candidates (draft blocks per fused pass) must be in 1..{self.block_size + 1} "
                                f"(from D on, every acceptance length), got {self.candidates}")


def _check_int(name: str, value) -> None:
    # bool is an int in Python, and 2.5 or "3" would only fail deep inside a step.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DecodingError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    iterations: int = 0
    verifier_calls: int = 0
    draft_calls: int = 0
    fused_calls: int = 0
    fused_candidates: dict[int, int] = field(default_factory=dict)  # c -> fused passes that carried c blocks
    forward_passes: int = 0  # every draft, verify, fused and AR step the backend ran (prefill excluded)
    accepted_histogram: dict[int, int] = field(default_factory=dict)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    host_syncs: int = 0
    segment_growths: int = 0
    finish_reason: str = ""
    seed: int | None = None  # the sampling seed used (None: greedy), to reproduce a sampled text
    # head="certified" (Engine.load): the greedy AR / verify head calls, and those the int8 rows
    # answered alone (the 16-bit head skipped); 0 with any other head
    certified_head_calls: int = 0
    certified_head_int8: int = 0

    @property
    def tokens_per_iteration(self) -> float:
        return self.new_tokens / self.iterations if self.iterations else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def verifier_call_rate(self) -> float:
        return self.verifier_calls / self.iterations if self.iterations else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "iterations": self.iterations, "tokens_per_iteration": self.tokens_per_iteration,
            "decode_tokens_per_s": self.decode_tokens_per_s, "verifier_calls": self.verifier_calls,
            "verifier_call_rate": self.verifier_call_rate, "draft_calls": self.draft_calls,
            "fused_calls": self.fused_calls,
            "fused_candidates": {str(k): v for k, v in sorted(self.fused_candidates.items())},
            "forward_passes": self.forward_passes,
            "tokens_per_forward": self.tokens_per_forward,
            "accepted_histogram": {str(k): v for k, v in sorted(self.accepted_histogram.items())},
            "prefill_s": self.prefill_s, "decode_s": self.decode_s, "host_syncs": self.host_syncs,
            "segment_growths": self.segment_growths, "finish_reason": self.finish_reason,
            "seed": self.seed, "certified_head_calls": self.certified_head_calls,
            "certified_head_int8": self.certified_head_int8,
        }


def check_prompt_fits(prompt_tokens: int, opts: DecodeOptions, max_context: int) -> int:
    """Refuse a prompt the largest KV segment cannot hold with room to decode; returns the
    slots decoding keeps free (1 for AR, 2·D for draft blocks)."""
    if prompt_tokens < 1:
        raise DecodingError("the prompt is empty; give at least one token")
    reserve = 1 if opts.policy == "ar" else 2 * (opts.block_size or 0)
    if prompt_tokens + reserve > max_context:
        raise DecodingError(
            f"the prompt has {prompt_tokens} tokens but the largest KV segment holds "
            f"{max_context} (with {reserve} slots for decoding); shorten it or re-export with a larger --max-context"
        )
    return reserve


def decode(backend: Backend, prompt_ids: list[int], opts: DecodeOptions, stats: DecodeStats,
           check_alignment: bool = True) -> Iterator[list[int]]:
    """Generate after ``prompt_ids``; yield each iteration's committed tokens.

    Stops at a stop token (it and anything after it in the block are dropped), at
    ``max_new_tokens``, when the largest KV segment is full, or when ``opts.should_stop()``
    says so (``finish_reason``: stop, length, context_full, cancelled). Raises
    ``NonFiniteError`` when a step's hidden states or logits are NaN/Inf.
    """
    reserve = check_prompt_fits(len(prompt_ids), opts, backend.max_context)
    sampler = None
    if opts.sampling is not None and not opts.sampling.plain_greedy:
        sampler = SamplingState(opts.sampling, prompt_ids, backend.vocab_size, backend.device)
        stats.seed = sampler.seed
    backend.reset()
    stats.prompt_tokens = len(prompt_ids)
    t0 = time.perf_counter()
    backend.prefill(prompt_ids[:-1])
    stats.prefill_s = time.perf_counter() - t0
    state = _LoopState([prompt_ids[-1]])
    produced = 0
    t_start = time.perf_counter()
    try:
        while True:
            if backend.history_length + len(state.pending) + reserve > backend.max_context:
                stats.finish_reason = "context_full"
                return
            if opts.should_stop is not None and opts.should_stop():
                stats.finish_reason = "cancelled"
                return
            committed = _iterate(backend, state, opts, stats, sampler)
            stats.iterations += 1
            if sampler is not None:
                sampler.commit(committed)
            if NON_FINITE_TOKEN in committed:
                stats.finish_reason = "non_finite"
                raise NonFiniteError(
                    f"step {stats.iterations} produced NaN/Inf hidden states or logits after {produced} new "
                    "token(s); generation stopped. The weights are corrupt or overflow in this dtype: check "
                    "the artifact with `bitmtp doctor -a ARTIFACT`, re-export it, or try --backend reference")
            stop_at = next((i for i, t in enumerate(committed) if t in opts.stop_token_ids), None)
            chunk = committed if stop_at is None else committed[:stop_at]
            chunk = chunk[: opts.max_new_tokens - produced]
            stats.accepted_histogram[len(committed)] = stats.accepted_histogram.get(len(committed), 0) + 1
            produced += len(chunk)
            stats.new_tokens = produced
            if check_alignment:
                _check_alignment(backend, prompt_ids, produced, chunk, committed, state.pending)
            if chunk:
                yield chunk
            if stop_at is not None:
                stats.finish_reason = "stop"
                return
            if produced >= opts.max_new_tokens:
                stats.finish_reason = "length"
                return
    finally:
        stats.decode_s = time.perf_counter() - t_start
        stats.host_syncs = backend.log.host_syncs
        stats.segment_growths = backend.log.segment_growths


@dataclass
class _LoopState:
    pending: list[int]  # committed, KV not materialised; the last one is the anchor
    draft: DraftResult | None = None  # drafts after the anchor a fused pass left (policy "fused")


def _iterate(backend: Backend, state: _LoopState, opts: DecodeOptions, stats: DecodeStats,
             sampler: SamplingState | None = None) -> list[int]:
    """One iteration: returns the committed tokens and updates ``state``.

    With a ``sampler`` the steps sample instead of taking the argmax: drafts d_j ~ q_j
    (confidence = q_j(d_j)), and a verify is speculative sampling, so verified tokens are
    distributed exactly as AR sampling's. Without one, the calls are the greedy ones."""
    pending = state.pending
    extra = () if sampler is None else (sampler,)
    if opts.policy == "ar":
        nxt = backend.ar_step(pending[-1], *extra)  # AR always holds exactly one pending token
        stats.verifier_calls += 1
        stats.forward_passes += 1
        state.pending = [nxt]
        return [nxt]
    if opts.policy == "fused" or (opts.policy == "hybrid" and opts.hybrid_fused):
        return _iterate_fused(backend, state, opts, stats)
    draft = backend.draft_step(pending, opts.block_size, *extra)
    stats.draft_calls += 1
    stats.forward_passes += 1
    if opts.policy in ("confidence", "hybrid"):  # speculative never reads h: no host sync here
        h = confident_prefix(draft.confidences, opts.tau)
        if opts.policy == "confidence" or h >= opts.min_prefix:
            n = max(h, 1)
            state.pending = draft.tokens[:n]
            return _flag_confidences(draft, draft.tokens[:n])
    verified = backend.verify_step(pending[-1], draft, *extra)
    stats.verifier_calls += 1
    stats.forward_passes += 1
    a, v = verified.accepted, verified.verifier_token
    state.pending = [v]
    # The drafts' confidences came back with the verify outputs: checking them costs nothing.
    return _flag_confidences(draft, list(draft.tokens[:a]) + [v])


def _iterate_fused(backend: Backend, state: _LoopState, opts: DecodeOptions, stats: DecodeStats) -> list[int]:
    """Verify the held drafts and draft the next block in one pass; draft first if the last
    pass's acceptance length was not among its candidates (or at the start). Hybrid commits a
    confident prefix (h ≥ m) of the drafts unverified instead, as it does with a draft step's."""
    anchor, pending, draft = state.pending[-1], state.pending, state.draft
    if draft is None:
        draft = backend.draft_step(pending, opts.block_size)  # materialises the pending rows
        stats.draft_calls += 1
        stats.forward_passes += 1
        pending = []
    if opts.policy == "hybrid":
        h = confident_prefix(draft.confidences, opts.tau)
        if h >= opts.min_prefix:
            state.pending, state.draft = pending + draft.tokens[:h], None
            return _flag_confidences(draft, draft.tokens[:h])
    chooser = opts.chooser
    count = chooser.current if chooser is not None else opts.candidates
    res = backend.fused_step(anchor, pending, draft, count, opts.block_size)
    if chooser is not None:
        chooser.observe(count, res.accepted, hit=res.next_draft is not None)
    stats.fused_candidates[count] = stats.fused_candidates.get(count, 0) + 1
    stats.fused_calls += 1
    stats.verifier_calls += 1
    stats.forward_passes += 1
    a, v = res.accepted, res.verifier_token
    state.pending, state.draft = [v], res.next_draft
    return _flag_confidences(draft, list(draft.tokens[:a]) + [v])


def _flag_confidences(draft, committed: list[int]) -> list[int]:
    """NaN/Inf draft confidences (logits overflowing although the hidden rows are finite)
    flag the commit like a non-finite row does."""
    if all(math.isfinite(c) for c in draft.confidences):
        return committed
    return committed + [NON_FINITE_TOKEN]


def _check_alignment(backend: Backend, prompt_ids, produced, chunk, committed, pending) -> None:
    """Accepted-prefix alignment: materialised history + pending == prompt + generated.

    Checked on the *untruncated* commit (a stop token truncates what the user sees, not
    what the backend holds)."""
    held = backend.history_length + len(pending)
    expected = len(prompt_ids) + produced + (len(committed) - len(chunk))
    if held != expected:
        raise AssertionError(f"KV boundary drifted: history {backend.history_length} + pending "
                             f"{len(pending)} != prompt {len(prompt_ids)} + generated {expected - len(prompt_ids)}")
