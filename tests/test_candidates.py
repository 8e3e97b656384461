"""Policy fused without a fixed c: the per-pass choice of the candidate count from the step
costs timed at load and what each c's passes committed (``runtime/candidates.py``)."""

from __future__ import annotations

import math
import random

import pytest

from bitmtp_edge.runtime.candidates import CandidateChooser
from bitmtp_edge.runtime.decoding import DecodeOptions, DecodingError
from tests.helpers import fast_backend, needs_gpu, random_model, reference_backend, write_test_artifact
from tests.test_decoding import run

PROMPT = [3, 14, 15, 92, 65, 35]


def simulate(ch: CandidateChooser, passes: int, outcome) -> list[int]:
    """Run ``passes`` fused passes: ``outcome(c) -> (accepted, hit)``; the c of every pass."""
    used = []
    for _ in range(passes):
        c = ch.current
        used.append(c)
        ch.observe(c, *outcome(c))
    return used


def board_like(rng: random.Random):
    """More candidates hit more often and commit no more per pass (what the embedded model
    measured: c = 1 5.1 tokens per fused pass, c = 3 4.5)."""
    def outcome(c):
        hit = rng.random() < {1: 0.53, 2: 0.76, 3: 0.81}[c]
        return rng.choice([3, 4, 5]) if c == 1 else rng.choice([2, 3, 4, 5]), hit
    return outcome


def test_every_count_is_measured_in_turn_first():
    ch = CandidateChooser({1: 100.0, 2: 110.0, 3: 120.0}, draft_us=90.0)
    used = simulate(ch, 3 * ch.BLOCK, board_like(random.Random(0)))
    assert used == [1] * ch.BLOCK + [2] * ch.BLOCK + [3] * ch.BLOCK
    assert all(r.passes == ch.BLOCK for r in ch.records.values())


def test_the_price_is_the_passes_and_misses_at_the_timed_costs():
    ch = CandidateChooser({1: 1000.0, 3: 1500.0}, draft_us=800.0)
    ch.observe(1, 4, hit=False)  # 5 tokens, a fused pass and the draft step after it
    ch.observe(1, 2, hit=True)  # 3 tokens
    assert ch.us_per_token(1) == pytest.approx((2 * 1000 + 800) / 8)
    assert ch.us_per_token(3) == math.inf  # nothing measured yet


@pytest.mark.parametrize("costs,want", [({1: 4966.0, 2: 7132.0, 3: 7762.0}, 1),  # 2B, 8 SMs of the H200
                                        ({1: 231.0, 2: 234.3, 3: 236.7}, 3)])  # 27M, whole H200 (launch-bound)
def test_costs_that_grow_with_the_width_settle_on_one_candidate_flat_costs_on_more(costs, want):
    ch = CandidateChooser(costs, draft_us=costs[1] * 0.85)
    used = simulate(ch, 3000, board_like(random.Random(1)))
    assert ch.cheapest() == want
    tail = used[3 * ch.BLOCK:]  # after the first measuring round
    assert tail.count(want) / len(tail) > 0.9  # the others only in their measuring blocks


def test_a_changed_workload_is_noticed_by_the_measuring_blocks():
    """c = 1 first wins; then its hits stop (another kind of text) and c = 3 takes over."""
    ch = CandidateChooser({1: 1000.0, 3: 1100.0}, draft_us=1000.0)
    simulate(ch, 600, lambda c: (4, True))  # everything hits: the narrow pass is cheaper
    assert ch.cheapest() == 1
    simulate(ch, 6000, lambda c: (4, c == 3))  # only three candidates hit now
    assert ch.cheapest() == 3 and ch.current == 3


def test_old_passes_are_halved_not_dropped():
    ch = CandidateChooser({1: 1.0}, draft_us=1.0)
    simulate(ch, ch.KEEP + 1, lambda c: (1, False))
    r = ch.records[1]
    assert r.passes <= ch.KEEP / 2 + 1 and r.misses == r.passes and r.tokens == 2 * r.passes


