"""tools/sm_partition_stack.py: its report from recorded runs (CPU), its argument errors, and
on a GPU the partition it measures on (the SMs a green context's launches reach)."""

from __future__ import annotations

import json
import types
from dataclasses import replace

import pytest
import torch

from kernels_ampere import tuning
from kernels_ampere.autotune import MODEL_LAYERS, MODEL_SHAPES
from tests.helpers import needs_gpu
from tools import sm_partition_stack as sps


def run_file(path, sms, mma_v3, rows):
    meta = {"device": "NVIDIA H200", "sms": sms, "sms_asked": sms, "gpu_sms": 132, "mma_v3": mma_v3,
            "sm_clock_mhz": 1980.0, "model": "bitnet-2b", "bf16_matmul_tflops": 55.5, "green_context": True,
            "torch": "2.11.0", "date": "2026-12-02", "command": f"python tools/sm_partition_stack.py --sms {sms}"}
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return str(path)


def row(m, scheme, us, rate):
    return {"M": m, "scheme": scheme, "us": us, "weights_per_sm_clock": rate, "configs": {}}


def test_summarize_puts_every_run_in_one_table(tmp_path, capsys):
    a = run_file(tmp_path / "sm8.json", 8, True, [row(1, "shipped", 4163.0, 31.6), row(1, "board defaults", 3427.2, 38.4),
                                                  row(9, "shipped", 4156.0, 31.7)])
    b = run_file(tmp_path / "sm8_v2.json", 8, False, [row(1, "board defaults", 3526.0, 37.3)])
    md = tmp_path / "sm.md"
    assert sps.main(["--summarize", a, b, "--md", str(md)]) == 0
    text = md.read_text()
    assert text == capsys.readouterr().out
    lines = [ln for ln in text.splitlines() if ln.startswith("| 8 ")]
    assert lines == ["| 8 | mma.sync (DISABLE_MMA_V3=1) | 1 |  | 3526 (37.3) |",
                     "| 8 | wgmma (sm_90) | 1 | 4163 (31.6) | 3427 (38.4) |",
                     "| 8 | wgmma (sm_90) | 9 | 4156 (31.7) |  |"]
    assert "| SMs | tensor-core instruction | M | shipped: µs (weights/SM-clock) | board defaults:" in text
    assert "`sm8_v2.json`: 8 SMs reached (asked 8)" in text
    # the boards' projection: an 8-SM board from the 8-SM run with an Orin's mma.sync only, at
    # the stack's bytes and weights: per call max(bytes / (0.8 BW), weights / (r SMs f)) + 3 µs
    shapes, layers = MODEL_SHAPES["bitnet-2b"], MODEL_LAYERS["bitnet-2b"]
    step = layers * sum(max(n * (-(-k // 128) * 32) / (0.8 * 102.4e9), n * k / (37.3 * 8 * 918e6)) + 3e-6
                        for _, n, k, _ in shapes)
    assert f"| Orin NX 16GB | 8 SMs, mma.sync | 1 | board defaults | 37.3 | {step * 1e3:.2f} ({1 / step:.0f}) |" in text
    assert "8 SMs, wgmma" not in text and "AGX Orin" not in text  # no 16-SM run given


def test_summarize_refuses_a_file_it_did_not_write(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="other.json: not a result of this script"):
        sps.main(["--summarize", str(other)])


@pytest.mark.parametrize("argv,message", [(["--sms", "8"], "give --out"),
                                          (["--widths", "1,x", "--out", "o.json"], "--widths '1,x'"),
                                          (["--generations", "v5,v9", "--out", "o.json"], "choose from v1, ")])
def test_bad_arguments_say_what_to_give(argv, message):
    with pytest.raises(SystemExit, match=message):
        sps.main(argv)


def test_vary_takes_every_combination_of_the_fields_given():
    changes = sps.parse_vary("num_stages=3,4; block_kb=64,128,256")
    assert len(changes) == 6
    assert {(c["num_stages"], c["block_kb"]) for c in changes} == {(s, kb) for s in (3, 4) for kb in (64, 128, 256)}
    assert sps.vary_scheme({"block_n": 128, "num_stages": 4}) == "board, bn128 s4"
    assert sps.parse_vary("") == []


@pytest.mark.parametrize("text,message", [("stages=3", "'stages' is not one of"), ("num_stages=3,x", "comma-separated")])
def test_vary_names_what_it_cannot_take(text, message):
    with pytest.raises(SystemExit, match=message):
        sps.parse_vary(text)


def test_vary_needs_a_partition():
    with pytest.raises(SystemExit, match="give --sms N"):
        sps.main(["--sms", "0", "--vary", "num_stages=4", "--out", "o.json"])


def test_a_variant_changes_only_the_tensor_core_launches_it_names():
    stack = types.SimpleNamespace(shapes=MODEL_SHAPES["bitnet-2b"])
    board = sps.configs_for(stack, "board defaults", 9, 8)
    varied = sps.varied_configs(stack, 9, 8, {"num_stages": 5, "block_kb": 128})
    assert all(c.kernel == tuning.MMA for c in board.values())
    for name, cfg in board.items():
        assert varied[name] == replace(cfg, num_stages=5, block_kb=128)
        assert varied[name] != cfg
    # --vary-only: the named projections alone
    down = sps.varied_configs(stack, 9, 8, {"split_k": 2}, only=("w2 (down)",))
    assert down["w2 (down)"] == replace(board["w2 (down)"], split_k=2)
    assert all(down[name] == board[name] for name in board if name != "w2 (down)")
    with pytest.raises(SystemExit, match="projections are wqkv, wo, "):
        sps.main(["--sms", "8", "--vary", "split_k=2", "--vary-only", "down", "--out", "o.json"])
    # a launch without tensor-core tiles (gemv at M = 1 on the whole GPU) is left as it is
    gemv = sps.configs_for(stack, "board defaults", 1, 132)
    assert sps.varied_configs(stack, 1, 132, {"num_stages": 5}) == gemv
    assert {c.kernel for c in gemv.values()} == {tuning.GEMV}


def test_a_generation_scheme_launches_that_generations_board_defaults():
    stack = types.SimpleNamespace(shapes=MODEL_SHAPES["bitnet-2b"])
    v4 = sps.configs_for(stack, "board, v4", 33, 8)
    board = sps.configs_for(stack, "board defaults", 33, 8)
    assert {c.block_m for c in v4.values()} == {16}  # v4: 16-row tiles side by side
    assert v4 != board
    assert v4 == {name: tuning.default_linear(33, g, n=n, k=k, sms=8, generation="v4")
                  for name, n, k, g in stack.shapes}


@pytest.mark.gpu
@needs_gpu
def test_a_green_context_confines_launches_to_the_sms_asked():
    default = torch.cuda.current_stream()
    total = sps.sms_reached()
    context = sps.enter_partition(8)  # held: a collected green context takes its stream with it
    try:
        reached = sps.sms_reached()
    finally:
        torch.cuda.set_stream(default)
    del context
    assert total == torch.cuda.get_device_properties(0).multi_processor_count
    assert reached == 8
