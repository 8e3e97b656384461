"""The trainer (tools.train): QAT numerics, the joint loss, budget/resume/compile handling,
checkpoints, and train -> export -> Engine.load -> generate on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bitmtp_edge.format.config import QuantConfig
from bitmtp_edge.runtime.model import LatentTernaryLinear, PackedTernaryLinear
from kernels_ampere.numerics import ternarize_absmean
from tests.helpers import one_thread  # noqa: F401 - the fixture pytestmark uses
from tests.test_corpus_tokenizer import write_tree
from tools.blocks import BlockLayout, build_rows, clean_mask, sample_anchors
from tools.corpus import CorpusOptions, SourceRoot, build
from tools.hf_checkpoint import load_latent_model, load_runtime_model, read_checkpoint
from tools.train import PRESETS, TrainConfig, Trainer


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("src")
    write_tree(root, n=60)
    out = tmp_path_factory.mktemp("corpus")
    build(out, [SourceRoot("demo", root)], CorpusOptions(vocab_size=384, val_permille=100, test_permille=150),
          log=lambda m: None)
    return out


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(data=str(data), out=str(out), preset="tiny", seq_len=32, block_size=4, blocks=4, batch_size=8,
                lr=1e-2, warmup_steps=5, max_steps=40, eval_every=0, eval_batches=1, log_every=1,
                save_every_s=1e9, device="cpu", compile="off")
    base.update(kw)
    return TrainConfig(**base)


def quiet(_msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    """A tiny BitMTP (D=4) run of 40 steps."""
    out = tmp_path_factory.mktemp("run_d4")
    Trainer(tiny(data, out), log=quiet).run()
    return out


# -- numerics --------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,m", [(64, 128, 5), (96, 256, 1), (128, 384, 17)])
def test_qat_linear_equals_runtime_linear_on_same_weights(n, k, m):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.02
    x = torch.randn(2, m, k, generator=g, dtype=torch.float64) * 3
    qat = LatentTernaryLinear(k, n, QuantConfig()).double()
    qat.weight.data.copy_(w)
    runtime = PackedTernaryLinear(k, n, QuantConfig())
    codes, scale = ternarize_absmean(w)
    runtime.codes.copy_(codes)
    runtime.scale.copy_(scale)
    y_qat, y_rt = qat(x), runtime(x)
    # Both multiply the integer grids (exact in float64) and apply the two scales in one order.
    assert torch.equal(y_qat, y_rt)
    # straight-through: the latent weight gets a gradient
    y_qat.sum().backward()
    assert qat.weight.grad is not None and qat.weight.grad.abs().sum() > 0


def test_clean_stream_is_blind_to_blocks(trained):
    model, _ = load_latent_model(trained / "final")
    model = model.double().eval()
    layout = BlockLayout(32, 4, 6)
    window = torch.randint(2, 300, (2, layout.window), generator=torch.Generator().manual_seed(0))
    ids, pos, tgt, mask = build_rows(window, sample_anchors(layout, 2, torch.Generator().manual_seed(1)), layout, 1, 0)
    with torch.no_grad():
        joint = model(ids, pos, mask)[:, :32]
        alone = model(ids[:, :32], pos[:, :32], clean_mask(32))
    torch.testing.assert_close(joint, alone, rtol=1e-9, atol=1e-9)


def test_checkpoint_forms_agree_with_the_qat_model(trained):
    qat, _ = load_latent_model(trained / "final")
    qat = qat.double().eval()
    rt_latent, _ = load_runtime_model(trained / "final")
    rt_compact, ck = load_runtime_model(trained / "compact")
    assert ck.compact and ck.mtp is not None and ck.mtp.block_size == 4 and ck.corpus_sha256
    ids = torch.randint(2, 300, (1, 24), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(24).unsqueeze(0)
    m = clean_mask(24)
    with torch.no_grad():
        a = qat.verify_logits(qat(ids, pos, m))
        b = rt_latent.verify_logits(rt_latent(ids, pos, m))
        c = rt_compact.verify_logits(rt_compact(ids, pos, m))
    # QAT forward == exact integer runtime, bit for bit. (It once multiplied the dequantised
    # values, x_int * a_scale times codes * w_scale: products of up to 55 bits, rounded in a
    # BLAS-dependent order, so on some hosts an activation a hair from a rounding boundary of
    # the next layer's int8 quantiser landed on the other side: 25 of 9216 logits off by up
    # to 4.5e-4 on a 2-core x86. Now nothing upstream of a quantiser differs in any bit.)
    assert torch.equal(a, b)
    # compact = latent with the scales, norms and embedding rounded to bfloat16
    assert (b.argmax(-1) == c.argmax(-1)).float().mean() >= 0.9
    for name in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.k_proj"):
        mod_l, mod_c = rt_latent.get_submodule(name), rt_compact.get_submodule(name)
        assert torch.equal(mod_l.codes, mod_c.codes)
        torch.testing.assert_close(mod_l.scale, mod_c.scale, rtol=4e-3, atol=0)


def test_pack_checkpoint_matches_the_trainers_compact_form(trained, tmp_path):
    from tools.pack_checkpoint import pack

    from safetensors.torch import load_file

    out = pack(trained / "final", tmp_path / "packed")
    a, b = load_file(out / "model.safetensors"), load_file(trained / "compact" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert (out / "bitmtp.json").read_text() == (trained / "compact" / "bitmtp.json").read_text()
    with pytest.raises(FileExistsError):
        pack(trained / "final", out)


# -- the trainer ---------------------------------------------------------------------------

def test_cpu_training_smoke_loss_falls(trained):
    log = json.loads((trained / "train_log.json").read_text())
    hist = log["history"]
    first = sum(h["loss"] for h in hist[:3]) / 3
    last = sum(h["loss"] for h in hist[-5:]) / 5
    assert last < first - 1.0, f"loss did not fall: {first:.3f} -> {last:.3f}"
    assert all(h["mtp"] > 0 for h in hist), "the MTP term is on"
    s = log["summary"]
    assert s["steps"] == 40 and s["stop_reason"] == "max_steps" and s["clean_tokens"] == 40 * 8 * 32
    assert s["val_ntp"] < 5.5 and len(s["val_slot_acc"]) == 4
    b = json.loads((trained / "compact" / "bitmtp.json").read_text())
    assert b["block_size"] == 4 and b["mask_token_id"] == 1 and b["tau"] == 0.9 and b["min_prefix"] == 3
    assert b["corpus_sha256"] == log["corpus_sha256"]
    cfg = json.loads((trained / "compact" / "config.json").read_text())
    assert cfg["architectures"] == ["BitNetForCausalLM"] and cfg["hidden_act"] == "relu2"
    assert cfg["quantization_config"]["quantization_mode"] == "offline"


def test_sft_baseline_has_no_blocks(data, tmp_path):
    tc = tiny(data, tmp_path, mtp_weight=0.0, max_steps=3)
    assert not tc.layout.has_blocks and tc.layout.seq_len == 32
    s = Trainer(tc, log=quiet).run()
    assert s["block_tokens"] == 0 and "val_mtp" not in s
    assert not (tmp_path / "compact" / "bitmtp.json").exists(), "an AR-only checkpoint exports as AR-only"
    assert read_checkpoint(tmp_path / "compact").mtp is None


def test_time_budget_stops_and_saves(data, tmp_path):
    s = Trainer(tiny(data, tmp_path, max_steps=100000, time_budget_s=2.0, reserve_s=0.5), log=quiet).run()
    assert s["stop_reason"] == "time_budget" and 0 < s["steps"] < 100000
    assert (tmp_path / "compact" / "model.safetensors").is_file() and (tmp_path / "resume.pt").is_file()


def test_budget_fitted_steps_are_shared(data, tmp_path):
    plan = tmp_path / "plan.json"
    lead = Trainer(tiny(data, tmp_path / "lead", max_steps=0, time_budget_s=3.0, reserve_s=0.5, fit_marks=(2, 6, 12),
                        share_plan=str(plan)), log=quiet)
    s = lead.run()
    assert plan.is_file() and json.loads(plan.read_text())["max_steps"] == s["max_steps"]
    follow = Trainer(tiny(data, tmp_path / "follow", max_steps=0, mtp_weight=0.0, steps_from=str(plan)), log=quiet)
    assert follow.run()["max_steps"] == s["max_steps"]


def test_resume_reproduces_an_uninterrupted_run(data, tmp_path):
    straight = Trainer(tiny(data, tmp_path / "a", max_steps=8), log=quiet)
    straight.run()
    Trainer(tiny(data, tmp_path / "b", max_steps=8, stop_at=4), log=quiet).run()
    resumed = Trainer(tiny(data, tmp_path / "b", max_steps=8, resume=True), log=quiet)
    assert resumed.step == 4
    s = resumed.run()
    assert s["steps"] == 8
    for (n, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_compile_failure_falls_back_to_eager(data, tmp_path, monkeypatch):
    def broken_compile(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("inductor exploded")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    tr = Trainer(tiny(data, tmp_path, max_steps=3, compile="on"), log=quiet)
    s = tr.run()
    assert s["steps"] == 3 and tr.compiled is None
    assert any("torch.compile failed" in e for e in tr.events)


# -- train -> export -> load -> generate -------------------------------------------------------

def test_train_export_load_generate(trained, tmp_path):
    from click.testing import CliRunner

    export_cli = pytest.importorskip("export.cli")
    from bitmtp_edge import Engine
    from bitmtp_edge.backends.reference import ReferenceBackend
    from bitmtp_edge.runtime.decoding import DecodeOptions, DecodeStats, decode
    from bitmtp_edge.format.segments import plan_segments

    out = tmp_path / "artifact"
    res = CliRunner().invoke(export_cli.main, [str(trained / "compact"), str(out), "--max-context", "256", "-q"])
    assert res.exit_code == 0, res.output
    eng = Engine.load(out, backend="reference", device="cpu")
    assert eng.block_size == 4
    prompt = "def scale(values, factor):\n"
    runs = {pol: eng.generate(prompt, max_new_tokens=12, policy=pol) for pol in ("ar", "confidence", "speculative", "hybrid")}
    assert runs["speculative"].token_ids == runs["ar"].token_ids, "speculative decoding is lossless"
    for r in runs.values():
        assert 0 < len(r.token_ids) <= 12 and r.stats.iterations > 0
    # The artifact and the in-process runtime model (tools/eval_quality's) decode identically.
    model, ck = load_runtime_model(trained / "compact")
    backend = ReferenceBackend(model, plan_segments(ck.model, 256, workspace=9), ck.mtp.mask_token_id,
                               torch.float64, "cpu")
    ids = eng.encode(prompt)
    opts = DecodeOptions(policy="ar", max_new_tokens=12, block_size=4, stop_token_ids=frozenset(ck.model.eos_token_ids))
    tokens = [t for chunk in decode(backend, ids, opts, DecodeStats()) for t in chunk]
    assert tokens == runs["ar"].token_ids


@pytest.mark.slow
def test_transformers_loads_the_compact_checkpoint(trained):
    """The compact checkpoint is a valid HF BitNet (autobitlinear, offline) checkpoint."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(trained / "compact"), dtype=torch.bfloat16).eval()
    model, _ = load_runtime_model(trained / "compact")
    ids = torch.randint(2, 300, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model.verify_logits(model(ids, torch.arange(20).unsqueeze(0), clean_mask(20)))[0]
        got = hf(ids).logits[0].double()
    # transformers runs it in bfloat16; the runtime is exact integer arithmetic
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


def test_embedded_model_is_the_default_and_decodes_losslessly():
    """The shipped artifact (bitmtp_edge/embedded/model): Engine.load() with no path."""
    from bitmtp_edge import Engine
    from bitmtp_edge.runtime.engine import embedded_artifact_path

    # The package always ships it: a missing folder is a packaging bug, not a reason to skip.
    assert (embedded_artifact_path() / "manifest.json").is_file(), embedded_artifact_path()
    eng = Engine.load(backend="reference", device="cpu")
    assert eng.block_size == 8 and eng.manifest.mtp.mask_token_id == 1
    prompt = 'def clamp(value, low, high):\n    """Limit value to the range [low, high]."""'
    ar = eng.generate(prompt, max_new_tokens=16, policy="ar")
    spec = eng.generate(prompt, max_new_tokens=16, policy="speculative")
    assert spec.token_ids == ar.token_ids and len(ar.token_ids) == 16
    assert spec.stats.tokens_per_iteration > 1.0, "the trained drafts get accepted"


def test_quality_report_on_a_tiny_model(data, trained, tmp_path):
    from tools import eval_quality

    sft = tmp_path / "sft"
    Trainer(tiny(data, sft, mtp_weight=0.0, max_steps=10), log=quiet).run()
    out_json, out_md = tmp_path / "q.json", tmp_path / "q.md"
    args = ["--data", str(data), "--model", f"sft={sft / 'compact'}", "--model", f"d4={trained / 'compact'}",
            "--prompts", "3", "--max-new-tokens", "10", "--window", "32", "--max-windows", "4",
            "--train-logs", str(tmp_path / "none"), "--json", str(out_json), "--md", str(out_md)]
    with pytest.raises(SystemExit) as done:
        eval_quality.main(args)
    assert done.value.code == 0
    r = json.loads(out_json.read_text())
    assert set(r["heldout"]["models"]) == {"sft", "d4"} and r["heldout"]["baseline"] == "sft"
    dec = r["decoding"]["summary"]
    assert set(dec["sft"]) == {"ar"} and set(dec["d4"]) == {"ar", "confidence", "speculative", "hybrid", "fused"}
    assert dec["d4"]["speculative"]["agreement_with_ar"] == 1.0
    assert dec["d4"]["fused"]["agreement_with_ar"] == 1.0  # the reference backend is exact
    assert dec["d4"]["speculative"]["tokens_per_iteration"] >= 1.0
    assert r["training"]["d4"]["steps"] == 40 and "d4: speculative agreement with AR = 100%" in r["targets"]
    assert "| d4 | hybrid |" in out_md.read_text()


def test_quality_decoding_in_chunks_equals_one_task_per_policy(data, trained, tmp_path):
    """--chunk splits a (model, policy) over several tasks: the same records, the same summary;
    --policies keeps ar (the agreement's reference); --prompt-file decodes another prompt set."""
    from tools import eval_quality
    from tools.prompts import Prompt

    path = str(trained / "compact")
    prompts = [Prompt(id=f"p{i}", path="", name="", kind="first_lines", prompt=t, reference="")
               for i, t in enumerate(["def scale(values, factor):", "import os", "class Point:", "x = ["])]
    args = dict(data=str(data), device="cpu", jobs=1, max_new_tokens=8, tau=0.9, min_prefix=2, log=quiet)
    whole = eval_quality.evaluate_decoding({"d4": path}, prompts, policies=("speculative",), **args)
    parts = eval_quality.evaluate_decoding({"d4": path}, prompts, chunk=3, policies=("speculative",), **args)
    assert set(whole["summary"]["d4"]) == {"ar", "speculative"}

    def counts(rep):  # everything but the wall time
        return {pol: {k: v for k, v in s.items() if k != "decode_s"} for pol, s in rep["summary"]["d4"].items()}

    assert counts(parts) == counts(whole) and parts["samples"] == whole["samples"]
    assert whole["summary"]["d4"]["speculative"]["prompts"] == 4
    pf = tmp_path / "p.jsonl"
    pf.write_text("".join(json.dumps(p.__dict__) + "\n" for p in prompts[:2]))
    out_json = tmp_path / "q.json"
    with pytest.raises(SystemExit) as done:
        eval_quality.main(["--data", str(data), "--model", f"d4={path}", "--sections", "decoding", "--prompt-file",
                           str(pf), "--prompts", "9", "--max-new-tokens", "6", "--chunk", "1", "--policies",
                           "hybrid", "--train-logs", str(tmp_path / "none"), "--json", str(out_json), "--md",
                           str(tmp_path / "q.md")])
    assert done.value.code == 0
    r = json.loads(out_json.read_text())
    assert r["decoding"]["settings"]["prompts"] == 2 and r["decoding"]["settings"]["prompt_file"] == str(pf)
    assert set(r["decoding"]["summary"]["d4"]) == {"ar", "hybrid"}


def test_recipes_report_collects_a_device_evaluation(data, trained, tmp_path):
    """tools.recipes_report: the recipes table (and its targets) from eval_quality's outputs."""
    from tools import eval_quality, recipes_report

    sft = tmp_path / "sft"
    Trainer(tiny(data, sft, mtp_weight=0.0, max_steps=4), log=quiet).run()
    ev, d4 = tmp_path / "eval", str(trained / "compact")
    ev.mkdir()
    common = ["--data", str(data), "--max-new-tokens", "8", "--train-logs", str(tmp_path / "none")]
    pf = tmp_path / "docs.jsonl"
    pf.write_text(json.dumps({"id": "a", "path": "", "name": "", "kind": "docstring", "reference": "",
                              "prompt": 'def twice(x):\n    """Return x doubled."""\n'}) + "\n")
    for args in (["--model", f"d4={d4}", "--sections", "decoding", "--prompts", "2", "--policies", "speculative,hybrid",
                  "--json", str(ev / "heldout_a.json"), "--md", str(ev / "a.md")],
                 ["--model", f"d4={d4}", "--sections", "decoding", "--prompt-file", str(pf), "--policies", "hybrid,speculative",
                  "--json", str(ev / "doc_a.json"), "--md", str(ev / "b.md")],
                 ["--model", f"sft={sft / 'compact'}", "--model", f"d4={d4}", "--sections", "heldout", "--window", "32",
                  "--max-windows", "2", "--json", str(ev / "ntp.json"), "--md", str(ev / "c.md")]):
        with pytest.raises(SystemExit) as done:
            eval_quality.main(common + args)
        assert done.value.code == 0
    spec = {"shipped": "d4", "models": {"d4": {"recipe": "tiny", "budget": "40 steps",
                                               "train_log": str(trained / "train_log.json")},
                                        "gone": {"recipe": "never evaluated"}}}
    rc = recipes_report.build(spec, ev)
    held = json.loads((ev / "heldout_a.json").read_text())["decoding"]["summary"]["d4"]
    ntp = json.loads((ev / "ntp.json").read_text())["heldout"]
    m = rc["models"]["d4"]
    assert rc["missing"] == ["gone"] and rc["settings"]["source"] == "decode" and rc["settings"]["prompts"] == 2
    assert m["hybrid"] == held["hybrid"] and m["ar"] == held["ar"] and m["heldout_gap_pct"] == ntp["gap_pct"]["d4"]
    assert m["val_ntp"] == json.loads((trained / "train_log.json").read_text())["summary"]["val_ntp"]
    assert rc["docstring_prompts"]["d4"]["hybrid"]["prompts"] == 1
    report = {"recipes": rc}
    targets = eval_quality.check_targets(report)
    hy = held["hybrid"]
    assert targets["d4: hybrid verifier rate <= 0.5 (decoded)"] == {
        "value": round(hy["verifier_call_rate"], 3), "pass": hy["verifier_call_rate"] <= 0.5}
    assert "| d4 | tiny | 40 steps |" in eval_quality.to_markdown(report)


def test_eval_task_devices_name_every_gpu_by_index():
    # A worker selects its GPU with torch.cuda.set_device, which refuses a bare "cuda": one
    # visible GPU must come out as "cuda:0" too (the bug that lost a device call's decoding).
    from tools.eval_quality import task_devices

    assert task_devices("cuda", gpus=1) == ["cuda:0"]
    assert task_devices("cuda", gpus=2) == ["cuda:0", "cuda:1"]
    assert task_devices("cpu") == ["cpu"]
    with pytest.raises(ValueError, match="--device cuda"):
        task_devices("cuda", gpus=0)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_presets_projections_take_whole_128_chunks(name):
    """The packed W2A8 format reads K in 128-wide chunks: every projection's input width
    (hidden for q/k/v/gate/up, heads x head_dim for o, intermediate for down) is a multiple."""
    p = PRESETS[name]
    for k in (p["hidden_size"], p["num_heads"] * p["head_dim"], p["intermediate_size"]):
        assert k % 128 == 0, (name, k)
    assert p["num_heads"] % p["num_kv_heads"] == 0
