"""``bitmtp bench`` on a CPU: small defaults, an ETA, Ctrl-C keeps what was measured, a CSV
beside the JSON and Markdown; and the reference backend's torch thread rule."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from bitmtp_edge.app import bench as B
from bitmtp_edge.app.cli import main
from bitmtp_edge.app.live import BenchProgress
from bitmtp_edge.runtime import engine as E

from .helpers import random_model, write_test_artifact


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return write_test_artifact(random_model(seed=0, hidden=128, layers=1), tmp_path_factory.mktemp("bcpu") / "art",
                               max_context=128)


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"t{i} t{i + 1} t{i + 2}"}) for i in range(1, 6)) + "\n")
    return p


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cpu_defaults_are_small_and_said(artifact, prompts_file, tmp_path):
    res = invoke("bench", "-a", artifact, "--device", "cpu", "--prompts", prompts_file, "--policies", "ar,hybrid",
                 "--monitor", "none", "--out", tmp_path / "o", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    cfg = report["config"]
    assert (cfg["max_new_tokens"], cfg["repeats"]) == (B.CPU_DEFAULTS["max_new_tokens"], B.CPU_DEFAULTS["repeats"])
    assert len(report["workload"]["prompts"]) == B.CPU_DEFAULTS["num_prompts"]
    assert "CPU defaults" in res.stderr
    assert B.CPU_DEFAULTS["num_prompts"] * B.CPU_DEFAULTS["max_new_tokens"] * B.CPU_DEFAULTS["repeats"] \
        <= B.GPU_DEFAULTS["num_prompts"] * B.GPU_DEFAULTS["max_new_tokens"] * B.GPU_DEFAULTS["repeats"] / 20


def test_explicit_sizes_win_over_the_cpu_defaults(artifact, prompts_file, tmp_path):
    res = invoke("bench", "-a", artifact, "--device", "cpu", "--prompts", prompts_file, "--policies", "ar",
                 "--num-prompts", 3, "-n", 5, "--repeats", 2, "--warmup", 0, "--monitor", "none",
                 "--out", tmp_path / "o", "--json")
    report = json.loads(res.stdout)
    assert (report["config"]["max_new_tokens"], report["config"]["repeats"]) == (5, 2)
    assert len(report["workload"]["prompts"]) == 3 and len(report["runs"]) == 6


def test_ctrl_c_writes_what_was_measured_marked_partial(artifact, prompts_file, tmp_path, monkeypatch):
    real, calls = B.run_once, []

    def interrupted_on_the_fifth_run(*args, **kw):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kw)
    monkeypatch.setattr(B, "run_once", interrupted_on_the_fifth_run)
    out = tmp_path / "o"
    res = invoke("bench", "-a", artifact, "--device", "cpu", "--prompts", prompts_file, "--policies", "ar,hybrid",
                 "--num-prompts", 3, "-n", 4, "--repeats", 2, "--monitor", "psutil", "--interval-ms", 20,
                 "--out", out)
    assert res.exit_code == 130, res.output
    assert "interrupted" in res.output
    report = json.loads((out / "bench.json").read_text())
    assert report["partial"] is True and len(report["runs"]) == 4 and report["planned_runs"] == 2 + 3 * 2 * 2
    assert report["notes"][0].startswith("PARTIAL")
    assert "PARTIAL" in (out / "bench.md").read_text()
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [r["partial"] for r in rows] == ["True", "True"]


def test_bench_csv_holds_the_route_numbers_of_bench_json(artifact, prompts_file, tmp_path):
    out = tmp_path / "o"
    res = invoke("bench", "-a", artifact, "--device", "cpu", "--prompts", prompts_file, "--policies",
                 "ar,speculative", "--num-prompts", 2, "-n", 4, "--repeats", 1, "--warmup", 0, "--monitor", "none",
                 "--out", out, "--json")
    report = json.loads(res.stdout)
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [r["name"] for r in rows] == [r["name"] for r in report["routes"]]
    for row, route in zip(rows, report["routes"]):
        assert float(row["decode_tok_s"]) == route["decode_tok_s"]
        assert int(row["new_tokens"]) == route["new_tokens"] and row["partial"] == "False"
        assert row["avg_power_w"] == ""  # not measured: empty, not 0
    assert "bench.csv" in report["files"]


def test_the_progress_bar_shows_an_eta():
    from rich.progress import TimeRemainingColumn

    bar = BenchProgress()
    assert any(isinstance(c, TimeRemainingColumn) for c in bar._bar.columns)


# ----------------------------------------------------------------------------- torch threads


def test_thread_rule(monkeypatch):
    for var in ("BITMTP_CPU_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(E.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(E.os, "getloadavg", lambda: (3.5, 3.0, 2.0))
    assert E.cpu_threads_rule()[0] == 1 and "busy" in E.cpu_threads_rule()[1]
    monkeypatch.setattr(E.os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    assert E.cpu_threads_rule()[0] == 2
    monkeypatch.setattr(E.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert E.cpu_threads_rule()[0] == E.CPU_THREADS_MAX
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert E.cpu_threads_rule()[0] is None  # the user chose: torch follows OMP_NUM_THREADS
    monkeypatch.setenv("BITMTP_CPU_THREADS", "5")
    assert E.cpu_threads_rule() == (5, "BITMTP_CPU_THREADS")
    monkeypatch.setenv("BITMTP_CPU_THREADS", "many")
    with pytest.raises(ValueError, match="BITMTP_CPU_THREADS"):
        E.cpu_threads_rule()


def test_engine_load_sets_the_reference_backends_threads(artifact, monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(E, "choose_cpu_threads", lambda: 1)
        torch.set_num_threads(2)
        E.Engine.load(artifact, backend="reference", device="cpu")
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(E, "choose_cpu_threads", lambda: None)
        torch.set_num_threads(2)
        E.Engine.load(artifact, backend="reference", device="cpu")
        assert torch.get_num_threads() == 2  # left alone when the user chose
    finally:
        torch.set_num_threads(before)


def test_doctor_says_the_thread_count(monkeypatch):
    from bitmtp_edge.app.doctor import check_backend

    monkeypatch.setattr(E, "cpu_threads_rule", lambda: (1, "host busy (load 3.5 on 2 cores)"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU case, on any machine
    c = check_backend(torch)
    assert c.details["device"] == "cpu" and c.details["cpu_threads"] == 1
    assert "1 torch thread(s): host busy" in c.summary
