"""How many draft blocks a fused pass carries: c chosen from this device's step costs and the
model's acceptance as decoding observes it (``policy="fused"`` without ``candidates``).

A fused pass of c candidates is D + c·D rows wide. More candidates make a hit (the accepted
length among them, so the next drafts ride along) likelier, and every miss costs a draft step
before the next fused pass. Which c is fastest depends on both sides: on the H200 a 27M model's
step is launch-bound and the width nearly free (c = 3 won, ×2.79 against ×2.57 for c = 1), while
a 2B model's width-32 pass costs 1.18× its width-16 one on the whole H200 and 1.56× on 8 SMs
(an Orin NX's count), where c = 1 projects 3.21× AR against c = 3's 2.28×
(``tools/results/board_projection``). So the runtime prices it instead of fixing it:

* **costs**: the graph backend times its captured fused states (one per c) and the draft
  step after a miss at load (``GraphBackend.step_costs``), on this GPU, at its SM count;
* **acceptance**: after every fused pass, the rank of the accepted length a among the lengths
  ordered as the step orders its candidates (most probable first,
  ``decoding_rules.candidate_lengths``). A pass with c candidates hits iff that rank < c, so
  one pass tells what every c would have done, whichever c ran it. Passes whose drafts came
  from a hit (a candidate block's rows) and from a draft step (after a miss) are counted
  apart: they draft differently well, and c sets how often each kind comes.

With those, each c is a two-state chain (the next drafts from a hit or from a draft step);
its stationary mix gives the µs per committed token:

    π_F = (1 − h_H) / (1 − h_H + h_F)          (share of passes whose drafts a draft step made)
    µs/token = (cost(c) + draft_cost · (π_H (1 − h_H) + π_F (1 − h_F))) / (π_H T_H + π_F T_F)

with h_s = P(rank < c | s) and T_s the mean tokens a pass of kind s commits (a + 1). The
chooser starts from the cheapest prior guess (ranks uniform), re-chooses every few passes,
and keeps its counts across generations (an engine serves one model), halving them now and
then so that it follows a change of workload. Any c is lossless: only speed depends on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

HIT, DRAFTED = "hit", "drafted"  # where a fused pass's drafts came from


def acceptance_rank(confidences: Sequence[float], accepted: int) -> int:
    """The position of ``accepted`` among the acceptance lengths 0..m ordered by estimated
    probability, most probable first — the order the fused step picks its candidates in
    (``decoding_rules.acceptance_probabilities`` / ``candidate_lengths``: ties to the shorter
    length, a NaN probability first), in Python floats: a statistic, so the float32 rounding
    of the device's product does not matter here."""
    reach, probs = 1.0, []
    for c in confidences:
        probs.append(reach * (1.0 - c))
        reach *= c
    probs.append(reach)
    if not 0 <= accepted < len(probs):
        raise ValueError(f"accepted length {accepted} outside 0..{len(probs) - 1}")
    key = [2.0 if math.isnan(p) else p for p in probs]
    target = key[accepted]
    return sum(1 for j, p in enumerate(key) if p > target or (p == target and j < accepted))


@dataclass
class _Tally:
    passes: float = 0.0
    tokens: float = 0.0  # sum of a + 1 over the passes
    ranks: list[float] = field(default_factory=list)  # passes whose accepted length had rank r

    def add(self, rank: int, tokens: int) -> None:
        if rank >= len(self.ranks):
            self.ranks.extend([0.0] * (rank + 1 - len(self.ranks)))
        self.ranks[rank] += 1
        self.passes += 1
        self.tokens += tokens

    def halve(self) -> None:
        self.passes, self.tokens = self.passes / 2, self.tokens / 2
        self.ranks = [r / 2 for r in self.ranks]


