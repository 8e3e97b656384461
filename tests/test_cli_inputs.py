"""Inputs of the Python API and the CLI: wrong types and ranges are refused before the
prefill with a message naming the argument; an AR-only artifact is treated alike by
generate, chat and serve; ``--help`` imports neither torch nor the bench."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from bitmtp_edge.app.cli import main as bitmtp
from bitmtp_edge.runtime.decoding import DecodingError
from bitmtp_edge.runtime.engine import Engine

from .helpers import artifact_tensors, no_prefill, random_model, write_test_artifact  # noqa: F401  (no_prefill: the fixture)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return write_test_artifact(random_model(seed=6), tmp_path_factory.mktemp("inputs") / "model", block_size=4)


@pytest.fixture(scope="module")
def ar_only(tmp_path_factory) -> Path:
    """An artifact without an MTP block (a plain ternary model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from bitmtp_edge.format.manifest import Manifest, write_artifact
    from bitmtp_edge.format.roles import step_widths
    from bitmtp_edge.format.segments import plan_segments

    model = random_model(seed=7)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(model.cfg.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tmp = Path(tempfile.mkdtemp())
    tok.save(str(tmp / "tokenizer.json"))
    tensors = {k: v for k, v in artifact_tensors(model).items() if not k.startswith("draft_head.")}
    manifest = Manifest(model=model.cfg, quant=model.quant, kv=plan_segments(model.cfg, 256, workspace=1),
                        mtp=None, draft_head=None, widths=step_widths(None))
    return write_artifact(tmp_path_factory.mktemp("ar") / "model", manifest, tensors,
                          {"tokenizer.json": tmp / "tokenizer.json"})


@pytest.fixture(scope="module")
def engine(artifact) -> Engine:
    return Engine.load(artifact, backend="reference", device="cpu")


# ----------------------------------------------------------------------------- the Python API


def test_bytes_are_not_token_ids(no_prefill):
    for prompt in (b"def f(x):", bytearray(b"t1 t2")):
        with pytest.raises(TypeError, match="bytes"):
            no_prefill.generate(prompt, max_new_tokens=4)


@pytest.mark.parametrize("kw, name", [({"max_new_tokens": 2.5}, "max_new_tokens"), ({"max_new_tokens": "8"}, "max_new_tokens"),
                                      ({"max_new_tokens": True}, "max_new_tokens"), ({"tau": "0.5"}, "tau"),
                                      ({"tau": float("nan")}, "tau"), ({"min_prefix": 2.5}, "min_prefix"),
                                      ({"policy": ["ar"]}, "policy"), ({"stop": "\n"}, "stop")])
def test_wrong_argument_types_are_refused_before_the_prefill(no_prefill, kw, name):
    with pytest.raises((DecodingError, TypeError), match=name):
        no_prefill.generate("t1 t2 t3", **kw)
    with pytest.raises((DecodingError, TypeError), match=name):
        no_prefill.stream("t1 t2 t3", **kw)  # refused when called, not at the first token


def test_lone_surrogates_are_a_clear_error(no_prefill):
    with pytest.raises(DecodingError, match="lone surrogate"):
        no_prefill.generate("t1 \udcff t2", max_new_tokens=2)


@pytest.mark.parametrize("ids, error", [([-1], DecodingError), ([96], DecodingError), ([True], TypeError),
                                        ([1.5], TypeError), (["3"], TypeError), ([], DecodingError)])
def test_token_id_prompts_are_checked(no_prefill, ids, error):
    with pytest.raises(error):
        no_prefill.generate(ids, max_new_tokens=2)


def test_text_prompts_are_range_checked_against_the_model_vocabulary(no_prefill, monkeypatch):
    class WiderTokenizer:  # a tokenizer that knows more tokens than the model has rows
        def encode(self, text, add_special_tokens=False):
            return type("Enc", (), {"ids": [3, 96 + 5]})()
    monkeypatch.setattr(no_prefill, "tokenizer", WiderTokenizer())
    with pytest.raises(DecodingError, match="outside the vocabulary"):
        no_prefill.generate("anything", max_new_tokens=2)


def test_logits_refuses_more_ids_than_the_context(engine):
    n = engine.backend.max_context
    with pytest.raises(DecodingError, match="logits"):
        engine.logits(list(range(8)) * (n // 8 + 1))
    with pytest.raises(TypeError):
        engine.logits(b"t1 t2")
    assert engine.logits([1, 2, 3]).shape == (3, engine.manifest.model.vocab_size)


# ----------------------------------------------------------------------------- the CLI


def run(*args, input=None):
    return CliRunner().invoke(bitmtp, [str(a) for a in args], input=input)


def test_generate_says_why_it_stopped(artifact):
    res = run("generate", "t1 t2 t3", "-a", artifact, "--device", "cpu", "-n", "3", "--policy", "ar")
    assert res.exit_code == 0, res.output
    assert "stopped: length" in res.output or "stopped: stop" in res.output


def test_generate_with_a_non_utf8_prompt_is_one_line_not_a_traceback(artifact):
    res = run("generate", "t1 \udcff", "-a", artifact, "--device", "cpu", "-n", "2")
    assert res.exit_code == 1 and "not valid Unicode" in res.output and "Traceback" not in res.output


def test_every_command_runs_an_ar_only_artifact_with_ar_by_default(ar_only):
    gen = run("generate", "t1 t2", "-a", ar_only, "--device", "cpu", "-n", "2")
    assert gen.exit_code == 0 and "AR-only" in gen.output and "[ar]" in gen.output, gen.output
    chat = run("chat", "-a", ar_only, "--device", "cpu", "-n", "2", input="t1 t2\n")
    assert chat.exit_code == 0 and "AR-only" in chat.output and "policy ar" in chat.output, chat.output
    req = json.dumps({"prompt": [1, 2], "max_new_tokens": 2}) + "\n"
    srv = run("serve", "-a", ar_only, "--device", "cpu", "--no-warmup", input=req)
    assert srv.exit_code == 0 and "AR-only" in srv.output, srv.output
    assert len(json.loads([x for x in srv.output.splitlines() if x.startswith("{")][0])["token_ids"]) == 2


@pytest.mark.parametrize("command", [["generate", "t1"], ["chat"], ["serve", "--no-warmup"]])
def test_every_command_refuses_an_mtp_policy_asked_for_on_an_ar_only_artifact(ar_only, command):
    res = run(*command[:1], *command[1:], "-a", ar_only, "--device", "cpu", "--policy", "hybrid", input="")
    assert res.exit_code == 1 and "AR-only" in res.output and "--policy ar" in res.output, res.output


def test_help_imports_neither_torch_nor_the_bench():
    code = ("import sys; import bitmtp_edge.app.cli as c; "
            "print(sorted(m for m in ('torch', 'bitmtp_edge.app.bench', 'rich') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_cli_copy_of_the_monitor_choices_agrees():
    from bitmtp_edge.app import bench, cli

    assert cli.MONITOR_CHOICES == bench.MONITOR_CHOICES


# ----------------------------------------------------------------------------- found by black-box runs


@pytest.mark.parametrize("policy", ["ar", "hybrid"])
def test_chat_keeps_room_for_the_reply_once_the_transcript_fills_the_context(engine, policy):
    # The transcript was cut to the context less one slot: after a long turn every reply
    # stopped at a token or two ("context_full").
    from bitmtp_edge.app.chat import ChatSession

    session = ChatSession(engine, policy=policy, max_new_tokens=8)
    long_turn = " ".join(f"t{3 + i % 80}" for i in range(engine.backend.max_context + 50))
    for turn in (long_turn, "t1 t2 t3"):
        for _ in session.reply(turn):
            pass
        assert session.last_stats.finish_reason in ("length", "stop"), session.last_stats
    assert len(engine.encode(session.transcript)) > engine.backend.max_context  # it did fill the context


def test_demo_names_a_malformed_prompts_file_beside_the_artifact(artifact, tmp_path):
    import shutil

    folder = Path(shutil.copytree(artifact, tmp_path / "model"))
    for line, what in (('{"text": "t1 t2"}', '"prompt" key'), ("t1 t2", "not valid JSON"),
                       ('{"prompt": ""}', "non-empty string")):
        (folder / "prompts.jsonl").write_text(line + "\n")
        res = run("demo", "-a", folder, "--device", "cpu", "-n", "2")
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
        assert "prompts.jsonl:1" in res.output and what in res.output, res.output


def test_doctor_reports_a_bad_thread_count_instead_of_a_traceback(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the reference backend on the CPU
    monkeypatch.setenv("BITMTP_CPU_THREADS", "abc")
    res = run("doctor")
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    backend = [line for line in res.output.splitlines() if line.split()[1:2] == ["backend"]]
    assert backend and "✗" in backend[0] and "BITMTP_CPU_THREADS='abc'" in backend[0], res.output
    assert "problems: backend" in res.output


@pytest.mark.parametrize("device", ["tpu", "meta"])
def test_generate_with_a_device_torch_cannot_use_is_one_line(artifact, device):
    res = run("generate", "t1 t2", "-a", artifact, "--device", device, "-n", "2")
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
    assert f"device={device!r}" in res.output and "Traceback" not in res.output
    embedded = run("generate", "t1", "--device", device, "-n", "2")
    assert "embedded model" not in embedded.output  # the hint is for artifact errors, not this


def test_generate_with_a_tiny_temperature_prints_the_greedy_text(artifact):
    greedy = run("generate", "t5 t6", "-a", artifact, "--device", "cpu", "-n", "6", "--policy", "ar", "--json")
    tiny = run("generate", "t5 t6", "-a", artifact, "--device", "cpu", "-n", "6", "--policy", "ar", "--json",
               "-t", "1e-40", "--seed", "1")
    assert greedy.exit_code == tiny.exit_code == 0, tiny.output
    assert json.loads(tiny.output)["token_ids"] == json.loads(greedy.output)["token_ids"]


def test_export_onnx_from_a_file_says_it_is_a_file(tmp_path):
    from export.cli import main as bitmtp_export

    (tmp_path / "OUT").write_text("not a folder")
    res = CliRunner().invoke(bitmtp_export, ["--onnx-from", str(tmp_path / "OUT")])
    assert res.exit_code == 2 and "is a file" in res.output and "no such" not in res.output, res.output


def test_the_demo_says_when_an_artifact_has_no_mtp_block(engine, monkeypatch):
    from dataclasses import replace

    from bitmtp_edge.app.demo import run_demo

    monkeypatch.setattr(engine, "manifest", replace(engine.manifest, mtp=None))
    lines = []
    report = run_demo(engine, max_new_tokens=2, echo=lines.append, prompts=["t1 t2"])
    assert report["policy"] == "ar" and "AR-only" in lines[0] and "hybrid" in lines[0], lines
