"""The two roles a step plays and the widths (rows per step) the runtime specialises for each.

With block size D (``MTPConfig.block_size``):

* ``verify``: width 1 (plain AR and the prefill tail) and D + 1 (the verifier token plus a
  block of D drafted tokens);
* ``draft``: width k + D for k in 1..D (the k accepted tokens that restart the block plus D
  mask tokens).

An AR-only artifact (no MTP block) has the verify width 1 and no draft widths.
"""

from __future__ import annotations

VERIFY = "verify"
DRAFT = "draft"
ROLES = (VERIFY, DRAFT)


def step_widths(block_size: int | None) -> dict[str, list[int]]:
    """Step widths per role for block size D (None: an AR-only model); see the module docstring."""
    if block_size is None:
        return {VERIFY: [1], DRAFT: []}
    d = block_size
    return {VERIFY: [1, d + 1], DRAFT: list(range(d + 1, 2 * d + 1))}


def max_width(widths: dict[str, list[int]]) -> int:
    """M_max: the widest step of any role, which sizes the KV workspace."""
    return max(w for ws in widths.values() for w in ws)
