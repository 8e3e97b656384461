"""``bitmtp tune`` and the autotuner's layer-level choice, on the CPU.

The tuner's logic runs for real under the Triton interpreter on tiny shapes (every candidate
checked against its twin); only the GPU timer is replaced by a model of one that charges a
switch between different kernels in a row, the effect that makes per-shape winners lose as
a layer on an H200 (tools/results/kernels.md).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("triton")

from bitmtp_edge.app import cli  # noqa: E402
from kernels_ampere import autotune, tuning  # noqa: E402
from kernels_ampere.tuning import DOT, GEMV, LinearConfig  # noqa: E402
from tests.helpers import DEVICE  # noqa: E402


class SwitchingTimer:
    """µs per call: a cost per (shape, kernel) plus a penalty wherever the kernel changes from
    one call to the next (reps like GraphTimer's)."""

    reps = 8

    def __init__(self, cost: dict, switch_us: float):
        self.cost, self.switch_us, self.seen = cost, switch_us, []

    def __call__(self, calls, reps=None):
        self.seen.append([c.config for c in calls])
        total = 0.0
        for i, c in enumerate(calls):
            total += self.cost[(c.shape, c.config.kernel)]
            if i and c.config.kernel != calls[i - 1].config.kernel:
                total += self.switch_us
        return total / len(calls)


def cases(monkeypatch):
    monkeypatch.setattr(autotune, "DEVICE", DEVICE)
    # a large GPU's untuned defaults (gemv at M = 1), whatever runs the test: without CUDA the
    # SM count reads 1, where the defaults put M = 1 on the tensor cores (tuning's v6)
    monkeypatch.setattr(tuning, "sm_count", lambda device: 132)
    return {"a": autotune.LinearBench("w2a8_linear", 24, 256, False, rotate_mb=0.0, seed=1, min_copies=2),
            "b": autotune.LinearBench("w2a8_linear", 40, 128, False, rotate_mb=0.0, seed=2, min_copies=2)}


@pytest.fixture
def two_candidates(monkeypatch):
    picks = [LinearConfig(GEMV, 8, 64), LinearConfig(DOT, 16, 64, num_stages=2)]
    monkeypatch.setattr(tuning, "linear_candidates", lambda m, n, k, g, weight_only=False: picks)
    return picks


def test_tune_layer_keeps_the_per_shape_picks_when_the_layer_agrees(monkeypatch, two_candidates):
    layer = cases(monkeypatch)
    # a prefers gemv, b prefers dot, and switching is free: the per-shape picks make the faster layer
    timer = SwitchingTimer({((24, 256), GEMV): 1.0, ((24, 256), DOT): 3.0,
                            ((40, 128), GEMV): 3.0, ((40, 128), DOT): 1.0}, switch_us=0.0)
    entries, log = autotune.tune_layer(layer, 1, timer, log=lambda *_: None)
    assert [e["config"]["kernel"] for e in entries] == [GEMV, DOT]
    assert {e["layer"] for e in entries} == {"tuned"} and all(e["us"] == 1.0 for e in entries)
    assert [len(t["tried"]) for t in log] == [2, 2] and all("us" in c for t in log for c in t["tried"])


def test_tune_layer_prefers_the_defaults_where_switching_kernels_costs_more(monkeypatch, two_candidates, tmp_path):
    layer = cases(monkeypatch)
    # alone each shape still prefers its own kernel, but a change of kernel costs 10 µs: the
    # untuned defaults (one kernel for both at M = 1) win the layer and go into the table
    timer = SwitchingTimer({((24, 256), GEMV): 1.0, ((24, 256), DOT): 3.0,
                            ((40, 128), GEMV): 3.0, ((40, 128), DOT): 1.0}, switch_us=10.0)
    entries, _ = autotune.tune_layer(layer, 1, timer, log=lambda *_: None)
    defaults = [autotune.untuned(case, 1) for case in layer.values()]
    assert [LinearConfig(**e["config"]) for e in entries] == defaults
    assert {e["layer"] for e in entries} == {"untuned"} and all(e["us"] is None for e in entries)
    assert entries[0]["layer_us"] == pytest.approx(2 * (1.0 + 3.0) / 2)
    # the layer was timed in model order: a, b, a, b over the weight copies
    layered = [cfgs for cfgs in timer.seen if len(cfgs) == 4]
    assert layered and all(cfgs[0] == cfgs[2] and cfgs[1] == cfgs[3] for cfgs in layered)
    # what the runtime then looks up
    path = tmp_path / "gpu.json"
    autotune.write_table(path, "test gpu", entries, {"command": "test"})
    table = json.loads(path.read_text())["entries"]
    assert tuning.find_config(table, "w2a8_linear", tuning.linear_key(24, 256, 1, False)) == defaults[0]
    assert tuning.find_config(table, "w2a8_linear", tuning.linear_key(40, 128, 2, False)) == defaults[1]


def test_tune_command_runs_the_autotuner_with_its_options(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(autotune, "main", lambda argv: seen.append(argv) or 0)
    res = CliRunner().invoke(cli.main, ["tune", "--models", "bitmtp-27m", "--widths", "1,9", "--out", "t.json",
                                        "--jobs", "2"])
    assert res.exit_code == 0, res.output
    assert seen == [["--widths", "1,9", "--op", "w2a8_linear", "--models", "bitmtp-27m", "--out", "t.json",
                     "--jobs", "2"]]
    res = CliRunner().invoke(cli.main, ["tune", "--models", "", "--shapes", "2048x2048g", "--weight-only"])
    assert res.exit_code == 0, res.output
    assert seen[-1] == ["--widths", cli.TUNE_WIDTHS, "--op", "w2a16_linear", "--shapes", "2048x2048g"]


def test_tune_command_explains_bad_input_and_a_missing_gpu(monkeypatch):
    res = CliRunner().invoke(cli.main, ["tune", "--models", "gpt-7"])
    assert res.exit_code == 2 and "--models" in res.output and "bitnet-2b" in res.output
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(cli.main, ["tune"])
    assert res.exit_code == 1 and "CUDA" in res.output
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def refuse(argv):
        raise SystemExit("autotune: --widths 'x' is not a comma list of integers (e.g. 1,2,9,16)")
    monkeypatch.setattr(autotune, "main", refuse)
    res = CliRunner().invoke(cli.main, ["tune", "--widths", "x"])
    assert res.exit_code == 1 and "--widths" in res.output


def test_tune_models_are_the_autotuner_models():
    assert set(cli.TUNE_MODELS) == set(autotune.MODEL_SHAPES)


class LayerStepTimer:
    """µs per call: cheap only where every call in a row runs folded launches with 256-byte K
    steps over two stages (the H200's 2B stack, session 21), a little cheaper on 16-row tiles."""

    reps = 8

    def __init__(self):
        self.seen = []

    def __call__(self, calls, reps=None):
        cfgs = [c.config for c in calls]
        self.seen.append(cfgs)
        together = all(c.fold_lanes and (c.block_kb, c.num_stages) == (256, 2) for c in cfgs)
        return sum((1.0 if together else 2.0) * (0.9 if c.block_n == 16 else 1.0) for c in cfgs) / len(cfgs)


def test_tune_layer_tries_longer_k_steps_on_every_folded_launch_at_once(monkeypatch):
    """A step length that no projection picks alone wins the layer when all take it together:
    the table gets the per-shape picks with that step, each still exact against its twin."""
    layer = cases(monkeypatch)
    pick = LinearConfig(tuning.MMA, 16, 64, num_warps=4, num_stages=2, fold_lanes=True)
    monkeypatch.setattr(tuning, "linear_candidates", lambda m, n, k, g, weight_only=False: [pick])
    timer = LayerStepTimer()
    entries, _ = autotune.tune_layer(layer, 9, timer, log=lambda *_: None)
    assert [LinearConfig(**e["config"]) for e in entries] == [replace(pick, block_kb=256, num_stages=2)] * 2
    assert {e["layer"] for e in entries} == {"tuned, kb256 s2"} and all(e["us"] is None for e in entries)
    layered = [cfgs for cfgs in timer.seen if len(cfgs) == 4]  # each option timed as a layer
    steps = {(c.block_kb, c.num_stages) for cfgs in layered for c in cfgs}
    assert steps >= {(64, 2), *tuning.LAYER_STEP_VARIANTS}
    # a launch that is not folded keeps its K step in every variant
    dot = LinearConfig(DOT, 16, 64, num_stages=2)
    assert tuning.layer_step_variant(dot, 256, 2) == dot
