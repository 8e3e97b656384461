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
                                          (["--generations", "v5,v11", "--out", "o.json"], "choose from v1, ")])
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


@pytest.mark.parametrize("argv,message", [(["--vary-each"], "need --vary"), (["--write-table", "t"], "need --vary")])
def test_vary_each_and_write_table_say_what_they_need(argv, message):
    with pytest.raises(SystemExit, match=message):
        sps.main(["--sms", "0", *argv, "--out", "o.json"])


def test_combined_takes_each_projections_fastest_variant_or_keeps_the_base():
    stack = types.SimpleNamespace(shapes=MODEL_SHAPES["bitnet-2b"])
    changes = sps.parse_vary("block_n=128;split_k=2,3")
    board = sps.configs_for(stack, "board defaults", 16, 8)
    rows = [row(16, "board defaults", 100.0, 1.0), row(9, "board, bn128 sk3 on wo", 50.0, 1.0),  # another width
            row(16, "board, bn128 sk2 on wo", 95.0, 1.0), row(16, "board, bn128 sk3 on wo", 97.0, 1.0),
            row(16, "board, bn128 sk2 on wqkv", 101.0, 1.0), row(16, "board, bn128 sk3 on w2 (down)", 99.0, 1.0)]
    cfgs, won = sps.combined_configs(stack, 16, 8, rows, changes)
    assert won == {"wqkv": None, "wo": {"block_n": 128, "split_k": 2}, "w13 (gate+up)": None,
                   "w2 (down)": {"block_n": 128, "split_k": 3}}
    assert cfgs["wo"] == replace(board["wo"], block_n=128, split_k=2)
    assert cfgs["w2 (down)"] == replace(board["w2 (down)"], block_n=128, split_k=3)
    assert cfgs["wqkv"] == board["wqkv"] and cfgs["w13 (gate+up)"] == board["w13 (gate+up)"]


def test_the_written_table_is_the_shipped_one_with_the_chosen_launches(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    stack = types.SimpleNamespace(shapes=MODEL_SHAPES["bitnet-2b"], model="bitnet-2b")
    shipped = json.loads((tuning.TUNED_DIR / "nvidia_h200.json").read_text())["entries"]
    chosen = {16: {name: tuning.LinearConfig(tuning.MMA, 128, 64, num_warps=4, num_stages=3, split_k=s,
                                             fold_lanes=True) for s, (name, *_) in enumerate(stack.shapes, 1)},
              17: {name: tuning.LinearConfig(tuning.MMA, 64, 64, num_warps=4, num_stages=3, split_k=2, fold_lanes=True)
                   for name, *_ in stack.shapes}}
    path = sps.write_table(tmp_path, stack, chosen, {"date": "2026-12-03", "command": "python x --vary-each"})
    data = json.loads(path.read_text())
    assert path.name == "nvidia_h200.json" and data["gpu"] == "NVIDIA H200"
    assert "M = [16, 17] of the bitnet-2b shapes from `python x --vary-each`" in data["note"]
    entries = data["entries"]
    assert len(entries) == len(shipped) + 4  # M = 16 replaced, M = 17 added (the shipped table has no 17)
    for m, cfgs in chosen.items():
        for name, n, k, g in stack.shapes:
            assert tuning.find_config(entries, "w2a8_linear", tuning.linear_key(n, k, m, g)) == cfgs[name]
    untouched = [e for e in shipped if e["key"].get("M") not in (16, 17)]
    assert all(e in entries for e in untouched)


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


def test_two_chains_vary_only_the_folded_launches_without_a_tail():
    """``--vary chains=2``: the folded ``mma`` launches take it; a tail-tile launch (the 8-SM
    board at M = 33) and an unfolded one keep theirs instead of failing the sweep."""
    stack = types.SimpleNamespace(shapes=MODEL_SHAPES["bitnet-2b"])
    board = sps.configs_for(stack, "board defaults", 9, 8)
    varied = sps.varied_configs(stack, 9, 8, {"chains": 2})
    assert all(c.fold_lanes and not c.tail_m for c in board.values())
    assert all(varied[name] == replace(cfg, chains=2) for name, cfg in board.items())
    tails = sps.configs_for(stack, "board defaults", 33, 8)
    assert any(c.tail_m for c in tails.values())
    varied = sps.varied_configs(stack, 33, 8, {"chains": 2, "num_stages": 4})
    for name, cfg in tails.items():
        expect = replace(cfg, num_stages=4) if cfg.tail_m else replace(cfg, chains=2, num_stages=4)
        assert varied[name] == expect
    unfolded = replace(board["wo"], fold_lanes=False)
    assert sps.launch_change(unfolded, {"chains": 2, "num_stages": 4}) == {"num_stages": 4}
    assert sps.parse_vary("chains=1,2") == [{"chains": 1}, {"chains": 2}]


def test_without_vary_each_the_table_takes_the_fastest_variant_as_timed():
    """``--write-table`` without ``--vary-each``: per width the fastest row among the base and the
    variants (every projection changed together), or the base where nothing beat it."""
    stack = types.SimpleNamespace(shapes=MODEL_SHAPES["bitnet-2b"])
    changes = sps.parse_vary("block_kb=128,256;num_stages=2")
    variants = {sps.vary_scheme(c): (c, ()) for c in changes}
    rows = [row(16, "board defaults", 100.0, 1.0), row(16, "board, kb128 s2", 99.0, 1.0), row(16, "board, kb256 s2", 90.0, 1.0),
            row(9, "board, kb256 s2", 10.0, 1.0), row(9, "board defaults", 50.0, 1.0), row(9, "board, kb128 s2", 60.0, 1.0)]
    board = sps.configs_for(stack, "board defaults", 16, 8)
    cfgs, won = sps.fastest_variant(stack, 16, 8, rows, variants)
    assert won == "board, kb256 s2"
    assert cfgs == {name: replace(c, block_kb=256, num_stages=2) if c.kernel == tuning.MMA else c
                    for name, c in board.items()}
    rows[0]["us"] = 80.0  # the base beats every variant: the base launches
    assert sps.fastest_variant(stack, 16, 8, rows, variants) == (board, None)
    assert sps.fastest_variant(stack, 9, 8, rows, variants)[1] == "board, kb256 s2"  # each width its own
