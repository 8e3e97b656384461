"""The replay state s = (M, σ, r): which captured step a backend executes.

``width`` M is the number of rows in the step, ``segment`` σ the index of the KV capacity
segment whose buffer the step reads and writes, ``role`` r the numerical role: ``verify``
(exact 16-bit head; also AR and the prefill tail), ``draft`` (cheap head) or ``fused`` (a
verify and draft blocks in one pass: the 16-bit head on the verify rows, the cheap head on
the rows of the accepted block). A graph-replay
backend keeps one captured graph per state; the reference backend records the states it ran
so tests and stats can check them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["verify", "draft", "fused"]
ROLES = ("verify", "draft", "fused")


@dataclass(frozen=True, order=True)
class ReplayState:
    width: int
    segment: int
    role: Role

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"replay width must be >= 1, got {self.width}")
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}")

    def __str__(self) -> str:
        return f"(M={self.width}, σ={self.segment}, {self.role})"