class CandidateChooser:
    """Picks c for the next fused pass; see the module docstring.

    ``fused_us``: µs of a fused pass per candidate count c (the captured ones);
    ``draft_us``: µs of the draft step that follows a miss; ``lengths``: how many acceptance
    lengths a fused pass ranks (D: it verifies D − 1 drafts)."""

    PRIOR = 4.0  # pseudo-passes of the uniform-rank prior in each kind's estimates
    FIRST_CHOICE = 16  # passes observed before the first data-driven choice ...
    EVERY = 16  # ... and between later ones
    KEEP = 4096  # passes remembered before the counts are halved

    def __init__(self, fused_us: dict[int, float], draft_us: float, lengths: int):
        if not fused_us:
            raise ValueError("no fused pass costs to choose from")
        if any(not (math.isfinite(v) and v > 0) for v in [*fused_us.values(), draft_us]):
            raise ValueError(f"step costs must be positive and finite, got fused {fused_us}, draft {draft_us}")
        if lengths < 1:
            raise ValueError(f"lengths must be >= 1, got {lengths}")
        self.fused_us = dict(sorted(fused_us.items()))
        self.draft_us, self.lengths = float(draft_us), lengths
        self.tallies = {HIT: _Tally(), DRAFTED: _Tally()}
        self._since = 0
        self.current = self._argmin()
        self.choices = 1  # how many times c was (re)chosen, the prior's included

    def observe(self, from_hit: bool, confidences: Sequence[float], accepted: int) -> None:
        """One fused pass: its drafts came from a hit (else from a draft step), their
        confidences (the D − 1 the pass verified) and the accepted length a."""
        self.tallies[HIT if from_hit else DRAFTED].add(acceptance_rank(confidences, accepted), accepted + 1)
        self._since += 1
        seen = sum(t.passes for t in self.tallies.values())
        if seen > self.KEEP:
            for t in self.tallies.values():
                t.halve()
        if self._since >= (self.FIRST_CHOICE if self.choices == 1 else self.EVERY):
            self._since = 0
            self.current = self._argmin()
            self.choices += 1

    def hit_rate(self, kind: str, count: int) -> float:
        """P(rank < c) for passes of ``kind``, shrunk toward the uniform prior c / lengths."""
        t = self.tallies[kind]
        hits = sum(t.ranks[:count])
        return (hits + self.PRIOR * min(count, self.lengths) / self.lengths) / (t.passes + self.PRIOR)

    def tokens_per_pass(self, kind: str) -> float:
        """Mean a + 1 for passes of ``kind``, shrunk toward both kinds' mean (1 without data)."""
        both = sum(t.passes for t in self.tallies.values())
        pooled = sum(t.tokens for t in self.tallies.values()) / both if both else 1.0
        t = self.tallies[kind]
        return (t.tokens + self.PRIOR * pooled) / (t.passes + self.PRIOR)

    def us_per_token(self, count: int) -> float:
        """The projected µs per committed token with c = ``count`` (module docstring)."""
        h_hit, h_drafted = self.hit_rate(HIT, count), self.hit_rate(DRAFTED, count)
        leave = (1.0 - h_hit) + h_drafted
        share_drafted = (1.0 - h_hit) / leave if leave > 0 else 0.0
        share_hit = 1.0 - share_drafted
        misses = share_hit * (1.0 - h_hit) + share_drafted * (1.0 - h_drafted)
        tokens = share_hit * self.tokens_per_pass(HIT) + share_drafted * self.tokens_per_pass(DRAFTED)
        return (self.fused_us[count] + misses * self.draft_us) / tokens

    def _argmin(self) -> int:
        return min(self.fused_us, key=lambda c: (self.us_per_token(c), c))  # ties: fewer candidates

    def to_dict(self) -> dict:
        """What the choice rests on, for reports (``bitmtp bench``, ``tools/bench_e2e.py``)."""
        return {"current": self.current, "choices": self.choices,
                "fused_us": {str(c): round(v, 1) for c, v in self.fused_us.items()},
                "draft_us": round(self.draft_us, 1),
                "passes": {k: round(t.passes, 1) for k, t in self.tallies.items()},
                "tallies": {k: {"passes": t.passes, "tokens": t.tokens, "ranks": list(t.ranks)}
                            for k, t in self.tallies.items()},
                "projected_us_per_token": {str(c): round(self.us_per_token(c), 2) for c in self.fused_us}}
