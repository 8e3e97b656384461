"""``bitmtp bench`` and ``bitmtp tune`` as a user runs them on a machine without a GPU (found
by black-box runs): every output format holding the same numbers, reports written whole or
not at all, workload errors found before the runs, Ctrl-C at any point, tune's refusals."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

import pytest
from click.testing import CliRunner

from bitmtp_edge.app import bench as B
from bitmtp_edge.app import bench_report
from bitmtp_edge.app.cli import main

from .helpers import random_model, write_test_artifact

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return write_test_artifact(random_model(seed=0, hidden=128, layers=1), tmp_path_factory.mktemp("bbb") / "art",
                               max_context=128)


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"t{i} t{i + 1} t{i + 2}"}) for i in range(1, 4)) + "\n")
    return p


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def bench(artifact, prompts_file, out, *args):
    return invoke("bench", "-a", artifact, "--device", "cpu", "--prompts", prompts_file, "--monitor", "none",
                  "--out", out, *args)


@pytest.fixture(scope="module")
def swept(artifact, tmp_path_factory):
    """One sweep, shared: ar, hybrid at two τ, fused at two c; two prompts, two repeats."""
    tmp = tmp_path_factory.mktemp("sweep")
    prompts = tmp / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"t{i} t{i + 1}"}) for i in (1, 5)) + "\n")
    out = tmp / "o"
    res = bench(artifact, prompts, out, "--policies", "fused,hybrid,ar", "--tau", 0.5, "--tau", 0.9, "-c", 1, "-c", 3,
                "-n", 6, "--repeats", 2, "--warmup", 0, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout), out


def test_every_output_format_holds_the_same_numbers(swept):
    data, out = swept
    assert json.loads((out / "bench.json").read_text()) == data  # --json prints bench.json
    names = ["ar", "fused c=1", "fused c=3", "hybrid τ=0.5 m=3", "hybrid τ=0.9 m=3"]  # ar first, then as asked
    assert [r["name"] for r in data["routes"]] == names
    measured = [r for r in data["runs"] if r["repeat"] >= 0]
    assert len(measured) == data["planned_runs"] == 5 * 2 * 2
    ar_runs = [r for r in measured if r["route"] == "ar"]
    rows = {r["name"]: r for r in csv.DictReader((out / "bench.csv").open(encoding="utf-8"))}
    md = (out / "bench.md").read_text(encoding="utf-8")
    for route in data["routes"]:
        runs = [r for r in measured if r["route"] == route["name"]]
        tokens, iterations = sum(r["new_tokens"] for r in runs), sum(r["iterations"] for r in runs)
        passes, verifies = sum(r["forward_passes"] for r in runs), sum(r["verifier_calls"] for r in runs)
        assert route["tokens_per_iteration"] == tokens / iterations
        assert route["tokens_per_forward"] == tokens / passes and route["forward_passes"] == passes
        assert route["verifier_call_rate"] == verifies / iterations
        assert route["decode_tok_s"] == median(r["decode_tok_s"] for r in runs)
        ratios = [median(r["decode_tok_s"] for r in runs if r["prompt_index"] == i)
                  / median(r["decode_tok_s"] for r in ar_runs if r["prompt_index"] == i) for i in (0, 1)]
        assert route["speedup_vs_ar"] == pytest.approx(median(ratios), rel=1e-12)
        # the CSV: every number of the JSON route, bench.md's tokens/forward and fused's c included
        row = rows[route["name"]]
        for key in ("decode_tok_s", "speedup_vs_ar", "tokens_per_iteration", "tokens_per_forward",
                    "verifier_call_rate"):
            assert float(row[key]) == route[key], key
        assert int(row["forward_passes"]) == passes
        assert row["candidates"] == ("" if route["candidates"] is None else str(route["candidates"]))
        # bench.md: the same numbers, rounded
        line = next(x for x in md.splitlines() if x.startswith(f"| {route['name']} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1:6] == [f"{route['decode_tok_s']:.1f}", f"{route['speedup_vs_ar']:.2f}",
                              f"{route['tokens_per_iteration']:.2f}", f"{route['tokens_per_forward']:.2f}",
                              f"{route['verifier_call_rate']:.2f}"]


def test_a_prompt_one_route_cannot_decode_is_refused_before_any_run(artifact, tmp_path, monkeypatch):
    # 124 tokens fit AR (1 slot to decode in a 128-token cache) but not hybrid (2·D = 8): the
    # error came at that prompt's first hybrid run, after every earlier run, and threw them away.
    calls = []
    real = B.run_once
    monkeypatch.setattr(B, "run_once", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "t1 t2"}) + "\n"
                       + json.dumps({"prompt": " ".join(f"t{3 + i % 80}" for i in range(124))}) + "\n")
    res = bench(artifact, prompts, tmp_path / "o", "--policies", "ar,hybrid", "-n", 2)
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert f"{prompts}:2: the prompt has 124 tokens" in res.output and "8 slots for decoding" in res.output
    assert calls == [] and not (tmp_path / "o").exists()
    assert invoke("bench", "-a", artifact, "--prompts", prompts, "--policies", "ar", "-n", 2, "--monitor", "none",
                  "--out", tmp_path / "o").exit_code == 0  # AR alone can run it


def test_a_report_that_cannot_be_written_is_one_line_and_the_numbers_still_shown(artifact, prompts_file, tmp_path):
    # A folder named bench.md (or a full disk) in --out: a traceback after the whole benchmark,
    # its numbers lost, and a fresh bench.json beside the old files.
    out = tmp_path / "o"
    (out / "bench.md").mkdir(parents=True)
    res = bench(artifact, prompts_file, out, "--policies", "ar", "-n", 2, "--json")
    assert res.exit_code == 1 and res.exception is not None and isinstance(res.exception, SystemExit), res.output
    assert f"{out / 'bench.md'}: is a folder" in res.stderr
    assert json.loads(res.stdout)["routes"][0]["name"] == "ar"  # what was measured still reaches the user
    assert sorted(p.name for p in out.iterdir()) == ["bench.md"]  # nothing written beside it, no temporaries


def test_a_failed_write_leaves_the_earlier_report_whole(artifact, prompts_file, tmp_path, monkeypatch):
    out = tmp_path / "o"
    assert bench(artifact, prompts_file, out, "--policies", "ar", "-n", 2).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(report, path):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(bench_report, "plot_power", disk_full)
    res = bench(artifact, prompts_file, out, "--policies", "ar,speculative", "-n", 2)
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert f"{out / 'power.png'}: cannot be written (No space left on device)" in res.output
    assert "| speculative |" in res.stdout  # the table is still printed
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # old report whole, not a mix


def test_ctrl_c_while_writing_leaves_no_half_written_files(artifact, prompts_file, tmp_path, monkeypatch):
    out = tmp_path / "o"

    def interrupted(report, path):
        path.write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt
    monkeypatch.setattr(bench_report, "plot_tok_s", interrupted)
    res = bench(artifact, prompts_file, out, "--policies", "ar", "-n", 2)
    assert res.exit_code == 1  # click: Aborted!
    assert list(out.iterdir()) == []  # no bench.json written before the plot, no temporary


def test_ctrl_c_before_any_measured_run_keeps_the_earlier_report(artifact, prompts_file, tmp_path, monkeypatch):
    # An empty report (every route "–") replaced the earlier results in the same --out.
    out = tmp_path / "o"
    assert bench(artifact, prompts_file, out, "--policies", "ar", "-n", 2).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = B.run_once, []

    def interrupted_in_the_warm_up(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)
    monkeypatch.setattr(B, "run_once", interrupted_in_the_warm_up)
    res = bench(artifact, prompts_file, out, "--policies", "ar,hybrid", "-n", 2, "--json")
    assert res.exit_code == 130 and res.stdout == ""
    assert "interrupted before any measured run (1 warm-up run(s) done): nothing written" in res.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_ctrl_c_inside_the_engine_writes_a_valid_partial_report(artifact, prompts_file, tmp_path, monkeypatch):
    from bitmtp_edge.backends.reference import ReferenceBackend

    real, calls = ReferenceBackend.verify_step, []

    def verify_then_ctrl_c(self, *args, **kw):  # Ctrl-C in the middle of a decode, not between runs
        calls.append(1)
        if len(calls) == 12:
            raise KeyboardInterrupt
        return real(self, *args, **kw)
    monkeypatch.setattr(ReferenceBackend, "verify_step", verify_then_ctrl_c)
    out = tmp_path / "o"
    res = bench(artifact, prompts_file, out, "--policies", "ar,speculative", "-n", 3, "--repeats", 2, "--ignore-eos",
                "--monitor", "psutil", "--interval-ms", 20)
    assert res.exit_code == 130, res.output
    data = json.loads((out / "bench.json").read_text())
    assert data["partial"] is True and 0 < len(data["runs"]) < data["planned_runs"]
    assert all(r["new_tokens"] == 3 for r in data["runs"])  # the run cut short is not recorded
    rows = list(csv.DictReader((out / "bench.csv").open(encoding="utf-8")))
    assert [r["partial"] for r in rows] == ["True", "True"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_report_files_are_utf8_whatever_the_locale(swept, tmp_path):
    # τ, ×, — in bench.md and bench.csv: under an ASCII locale the write raised UnicodeEncodeError.
    data, _ = swept
    (tmp_path / "in.json").write_text(json.dumps(data), encoding="utf-8")
    code = ("import json, sys; from bitmtp_edge.app.bench_report import write_report; "
            "write_report(json.loads(open(sys.argv[1], encoding='utf-8').read()), sys.argv[2])")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    subprocess.run([sys.executable, "-X", "utf8=0", "-c", code, tmp_path / "in.json", tmp_path / "o"],
                   cwd=ROOT, env=env, check=True, capture_output=True)
    assert "hybrid τ=0.5 m=3" in (tmp_path / "o" / "bench.md").read_text(encoding="utf-8")
    assert "hybrid τ=0.5 m=3" in (tmp_path / "o" / "bench.csv").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- tune


def test_tune_without_a_gpu_says_it_needs_one(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = invoke("tune")
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    assert "tune needs a CUDA GPU" in res.output and "Traceback" not in res.output


def test_tune_with_a_broken_torch_is_one_line(monkeypatch):
    # The usual Jetson failure (a wheel for another JetPack): a traceback from `import torch`.
    monkeypatch.setitem(sys.modules, "torch", None)
    res = invoke("tune")
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert "torch cannot be imported" in res.output and "bitmtp doctor" in res.output


def test_tune_without_triton_says_how_to_install_it(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)
    res = invoke("tune")
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert "Triton is not installed" in res.output and "bitmtp-edge[triton]" in res.output
