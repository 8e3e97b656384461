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

from ..replay import ReplayState


@dataclass
class DraftResult:
    tokens: list[int]  # d_1..d_D
    confidences: list[float]  # max softmax of each block row


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

    def verify_step(self, anchor: int, drafts: list[int]) -> list[int]:
        """Width D + 1, verify role, over [anchor, d_1..d_D]; the anchor is the last
        materialised token and sits at its own position (its history row is hidden).
        Returns the greedy prediction of each row (D + 1 ints)."""

    def accept(self, accepted: int) -> None:
        """Promote the KV rows of d_1..d_accepted of the last verify into history."""

    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, V] float32 verify-role logits of a fresh causal pass (no state kept)."""
