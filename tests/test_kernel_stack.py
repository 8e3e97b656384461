"""``tools.kernel_stack``'s schemes: which launch each projection of a benchmarked stack gets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kernels_ampere import tuning
from tools import kernel_stack


@pytest.mark.parametrize("generation", tuning.W2A8_GENERATIONS)
def test_untuned_scheme_takes_the_generation_it_names(generation, monkeypatch):
    """``vN untuned`` is generation N's defaults on this GPU's SM count: "v10 untuned" is v10's,
    not v1's (a name read by its first two characters once mistook one for the other)."""
    monkeypatch.setattr(tuning, "sm_count", lambda device=None: 132)
    stack = SimpleNamespace(shapes=[("wqkv", 3840, 2560, False), ("w2", 2560, 6912, False)])
    for m in (1, 9, 24, 40):
        configs = kernel_stack.scheme_configs(stack, f"{generation} untuned", m, (), {})
        assert configs == {name: tuning.default_linear(m, g, n=n, k=k, sms=132, generation=generation)
                           for name, n, k, g in stack.shapes}
