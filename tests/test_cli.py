"""The ``bitmtp`` command line through click's CliRunner: doctor, chat, serve,
generate and the friendly errors (``bench`` has tests/test_bench.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from bitmtp_edge.app import cli
from bitmtp_edge.app.cli import main
from tests.helpers import random_model, write_test_artifact

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    model = random_model(seed=1, hidden=128, layers=1)
    return write_test_artifact(model, tmp_path_factory.mktemp("cli") / "art", max_context=128)


@pytest.fixture(scope="module")
def engine(artifact):
    from bitmtp_edge.runtime.engine import Engine

    return Engine.load(artifact, backend="reference", device="cpu")


def invoke(*args, input: str | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input, catch_exceptions=False)


# --------------------------------------------------------------------------- the shell itself


def test_option_choices_match_the_library():
    from bitmtp_edge.backends.fast_model import HEADS
    from bitmtp_edge.backends.graph import RuntimeOptions
    from bitmtp_edge.runtime.engine import BACKENDS, DRAFT_HEAD_CHOICES

    assert cli.BACKEND_NAMES == BACKENDS
    assert cli.RUNTIME_NAMES == RuntimeOptions.PRESETS
    assert cli.HEAD_NAMES == HEADS
    assert cli.DRAFT_HEAD_NAMES == DRAFT_HEAD_CHOICES


def test_importing_the_cli_does_not_import_torch():
    # doctor must be able to report a broken torch install instead of dying on the import
    code = "import sys, bitmtp_edge.app.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_help_lists_every_command():
    res = invoke("--help")
    assert res.exit_code == 0
    for name in ("generate", "demo", "chat", "bench", "doctor", "serve"):
        assert name in res.output


# --------------------------------------------------------------------------- doctor


@pytest.fixture
def bare_host(monkeypatch, tmp_path):
    """This machine as a CPU-only host that is not a Jetson, whatever it really is: no CUDA
    device, an empty filesystem root for the board and posture checks, no NVML, no
    tegrastats or jtop socket. (On a GPU host or a Jetson the real answers differ.)"""
    import os

    import torch

    from bitmtp_edge.app import doctor

    run_doctor = doctor.run_doctor
    exists = os.path.exists
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor, "run_doctor", lambda artifact=None: run_doctor(artifact, root=tmp_path))
    monkeypatch.setattr(doctor, "_probe_nvml", lambda: {"available": False, "detail": "no NVIDIA driver here"})
    monkeypatch.setattr(doctor.shutil, "which", lambda *args, **kw: None)
    monkeypatch.setattr(doctor.os.path, "exists",
                        lambda p: False if str(p) in ("/usr/bin/tegrastats", doctor.JTOP_SOCKET) else exists(p))


def test_doctor_says_plainly_there_is_no_gpu_and_no_jetson(bare_host):
    res = invoke("doctor")
    assert res.exit_code == 0, res.output
    lines = {line.split()[1]: line for line in res.output.splitlines() if len(line.split()) > 1}
    assert "no GPU" in lines["gpu"]
    assert "not a Jetson" in lines["board"]
    assert "off a Jetson" in lines["posture"]
    assert "auto → reference on cpu" in lines["backend"]
    assert "no Triton kernels run here" in lines["kernels"]
    assert "auto → psutil" in lines["monitors"] and "energy per token will be unknown" in lines["monitors"]
    assert "not a Jetson, no GPU" in res.output.splitlines()[-1]


def test_doctor_json_checks_the_artifact(artifact, bare_host):
    res = invoke("doctor", "--artifact", artifact, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    checks = {c["name"]: c for c in data["checks"]}
    assert list(checks) == ["python", "torch", "triton", "gpu", "backend", "kernels", "board", "posture", "monitors",
                            "artifact"]
    assert checks["kernels"]["details"]["table"] is None and "reference backend" in checks["kernels"]["summary"]
    assert checks["gpu"]["details"]["available"] is False
    assert checks["board"]["details"]["on_jetson"] is False
    assert checks["backend"]["details"]["auto"] == "reference"
    assert checks["monitors"]["details"]["sources"]["tegrastats"]["available"] is False
    art = checks["artifact"]
    assert art["status"] == "ok" and art["details"]["block_size"] == 4 and "sha256" in art["summary"]
    assert data["ok"] is True and "no GPU" in data["verdict"]


def test_doctor_fails_on_a_corrupt_or_missing_artifact(artifact, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(artifact, bad)
    with open(bad / "weights.safetensors", "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    res = invoke("doctor", "--artifact", bad)
    assert res.exit_code == 1 and "sha256 mismatch" in res.output and "weights.safetensors" in res.output
    res = invoke("doctor", "--artifact", tmp_path / "nope", "--json")
    assert res.exit_code == 1
    art = json.loads(res.output)["checks"][-1]
    assert art["status"] == "fail" and "no such artifact folder" in art["summary"]


# --------------------------------------------------------------------------- generate


def test_generate_json_parses_and_missing_artifact_is_named(artifact, tmp_path):
    res = invoke("generate", "t1 t2 t3", "--artifact", artifact, "-n", 4, "--policy", "speculative", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert len(data["token_ids"]) == data["stats"]["new_tokens"] <= 4
    res = invoke("generate", "t1", "--artifact", tmp_path / "missing")
    assert res.exit_code == 1
    assert f"Error: {tmp_path / 'missing'}: no such artifact folder" in res.output and "bitmtp-export" in res.output
    res = invoke("generate", "t1", "--artifact", artifact, "--policy", "beam")
    assert res.exit_code == 2 and "'beam' is not one of" in res.output


def test_generate_with_the_int8_head_is_lossless(artifact):
    runs = {}
    for policy in ("ar", "speculative"):
        res = invoke("generate", "t1 t2 t3", "--artifact", artifact, "-n", 8, "--policy", policy, "--head", "int8",
                     "--json")
        assert res.exit_code == 0, res.output
        runs[policy] = json.loads(res.stdout)["token_ids"]
    assert runs["speculative"] == runs["ar"]
    res = invoke("generate", "t1", "--artifact", artifact, "--head", "fp4")
    assert res.exit_code == 2 and "'fp4' is not one of" in res.output


def test_generate_with_the_int4_draft_head_is_lossless(artifact):
    runs = {}
    for policy in ("ar", "speculative"):
        res = invoke("generate", "t1 t2 t3", "--artifact", artifact, "-n", 8, "--policy", policy,
                     "--draft-head", "int4", "--json")
        assert res.exit_code == 0, res.output
        runs[policy] = json.loads(res.stdout)["token_ids"]
    assert runs["speculative"] == runs["ar"]
    res = invoke("generate", "t1", "--artifact", artifact, "--draft-head", "int2")
    assert res.exit_code == 2 and "'int2' is not one of" in res.output


def test_generate_with_candidates_captures_that_fused_state_at_load(artifact, monkeypatch):
    """``--candidates 1`` (the board's route) used to capture its fused graphs at the first
    fused step, mid-generation: the load was told only the default c."""
    from bitmtp_edge.backends.graph import RuntimeOptions
    from bitmtp_edge.runtime.engine import Engine

    seen = []
    load = Engine.load.__func__

    def spy(cls, *args, runtime="full", **kw):
        seen.append(runtime)
        return load(cls, *args, runtime=runtime, **kw)

    monkeypatch.setattr(Engine, "load", classmethod(spy))
    res = invoke("generate", "t1 t2 t3", "--artifact", artifact, "-n", 6, "--policy", "fused", "-c", 1, "--json")
    assert res.exit_code == 0, res.output
    res = invoke("generate", "t1 t2 t3", "--artifact", artifact, "-n", 6, "--json")
    assert res.exit_code == 0, res.output
    assert seen == [RuntimeOptions.preset("full", fused_candidates=(1,)), "full"]


# --------------------------------------------------------------------------- chat


def test_chat_round_trip_with_commands(artifact):
    script = "t1 t2 t3\n/policy ar\nt4 t5\n/policy beam\n/policy\n/teleport\n/reset\n/help\n/quit\nt6 never read\n"
    res = invoke("chat", "--artifact", artifact, "-n", 5, input=script)
    assert res.exit_code == 0, res.output
    err = res.stderr
    assert "policy hybrid" in err.splitlines()[0] and "/quit to leave" in err.splitlines()[0]
    stats = [line for line in err.splitlines() if line.startswith("[")]
    assert len(stats) == 2  # two user turns answered, the line after /quit never read
    assert stats[0].startswith("[hybrid] ") and stats[1].startswith("[ar] ")
    for line in stats:
        assert "tok/s" in line and "tokens/iteration" in line and "verifier calls" in line
    assert "[ar] " in stats[1] and "1.00 tokens/iteration" in stats[1]
    assert "policy: ar (choices:" in err
    assert "error: unknown policy 'beam'" in err
    assert "error: unknown command '/teleport'" in err
    assert "transcript cleared" in err and "/reset" in err
    replies = [line for line in res.stdout.splitlines() if line.strip()]
    assert len(replies) == 2 and all(piece.startswith("t") for r in replies for piece in r.split())


def test_chat_ends_at_end_of_input(artifact):
    res = invoke("chat", "--artifact", artifact, "-n", 3, "--policy", "confidence", input="t1 t2\n")
    assert res.exit_code == 0 and "[confidence] " in res.stderr


def test_chat_session_keeps_and_trims_the_transcript(engine):
    from bitmtp_edge.app.chat import ChatSession, parse_command

    s = ChatSession(engine, policy="hybrid", max_new_tokens=4)
    reply = "".join(piece for piece, _ in s.reply("t1 t2"))
    assert s.transcript == "t1 t2\n" + reply and s.last_stats.new_tokens > 0
    s.transcript = " ".join(f"t{i % 90}" for i in range(1000)) + "\n"  # far beyond the 128-token context
    assert list(s.reply("t3"))  # the oldest tokens are dropped, no "prompt too long"
    s.reset()
    assert s.transcript == ""
    assert parse_command("/exit") == parse_command("/quit")
    assert parse_command("  /policy ar ").arg == "ar" and parse_command("not a command") is None


# --------------------------------------------------------------------------- serve


def test_serve_answers_json_lines_on_stdin(artifact):
    lines = [
        {"id": 1, "prompt": "t1 t2", "max_new_tokens": 3},
        "this is not json",
        {"id": 2, "prompt": "t3", "max_new_tokens": 3, "policy": "ar", "stream": True},
        {"id": 3, "op": "info"},
        {"id": 4, "prompt": ""},
        {"id": 5, "prompt": "t1", "policy": "beam"},
        {"id": 6, "prompt": "t1", "beam_width": 4},
        {"id": 7, "prompt": "t1", "max_new_tokens": 3, "temperature": 0.7, "seed": 5},
    ]
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    res = invoke("serve", "--artifact", artifact, "--no-warmup", input=text)
    assert res.exit_code == 0, res.output
    out = [json.loads(line) for line in res.stdout.splitlines()]
    by_id: dict = {}
    for o in out:
        by_id.setdefault(o["id"], []).append(o)
    assert by_id[1][0]["stats"]["new_tokens"] == len(by_id[1][0]["token_ids"]) <= 3
    assert by_id[None][0]["error"].startswith("line 2: not valid JSON")
    deltas, done = by_id[2][:-1], by_id[2][-1]
    assert done["done"] is True and done["text"] == "".join(d["delta"] for d in deltas)
    assert done["stats"]["verifier_call_rate"] == 1.0
    assert by_id[3][0]["info"]["block_size"] == 4 and by_id[3][0]["info"]["backend"] == "reference"
    assert by_id[3][0]["info"]["head"] == "16bit"
    assert "non-empty string" in by_id[4][0]["error"]
    assert "unknown policy 'beam'" in by_id[5][0]["error"]
    assert "unknown key(s) beam_width" in by_id[6][0]["error"]
    assert by_id[7][0]["stats"]["seed"] == 5  # sampled
    assert "ready in" in res.stderr and "after 8 request(s)" in res.stderr


def test_serve_on_a_unix_socket(engine, tmp_path):
    from bitmtp_edge.app.serve import UnixServer

    path = tmp_path / "s.sock"
    server = UnixServer(path, engine)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        assert path.is_socket() and (path.stat().st_mode & 0o777) == 0o660
        with pytest.raises(OSError, match="already listening"):
            UnixServer(path, engine)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(path))
            f = s.makefile("rwb")
            f.write(b'{"id": "a", "prompt": "t1 t2", "max_new_tokens": 2}\n{"id": "b", "op": "info"}\n')
            f.flush()
            first, second = json.loads(f.readline()), json.loads(f.readline())
        assert first["id"] == "a" and first["stats"]["new_tokens"] <= 2
        assert second["info"]["max_context"] == engine.backend.max_context
    finally:
        server.shutdown()
        server.server_close()
    assert not path.exists()
    # a socket left behind by a dead server is replaced, not an error
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    UnixServer(path, engine).server_close()


def test_capture_progress_bar_counts_the_graphs():
    import io

    from rich.console import Console

    from bitmtp_edge.app.live import CaptureProgress

    out = io.StringIO()
    bar = CaptureProgress(Console(file=out, force_terminal=True, width=80))
    for i in range(1, 41):
        bar(i, 40)
    assert bar._bar.tasks[0].completed == 40 and bar._bar.tasks[0].total == 40
    bar.close()
    assert "capturing CUDA graphs" in out.getvalue()
    CaptureProgress().close()  # nothing captured (CPU, reference): nothing shown, no error


def test_doctor_names_the_launch_table_or_the_defaults_a_gpu_runs():
    """A GPU with a shipped table gets it named; one without (every Orin today) is told the
    SM-count defaults it runs, which kernel its AR step takes, and how to tune."""
    from bitmtp_edge.app.doctor import kernel_table_check

    h200 = kernel_table_check("NVIDIA H200", 132)
    assert h200.status == "ok" and "kernels_ampere/tuned/nvidia_h200.json" in h200.summary
    assert h200.details["entries"] > 0
    orin = kernel_table_check("Orin (nvgpu)", 8)
    assert orin.status == "info" and orin.details["table"] is None and "bitmtp tune" in orin.summary
    assert orin.details["ar_step_kernel"] == "mma" and "for 8 SMs" in orin.summary
    assert kernel_table_check("Some Big GPU", 132).details["ar_step_kernel"] == "gemv"
