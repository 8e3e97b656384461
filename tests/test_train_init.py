"""Fine-tuning existing ternary checkpoints into BitMTP (``tools.train --init``), the
self-distillation data and loss (``tools.distill``, ``--distill``, ``--kl-weight``), NTP
distillation from a frozen teacher (``--ntp-teacher``), and training under ``torchrun``
(gloo, 2 processes) with resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bitmtp_edge.runtime.model import TernaryLM
from tests.helpers import one_thread  # noqa: F401 - the fixture pytestmark uses
from tests.test_corpus_tokenizer import write_tree
from tools import fake_checkpoints as fake
from tools.blocks import IGNORE, BlockLayout
from tools.corpus import CorpusOptions, SourceRoot, build
from tools.init_checkpoint import InitError, latent_from_codes, load_for_training
from tools.train import TrainConfig, Trainer, joint_loss

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints in the formats bitmtp-export reads (same 512-token tokenizer)."""
    d = tmp_path_factory.mktemp("ckpts")
    online = fake.make_bitnet_online(d / "bitnet-online")
    return {"bitnet-online": online, "bitnet-packed": fake.make_bitnet_packed(online, d / "bitnet-packed"),
            "qwen3": fake.make_qwen3_group128(d / "qwen3")}


@pytest.fixture(scope="module")
def data(sources, tmp_path_factory) -> Path:
    """A corpus encoded with the fake checkpoints' tokenizer (``corpus build --tokenizer``)."""
    root = tmp_path_factory.mktemp("src")
    write_tree(root, n=60)
    out = tmp_path_factory.mktemp("corpus")
    build(out, [SourceRoot("demo", root)], CorpusOptions(val_permille=100, test_permille=150), log=lambda m: None,
          tokenizer=sources["bitnet-online"])
    return out


