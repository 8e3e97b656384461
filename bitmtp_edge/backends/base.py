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

    With sampling, ``probs`` holds the draft distributions q [D, V] the tokens were drawn
    from (a verify needs them; a graph backend keeps them in a static buffer instead).
    """

    def __init__(self, tokens=None, confidences=None, loader=None, probs=None):
        self._tokens, self._confidences, self._loader = tokens, confidences, loader
        self.probs = probs

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
        """Materialise ``token_ids`` into history (verify role, causal)."""

    def ar_step(self, token: int, sampler=None) -> int:
        """Width 1, verify role: materialise ``token``; return the greedy next token."""

    def draft_step(self, pending: list[int], block_size: int, sampler=None) -> DraftResult:
        """Width k + D, draft role: materialise ``pending``; draft D tokens after its anchor."""

    def verify_step(self, anchor: int, draft: DraftResult, sampler=None) -> VerifyResult:
        """Width D + 1, verify role, over [anchor, d_1..d_D]; the anchor is the last
        materialised token and sits at its own position (its history row is hidden).
        Promotes the KV rows of the accepted drafts d_1..d_a into history."""

    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, V] float32 verify-role logits of a fresh causal pass (no state kept)."""
