"""What a backend does: execute decode steps over one sequence's segmented KV.

The decoding policies (``decoding.py``) drive every backend through this interface; a
backend owns the model, the KV segments and whatever makes steps fast (kernels, graphs).
All token lists are host ints: the reference backend synchronises per step, graph
backends keep one host read per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..runtime.replay import ReplayState

# Prompt tokens per eager prefill step. Both backends prefill in chunks so that the widest
# intermediate stays bounded: the attention scores of a chunk are [Hq, chunk, |σ| + W]
# float32 (about 84 MB at Hq = 20, 256 rows and a 4096-slot segment), which matters on a
# Jetson whose CPU and GPU share 8 GB. Chunking changes what no row sees: every row is
# written at its own slot and attends to exactly the rows before it.
PREFILL_CHUNK = 256


def check_pending(pending: list[int], block_size: int) -> None:
    """A draft step's entry check: 1 <= k <= D pending tokens (p_k is the anchor)."""
    assert 1 <= len(pending) <= block_size, f"{len(pending)} pending tokens for D = {block_size}"


# The token a step reports for a row whose hidden state is not finite (NaN/Inf: corrupt
# weights or an overflow). Graph backends compute it on the device, so the host learns of
# it from the values it reads anyway; ``decoding.decode`` turns it into an error.
NON_FINITE_TOKEN = -1


def flag_non_finite(hidden: torch.Tensor, tokens: torch.Tensor, confidences: torch.Tensor | None = None) -> torch.Tensor:
    """``tokens`` [M] with ``NON_FINITE_TOKEN`` where the row of ``hidden`` [M, H] is not
    finite, or its ``confidences`` [M] (max-softmax: NaN as soon as one logit is) are not.

    Times zero, a finite value is a zero and a NaN or an infinity a NaN, so a row sums to zero
    exactly when it is finite: six ops (kernel launches in a captured step) where
    ``isfinite(...).all()`` took eleven (``isfinite`` is four ops of its own)."""
    zeros = (hidden * 0).sum(dim=-1)
    if confidences is not None:
        zeros = zeros + confidences * 0
    return torch.where(zeros == 0, tokens, NON_FINITE_TOKEN)


class DraftResult:
    """d_1..d_D and their confidences (max softmax of each block row).

    A graph backend hands back a *lazy* result (``loader``): the speculative policy never
    looks at the drafts before verifying, so the verify step reads them back together with
    its own outputs in one transfer and ``deliver``s them here.

    With sampling, ``probs`` holds the draft distributions q [D, V] the tokens were drawn
    from (a verify needs them; a graph backend keeps them in a static buffer instead).
    """

    def __init__(self, tokens: list[int] | None = None, confidences: list[float] | None = None, loader=None,
                 probs=None):
        assert tokens is not None or loader is not None, "a DraftResult needs its values or a loader"
        self._tokens, self._confidences, self._loader = tokens, confidences, loader
        self.probs = probs

    @property
    def loaded(self) -> bool:
        """Whether the host holds the values (reading them now costs no transfer)."""
        return self._tokens is not None

    def deliver(self, tokens: list[int], confidences: list[float]) -> None:
        """Hand over values read together with another step's outputs (no-op once loaded)."""
        if self._tokens is None:
            self._tokens, self._confidences = tokens, confidences

    def _load(self) -> None:
        if self._tokens is None:
            self._tokens, self._confidences = self._loader()

    @property
    def tokens(self) -> list[int]:
        self._load()
        return self._tokens

    @property
    def confidences(self) -> list[float]:
        self._load()
        return self._confidences


@dataclass
class VerifyResult:
    accepted: int  # a: leading drafts equal to the verifier's greedy token of the row before
    verifier_token: int  # v: the verifier's greedy token of row a


@dataclass
class FusedResult:
    """What one fused verify + draft step decided."""

    accepted: int  # a, as in VerifyResult
    verifier_token: int  # v
    candidates: list[int]  # C: the acceptance lengths whose draft blocks the step carried
    next_draft: DraftResult | None  # rows 1..D-1 of block a (drafts after v) if a ∈ C, else None


@dataclass
class StepLog:
    """Which replay states ran, and how often the host waited on the device."""

    states: list[ReplayState] = field(default_factory=list)
    host_syncs: int = 0
    segment_growths: int = 0


class Backend(Protocol):
    """Every step takes an optional ``sampler`` (``runtime.sampling.SamplingState``):
    absent, steps take the argmax (the greedy path); present, they sample with its
    uniforms and counts (drafts d_j ~ q_j with confidence q_j(d_j); a verify accepts by
    speculative sampling and v is drawn from the residual or bonus distribution)."""

    name: str
    log: StepLog
    device: torch.device

    @property
    def history_length(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def reset(self) -> None: ...

    def prefill(self, token_ids: list[int]) -> None:
        """token_ids [T] host ints: materialise them into history (verify role, causal), in
        chunks of ``PREFILL_CHUNK``. L += T."""

    def ar_step(self, token: int, sampler=None) -> int:
        """Width 1, verify role: materialise ``token``; return the greedy next token. L += 1."""

    def draft_step(self, pending: list[int], block_size: int, sampler=None) -> DraftResult:
        """pending [k] host ints, 1 <= k <= D (``check_pending``). Width k + D, draft role:
        materialise ``pending``; draft D tokens after its anchor p_k -> DraftResult with
        tokens [D] and confidences [D]. L += k."""

    def verify_step(self, anchor: int, draft: DraftResult, sampler=None) -> VerifyResult:
        """draft: the D tokens of the last draft step. Width D + 1, verify role, over
        [anchor, d_1..d_D]; the anchor is the last materialised token and sits at its own
        position (its history row is hidden). Promotes the KV rows of the accepted drafts
        d_1..d_a into history: L += a, 0 <= a <= D."""

    def fused_step(self, anchor: int, pending: list[int], draft: DraftResult, candidates: int) -> FusedResult:
        """One pass that verifies ``draft`` and drafts again (``masks.fused_step_mask``).

        ``pending``: committed tokens not yet materialised, ending with the anchor the drafts
        hang from; empty when the anchor is the last materialised token (recomputed at its own
        slot, as in ``verify_step``). The causal rows ``pending + drafts`` (``[anchor] + drafts``
        when empty) are the verify; ``candidates`` = c draft blocks ride along, one per
        acceptance length in C (``decoding_rules.candidate_lengths`` of the drafts'
        confidences). Materialises the pending rows and promotes d_1..d_a."""

    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] int64 -> [T, V] float32 verify-role logits of a fresh causal pass
        (no state kept)."""
