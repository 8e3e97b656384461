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


class DraftResult:
    """d_1..d_D and their confidences (max softmax of each block row).

    A graph backend hands back a *lazy* result (``loader``): the speculative policy never
    looks at the drafts before verifying, so it reads them back together with the verify
    outputs in one transfer.
    """

    def __init__(self, tokens=None, confidences=None, loader=None):
        self._tokens, self._confidences, self._loader = tokens, confidences, loader

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
    name: str
    log: StepLog

    @property
    def history_length(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def reset(self) -> None: ...

    def prefill(self, token_ids: list[int]) -> None:
        """Materialise ``token_ids`` into history (verify role, causal)."""

    def ar_step(self, token: int) -> int:
        """Width 1, verify role: materialise ``token``; return the greedy next token."""

    def draft_step(self, pending: list[int], block_size: int) -> DraftResult:
        """Width k + D, draft role: materialise ``pending``; draft D tokens after its anchor."""

    def verify_step(self, anchor: int, draft: DraftResult) -> VerifyResult:
        """Width D + 1, verify role, over [anchor, d_1..d_D]; the anchor is the last
        materialised token and sits at its own position (its history row is hidden).
        Promotes the KV rows of the accepted drafts d_1..d_a into history."""

    def fused_step(self, anchor: int, pending: list[int], draft: DraftResult, candidates: int) -> FusedResult:
        """One pass that verifies ``draft`` and drafts again (``masks.fused_step_mask``).

        ``pending``: committed tokens not yet materialised, ending with the anchor the drafts
        hang from; empty when the anchor is the last materialised token (recomputed at its own
        slot, as in ``verify_step``). The causal rows ``pending + drafts`` (``[anchor] + drafts``
        when empty) are the verify; ``candidates`` = c draft blocks ride along, one per
        acceptance length in C (``decoding_rules.candidate_lengths`` of the drafts'
        confidences). Materialises the pending rows and promotes d_1..d_a."""

    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, V] float32 verify-role logits of a fresh causal pass (no state kept)."""
