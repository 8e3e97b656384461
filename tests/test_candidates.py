"""Policy fused without a fixed c: the per-pass choice of the candidate count from step
costs and observed acceptance (``runtime/candidates.py``)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from bitmtp_edge.runtime.candidates import DRAFTED, HIT, CandidateChooser, acceptance_rank
from bitmtp_edge.runtime.decoding import DecodeOptions, DecodingError
from bitmtp_edge.runtime.decoding_rules import candidate_lengths
from tests.helpers import fast_backend, needs_gpu, random_model, reference_backend, write_test_artifact
from tests.test_decoding import run

PROMPT = [3, 14, 15, 92, 65, 35]


def test_the_rank_of_a_says_which_candidate_counts_would_have_carried_it():
    """rank(a) < c exactly when the fused step's own choice of c lengths holds a, for every c
    and a, on fresh random confidences (ties included: repeated and saturated values)."""
    g = torch.Generator().manual_seed(11)
    for trial in range(300):
        m = 1 + trial % 9
        conf = torch.rand(m, generator=g)
        if trial % 5 == 0:  # ties: repeated values, 0 and 1
            conf[torch.randint(0, m, (max(m // 2, 1),), generator=g)] = conf[0].item()
            conf[-1] = float(trial % 2)
        values = conf.tolist()
        for a in range(m + 1):
            rank = acceptance_rank(values, a)
            for c in range(1, m + 2):
                assert (rank < c) == (a in candidate_lengths(conf, c).tolist()), (values, a, c)


def test_a_nan_confidence_ranks_first_as_the_step_picks_it():
    conf = [0.9, float("nan"), 0.2]
    first = candidate_lengths(torch.tensor(conf), 1).tolist()
    assert [acceptance_rank(conf, a) for a in first] == [0]


def test_rank_refuses_a_length_past_the_drafts():
    with pytest.raises(ValueError, match="outside 0..2"):
        acceptance_rank([0.5, 0.5], 3)


def stationary_us_per_token(ch: CandidateChooser, c: int) -> float:
    """The same quantity by iterating the two-kind chain to its fixed point (no closed form)."""
    h = {k: ch.hit_rate(k, c) for k in (HIT, DRAFTED)}
    share = {HIT: 0.5, DRAFTED: 0.5}
    for _ in range(10_000):
        share = {HIT: share[HIT] * h[HIT] + share[DRAFTED] * h[DRAFTED],
                 DRAFTED: share[HIT] * (1 - h[HIT]) + share[DRAFTED] * (1 - h[DRAFTED])}
    misses = sum(share[k] * (1 - h[k]) for k in share)
    tokens = sum(share[k] * ch.tokens_per_pass(k) for k in share)
    return (ch.fused_us[c] + misses * ch.draft_us) / tokens


def feed(ch: CandidateChooser, passes: int, rng: random.Random, drafts: int, skew: float) -> None:
    """Passes of a model whose accepted length is mostly the likeliest one (``skew``)."""
    from_hit = False
    for _ in range(passes):
        conf = [rng.random() for _ in range(drafts)]
        order = sorted(range(drafts + 1), key=lambda j: acceptance_rank(conf, j))
        a = order[0] if rng.random() < skew else rng.choice(order)
        ch.observe(from_hit, conf, a)
        from_hit = rng.random() < 0.6


def test_the_projection_is_the_chains_stationary_cost():
    rng = random.Random(5)
    ch = CandidateChooser({1: 900.0, 2: 1100.0, 3: 1400.0}, draft_us=800.0, lengths=8)
    feed(ch, 200, rng, drafts=7, skew=0.5)
    for c in (1, 2, 3):
        assert math.isclose(ch.us_per_token(c), stationary_us_per_token(ch, c), rel_tol=1e-9)


def test_costs_that_grow_with_the_width_pick_one_candidate_flat_costs_more():
    """A 2B-like step on a board's SM count (width 32 at 1.56x width 16) against a
    launch-bound one (every width alike), for the same acceptance."""
    for costs, want in (({1: 4966.0, 2: 7132.0, 3: 7762.0}, 1), ({1: 300.0, 2: 301.0, 3: 302.0}, 3)):
        ch = CandidateChooser(costs, draft_us=costs[1] * 0.85, lengths=8)
        feed(ch, 400, random.Random(1), drafts=7, skew=0.45)
        assert ch.current == want, (costs, ch.to_dict())
        assert ch.current == min(costs, key=ch.us_per_token)


def test_without_observations_the_prior_prices_uniform_ranks():
    ch = CandidateChooser({1: 1000.0, 3: 1100.0}, draft_us=900.0, lengths=8)
    # uniform ranks: c = 1 hits 1/8 of passes, c = 3 3/8; tokens per pass alike
    assert ch.us_per_token(1) == pytest.approx(1000 + 7 / 8 * 900)
    assert ch.us_per_token(3) == pytest.approx(1100 + 5 / 8 * 900)
    assert ch.current == 3 and ch.choices == 1


def test_the_choice_waits_for_its_first_passes_then_recurs():
    ch = CandidateChooser({1: 1000.0, 2: 1001.0}, draft_us=5000.0, lengths=4)
    first = ch.current
    for i in range(CandidateChooser.FIRST_CHOICE - 1):
        ch.observe(False, [0.9, 0.9, 0.9], 0)
    assert ch.choices == 1 and ch.current == first
    ch.observe(False, [0.9, 0.9, 0.9], 0)
    assert ch.choices == 2
    for i in range(CandidateChooser.EVERY):
        ch.observe(True, [0.9, 0.9, 0.9], 3)
    assert ch.choices == 3


def test_old_passes_fade_but_keep_their_proportions():
    ch = CandidateChooser({1: 1.0, 2: 2.0}, draft_us=1.0, lengths=4)
    for i in range(CandidateChooser.KEEP + 1):
        ch.observe(i % 2 == 0, [0.8, 0.4, 0.1], 0 if i % 4 < 2 else 1)
    passes = sum(t.passes for t in ch.tallies.values())
    assert passes <= CandidateChooser.KEEP / 2 + 1
    assert ch.tallies[HIT].passes == pytest.approx(ch.tallies[DRAFTED].passes, abs=1)


@pytest.mark.parametrize("bad", [{}, {1: 0.0}, {1: float("nan")}])
def test_the_chooser_refuses_costs_it_cannot_price(bad):
    with pytest.raises(ValueError):
        CandidateChooser(bad, draft_us=1.0, lengths=4)


def test_a_chooser_is_for_policy_fused_only():
    ch = CandidateChooser({1: 1.0}, draft_us=1.0, lengths=4)
    with pytest.raises(DecodingError, match="policy 'fused' only"):
        DecodeOptions("speculative", 10, block_size=4, chooser=ch)


class Cycling(CandidateChooser):
    """Changes c after every pass: 1, 2, 3, 1, ..."""

    EVERY = FIRST_CHOICE = 1

    def _argmin(self) -> int:
        self._turn = getattr(self, "_turn", -1) + 1
        return (1, 2, 3)[self._turn % 3]


@pytest.mark.parametrize("make", ["reference", "graph"])
def test_fused_equals_ar_when_c_changes_every_pass(make):
    """Any c is lossless, so a c that changes between passes (after a hit or a draft step)
    must leave the tokens AR's; each pass ran the chooser's c and told it what it saw."""
    model, d = random_model(8), 4
    build = reference_backend if make == "reference" else fast_backend
    ar, _ = run(reference_backend(model, max_context=256), PROMPT, "ar", n=40, block_size=None)
    ch = Cycling({1: 1.0, 2: 1.0, 3: 1.0}, draft_us=1.0, lengths=d)
    out, stats = run(build(model, max_context=256, smallest=16, block_size=d), PROMPT, "fused", n=40,
                     block_size=d, chooser=ch)
    assert out == ar
    assert set(stats.fused_candidates) == {1, 2, 3}
    assert sum(stats.fused_candidates.values()) == stats.fused_calls
    assert sum(t.passes for t in ch.tallies.values()) == stats.fused_calls


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

    model = random_model(6, vocab=256, hidden=256, heads=(8, 2))
    art = write_test_artifact(model, tmp_path / "art", block_size=8, max_context=256, smallest=16)
    eng = Engine.load(art, backend="ampere", device="cuda", runtime="full")
    costs = eng.backend.step_costs
    assert set(costs["fused"]) == {1, 2, 3} and costs["draft"] > 0
    assert all(v > 0 for v in costs["fused"].values()) and eng.startup["step_costs_s"] > 0
    assert eng.backend.history_length == 0  # the timing left no history behind
    ch = eng.candidate_chooser
    assert ch is not None and ch.fused_us == costs["fused"]
    ar = eng.generate(PROMPT, max_new_tokens=100, policy="ar")
    res = eng.generate(PROMPT, max_new_tokens=100, policy="fused")
    assert res.token_ids == ar.token_ids
    assert sum(res.stats.fused_candidates.values()) == res.stats.fused_calls > 0
    assert set(res.stats.fused_candidates) <= {1, 2, 3}
    assert res.stats.host_syncs == res.stats.iterations  # switching c adds no read
    fixed = eng.generate(PROMPT, max_new_tokens=100, policy="fused", candidates=2)
    assert fixed.token_ids == ar.token_ids and set(fixed.stats.fused_candidates) == {2}
