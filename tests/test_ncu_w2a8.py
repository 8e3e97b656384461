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