def tiny(data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(data=str(data), out=str(out), seq_len=32, block_size=4, blocks=4, batch_size=4, lr=2e-3,
                warmup_steps=2, max_steps=6, eval_every=0, eval_batches=1, log_every=1, save_every_s=1e9,
                device="cpu", compile="off")
    base.update(kw)
    return TrainConfig(**base)


def runtime_from_export(path: Path) -> TernaryLM:
    """The source checkpoint as the exporter reads it: canonical codes + scales, PackedTernaryLinear, float64."""
    from export.checkpoint import open_checkpoint
    from export.hf_config import read_spec
    from export.readers import Ternary, detect_format, read_tensors, source_tensors

    with open_checkpoint(path) as ck:
        spec = read_spec(ck)
        fmt = detect_format(ck, spec)
        tensors = list(read_tensors(ck, spec, fmt, source_tensors(ck, spec, fmt)))
    model = TernaryLM(spec.model, spec.quant).double()
    state = model.state_dict()
    for t in tensors:
        if isinstance(t, Ternary):
            state[f"{t.name}.codes"] = t.codes
            state[f"{t.name}.scale"] = t.scale.float().reshape(state[f"{t.name}.scale"].shape)
        else:
            state[t.name] = t.tensor.double()
    model.load_state_dict(state)
    return model.eval()


# -- --init ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(8, 128), (64, 256)])
def test_latent_weights_give_back_the_codes_and_scale(n, k):
    from kernels_ampere.numerics import ternarize_absmean, ternarize_group_absmax

    g = torch.Generator().manual_seed(n)
    codes = torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(1, generator=g) * 0.05 + 0.01
    c2, s2 = ternarize_absmean(latent_from_codes(codes, scale))
    # codes exactly; the float32 mean's granularity can leave the scale an ulp or two away
    assert torch.equal(c2, codes) and abs(float(s2) - float(scale)) <= 2 * float(torch.finfo(torch.float32).eps * scale)
    gs = torch.rand(n, k // 128, generator=g) * 0.05 + 0.01
    c3, s3 = ternarize_group_absmax(latent_from_codes(codes, gs))
    assert torch.equal(c3, codes) and torch.equal(s3, gs)


@pytest.mark.parametrize("form", ["bitnet-online", "bitnet-packed", "qwen3"])
def test_init_model_is_the_checkpoint(sources, data, form):
    """Step 0 of the fine-tune computes what the exported source checkpoint computes."""
    model, info = load_for_training(sources[form], mask_token_id=1, data_tokenizer=data / "tokenizer.json")
    assert info.mask_token_id == 1 and info.mask_row == "mean" and info.family == model.cfg.family
    emb = model.model.embed_tokens.weight.detach()
    others = torch.cat([emb[:1], emb[2:]])
    torch.testing.assert_close(emb[1], others.mean(0), rtol=0, atol=1e-7)
    ref = runtime_from_export(sources[form])
    # the quantised weights: the exporter's codes exactly, its scales to float32 rounding
    from kernels_ampere.numerics import ternarize_absmean, ternarize_group_absmax

    quantise = ternarize_group_absmax if form == "qwen3" else ternarize_absmean
    mine = {}
    for name, mod in ref.named_modules():
        if hasattr(mod, "codes"):
            codes, scale = quantise(model.get_submodule(name).weight.detach())
            assert torch.equal(codes, mod.codes), name
            torch.testing.assert_close(scale.reshape(mod.scale.shape).to(mod.scale.dtype), mod.scale, rtol=2.5e-7, atol=0,
                                       msg=name)
            mine[f"{name}.codes"], mine[f"{name}.scale"] = codes, scale.reshape(mod.scale.shape)
    # ... and the QAT model computes exactly what the runtime computes with them
    ref.load_state_dict({**ref.state_dict(), **mine})
    ids = torch.randint(2, 500, (2, 20), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(20).expand(2, 20)
    mask = torch.ones(20, 20, dtype=torch.bool).tril().expand(2, 20, 20)
    with torch.no_grad():
        a = model.double().eval()(ids, pos, mask)
        b = ref(ids, pos, mask)
    if form == "qwen3":  # weight-only: the same float64 product, by F.linear vs matmul
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    else:  # W1.58A8: bit-identical (the QAT linear multiplies the integer grids)
        assert torch.equal(a, b)


def test_init_refuses_a_corpus_with_another_tokenizer(sources, tmp_path):
    from tools.tokenizer import load_tokenizer

    tok = load_tokenizer(sources["bitnet-online"])
    vocab = tok.get_vocab()
    swapped = json.loads(tok.to_str())
    a, b = sorted(vocab, key=vocab.get)[100:102]
    m = swapped["model"]["vocab"]
    m[a], m[b] = m[b], m[a]
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text(json.dumps(swapped))
    with pytest.raises(InitError, match="corpus build --tokenizer"):
        load_for_training(sources["bitnet-online"], 1, other / "tokenizer.json")


@pytest.mark.parametrize("form", ["bitnet-packed", "qwen3"])
def test_fine_tune_exports_and_decodes_losslessly(sources, data, form, tmp_path):
    from click.testing import CliRunner

    from bitmtp_edge import Engine
    from export.cli import main as export_main

    s = Trainer(tiny(data, tmp_path / "run", init=str(sources[form])), log=lambda m: None).run()
    assert s["steps"] == 6 and np.isfinite(s["val_ntp"])
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    assert log["init"]["format"] == ("qwen3-group128" if form == "qwen3" else "bitnet-packed")
    first, last = log["history"][0], log["history"][-1]
    assert last["mtp"] < first["mtp"], "the new mask blocks learn"
    out = tmp_path / "artifact"
    res = CliRunner().invoke(export_main, [str(tmp_path / "run" / "compact"), str(out), "--max-context", "256", "-q"])
    assert res.exit_code == 0, res.output
    eng = Engine.load(out, backend="reference", device="cpu")
    assert eng.block_size == 4 and eng.manifest.mtp.mask_token_id == 1
    assert eng.manifest.model.family == ("qwen3" if form == "qwen3" else "bitnet")
    ar = eng.generate("The ternary weight", max_new_tokens=10, policy="ar")
    spec = eng.generate("The ternary weight", max_new_tokens=10, policy="speculative")
    assert spec.token_ids == ar.token_ids and len(ar.token_ids) > 0


def test_tokenizer_without_mask_token_grows_the_vocabulary(sources, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tools.corpus import adopt_tokenizer
    from tools.tokenizer import EOS_TOKEN, MASK_TOKEN

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([fake.CORPUS] * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS_TOKEN],
                                                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    adopted = adopt_tokenizer(tmp_path / "tok", log=lambda m: None)
    mask = adopted.token_to_id(MASK_TOKEN)
    assert mask == tok.get_vocab_size() and adopted.token_to_id(EOS_TOKEN) == tok.token_to_id(EOS_TOKEN)
    model, info = load_for_training(sources["bitnet-online"], mask_token_id=600)
    assert model.cfg.vocab_size == 601 and info.source_vocab == 512
    emb = model.model.embed_tokens.weight.detach()
    torch.testing.assert_close(emb[600], emb[:512].mean(0), rtol=0, atol=1e-7)
    assert torch.equal(emb[512:600], emb[600].expand(88, -1))


# -- self-distillation -------------------------------------------------------------------------

def test_cached_greedy_equals_full_recompute(sources):
    from tools.distill import freeze, greedy_continue, greedy_reference

    for form in ("bitnet-online", "qwen3"):
        model, _ = load_for_training(sources[form], 1)
        frozen = freeze(model.double())
        prompts = torch.randint(2, 500, (3, 7), generator=torch.Generator().manual_seed(1))
        fast = greedy_continue(frozen, prompts, 9)
        assert torch.equal(fast, greedy_reference(frozen, prompts, 9))
        assert torch.equal(fast[:, :7], prompts) and fast.shape == (3, 16)
        # the frozen copy is the training model, minus re-quantising the weights each call
        assert torch.equal(greedy_reference(model.double().eval(), prompts, 9), fast)


def test_kl_term_reads_the_clean_row_a_slot_predicts():
    """A block slot whose logits equal the clean stream's at position p + j has zero KL."""
    torch.manual_seed(0)
    L, D, K, V = 12, 4, 2, 30
    clean = torch.randn(1, L, V)
    anchors = torch.tensor([[3, 9]])
    blocks = torch.stack([clean[0, min(p + j, L - 1)] for p in anchors[0].tolist() for j in range(D)]).unsqueeze(0)
    tgt = torch.randint(0, V, (1, L + K * D))

    def logits_fn(ids, pos, mask, blk=blocks):
        return torch.cat([clean, blk], dim=1)

    args = (None, None, None, tgt, L, 1.0, D, anchors)
    _, _, _, kl, _ = joint_loss(logits_fn, *args, kl_weight=1.0)
    assert float(kl) == pytest.approx(0.0, abs=1e-6)
    shifted = torch.roll(blocks, 1, dims=1)  # each slot now holds its neighbour's teacher
    _, _, _, kl2, _ = joint_loss(lambda *a: torch.cat([clean, shifted], dim=1), *args, kl_weight=1.0)
    assert float(kl2) > 0.1
    sw = torch.tensor([0.0, 0.0, 0.0, 1.0])  # slot weights select slot 3 only
    _, _, mtp_w, _, _ = joint_loss(logits_fn, *args, slot_weights=sw)
    ce = torch.nn.functional.cross_entropy(blocks[0], tgt[0, L:], reduction="none").view(K, D)
    assert float(mtp_w) == pytest.approx(float(ce[:, 3].mean()), rel=1e-5)


def test_distill_rows_train_the_blocks_on_teacher_tokens(sources, data, tmp_path):
    from tools.distill import generate, load_rows
    from tools.train import DistillRows

    meta = generate(str(sources["bitnet-packed"]), str(data), str(tmp_path / "d"), rows=6, prompt_len=10,
                    seq_len=32, batch=4, seed=0, shard=0, device="cpu", precision="fp32", log=lambda m: None)
    rows, m = load_rows(tmp_path / "d")
    assert rows.shape == (6, 48) and meta["prompt_len"] == m["prompt_len"] == 10 and rows.dtype == np.uint16
    layout = BlockLayout(32, 4, 4)
    dr = DistillRows(str(tmp_path / "d"), layout, 0, torch.device("cpu"), 1, 0)
    ids, pos, mask, tgt, anchors = dr.next(5)
    assert int(anchors.min()) >= 9 and (tgt[:, :32] == IGNORE).all()
    # a block's targets are the row's own (generated) tokens after its anchor
    row_of = {tuple(r[:32].tolist()): r for r in torch.from_numpy(rows.astype(np.int64))}
    for b in range(5):
        r = row_of[tuple(ids[b, :32].tolist())]
        for k, p in enumerate(anchors[b].tolist()):
            want = r[p + 1:p + 5]
            got = tgt[b, 32 + 4 * k:32 + 4 * k + 4]
            assert torch.equal(got[got != IGNORE], want[got != IGNORE])
    s = Trainer(tiny(data, tmp_path / "run", init=str(sources["bitnet-packed"]), distill=str(tmp_path / "d"),
                     distill_frac=0.5, kl_weight=1.0), log=lambda m: None).run()
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    assert s["distill_rows"] == 6 * 2 and log["distill"]["rows"] == 6
    assert all(h["kl"] > 0 for h in log["history"])


def test_distill_ntp_targets_follow_the_mode(sources, data, tmp_path):
    """--distill-ntp: none leaves the distill rows' clean stream unscored, prompt scores the
    corpus tokens of the prompt only, all scores every next token; the blocks are the same."""
    from tools.distill import generate, load_rows
    from tools.train import DistillRows

    generate(str(sources["bitnet-packed"]), str(data), str(tmp_path / "d"), rows=5, prompt_len=10, seq_len=32,
             batch=5, seed=3, shard=0, device="cpu", precision="fp32", log=lambda m: None)
    rows = torch.from_numpy(load_rows(tmp_path / "d")[0].astype(np.int64))
    layout = BlockLayout(32, 4, 4)
    got = {mode: DistillRows(str(tmp_path / "d"), layout, 0, torch.device("cpu"), 1, 0, ntp=mode).next(4)
           for mode in ("none", "prompt", "all")}
    ids = got["all"][0]
    idx = [next(i for i in range(len(rows)) if torch.equal(rows[i, :32], ids[b, :32])) for b in range(4)]
    want = rows[idx, 1:33]  # clean position i predicts x_{i+1}
    assert (got["none"][3][:, :32] == IGNORE).all()
    assert torch.equal(got["all"][3][:, :32], want)
    assert torch.equal(got["prompt"][3][:, :9], want[:, :9]) and (got["prompt"][3][:, 9:32] == IGNORE).all()
    for mode in ("none", "prompt"):  # same generator seed: same rows and anchors, same block targets
        assert torch.equal(got[mode][0], ids) and torch.equal(got[mode][3][:, 32:], got["all"][3][:, 32:])
    with pytest.raises(ValueError, match="--distill-ntp"):
        DistillRows(str(tmp_path / "d"), layout, 0, torch.device("cpu"), 1, 0, ntp="corpus")
    # in training, the NTP term now averages over the corpus rows and the distill rows' prompts
    s = Trainer(tiny(data, tmp_path / "run", init=str(sources["bitnet-packed"]), distill=str(tmp_path / "d"),
                     distill_ntp="prompt", slot_weights=(3.0, 2.0, 1.0, 1.0)), log=lambda m: None).run()
    log = json.loads((tmp_path / "run" / "train_log.json").read_text())
    assert s["steps"] == 6 and log["config"]["distill_ntp"] == "prompt"
    assert all(h["ntp"] > 0 and h["mtp"] > 0 for h in log["history"])


# -- NTP distillation from a frozen teacher (--ntp-teacher) ------------------------------------

def test_ntp_kl_term_mixes_ce_and_kl_on_the_scored_positions():
    """The NTP term is (1 - w) CE + w KL(teacher ‖ student), averaged over the positions CE scores."""
    g = torch.Generator().manual_seed(0)
    B, L, D, K, V = 2, 10, 4, 2, 30
    logits = torch.randn(B, L + K * D, V, generator=g)
    teacher = 2 * torch.randn(B, L, V, generator=g)
    tgt = torch.randint(0, V, (B, L + K * D), generator=g)
    tgt[0, 6:L] = IGNORE  # unscored clean positions get no KL either
    args = (lambda *a: logits, None, None, None, tgt, L, 0.7, D, torch.tensor([[1, 4], [2, 5]]))
    _, ntp, mtp, _, off = joint_loss(*args)
    assert float(off) == 0.0
    w = 0.4
    loss, ntp_w, mtp_w, _, ntp_kl = joint_loss(*args, ntp_teacher=teacher, ntp_kl_weight=w)
    p_t, logp_s = teacher.softmax(-1), logits[:, :L].log_softmax(-1)
    want = (p_t * (p_t.log() - logp_s)).sum(-1)[tgt[:, :L] != IGNORE].mean()
    assert float(ntp_kl) == pytest.approx(float(want), rel=1e-5) and float(want) > 0.1
    assert torch.equal(ntp_w, ntp) and torch.equal(mtp_w, mtp)  # the logged CE terms stay CE
    assert float(loss) == pytest.approx(float((1 - w) * ntp + w * want + 0.7 * mtp), rel=1e-5)
    *_, same = joint_loss(*args, ntp_teacher=logits[:, :L].clone(), ntp_kl_weight=w)
    assert float(same) == pytest.approx(0.0, abs=1e-6)
    # the SFT layout (no blocks) takes the same mix
    sft_loss, *_ = joint_loss(lambda *a: logits[:, :L], None, None, None, tgt[:, :L], L, 0.0,
                              ntp_teacher=teacher, ntp_kl_weight=1.0)
    assert float(sft_loss) == pytest.approx(float(want), rel=1e-5)


def test_lr_holds_its_peak_until_a_budget_fitted_run_knows_its_steps():
    from tools.train import lr_at

    tc = TrainConfig(data="d", out="o", lr=2e-4, warmup_steps=0, min_lr_ratio=0.1)
    assert lr_at(0, tc, 0) == lr_at(59, tc, 0) == 2e-4  # not fitted yet: no decay to the floor
    assert lr_at(0, tc, 1000) == 2e-4 and lr_at(1000, tc, 1000) == pytest.approx(2e-5)
    assert lr_at(500, tc, 1000) == pytest.approx(1.1e-4)  # cosine midpoint
    warm = TrainConfig(data="d", out="o", lr=1e-3, warmup_steps=10)
    assert lr_at(4, warm, 0) == pytest.approx(5e-4) and lr_at(10, warm, 0) == 1e-3


def test_ntp_teacher_is_the_frozen_checkpoint_without_the_mask_token(sources, data, tmp_path):
    """Teacher = the --init checkpoint: its clean-stream logits are the student's, but for the
    mask token's, which gets no probability; no teacher weight is trained."""
    tr = Trainer(tiny(data, tmp_path / "run", init=str(sources["bitnet-packed"]),
                      ntp_teacher=str(sources["bitnet-packed"]), ntp_kl_weight=0.5), log=lambda m: None)
    ids, pos, mask, _, _ = tr.train_data.next()
    teacher = tr._ntp_teacher_logits(ids, pos, mask)
    with torch.no_grad():
        student = tr.logits_model(ids, pos, mask)[:, :32]
    mask_id = tr.index.mask_token_id
    others = torch.arange(student.shape[-1]) != mask_id
    torch.testing.assert_close(teacher[..., others], student[..., others], rtol=1e-5, atol=1e-4)
    assert (teacher.softmax(-1)[..., mask_id] == 0).all() and (student.softmax(-1)[..., mask_id] > 0).all()
    trained = {id(p) for group in tr.opt.param_groups for p in group["params"]}
    assert not any(p.requires_grad or id(p) in trained for p in tr.ntp_teacher.parameters())
    for bad, match in ((dict(ntp_teacher=str(sources["qwen3"]), ntp_kl_weight=1.5), "in \\[0, 1\\]"),
                       (dict(ntp_kl_weight=0.5), "go together"),
                       (dict(ntp_teacher=str(sources["qwen3"])), "go together")):
        with pytest.raises(ValueError, match=match):
            Trainer(tiny(data, tmp_path / "bad", **bad), log=lambda m: None)


def test_ntp_teacher_loads_without_pickle_and_pulls_the_student(sources, data, tmp_path, monkeypatch):
    """Distilling the qwen3 checkpoint's next-token distribution into the BitNet one: the teacher
    is read from safetensors and JSON only, and with the NTP target all teacher (w = 1, no MTP
    term pulling toward the corpus) the KL to it falls as the student trains."""
    import pickle

    def refuse(*a, **k):
        raise AssertionError("the NTP teacher is read without pickle")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)
    run = tmp_path / "run"
    s = Trainer(tiny(data, run, init=str(sources["bitnet-packed"]), ntp_teacher=str(sources["qwen3"]),
                     ntp_kl_weight=1.0, mtp_weight=0.0, max_steps=12, lr=3e-3), log=lambda m: None).run()
    log = json.loads((run / "train_log.json").read_text())
    assert s["steps"] == 12 and log["ntp_teacher"]["format"] == "qwen3-group128"
    assert log["config"]["ntp_kl_weight"] == 1.0
    kls = [h["ntp_kl"] for h in log["history"]]
    assert all(k > 0 for k in kls) and np.mean(kls[-3:]) < 0.8 * np.mean(kls[:3])


# -- torchrun ----------------------------------------------------------------------------------

TORCHRUN_TINY = ["--preset", "tiny", "--seq-len", "32", "--block-size", "4", "--blocks", "4", "--batch-size", "8",
                 "--lr", "1e-2", "--warmup-steps", "2", "--max-steps", "6", "--eval-every", "0", "--eval-batches", "1",
                 "--log-every", "1", "--device", "cpu", "--compile", "off"]


def _torchrun(args: list[str], ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "tools.train",
           *args]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if ok:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def _weights(run: Path, form: str = "final") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / form / "model.safetensors")


@pytest.fixture(scope="module")
def ddp_run(data, tmp_path_factory) -> Path:
    """A straight 6-step run of the tiny model on 2 gloo ranks (DistributedDataParallel)."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    _torchrun(["--data", str(data), *TORCHRUN_TINY, "--out", str(out)])
    return out


def test_ddp_two_processes_resume_equals_straight_run(data, ddp_run, tmp_path):
    """gloo, 2 ranks: a run paused at step 3 and resumed ends where the straight run ends."""
    common = ["--data", str(data), *TORCHRUN_TINY, "--out", str(tmp_path / "b")]
    _torchrun(common + ["--stop-at", "3"])
    _torchrun(common + ["--resume"])
    log = json.loads((tmp_path / "b" / "train_log.json").read_text())
    assert log["world_size"] == 2 and log["summary"]["steps"] == 6
    assert any("resumed at step 3" in e for e in log["events"])
    a, b = _weights(ddp_run), _weights(tmp_path / "b")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    # the ranks saw different windows: a 2-rank run is not a 1-rank run of the same seed
    single = Trainer(tiny(data, tmp_path / "c", preset="tiny", batch_size=8, lr=1e-2), log=lambda m: None)
    single.run()
    c = _weights(tmp_path / "c")
    assert any(not torch.allclose(a[n], c[n]) for n in a)


def test_fsdp_trains_as_ddp_does_and_resumes_where_it_stopped(data, ddp_run, tmp_path):
    """gloo, 2 ranks, ``--fsdp``: every parameter sharded, the checkpoints written whole. The
    run follows the DDP run of the same settings (same windows per rank; only the gradient
    reduction's rounding differs, which a ternary code at its threshold can amplify), and a run
    paused at step 3 and resumed ends exactly where the straight sharded run ends."""
    common = ["--data", str(data), *TORCHRUN_TINY, "--fsdp"]
    straight, paused = tmp_path / "straight", tmp_path / "paused"
    _torchrun(common + ["--out", str(straight)])
    _torchrun(common + ["--out", str(paused), "--stop-at", "3"])
    _torchrun(common + ["--out", str(paused), "--resume"])

    log, ddp_log = (json.loads((run / "train_log.json").read_text()) for run in (straight, ddp_run))
    assert log["config"]["fsdp"] and log["world_size"] == 2 and log["summary"]["steps"] == 6
    np.testing.assert_allclose([h["loss"] for h in log["history"]], [h["loss"] for h in ddp_log["history"]],
                               rtol=1e-3)
    a, d = _weights(straight), _weights(ddp_run)
    assert set(a) == set(d)
    for name in a:  # whole tensors, the DDP run's shapes; a run of another seed is > 2e-3 off in every tensor (up to 0.17)
        torch.testing.assert_close(a[name], d[name], rtol=0, atol=2e-3, msg=name)
    assert (straight / "compact" / "config.json").is_file()

    b = _weights(paused)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any("resumed at step 3" in e for e in json.loads((paused / "train_log.json").read_text())["events"])

    # the optimiser state's form follows --fsdp: resuming the other way is refused, by name
    res = _torchrun(["--data", str(data), *TORCHRUN_TINY, "--out", str(paused), "--resume"], ok=False)
    assert res.returncode != 0 and "saved with --fsdp" in res.stdout + res.stderr


def test_fsdp_needs_torchrun(data, tmp_path):
    with pytest.raises(ValueError, match="--fsdp shards the model over the processes torchrun starts"):
        Trainer(tiny(data, tmp_path / "run", fsdp=True), log=lambda m: None)