@pytest.mark.parametrize("bad", [{}, {1: 0.0}, {1: float("nan")}])
def test_the_chooser_refuses_costs_it_cannot_price(bad):
    with pytest.raises(ValueError):
        CandidateChooser(bad, draft_us=1.0)


def test_a_chooser_is_for_policy_fused_only():
    ch = CandidateChooser({1: 1.0}, draft_us=1.0)
    with pytest.raises(DecodingError, match="policy 'fused' only"):
        DecodeOptions("speculative", 10, block_size=4, chooser=ch)


class Cycling(CandidateChooser):
    """Changes c after every pass: 1, 2, 3, 1, ..."""

    BLOCK = 1

    def _next(self) -> int:
        return self.current % 3 + 1


@pytest.mark.parametrize("make", ["reference", "graph"])
def test_fused_equals_ar_when_c_changes_every_pass(make):
    """Any c is lossless, so a c that changes between passes (after a hit or a draft step)
    must leave the tokens AR's; each pass ran the chooser's c and told it what it saw."""
    model, d = random_model(8), 4
    build = reference_backend if make == "reference" else fast_backend
    ar, _ = run(reference_backend(model, max_context=256), PROMPT, "ar", n=40, block_size=None)
    ch = Cycling({1: 1.0, 2: 1.0, 3: 1.0}, draft_us=1.0)
    out, stats = run(build(model, max_context=256, smallest=16, block_size=d), PROMPT, "fused", n=40,
                     block_size=d, chooser=ch)
    assert out == ar
    assert set(stats.fused_candidates) == {1, 2, 3}
    assert sum(stats.fused_candidates.values()) == stats.fused_calls
    assert {c: r.passes for c, r in ch.records.items()} == stats.fused_candidates


def test_engine_without_timed_steps_keeps_the_fixed_default(tmp_path):
    from bitmtp_edge import Engine
    from bitmtp_edge.format.config import DEFAULT_CANDIDATES

    art = write_test_artifact(random_model(0, layers=1), tmp_path / "art", block_size=4, max_context=64)
    eng = Engine.load(art, backend="reference", device="cpu")
    assert eng.candidate_chooser is None
    opts = eng.decode_options("fused", 8)
    assert opts.chooser is None and opts.candidates == DEFAULT_CANDIDATES
    res = eng.generate(PROMPT, max_new_tokens=12, policy="fused")
    assert set(res.stats.fused_candidates) == {DEFAULT_CANDIDATES}


# --- on a GPU: the costs timed at load ------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
def test_gpu_load_times_the_fused_states_and_fused_picks_c_per_pass(tmp_path):
    from bitmtp_edge import Engine
    from bitmtp_edge.format.config import AUTO_CANDIDATES

    model = random_model(6, vocab=256, hidden=256, heads=(8, 2))
    art = write_test_artifact(model, tmp_path / "art", block_size=8, max_context=256, smallest=16)
    eng = Engine.load(art, backend="ampere", device="cuda", runtime="full")
    costs = eng.backend.step_costs
    assert set(costs["fused"]) == set(AUTO_CANDIDATES) and costs["draft"] > 0
    assert all(v > 0 for v in costs["fused"].values()) and eng.startup["step_costs_s"] > 0
    assert eng.backend.history_length == 0  # the timing left no history behind
    ch = eng.candidate_chooser
    assert ch is not None and ch.fused_us == costs["fused"]
    ar = eng.generate(PROMPT, max_new_tokens=100, policy="ar")
    res = eng.generate(PROMPT, max_new_tokens=100, policy="fused")
    assert res.token_ids == ar.token_ids
    assert sum(res.stats.fused_candidates.values()) == res.stats.fused_calls > 0
    assert set(res.stats.fused_candidates) <= set(AUTO_CANDIDATES)
    assert res.stats.host_syncs == res.stats.iterations  # switching c adds no read
    fixed = eng.generate(PROMPT, max_new_tokens=100, policy="fused", candidates=2)
    assert fixed.token_ids == ar.token_ids and set(fixed.stats.fused_candidates) == {2}
