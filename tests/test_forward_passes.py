"""DecodeStats.forward_passes: every draft, verify and AR step the backend ran, per policy."""

from __future__ import annotations

import pytest

from bitmtp_edge.runtime.decoding import DecodeStats
from tests.helpers import random_model, reference_backend
from tests.test_decoding import PROMPTS, run


class CountingBackend:
    """Forwards to a real backend and counts the decode steps it is asked to run."""

    def __init__(self, inner):
        self._inner = inner
        self.steps = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def ar_step(self, *a):
        self.steps += 1
        return self._inner.ar_step(*a)

    def draft_step(self, *a):
        self.steps += 1
        return self._inner.draft_step(*a)

    def verify_step(self, *a):
        self.steps += 1
        return self._inner.verify_step(*a)


@pytest.mark.parametrize("policy", ["ar", "confidence", "speculative", "hybrid"])
def test_forward_passes_count_every_backend_step(policy):
    model = random_model(4)
    for prompt in PROMPTS:
        b = CountingBackend(reference_backend(model, block_size=4))
        # τ 0.02 makes hybrid take both branches on a random 96-token model
        out, stats = run(b, prompt, policy, n=30, block_size=None if policy == "ar" else 4, tau=0.02, min_prefix=2)
        assert stats.forward_passes == b.steps > 0
        assert stats.forward_passes == stats.draft_calls + stats.verifier_calls
        assert stats.tokens_per_forward == pytest.approx(len(out) / b.steps)
        d = stats.to_dict()
        assert d["forward_passes"] == b.steps and d["tokens_per_forward"] == stats.tokens_per_forward
        if policy == "ar":
            assert stats.tokens_per_forward == stats.tokens_per_iteration == 1.0
        if policy == "speculative":
            assert stats.forward_passes == 2 * stats.iterations


def test_tokens_per_forward_is_zero_before_any_step():
    assert DecodeStats().tokens_per_forward == 0.0
