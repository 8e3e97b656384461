"""The fused verify + draft step on the reference backend (the oracle): its mask against a
brute-force full forward per row, its candidate rule, and the policy's losslessness."""

from __future__ import annotations

import math
import random

import pytest
import torch

from bitmtp_edge.backends.base import DraftResult, FusedResult, StepLog
from bitmtp_edge.runtime.decoding import DecodeOptions, DecodeStats, DecodingError, decode
from bitmtp_edge.runtime.decoding_rules import candidate_lengths
from bitmtp_edge.runtime.masks import (
    draft_in_place_mask, fused_step_mask, fused_step_spans, history_step_mask, spans_to_mask,
)
from tests.helpers import random_model, reference_backend
from tests.test_decoding import PROMPTS, assert_kv_matches_recompute, run

# --- the candidate rule ----------------------------------------------------------------------


def brute_force_candidates(conf: list[float], count: int) -> list[int]:
    """Enumerate P(a = j) = c_1…c_j (1 − c_{j+1}) (c_1…c_m for j = m) in plain Python."""
    m = len(conf)
    p = [math.prod(conf[:j]) * (1 - conf[j] if j < m else 1.0) for j in range(m + 1)]
    best = sorted(range(m + 1), key=lambda j: (-p[j], j))[:count]
    return sorted(best)


@pytest.mark.parametrize("seed", range(6))
def test_candidate_lengths_match_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    for m in (1, 3, 7, 8):
        conf = torch.rand(m, generator=g)
        for count in range(1, m + 3):
            got = candidate_lengths(conf, count).tolist()
            assert got == brute_force_candidates(conf.double().tolist(), count)
            assert len(got) == min(count, m + 1)


def test_candidates_follow_the_confidence_profile():
    assert candidate_lengths(torch.tensor([0.99, 0.99, 0.99, 0.99]), 1).tolist() == [4]  # all accepted
    assert candidate_lengths(torch.tensor([0.01, 0.99, 0.99]), 1).tolist() == [0]  # first one rejected
    # P = 0.1, 0.09, 0.729, 0.0073, 0.066: stop at the weak third draft, else at the first
    assert candidate_lengths(torch.tensor([0.9, 0.9, 0.1, 0.9]), 2).tolist() == [0, 2]


# --- the mask --------------------------------------------------------------------------------

def test_fused_mask_equals_spans_and_known_layouts():
    cap, ws, d = 24, 40, 4
    cand = torch.tensor([0, 2, 3])
    mask = fused_step_mask(cap, ws, 10, 5, cand, d)
    assert torch.equal(mask, spans_to_mask(fused_step_spans(10, 5, cand, d), cap, cap + ws))
    # causal rows: exactly the rows of a verify over the same slots
    assert torch.equal(mask[:5], history_step_mask(cap, ws, 10, 5))
    for b, j in enumerate(cand.tolist()):
        rows = mask[5 + b * d:5 + (b + 1) * d]
        hist = torch.arange(cap) < 10 + j  # history and causal rows before d_j, not d_j itself
        own = torch.zeros(ws, dtype=torch.bool)
        own[b * d:(b + 1) * d] = True  # its own block only, both ways
        assert torch.equal(rows, torch.cat([hist, own]).expand(d, -1))


@pytest.mark.parametrize("pending", [1, 2, 3])
def test_fused_mask_without_drafts_is_a_draft_step(pending):
    """No drafts and C = {0}: the pending rows then the block at the anchor, which is the
    draft step's layout exactly."""
    cap, ws, d, length = 32, 12, 4, 9
    fused = fused_step_mask(cap, ws, length, pending, torch.tensor([0]), d, anchor_row=pending - 1)
    assert torch.equal(fused, draft_in_place_mask(cap, ws, length, pending, d))


