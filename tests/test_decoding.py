"""Decoding invariants on the reference backend, and each policy branch forced by hand."""

from __future__ import annotations

import pytest
import torch

from bitmtp_edge.backends.base import DraftResult, StepLog, VerifyResult
from bitmtp_edge.runtime.decoding import (
    DecodeOptions, DecodeStats, DecodingError, accepted_prefix, confident_prefix, decode,
)
from bitmtp_edge.format.segments import plan_segments
from bitmtp_edge.runtime.kv import KVStore
from bitmtp_edge.runtime.masks import prefill_mask
from tests.helpers import random_model, reference_backend

PROMPTS = [[1, 5, 7, 9, 11], [3], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]]


def run(backend, prompt, policy, n=40, block_size=4, **kw):
    stats = DecodeStats()
    opts = DecodeOptions(policy, n, block_size=block_size, **kw)
    out = [t for chunk in decode(backend, prompt, opts, stats) for t in chunk]
    return out, stats


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block_size", [4, 8])
def test_speculative_equals_ar_greedy(seed, block_size):
    model = random_model(seed)
    for prompt in PROMPTS:
        ar, _ = run(reference_backend(model, block_size=block_size), prompt, "ar", block_size=None)
        spec, stats = run(reference_backend(model, block_size=block_size), prompt, "speculative", block_size=block_size)
        assert spec == ar
        assert stats.verifier_calls == stats.iterations


def test_hybrid_at_tau_one_equals_ar_on_a_real_model():
    # τ = 1 is never reached by a softmax over 96 tokens, so hybrid always verifies.
    model = random_model(3)
    ar, _ = run(reference_backend(model), PROMPTS[0], "ar", block_size=None)
    hyb, stats = run(reference_backend(model), PROMPTS[0], "hybrid", tau=1.0, min_prefix=1)
    assert hyb == ar and stats.verifier_calls == stats.iterations


class ForcedDrafts:
    """Replace a real backend's drafts by the AR continuation, truncated to ``accepted``
    correct tokens (then a wrong one): forces every acceptance length through real KV."""

    def __init__(self, inner, ar_tokens: list[int], prompt_len: int, accepted: int, vocab: int):
        self.inner, self.ar, self.prompt_len, self.accepted, self.vocab = inner, ar_tokens, prompt_len, accepted, vocab

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft_step(self, pending, block_size):
        real = self.inner.draft_step(pending, block_size)
        done = self.inner.history_length - self.prompt_len  # tokens generated so far
        want = self.ar[done:done + block_size]
        tokens = want[: self.accepted] + [(t + 1) % self.vocab for t in want[self.accepted:]]
        tokens += [0] * (block_size - len(tokens))
        return DraftResult(tokens, real.confidences)


@pytest.mark.parametrize("accepted", [0, 1, 3, 4])
def test_forced_acceptance_keeps_speculative_lossless_and_kv_exact(accepted):
    model = random_model(4)
    prompt = PROMPTS[0]
    ar, _ = run(reference_backend(model, max_context=256), prompt, "ar", n=60, block_size=None)
    backend = ForcedDrafts(reference_backend(model, max_context=256, smallest=16), ar + [0] * 16, len(prompt),
                           accepted, model.cfg.vocab_size)
    stats = DecodeStats()
    out = []
    for chunk in decode(backend, prompt, DecodeOptions("speculative", 40, block_size=4), stats):
        out.extend(chunk)
        assert_kv_matches_recompute(model, backend.inner, prompt + out)
    assert out == ar[:40]
    # Every iteration commits accepted drafts plus the verifier token (the last may be cut).
    assert max(stats.accepted_histogram) == accepted + 1


def assert_kv_matches_recompute(model, backend, tokens: list[int]) -> None:
    """The materialised history equals a from-scratch causal prefill of the same tokens."""
    length = backend.history_length
    assert length <= len(tokens)
    fresh = KVStore(model.cfg, plan_segments(model.cfg, 1024, workspace=1, dtype="float32"), torch.float64, "cpu")
    ids = torch.tensor([tokens[:length]])
    view = fresh.reserve(length)
    with torch.no_grad():
        model(ids, torch.arange(length)[None], prefill_mask(view.slots, 0, length)[None],
              kv=view, write_slots=fresh.history_slots(length))
    fresh.advance(length)
    k_ref, v_ref = fresh.history()
    k, v = backend.kv.history()
    torch.testing.assert_close(k, k_ref, rtol=0, atol=1e-9)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-9)


@pytest.mark.parametrize("policy", ["ar", "confidence", "speculative", "hybrid"])
def test_kv_matches_recompute_after_every_step(policy):
    model = random_model(5)
    backend = reference_backend(model, max_context=256, smallest=16)
    prompt = PROMPTS[2]
    out = []
    opts = DecodeOptions(policy, 48, block_size=None if policy == "ar" else 4, tau=0.3, min_prefix=2)
    for chunk in decode(backend, prompt, opts, DecodeStats()):
        out.extend(chunk)
        assert_kv_matches_recompute(model, backend, prompt + out)


@pytest.mark.parametrize("policy", ["ar", "confidence", "speculative", "hybrid"])
def test_crossing_segments_equals_one_large_segment(policy):
    model = random_model(6)
    block = None if policy == "ar" else 4
    small = reference_backend(model, max_context=128, smallest=16)
    big = reference_backend(model, max_context=128)
    a, stats = run(small, PROMPTS[2], policy, n=80, block_size=block, tau=0.3, min_prefix=2)
    b, _ = run(big, PROMPTS[2], policy, n=80, block_size=block, tau=0.3, min_prefix=2)
    assert a == b
    assert stats.segment_growths >= 2  # 16 -> 32 -> 64 (-> 128): three segments or more
    assert len({s.segment for s in small.log.states}) >= 3


