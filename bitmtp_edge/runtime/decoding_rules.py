"""The two prefix rules every policy and backend shares (host-side twins of the device ops)."""

from __future__ import annotations

from typing import Sequence


def confident_prefix(confidences: Sequence[float], tau: float) -> int:
    """h: the number of leading drafts whose confidence is at least τ."""
    h = 0
    for c in confidences:
        if c < tau:
            break
        h += 1
    return h


def accepted_prefix(drafts: Sequence[int], verifier_tokens: Sequence[int]) -> int:
    """a: leading drafts d_j equal to the verifier's greedy token of row j-1 (row 0 = anchor)."""
    a = 0
    for d, v in zip(drafts, verifier_tokens):
        if d != v:
            break
        a += 1
    return a