def brute_force_row(model, seq: list[int], positions: list[int], visible: torch.Tensor, row: int) -> torch.Tensor:
    """The hidden state of ``seq[row]`` from one full forward of ``seq`` alone (no KV)."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        return model(ids, torch.tensor([positions]), visible.unsqueeze(0))[0, row]


@pytest.mark.parametrize("seed,pending,block", [(0, 0, 4), (1, 1, 4), (2, 0, 3), (3, 2, 4)])
def test_every_fused_row_equals_a_full_forward_of_what_it_should_see(seed, pending, block):
    model = random_model(seed)
    backend = reference_backend(model, max_context=128, block_size=block)
    rng = random.Random(seed)
    history = [rng.randrange(2, 90) for _ in range(11)]
    backend.prefill(history)  # with no pending tokens the anchor is history[-1], recomputed
    pend = [rng.randrange(2, 90) for _ in range(pending)]
    drafts = [rng.randrange(2, 90) for _ in range(block)]
    chosen = [0, 2, block]
    anchor = pend[-1] if pend else history[-1]
    hidden = backend.fused_rows(anchor, pend, drafts, chosen, block)
    mask_id = backend.mask_token_id
    before = history if pend else history[:-1]  # the tokens before the first causal row
    causal = (pend if pend else [anchor]) + drafts
    prefix = before + causal[:-len(drafts)]  # every token up to and including the anchor
    rows = 0
    for i in range(len(causal)):  # causal row i: plain causal over prefix + the drafts before it
        seq = before + causal[:i + 1]
        visible = torch.ones(len(seq), len(seq), dtype=torch.bool).tril()
        ref = brute_force_row(model, seq, list(range(len(seq))), visible, len(seq) - 1)
        torch.testing.assert_close(hidden[i], ref, rtol=0, atol=1e-9)
        rows += 1
    for b, j in enumerate(chosen):  # block of j: everything before d_j, then the block both ways
        seen = prefix + drafts[:j - 1] if j else prefix[:-1]  # d_j is drafts[j - 1]
        head = drafts[j - 1] if j else prefix[-1]
        seq = seen + [head] + [mask_id] * (block - 1)
        n = len(seen)
        visible = torch.ones(len(seq), len(seq), dtype=torch.bool).tril()
        visible[n:, n:] = True
        positions = list(range(len(seq)))
        for r in range(block):
            ref = brute_force_row(model, seq, positions, visible, n + r)
            torch.testing.assert_close(hidden[len(causal) + b * block + r], ref, rtol=0, atol=1e-9)
            rows += 1
    assert rows == hidden.shape[0] == len(causal) + len(chosen) * block


# --- the policy --------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("block_size,candidates", [(4, 1), (4, 2), (4, 5), (8, 3)])
def test_fused_equals_ar_greedy(seed, block_size, candidates):
    model = random_model(seed)
    for prompt in PROMPTS[:2]:
        ar, _ = run(reference_backend(model, block_size=block_size), prompt, "ar", n=24, block_size=None)
        backend = reference_backend(model, block_size=block_size)
        out, stats = run(backend, prompt, "fused", n=24, block_size=block_size, candidates=candidates)
        assert out == ar
        assert stats.forward_passes == stats.fused_calls + stats.draft_calls == len(backend.log.states)
        assert stats.fused_calls == stats.iterations
        widths = {(s.width, s.role) for s in backend.log.states}
        c = min(candidates, block_size)  # after a hit: D − 1 drafts, so at most D lengths
        allowed = {(1 + block_size, "draft"), (1 + block_size + min(candidates, block_size + 1) * block_size, "fused"),
                   (block_size + c * block_size, "fused")}
        assert widths <= allowed


@pytest.mark.parametrize("policy,extra", [("fused", {}), ("hybrid", {"hybrid_fused": True})])
def test_kv_matches_recompute_after_every_fused_step(policy, extra):
    model = random_model(5)
    backend = reference_backend(model, max_context=256, smallest=16)
    prompt = PROMPTS[2]
    out = []
    opts = DecodeOptions(policy, 40, block_size=4, tau=0.3, min_prefix=2, candidates=2, **extra)
    for chunk in decode(backend, prompt, opts, DecodeStats()):
        out.extend(chunk)
        assert_kv_matches_recompute(model, backend, prompt + out)


def test_fused_crossing_segments_equals_one_large_segment():
    model = random_model(6)
    small = reference_backend(model, max_context=128, smallest=16)
    big = reference_backend(model, max_context=128)
    a, stats = run(small, PROMPTS[2], "fused", n=70, candidates=3)
    b, _ = run(big, PROMPTS[2], "fused", n=70, candidates=3)
    ar, _ = run(reference_backend(model, max_context=128), PROMPTS[2], "ar", n=70, block_size=None)
    assert a == b == ar[:len(a)]
    assert stats.segment_growths >= 2
    assert len({s.segment for s in small.log.states}) >= 3


def test_hybrid_fused_at_tau_one_equals_ar():
    model = random_model(3)
    ar, _ = run(reference_backend(model), PROMPTS[0], "ar", n=30, block_size=None)
    out, stats = run(reference_backend(model), PROMPTS[0], "hybrid", n=30, tau=1.0, hybrid_fused=True)
    assert out == ar and stats.fused_calls == stats.iterations


def test_candidates_option_is_checked():
    with pytest.raises(DecodingError, match=r"candidates .* must be in 1\.\.5"):
        DecodeOptions("fused", 10, block_size=4, candidates=6)
    with pytest.raises(DecodingError, match="must be in 1..5"):
        DecodeOptions("fused", 10, block_size=4, candidates=0)


# --- hand-built steps force each branch --------------------------------------------------------

class ScriptedFused:
    """Drafts, confidences, verifier tokens and acceptance given by the test; records calls."""

    name = "scripted"

    def __init__(self, script: list[tuple[int, list[int]]], draft_conf: list[float], held_conf=None):
        self.script = list(script)  # per fused call: (a, candidates C)
        self.draft_conf = draft_conf  # of a draft step's drafts
        self.held_conf = held_conf if held_conf is not None else draft_conf  # of a fused pass's next drafts
        self.length, self.log, self.calls = 0, StepLog(), []
        self.token = 100

    history_length = property(lambda self: self.length)
    max_context = property(lambda self: 10_000)

    def reset(self):
        self.length = 0

    def prefill(self, ids):
        self.length += len(ids)

    def _next(self, n):
        out = list(range(self.token, self.token + n))
        self.token += n
        return out

    def draft_step(self, pending, block_size):
        self.length += len(pending)
        self.calls.append(("draft", len(pending)))
        return DraftResult(self._next(block_size), list(self.draft_conf[:block_size]))

    def fused_step(self, anchor, pending, draft, candidates, block_size):
        a, chosen = self.script.pop(0)
        self.calls.append(("fused", len(pending), len(draft.tokens), candidates))
        self.length += len(pending) + a
        nxt = DraftResult(self._next(block_size - 1), list(self.held_conf[:block_size - 1])) if a in chosen else None
        return FusedResult(a, 7, chosen, nxt)


def test_a_hit_keeps_one_pass_per_iteration_and_a_miss_drafts_again():
    b = ScriptedFused([(2, [1, 2]), (3, [0, 1]), (0, [0, 4])], [0.5] * 4)
    stats = DecodeStats()
    out = [t for chunk in decode(b, [1, 2], DecodeOptions("fused", 8, block_size=4, candidates=2), stats)
           for t in chunk]
    # draft (k = 1), fused over its 4 drafts (hit at a = 2), fused over the 3 drafts it left
    # (miss at a = 3), then a draft step for the pending v, then fused again
    assert b.calls == [("draft", 1), ("fused", 0, 4, 2), ("fused", 1, 3, 2), ("draft", 1), ("fused", 0, 4, 2)]
    assert out == [100, 101, 7, 104, 105, 106, 7, 7]
    assert stats.forward_passes == 5 and stats.fused_calls == 3 and stats.draft_calls == 2
    assert stats.tokens_per_forward == pytest.approx(8 / 5)


def test_hybrid_fused_commits_confident_held_drafts_without_a_pass():
    b = ScriptedFused([(1, [1]), (2, [2])], [0.5] * 4, held_conf=[0.95, 0.95, 0.1])
    opts = DecodeOptions("hybrid", 9, block_size=4, tau=0.9, min_prefix=2, candidates=1, hybrid_fused=True)
    stats = DecodeStats()
    out = [t for chunk in decode(b, [1, 2], opts, stats) for t in chunk]
    # unconfident drafts are verified by a fused pass (hit at a = 1); the drafts it leaves are
    # confident (h = 2): committed with no pass, then drafted after as pending [v, e_1, e_2]
    assert b.calls == [("draft", 1), ("fused", 0, 4, 1), ("draft", 3), ("fused", 0, 4, 1)]
    assert out == [100, 7, 104, 105, 107, 108, 7, 111, 112]
    assert stats.forward_passes == 4 and stats.iterations == 4


def test_every_candidate_count_keeps_the_first_rows_causal():
    """C only adds blocks after the causal rows: the verify rows are the same whatever c."""
    model = random_model(2)
    outs = []
    for c in (1, 5):
        backend = reference_backend(model, max_context=64)
        backend.prefill([5, 6, 7, 8])
        outs.append(backend.fused_rows(9, [], [10, 11, 12, 13], list(range(c)), 4)[:5])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("candidates", [1, 3])
def test_a_fused_step_after_a_draft_step_has_a_fused_hits_width(candidates):
    """After a draft step the fused pass verifies d_1..d_{D-1} with the anchor reopened at its
    own slot: D + c·D rows, a hit's width. Verifying d_D too took one row more (17 at D = 8,
    c = 1), past a 16-row tile: 1.31x the pass on a board proxy. Still AR's output."""
    model, d = random_model(4), 4
    backend = reference_backend(model, max_context=256, smallest=16, block_size=d)
    out, stats = run(backend, PROMPTS[0], "fused", n=40, block_size=d, candidates=candidates)
    ar, _ = run(reference_backend(model, max_context=256), PROMPTS[0], "ar", n=40, block_size=None)
    assert out == ar
    assert stats.draft_calls >= 2  # misses happened: fused passes right after draft steps
    widths = {s.width for s in backend.log.states if s.role == "fused"}
    assert widths == {d + min(candidates, d) * d}
