"""The two roles a step plays and the widths (rows per step) the runtime specialises for each.

With block size D (``MTPConfig.block_size``):

* ``verify``: width 1 (plain AR and the prefill tail) and D + 1 (the verifier token plus a
  block of D drafted tokens);
* ``draft``: width k + D for k in 1..D (the k accepted tokens that restart the block plus D
  mask tokens).

An AR-only artifact (no MTP block) has the verify width 1 and no draft widths.
"""

from __future__ import annotations

from .config import MTPConfig

VERIFY = "verify"
DRAFT = "draft"
ROLES = (VERIFY, DRAFT)


def step_widths(mtp: MTPConfig | None) -> dict[str, list[int]]:
    """Step widths per role (see the module docstring)."""
    if mtp is None:
        return {VERIFY: [1], DRAFT: []}
    d = mtp.block_size
    return {VERIFY: [1, d + 1], DRAFT: list(range(d + 1, 2 * d + 1))}
