"""The prefix rules every policy and backend shares (host-side twins of the device ops),
and the fused step's choice of candidate acceptance lengths (the twin of the graph
backend's ``fused_prepare`` kernel)."""

from __future__ import annotations

from typing import Sequence

import torch


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


def acceptance_probabilities(confidences: torch.Tensor) -> torch.Tensor:
    """[m] draft confidences -> [m + 1] estimated P(a = j), j = 0..m, taking the drafts'
    confidences as independent acceptance chances: c_1…c_j · (1 − c_{j+1}), and c_1…c_m
    for j = m. float32, the running product rounded after every factor (the fused step's
    kernel computes it in this very order, so both pick the same C)."""
    conf = confidences.float().reshape(-1)
    reach = [torch.ones((), dtype=torch.float32, device=conf.device)]
    for c in conf:
        reach.append(reach[-1] * c)  # float32 x float32: one rounding per factor
    stop = torch.cat([1.0 - conf, torch.ones(1, dtype=conf.dtype, device=conf.device)])
    return torch.stack(reach) * stop


def candidate_lengths(confidences: torch.Tensor, count: int) -> torch.Tensor:
    """C: the ``count`` most probable acceptance lengths (ties to the shorter; a NaN
    probability first), ascending, int64 on the confidences' device."""
    p = acceptance_probabilities(confidences).nan_to_num(nan=2.0)
    count = min(count, p.shape[0])
    order = torch.sort(p, descending=True, stable=True).indices[:count]
    return torch.sort(order).values
