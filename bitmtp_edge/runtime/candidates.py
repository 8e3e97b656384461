"""How many draft blocks a fused pass carries: c chosen on the device, from the step costs
timed at load and the tokens each c commits as decoding measures them (``policy="fused"``
without ``candidates``).

A fused pass of c candidates is D + c·D rows wide. More candidates make a hit (the accepted
length among them, so the next drafts ride along) likelier, and every miss costs a draft step
before the next fused pass. Which c is fastest depends on the device and the model: on the H200
a 27M model's step is launch-bound and the width nearly free (c = 3 won, ×2.79 against ×2.57
for c = 1), while a 2B model's width-32 pass costs 1.18× its width-16 one on the whole H200 and
1.57× on 8 SMs (an Orin NX's count), where c = 1 projects 3.21× AR against c = 3's 2.28×
(``tools/results/board_projection``). So the runtime measures it instead of fixing it:

* **costs**: the graph backend times its captured fused states (one per c) and the draft
  step that follows a miss, once at load (``GraphBackend.time_fused_states``), on this GPU;
* **tokens**: per c, the fused passes run with it, their misses and the tokens they
  committed (a + 1 each). Then

      µs per token (c) = (passes · cost(c) + misses · cost(draft)) / tokens

  is what c has cost so far, priced at the device's own step costs (timing every pass on the
  host would read the clock of a queue the host runs ahead of).

Why measured and not predicted: what c sets is which passes hit, and the passes after a hit
draft from a block anchored at a draft, those after a miss from a fresh draft step — on the
embedded model 4.1 against 4.7 tokens per pass with c = 3 running, and c = 1 committed 5.1 per
fused pass where a two-state model of c = 3's own passes predicted 4.4: a hit at the likeliest
length is followed by easier text than a hit at the third likeliest. Only running c says what
c does.

So the chooser measures every c in turn for a block of passes, then runs the cheapest and, once
every ``REVISIT`` blocks, measures one of the others again for a block (the workload may
change). Its counts live as long as the engine (one model), halved when they grow old. Any c
is lossless: only the speed depends on the choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class CandidateRecord:
    """What the fused passes run with one c have done."""

    passes: float = 0.0
    misses: float = 0.0  # passes whose accepted length was not a candidate: a draft step followed
    tokens: float = 0.0  # committed, a + 1 per pass

    def halve(self) -> None:
        self.passes, self.misses, self.tokens = self.passes / 2, self.misses / 2, self.tokens / 2


class CandidateChooser:
    """Picks c for the next fused pass; see the module docstring.

    ``fused_us``: µs of a fused pass per candidate count c (the states timed at load);
    ``draft_us``: µs of the draft step that follows a miss."""

    BLOCK = 16  # passes per measuring block
    REVISIT = 32  # blocks of the cheapest c between two measuring blocks of another
    KEEP = 2048  # passes of one c remembered before its counts are halved

    def __init__(self, fused_us: dict[int, float], draft_us: float):
        if not fused_us:
            raise ValueError("no fused pass costs to choose from")
        if any(not (math.isfinite(v) and v > 0) for v in [*fused_us.values(), draft_us]):
            raise ValueError(f"step costs must be positive and finite, got fused {fused_us}, draft {draft_us}")
        self.fused_us = {int(c): float(v) for c, v in sorted(fused_us.items())}
        self.draft_us = float(draft_us)
        self.records = {c: CandidateRecord() for c in self.fused_us}
        self._unmeasured = list(self.fused_us)  # measured in turn first, fewest candidates first
        self.current = self._unmeasured.pop(0)
        self._left = self.BLOCK  # passes left in the current block
        self._blocks = 0  # blocks of the cheapest c since the last measuring block of another
        self._revisit = 0  # which of the others is measured next

    def observe(self, count: int, accepted: int, hit: bool) -> None:
        """One fused pass, run with ``count`` candidates: its accepted length, and whether it
        was a hit (else a draft step precedes the next pass)."""
        rec = self.records[count]
        rec.passes += 1
        rec.misses += not hit
        rec.tokens += accepted + 1
        if rec.passes > self.KEEP:
            rec.halve()
        self._left -= 1
        if self._left <= 0:
            self._left = self.BLOCK
            self.current = self._next()

    def _next(self) -> int:
        if self._unmeasured:
            return self._unmeasured.pop(0)
        best = self.cheapest()
        others = [c for c in self.fused_us if c != best]
        self._blocks += 1
        if others and self._blocks > self.REVISIT:
            self._blocks = 0
            self._revisit += 1
            return others[self._revisit % len(others)]
        return best

    def us_per_token(self, count: int) -> float:
        """µs per committed token of the passes run with c = ``count`` (inf before any)."""
        rec = self.records[count]
        if rec.tokens <= 0:
            return math.inf
        return (rec.passes * self.fused_us[count] + rec.misses * self.draft_us) / rec.tokens

    def cheapest(self) -> int:
        return min(self.fused_us, key=lambda c: (self.us_per_token(c), c))  # ties: fewer candidates

    def to_dict(self) -> dict:
        """What the choice rests on, for reports (``bitmtp bench``, ``tools/bench_e2e.py``)."""
        return {"current": self.current, "cheapest": self.cheapest(),
                "fused_us": {str(c): round(v, 1) for c, v in self.fused_us.items()},
                "draft_us": round(self.draft_us, 1),
                "records": {str(c): {"passes": r.passes, "misses": r.misses, "tokens": r.tokens}
                            for c, r in self.records.items()},
                "us_per_token": {str(c): (round(v, 2) if math.isfinite(v) else None)
                                 for c in self.fused_us for v in [self.us_per_token(c)]}}