def test_replay_states_follow_the_policy():
    model = random_model(7)
    backend = reference_backend(model, block_size=4)
    run(backend, PROMPTS[0], "speculative", n=12)
    for draft, verify in zip(backend.log.states[0::2], backend.log.states[1::2]):
        assert draft.role == "draft" and draft.width == 1 + 4
        assert verify.role == "verify" and verify.width == 4 + 1


# --- hand-built drafts force each branch --------------------------------------------------

class ScriptedBackend:
    """A backend whose drafts, confidences and verifier tokens are given by the test."""

    name = "scripted"

    def __init__(self, drafts, confidences, verifier=None, max_context=1000):
        self.drafts, self.confidences, self.verifier = drafts, confidences, verifier
        self._max, self.length, self.log = max_context, 0, StepLog()
        self.calls: list[str] = []
        self.accepted: list[int] = []

    @property
    def history_length(self):
        return self.length

    @property
    def max_context(self):
        return self._max

    def reset(self):
        self.length, self.calls = 0, []

    def prefill(self, ids):
        self.length += len(ids)

    def ar_step(self, token):
        self.length += 1
        self.calls.append("ar")
        return 1

    def draft_step(self, pending, block_size):
        self.length += len(pending)
        self.calls.append("draft")
        return DraftResult(list(self.drafts), list(self.confidences))

    def verify_step(self, anchor, draft):
        self.calls.append("verify")
        a = accepted_prefix(draft.tokens, self.verifier)
        self.accepted.append(a)
        self.length += a
        return VerifyResult(a, self.verifier[a])


def test_hybrid_commits_confident_prefix_when_h_ge_m():
    b = ScriptedBackend([10, 11, 12, 13], [0.99, 0.95, 0.91, 0.2])
    out, stats = run(b, [1, 2], "hybrid", n=3, tau=0.9, min_prefix=3)
    assert out == [10, 11, 12] and b.calls == ["draft"] and stats.verifier_calls == 0


def test_hybrid_falls_back_to_verify_when_h_lt_m():
    b = ScriptedBackend([10, 11, 12, 13], [0.99, 0.95, 0.5, 0.99], verifier=[10, 11, 7, 0, 0])
    out, stats = run(b, [1, 2], "hybrid", n=3, tau=0.9, min_prefix=3)
    assert b.calls == ["draft", "verify"] and b.accepted == [2]
    assert out == [10, 11, 7] and stats.verifier_calls == 1


def test_confidence_commits_at_least_one_token():
    b = ScriptedBackend([10, 11, 12, 13], [0.1, 0.1, 0.1, 0.1])
    out, stats = run(b, [1], "confidence", n=1)
    assert out == [10] and b.calls == ["draft"]


def test_speculative_verifies_even_confident_drafts():
    b = ScriptedBackend([10, 11, 12, 13], [1.0] * 4, verifier=[10, 11, 12, 13, 14])
    out, _ = run(b, [1], "speculative", n=5)
    assert b.calls == ["draft", "verify"] and out == [10, 11, 12, 13, 14]


def test_eos_inside_committed_block_ends_the_text():
    eos = 99
    b = ScriptedBackend([10, eos, 12, 13], [0.99] * 4)
    out, stats = run(b, [1], "confidence", n=50, stop_token_ids=frozenset({eos}))
    assert out == [10] and stats.finish_reason == "stop"


def test_max_new_tokens_cuts_a_block():
    b = ScriptedBackend([10, 11, 12, 13], [0.99] * 4)
    out, stats = run(b, [1], "confidence", n=6)
    assert out == [10, 11, 12, 13, 10, 11] and stats.finish_reason == "length"


def test_prefix_rules():
    assert confident_prefix([0.9, 0.95, 0.89, 1.0], 0.9) == 2
    assert confident_prefix([0.5], 0.9) == 0
    assert accepted_prefix([1, 2, 3], [1, 2, 4, 9]) == 2
    assert accepted_prefix([5, 2], [1, 2, 3]) == 0


# --- bad requests --------------------------------------------------------------------------

def test_unknown_policy_is_refused():
    with pytest.raises(DecodingError, match="unknown policy 'greedy'"):
        DecodeOptions("greedy", 10, block_size=4)


def test_zero_max_new_tokens_is_refused():
    with pytest.raises(DecodingError, match="max_new_tokens must be at least 1"):
        DecodeOptions("ar", 0)


def test_empty_prompt_is_refused():
    b = ScriptedBackend([1], [1.0])
    with pytest.raises(DecodingError, match="prompt is empty"):
        run(b, [], "ar", block_size=None)


def test_prompt_longer_than_largest_segment_is_refused():
    model = random_model(0)
    backend = reference_backend(model, max_context=64)
    with pytest.raises(DecodingError, match="largest KV segment holds 64"):
        run(backend, list(range(1, 80)), "ar", block_size=None)


def test_generation_stops_when_context_is_full():
    model = random_model(0)
    backend = reference_backend(model, max_context=32)
    out, stats = run(backend, [1, 2, 3], "speculative", n=100)
    assert stats.finish_reason == "context_full" and len(out) + 3 <= 32
