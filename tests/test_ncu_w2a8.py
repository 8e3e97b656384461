"""tools/ncu_w2a8.py's summary half: an ncu raw-page CSV joined to the launches it profiled."""

import csv
import json

import pytest

from tools import ncu_w2a8

HEADER = ["ID", "Kernel Name", "gpu__time_duration.sum", "launch__grid_size", "gpc__cycles_elapsed.max",
          "device__attribute_multiprocessor_count",
          "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
          "sm__pipe_tensor_op_imma_cycles_active.avg.pct_of_peak_sustained_active"]
UNITS = ["", "", "usecond", "", "cycle", "", "ratio", "ratio", "%"]


def write_report(tmp_path, rows, calls):
    raw = tmp_path / "raw.csv"
    with raw.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["==PROF== a line ncu prints before the table"])
        w.writerow(HEADER)
        w.writerow(UNITS)
        w.writerows(rows)
    meta = tmp_path / "calls.json"
    meta.write_text(json.dumps({"calls": calls, "device": "test GPU", "commit": "abc"}))
    return raw, meta


def call(m):
    return {"model": "bitnet-2b", "projection": "wo", "n": 2560, "k": 2560, "m": m,
            "config": {"kernel": "mma", "block_n": 64, "block_kb": 64, "num_warps": 4, "num_stages": 3,
                       "split_k": 4, "fold_lanes": True}}


def test_summary_joins_rows_to_calls_in_launch_order(tmp_path):
    rows = [["0", "_w2a8_gemv_kernel", "3.5", "1,320", "7000", "132", "4.25", "0.5", "0"],
            ["1", "_w2a8_mma_kernel", "6.25", "160", "12500", "132", "1.5", "2.75", "12.5"]]
    raw, meta = write_report(tmp_path, rows, [call(1), call(16)])
    assert ncu_w2a8.main(["summarize", str(raw), "--calls", str(meta), "--out", str(tmp_path / "o")]) == 0
    out = json.loads((tmp_path / "o" / "ncu_w2a8.json").read_text())["launches"]
    assert [r["m"] for r in out] == [1, 16] and out[0]["programs"] == 1320
    assert out[0]["duration"] == 3.5 and out[1]["kernel"] == "_w2a8_mma_kernel"
    assert list(out[1]["stalls"]) == ["wait", "long_scoreboard"]  # largest first
    assert out[1]["tensor pipes %"] == {"pipe_tensor_op_imma": 12.5}
    assert out[1]["weights per SM-clock"] == pytest.approx(2560 * 2560 / 12500 / 132)
    md = (tmp_path / "o" / "ncu_w2a8.md").read_text()
    assert "| wo | 16 | mma 64x64 w4 s3 k4 fold | 6.25 | 160 |" in md


def test_summary_refuses_a_report_that_does_not_match_the_calls(tmp_path):
    rows = [["0", "_w2a8_gemv_kernel", "3.5", "1320", "7000", "132", "4", "0.5", "0"]]
    raw, meta = write_report(tmp_path, rows, [call(1), call(16)])
    with pytest.raises(SystemExit, match="1 kernels.*2 calls"):
        ncu_w2a8.main(["summarize", str(raw), "--calls", str(meta), "--out", str(tmp_path / "o")])


def test_duration_in_nanoseconds_is_read_as_microseconds(tmp_path):
    rows = [["0", "_w2a8_gemv_kernel", "3,500", "1320", "7000", "132", "4", "0.5", "0"]]
    raw, meta = write_report(tmp_path, rows, [call(1)])
    text = raw.read_text().replace("usecond", "nsecond")
    raw.write_text(text)
    ncu_w2a8.main(["summarize", str(raw), "--calls", str(meta), "--out", str(tmp_path / "o")])
    assert json.loads((tmp_path / "o" / "ncu_w2a8.json").read_text())["launches"][0]["duration"] == 3.5


@pytest.mark.parametrize("spec, what", [
    ('16:wo={"kernel": "mma", "block_n": 64, "block_kb": 48}', "block_kb=48"),  # LinearConfig refuses it
    ('16:wo={"kernel": mma}', "expected"),  # not JSON
    ('x:wo={"kernel": "mma", "block_n": 64, "block_kb": 64}', "expected"),  # not a width
    ('16:qkv={"kernel": "mma", "block_n": 64, "block_kb": 64}', "no projection 'qkv'"),
])
def test_launch_refuses_a_bad_config_override_before_touching_the_gpu(spec, what):
    with pytest.raises(SystemExit, match=what):
        ncu_w2a8.main(["launch", "--calls", "unused.json", "--config", spec])


def test_launch_refuses_an_unknown_model():
    with pytest.raises(SystemExit, match="not one of"):
        ncu_w2a8.main(["launch", "--calls", "unused.json", "--model", "gpt-9"])


SOURCE_HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier", "stall_long_sb",
                 "stall_barrier (Not Issued)"]


def source_kernel(lines):
    """(address, sass, samples, barrier samples, long-scoreboard samples) -> source-page rows."""
    return [["Kernel Name", "_w2a8_mma_kernel"], SOURCE_HEADER] + [
        [f"0x{a:x}", f"      {text}", str(n), str(b), str(lsb), "0"] for a, text, n, b, lsb in lines]


def test_source_summary_splits_the_samples_at_the_main_loop(tmp_path):
    base = 0x7f00
    k0 = [(base, "LDG.E R2, [R4]", 10, 0, 10),  # before the loop
          (base + 0x10, "BAR.SYNC.DEFER_BLOCKING 0x0", 6, 6, 0),  # the outer loop starts here
          (base + 0x20, "STS.128 [R8], R4", 30, 0, 30),  # an inner loop starts here
          (base + 0x30, "BAR.SYNC.DEFER_BLOCKING 0x0", 4, 4, 0),
          (base + 0x40, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 20, 0, 0),  # not a CTA barrier
          (base + 0x50, f"@P0 BRA 0x{base + 0x20:x}", 0, 0, 0),  # the inner loop's branch back
          (base + 0x60, f"@P1 BRA 0x{base + 0x10:x}", 0, 0, 0),  # the outer one's: the longest body
          (base + 0x70, "STG.E [R2], R6", 30, 0, 0)]
    k1 = [(base, "EXIT", 5, 0, 0)]
    path = tmp_path / "source.csv"
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows(source_kernel(k0) + source_kernel(k1))
    kernels = ncu_w2a8.read_source(path)
    assert len(kernels) == 2
    s = ncu_w2a8.source_summary(kernels[0])
    assert ncu_w2a8.main_loop(kernels[0]) == (1, 6)
    assert s["samples"] == 100
    assert s["regions"]["before the loop"] == {"samples": 0.10, "barriers": 0, "instructions": 1}
    assert s["regions"]["loop"] == {"samples": 0.60, "barriers": 2, "instructions": 6}
    assert s["regions"]["after the loop"]["samples"] == 0.30
    assert s["stall reasons"] == {"long_sb": 0.40, "barrier": 0.10}  # "Not Issued" columns left out
    assert [t["index"] for t in s["top instructions"]] == [2, 7, 4]
    flat = ncu_w2a8.source_summary(kernels[1])  # no loop: everything counts as before it
    assert flat["regions"]["before the loop"]["samples"] == 1.0 and flat["regions"]["loop"]["instructions"] == 0


def test_source_page_without_stall_samples_is_refused(tmp_path):
    path = tmp_path / "source.csv"
    path.write_text('"Kernel Name","k"\n"Address","Source"\n"0x10","EXIT"\n')
    with pytest.raises(SystemExit, match="stall sampling"):
        ncu_w2a8.read_source(path)
