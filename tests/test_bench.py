"""``bitmtp bench`` and the library under it (bitmtp_edge.app.bench), on the CPU.

A one-layer random model written as a real artifact (tests/helpers.py) keeps every run to
milliseconds; what is checked is the protocol and the report, not the speed: the files
exist, the numbers are sane, energy is None with a stated reason under psutil and exact
under a source of known constant power, the posture is recorded, and --strict refuses an
unready Jetson (fixture tree) before loading anything.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from bitmtp_edge.app import bench as B
from bitmtp_edge.app.cli import main
from bitmtp_edge.jetson.monitor import PollingSource, Sample, Sampler
from tests.helpers import random_model, write_test_artifact
from tests.test_monitor_sampler import fake_tegrastats  # noqa: F401  (a fixture)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPTS = ['{"prompt": "t1 t2 t3"}', "", '{"prompt": "t4 t5", "id": "extra keys are ignored"}']


@pytest.fixture(scope="module")
def model():
    return random_model(seed=0, hidden=128, layers=1)


@pytest.fixture(scope="module")
def artifact(model, tmp_path_factory) -> Path:
    return write_test_artifact(model, tmp_path_factory.mktemp("bench") / "art", max_context=128)


@pytest.fixture(scope="module")
def engine(artifact):
    from bitmtp_edge.runtime.engine import Engine

    return Engine.load(artifact, backend="reference", device="cpu")


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(PROMPTS) + "\n")
    return p


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# --------------------------------------------------------------------------- workload and routes


def test_load_prompts_skips_blank_lines_and_keeps_where(prompts_file):
    got = B.load_prompts(prompts_file)
    assert [p.text for p in got] == ["t1 t2 t3", "t4 t5"]
    assert [p.where for p in got] == [f"{prompts_file}:1", f"{prompts_file}:3"]


@pytest.mark.parametrize("line, what", [
    ('{"prompt": "ok"', "not valid JSON"),
    ('["a list"]', 'expected an object with a "prompt" key'),
    ('{"text": "no prompt key"}', 'expected an object with a "prompt" key'),
    ('{"prompt": 42}', "must be a non-empty string"),
])
def test_load_prompts_names_the_bad_line(tmp_path, line, what):
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(B.BenchError) as info:
        B.load_prompts(p)
    assert str(info.value).startswith(f"{p}:3: ") and what in str(info.value)


def test_load_prompts_missing_or_empty_file(tmp_path):
    with pytest.raises(B.BenchError, match="no such prompts file"):
        B.load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(B.BenchError, match="no prompts"):
        B.load_prompts(tmp_path / "empty.jsonl")


def test_builtin_prompts_are_the_held_out_file_beside_the_artifact_else_the_fallback(tmp_path):
    from types import SimpleNamespace

    from bitmtp_edge.app.demo import FALLBACK_PROMPTS

    prompts, source = B.builtin_prompts(SimpleNamespace(path=tmp_path))
    assert [p.text for p in prompts] == list(FALLBACK_PROMPTS) and "FALLBACK_PROMPTS" in source
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"id": "x", "prompt": "def f():\n", "reference": "..."}) + "\n")
    prompts, source = B.builtin_prompts(SimpleNamespace(path=tmp_path))
    assert [p.text for p in prompts] == ["def f():\n"] and source.startswith("held-out prompts ")


def test_routes_put_ar_first_and_sweep_tau_and_m(engine):
    mtp = engine.manifest.mtp
    default = B.make_routes(engine, None)
    assert [r.name for r in default] == ["ar", f"confidence τ={mtp.tau:g}", "speculative",
                                         f"hybrid τ={mtp.tau:g} m={mtp.min_prefix}", "fused"]
    sweep = B.make_routes(engine, ("hybrid", "ar"), taus=(0.5, 0.9), min_prefixes=(1, 2))
    assert [r.name for r in sweep] == ["ar", "hybrid τ=0.5 m=1", "hybrid τ=0.5 m=2", "hybrid τ=0.9 m=1",
                                       "hybrid τ=0.9 m=2"]
    with pytest.raises(B.BenchError, match="unknown policy 'greedy'"):
        B.make_routes(engine, ("ar", "greedy"))
    with pytest.raises(B.BenchError, match=r"--min-prefix 9: m must be in 1\.\.4"):
        B.make_routes(engine, ("hybrid",), min_prefixes=(9,))
    fused = B.make_routes(engine, ("fused", "ar"), candidates=(1, 3, 1))
    assert [(r.name, r.candidates) for r in fused] == [("ar", None), ("fused c=1", 1), ("fused c=3", 3)]
    with pytest.raises(B.BenchError, match=r"--candidates 6: c must be in 1\.\.5"):
        B.make_routes(engine, ("fused",), candidates=(6,))
    # an engine that timed its fused states at load chooses c itself: the route says so
    from types import SimpleNamespace

    chooser = SimpleNamespace(manifest=engine.manifest, path=engine.path, candidate_chooser=object())
    (auto,) = B.make_routes(chooser, ("fused",))
    assert (auto.name, auto.candidates, auto.to_dict()["candidates"]) == ("fused c=auto", None, "auto")


def test_an_ar_only_model_benchmarks_ar_alone():
    from types import SimpleNamespace

    ar_only = SimpleNamespace(manifest=SimpleNamespace(mtp=None), path="AR/")
    assert [r.name for r in B.make_routes(ar_only, None)] == ["ar"]
    with pytest.raises(B.BenchError, match="'hybrid' needs an MTP-trained model; AR/ is AR-only"):
        B.make_routes(ar_only, ("ar", "hybrid"))


# --------------------------------------------------------------------------- the CLI end to end


def test_bench_cli_writes_json_table_and_plots(artifact, prompts_file, tmp_path):
    out = tmp_path / "out"
    res = invoke("bench", "--artifact", artifact, "--prompts", prompts_file, "-n", 6, "--repeats", 2,
                 "--warmup", 1, "--policies", "ar,hybrid,speculative", "--monitor", "psutil", "--interval-ms", 20,
                 "--out", out, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    for name in B.FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for png in ("tok_s.png", "power.png", "tokens_per_iteration.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    assert json.loads((out / "bench.json").read_text()) == report

    # provenance
    assert report["command"].startswith("bitmtp bench --artifact ") and "--policies ar,hybrid,speculative" in report["command"]
    assert report["engine"] == {"backend": "reference", "device": "cpu", "runtime": None, "head": "16bit",
                                "draft_head": "int8", "candidate_chooser": None}  # nothing timed at load on the reference backend
    assert len(report["artifact"]["manifest_sha256"]) == 64 and report["artifact"]["block_size"] == 4
    assert report["posture"]["on_jetson"] is False and report["device"]
    assert report["workload"]["source"] == str(prompts_file) and len(report["workload"]["prompts"]) == 2
    assert report["monitor"]["source"] == "psutil"

    # the routes
    routes = {r["policy"]: r for r in report["routes"]}
    assert list(routes) == ["ar", "hybrid", "speculative"]  # AR first, then as asked
    for r in routes.values():
        assert r["runs"] == 2 * 2 and r["decode_tok_s"] > 0 and r["new_tokens"] > 0
        assert r["tokens_per_iteration"] >= 1.0 and 0.0 <= r["verifier_call_rate"] <= 1.0
        assert r["speedup_vs_ar"] > 0
        assert r["avg_power_w"] is None and r["j_per_token"] is None and r["energy_j"] is None
        assert any("psutil" in n and "power unknown" in n for n in r["notes"])
        assert r["peak_rss_mb"] > 0 and r["clocks_mhz"] is not None
        assert sum(r["accepted_histogram"].values()) > 0
    assert routes["ar"]["tokens_per_iteration"] == 1.0 and routes["ar"]["verifier_call_rate"] == 1.0
    assert routes["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert routes["speculative"]["verifier_call_rate"] == 1.0  # it always verifies
    assert any("power unknown" in n for n in report["notes"])

    # every run (3 warm-ups + 3 routes x 2 prompts x 2 repeats) has its decode window on the timeline
    assert len(report["runs"]) == 3 + 12 and len(report["timeline"]["windows"]) == 15
    assert sum(w["warmup"] for w in report["timeline"]["windows"]) == 3
    assert all(0 <= w["start"] <= w["end"] for w in report["timeline"]["windows"])
    assert report["timeline"]["samples"] and all(s["power_w"] is None for s in report["timeline"]["samples"])

    md = (out / "bench.md").read_text()
    assert "| route | decode tok/s | speedup vs AR |" in md and "J/token" in md
    for r in report["routes"]:
        assert f"| {r['name']} |" in md
    assert "not a Jetson" in md and "power unknown" in md and "![power over time" in md


@pytest.mark.skipif(not (Path(B.__file__).parent / "embedded" / "model" / "manifest.json").is_file(),
                    reason="no embedded model in this checkout yet")
def test_bench_runs_on_the_embedded_model_and_its_held_out_prompts(tmp_path):
    res = invoke("bench", "--num-prompts", 1, "-n", 6, "--repeats", 1, "--warmup", 0, "--policies", "ar,hybrid",
                 "--monitor", "psutil", "--out", tmp_path / "e", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["artifact"]["path"].endswith("embedded/model")
    assert all(r["decode_tok_s"] > 0 for r in report["routes"])
    for name in B.FILES:
        assert (tmp_path / "e" / name).is_file()


def test_bench_with_the_int8_head_says_so(artifact, prompts_file, tmp_path):
    res = invoke("bench", "--artifact", artifact, "--prompts", prompts_file, "-n", 4, "--repeats", 1,
                 "--warmup", 0, "--policies", "ar,speculative", "--head", "int8", "--monitor", "psutil",
                 "--out", tmp_path / "out", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["engine"]["head"] == "int8"
    assert "| backend | reference on cpu, int8 verify head |" in (tmp_path / "out" / "bench.md").read_text()


def test_bench_cli_sweeps_fused_candidates(artifact, prompts_file, tmp_path):
    res = invoke("bench", "--artifact", artifact, "--prompts", prompts_file, "-n", 6, "--repeats", 1,
                 "--warmup", 0, "--policies", "ar,fused", "-c", 1, "--candidates", 2, "--monitor", "psutil",
                 "--out", tmp_path / "out", "--json")
    assert res.exit_code == 0, res.output
    routes = json.loads(res.stdout)["routes"]
    assert [(r["name"], r["candidates"]) for r in routes] == [("ar", None), ("fused c=1", 1), ("fused c=2", 2)]
    assert all(r["new_tokens"] > 0 for r in routes)


def test_bench_cli_table_on_stdout(artifact, prompts_file, tmp_path):
    res = invoke("bench", "-a", artifact, "--prompts", prompts_file, "--num-prompts", 1, "-n", 3, "--repeats", 1,
                 "--warmup", 0, "--policies", "ar,confidence", "--monitor", "none", "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert "| route |" in res.stdout and "| ar |" in res.stdout and "| confidence τ=0.9 |" in res.stdout
    assert "note: not a Jetson" in res.stderr and "wrote " in res.stderr
    report = json.loads((tmp_path / "o" / "bench.json").read_text())
    assert report["monitor"]["source"] == "none" and report["timeline"]["samples"] == []
    assert report["routes"][1]["verifier_call_rate"] == 0.0  # confidence never verifies


class ConstantPower(PollingSource):
    """A power sensor that always reads 10 W: energy over a window is exactly 10 W x its length."""

    name = "constant"

    def open(self) -> None:
        pass

    def poll(self) -> Sample:
        return Sample(t=time.monotonic(), power_w=10.0, temps_c={"tj": 51.5}, gpu_freq_mhz=918.0, ram_used_mb=100.0)


def test_energy_per_token_is_integrated_over_each_decode_window(engine):
    prompts = [B.BenchPrompt("t1 t2 t3", "test #1")]
    routes = B.make_routes(engine, ("ar", "hybrid"))
    config = B.BenchConfig(max_new_tokens=6, warmup=0, repeats=2, ignore_eos=True)
    report = B.run_bench(engine, prompts, routes, config, sampler=Sampler(ConstantPower(0.01)))
    assert len(report.runs) == 4
    for run in report.runs:
        assert run.stats.new_tokens == 6  # --ignore-eos: fixed lengths
        assert run.window is not None and run.window.avg_power_w == pytest.approx(10.0)
        assert run.j_per_token() == pytest.approx(10.0 * run.stats.decode_s / 6, rel=1e-6)
    data = report.to_dict()
    for r in data["routes"]:
        assert r["avg_power_w"] == pytest.approx(10.0) and r["j_per_token"] > 0
        assert r["tokens_per_joule"] == pytest.approx(1 / r["j_per_token"])
        assert r["peak_temps_c"] == {"tj": 51.5} and r["clocks_mhz"]["gpu"] == {"min": 918.0, "max": 918.0}
        assert r["peak_ram_used_mb"] == 100.0
    assert data["monitor"]["source"] == "constant" and data["monitor"]["power_note"] is None
    assert all(s["power_w"] == 10.0 for s in data["timeline"]["samples"])


def test_bench_drives_the_graph_backend_like_the_engine_does(model, engine):
    """The path the GPU bench takes (GraphBackend, as --backend ampere builds it), here with
    its CPU twins and no graphs: same decoding loop, runtime flags recorded."""
    import torch

    from bitmtp_edge.backends.graph import RuntimeOptions
    from bitmtp_edge.runtime.engine import Engine
    from tests.helpers import fast_backend

    backend = fast_backend(model, block_size=4, max_context=128,
                           options=RuntimeOptions(graphs=False, kv_dtype=torch.float32))
    fast = Engine(engine.path, engine.manifest, backend, engine.tokenizer, engine.device)
    prompts = [B.BenchPrompt("t1 t2 t3", "test #1")]
    config = B.BenchConfig(max_new_tokens=5, warmup=1, repeats=1, monitor="none")
    data = B.run_bench(fast, prompts, B.make_routes(fast, None), config).to_dict()
    assert data["engine"]["backend"] == backend.name and data["engine"]["head"] == "16bit"
    assert data["engine"]["runtime"] == {"specialize": True, "graphs": False, "hoist_verify": True,
                                         "capture": "load", "kv_dtype": "torch.float32",
                                         "fused_candidates": "(1, 3)", "precompile": True,
                                         "precompile_mode": "threads", "precompile_overlap": True,
                                         "precompile_timeout_s": 600.0, "precompile_workers": 0}
    ref = B.run_bench(engine, prompts, B.make_routes(engine, None), config).to_dict()
    # the twins are exact: both backends commit the same tokens per iteration on every route
    for a, b in zip(data["routes"], ref["routes"]):
        assert a["name"] == b["name"] and a["accepted_histogram"] == b["accepted_histogram"]


def test_bench_with_nvml_reports_power_and_energy_per_token(monkeypatch, artifact, prompts_file, tmp_path):
    """The H200 command's path (--monitor nvml) with a stand-in NVML: a GPU drawing a steady
    350 W, whose energy counter agrees, so both J/token figures are 350 W x decode time."""
    import sys

    from tests.test_monitor_sampler import _fake_pynvml

    fake = _fake_pynvml()
    fake.nvmlDeviceGetTotalEnergyConsumption = lambda h: int(time.monotonic() * 350_000)  # mJ
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    out = tmp_path / "nvml"
    res = invoke("bench", "-a", artifact, "--prompts", prompts_file, "-n", 4, "--repeats", 1, "--policies",
                 "ar,hybrid", "--monitor", "nvml", "--interval-ms", 10, "--out", out, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["monitor"]["source"] == "nvml" and report["monitor"]["power_note"] is None
    for r in report["routes"]:
        assert r["avg_power_w"] == pytest.approx(350.0)
        run_s = [x["decode_s"] / x["new_tokens"] for x in report["runs"] if x["route"] == r["name"] and x["repeat"] >= 0]
        assert r["j_per_token"] == pytest.approx(350.0 * statistics.median(run_s), rel=1e-3)
        assert r["j_per_token_counter"] == pytest.approx(r["j_per_token"], rel=0.05)
        assert r["peak_temps_c"] == {"gpu": 61.0} and r["clocks_mhz"]["gpu"]["max"] == 1980.0
        assert r["peak_gpu_mem_used_mb"] == 2048.0
    md = (out / "bench.md").read_text()
    assert "## Energy (decode windows)" in md and "J/token (energy counter)" in md


# --------------------------------------------------------------------------- posture


def _fixture_posture(monkeypatch, name: str):
    from bitmtp_edge.jetson import posture
    from tests.test_board_posture import board

    root, runner = board(name)
    monkeypatch.setattr(posture, "check_posture", functools.partial(posture.check_posture, root=root, runner=runner))


def test_strict_refuses_an_unready_jetson_before_loading(monkeypatch, tmp_path):
    _fixture_posture(monkeypatch, "orin-nano-super-25w")
    res = invoke("bench", "--strict", "--artifact", tmp_path / "never-loaded", "--out", tmp_path / "o")
    assert res.exit_code == 1
    assert "strict mode refuses" in res.output and "25W" in res.output and "sudo jetson_clocks" in res.output
    assert "never-loaded" not in res.output and not (tmp_path / "o").exists()


def test_posture_is_recorded_and_warned_without_strict(monkeypatch, artifact, prompts_file, tmp_path):
    _fixture_posture(monkeypatch, "orin-nano-super-25w")
    res = invoke("bench", "-a", artifact, "--prompts", prompts_file, "--num-prompts", 1, "-n", 2, "--repeats", 1,
                 "--warmup", 0, "--policies", "ar", "--monitor", "none", "--out", tmp_path / "o", "--json")
    assert res.exit_code == 0, res.output
    assert "warning: power posture: power mode is 25W" in res.stderr
    p = json.loads(res.stdout)["posture"]
    assert p["on_jetson"] is True and p["power_mode_name"] == "25W" and p["ready"] is False
    assert p["clocks_locked"] is False and len(p["warnings"]) == 2
    assert "25W" in (tmp_path / "o" / "bench.md").read_text()


def test_strict_bench_on_a_ready_jetson_with_tegrastats(monkeypatch, fake_tegrastats, artifact,  # noqa: F811
                                                        prompts_file, tmp_path):
    """The Jetson story end to end on the CPU: an Orin Nano Super fixture at MAXN_SUPER with
    locked clocks passes --strict, and the fake tegrastats (recorded Orin Nano lines) gives
    module power (VDD_IN), so every route has J/token; only our own child was started."""
    _fixture_posture(monkeypatch, "orin-nano-super")
    _, log = fake_tegrastats
    out = tmp_path / "jetson"
    res = invoke("bench", "--strict", "-a", artifact, "--prompts", prompts_file, "-n", 4, "--repeats", 1,
                 "--policies", "ar,hybrid", "--monitor", "tegrastats", "--interval-ms", 20, "--out", out, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["posture"]["ready"] is True and report["posture"]["power_mode_name"] == "MAXN_SUPER"
    assert report["device"].startswith("Jetson Orin Nano")
    assert report["monitor"]["source"] == "tegrastats"
    vdd_in_w = (4.761, 12.479)  # the range of VDD_IN over the recorded lines
    for r in report["routes"]:
        assert vdd_in_w[0] <= r["avg_power_w"] <= vdd_in_w[1] and r["j_per_token"] > 0
        assert "tj" in r["peak_temps_c"]
    started = log.read_text().splitlines()
    assert len(started) == 1 and started[0].endswith("--interval 20")  # never --stop
    assert "MAXN_SUPER, clocks locked — benchmark-ready" in (out / "bench.md").read_text()


# --------------------------------------------------------------------------- errors


def test_bench_errors_name_the_file_option_and_fix(artifact, tmp_path):
    res = invoke("bench", "--artifact", tmp_path / "missing", "--monitor", "none")
    assert res.exit_code == 1 and f"{tmp_path / 'missing'}: no such artifact folder" in res.output
    assert "bitmtp-export" in res.output

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "t1"}\n{"prompt": "t2",}\n')
    res = invoke("bench", "--artifact", artifact, "--prompts", bad)
    assert res.exit_code == 1 and f"{bad}:2: not valid JSON" in res.output

    res = invoke("bench", "--artifact", artifact, "--policies", "ar,beam")
    assert res.exit_code == 2 and "unknown policy 'beam'" in res.output and "hybrid" in res.output

    res = invoke("bench", "--artifact", artifact, "-D", 8, "--monitor", "none")
    assert res.exit_code == 1 and "--block-size 8" in res.output and "D=4" in res.output

    res = invoke("bench", "--artifact", artifact, "--monitor", "tegrastats", "-n", 2, "--out", tmp_path / "o")
    assert res.exit_code == 1 and "--monitor tegrastats: tegrastats not found" in res.output


def test_bench_reports_where_fused_c_auto_settled(model, engine):
    """An engine that timed its fused states at load (here: costs given to its chooser, CPU
    twins, no graphs) benchmarks fused as c=auto, and the report says what each c cost."""
    import torch

    from bitmtp_edge.app.bench_report import render_markdown
    from bitmtp_edge.backends.graph import RuntimeOptions
    from bitmtp_edge.runtime.candidates import CandidateChooser
    from bitmtp_edge.runtime.engine import Engine
    from tests.helpers import fast_backend

    backend = fast_backend(model, block_size=4, max_context=128,
                           options=RuntimeOptions(graphs=False, kv_dtype=torch.float32))
    fast = Engine(engine.path, engine.manifest, backend, engine.tokenizer, engine.device)
    fast.candidate_chooser = CandidateChooser({1: 100.0, 3: 130.0}, draft_us=90.0)
    prompts = [B.BenchPrompt("t1 t2 t3", "test #1")]
    config = B.BenchConfig(max_new_tokens=24, warmup=0, repeats=1, monitor="none", ignore_eos=True)
    data = B.run_bench(fast, prompts, B.make_routes(fast, ("fused",)), config).to_dict()
    (route,) = data["routes"]
    assert route["name"] == "fused c=auto" and route["candidates"] == "auto"
    chooser = data["engine"]["candidate_chooser"]
    passes = {int(c): r["passes"] for c, r in chooser["records"].items() if r["passes"]}
    assert passes == {int(c): n for c, n in route["fused_candidates"].items()} and sum(passes.values()) > 0
    assert "| fused c=auto | settled on c=" in render_markdown(data)


def test_bench_reports_what_share_the_certified_head_answered():
    """The certified head's greedy head calls of the runs, and the share the int8 rows answered
    alone, in the engine section and on the backend row; other heads say nothing of it."""
    import types

    from bitmtp_edge.app.bench_report import _head_note

    from bitmtp_edge.runtime.decoding import DecodeStats

    fast = types.SimpleNamespace(certified_counts=lambda: pytest.fail("the runs' own stats carry the counts"))
    engine = types.SimpleNamespace(head="certified", backend=types.SimpleNamespace(fast=fast))
    runs = [types.SimpleNamespace(stats=DecodeStats(certified_head_calls=c, certified_head_int8=i))
            for c, i in ((120, 100), (80, 80), (0, 0))]  # a warm-up, a run, a run that made no head call
    totals = B._certified_totals(engine, runs)
    assert totals == {"calls": 200, "certified": 180}
    calls, certified = totals["calls"], totals["certified"]
    note = _head_note({"head": "certified", "certified_head": {"calls": calls, "certified": certified}})
    assert note == ", certified head (180 of 200 greedy head calls answered by the int8 rows, 90%)"
    assert _head_note({"head": "certified", "certified_head": {"calls": 0, "certified": 0}}).endswith(
        "(no greedy head call in these runs)")
    assert _head_note({"head": "16bit"}) == "" and _head_note({"head": "int8"}) == ", int8 verify head"
    assert _head_note({"head": "int8", "draft_head": "int4"}) == ", int8 verify head, int4 draft head"
    assert _head_note({"head": "16bit", "draft_head": "int8"}) == ""
    assert B._certified_totals(types.SimpleNamespace(head="16bit", backend=engine.backend), runs) is None
    assert B._certified_totals(types.SimpleNamespace(head="certified", backend=object()), runs) is None
