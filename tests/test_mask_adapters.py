"""Mask-row capacity: adapters (``runtime.model.MaskRowAdapter``, ``tools.train --adapter-rank``)
and twins (``MaskRowTwin``, ``--twin-layers``) on the draft blocks' rows only, so the clean
stream (prefill, AR, verify, the NTP loss) stays the base model bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from bitmtp_edge.format.config import ConfigError, MTPConfig, ModelConfig, QuantConfig
from bitmtp_edge.runtime.model import TernaryLM
from tests.helpers import one_thread  # noqa: F401 - the fixture pytestmark uses
from tests.test_train_init import data, sources, tiny  # noqa: F401 - fixtures
from tools.blocks import BlockLayout, build_rows
from tools.train import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = ModelConfig(family="bitnet", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)


def random_runtime_model(seed: int) -> TernaryLM:
    g = torch.Generator().manual_seed(seed)
    model = TernaryLM(CFG, QuantConfig()).double()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith(".codes"):
                t.copy_(torch.randint(-1, 2, t.shape, generator=g))
            elif name.endswith(".scale"):
                t.copy_(0.02 + 0.05 * torch.rand(t.shape, generator=g, dtype=torch.float64))
            elif t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64) * (0.3 if t.dim() > 1 else 0.1) + (
                    1.0 if t.dim() == 1 else 0.0))
    return model.eval()


def randomize_mask_rows(model: TernaryLM, seed: int) -> TernaryLM:
    """The adapters' tensors and the slot offset random (a fresh adapter's B and offset are zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in [model.mask_slot_embedding] + [q for proj in model.projections() for q in proj.adapter.parameters()]:
            p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return model


def with_adapters(model: TernaryLM, rank: int, block_size: int) -> TernaryLM:
    model.attach_mask_adapters(rank, block_size)
    return model.double()


def training_rows(seed: int, clean: int = 12, d: int = 4, blocks: int = 3):
    g = torch.Generator().manual_seed(seed)
    layout = BlockLayout(clean, d, blocks)
    window = torch.randint(2, CFG.vocab_size, (1, layout.window), generator=g)
    anchors = torch.randperm(clean, generator=g)[:blocks].sort().values.unsqueeze(0)
    ids, pos, _, mask = build_rows(window, anchors, layout, mask_token_id=1, eos_token_id=None)
    return ids, pos, mask, clean


def test_adapters_change_the_block_rows_and_leave_the_clean_rows_bit_for_bit():
    ids, pos, mask, clean = training_rows(0)
    base = random_runtime_model(1)
    plain = base(ids, pos, mask)
    adapted = with_adapters(random_runtime_model(1), rank=4, block_size=4)
    assert adapted.adapter_rank == 4 and base.adapter_rank == 0
    assert torch.equal(adapted(ids, pos, mask, adapter_from=clean), plain)  # fresh: nothing changes until trained
    out = randomize_mask_rows(adapted, seed=2)(ids, pos, mask, adapter_from=clean)
    assert torch.equal(out[:, :clean], plain[:, :clean])  # exact: the verifier is the base model
    assert (out[:, clean:] - plain[:, clean:]).abs().amin(-1).gt(0).all()  # every block row moved
    assert torch.equal(adapted(ids, pos, mask), plain)  # no adapter_from: the base model everywhere


def test_twins_recompute_the_last_layers_block_rows_and_leave_the_clean_rows_bit_for_bit():
    ids, pos, mask, clean = training_rows(8)
    base = random_runtime_model(9)
    twinned = random_runtime_model(9)
    twinned.attach_mask_twins(1, 4)
    twinned.double()
    assert twinned.twin_layers == 1 and twinned.adapter_rank == 0
    assert torch.equal(twinned(ids, pos, mask, adapter_from=clean), base(ids, pos, mask))  # fresh copies: no change
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for proj in twinned.projections(twinned.model.layers[-1:]):
            proj.adapter.linear.codes.copy_(torch.randint(-1, 2, proj.codes.shape, generator=g))
    out, plain = twinned(ids, pos, mask, adapter_from=clean), base(ids, pos, mask)
    assert torch.equal(out[:, :clean], plain[:, :clean])
    assert (out[:, clean:] - plain[:, clean:]).abs().amin(-1).gt(0).all()
    assert all(p.adapter is None for p in twinned.projections(twinned.model.layers[:-1]))
    with pytest.raises(ValueError, match="twin layers must be in 1..2"):
        random_runtime_model(9).attach_mask_twins(3, 4)


def test_block_rows_must_be_whole_blocks():
    ids, pos, mask, clean = training_rows(5)
    model = randomize_mask_rows(with_adapters(random_runtime_model(6), rank=2, block_size=4), seed=7)
    with pytest.raises(ValueError, match="not whole 4-row draft blocks"):
        model(ids, pos, mask, adapter_from=clean + 1)


@pytest.mark.parametrize("rank", [-1, 1.5, True])
def test_adapter_rank_is_checked(rank):
    with pytest.raises(ConfigError, match="adapter_rank must be a whole number"):
        MTPConfig(block_size=4, mask_token_id=1, adapter_rank=rank)


def test_manifests_without_adapters_read_as_before():
    plain = MTPConfig(block_size=4, mask_token_id=1).to_dict()
    assert "adapter_rank" not in plain and "twin_layers" not in plain
    assert MTPConfig.from_dict(MTPConfig(4, 1, adapter_rank=16).to_dict()).adapter_rank == 16
    assert MTPConfig.from_dict(MTPConfig(4, 1, twin_layers=2).to_dict()).twin_layers == 2
    with pytest.raises(ConfigError, match="alternatives"):
        MTPConfig(4, 1, adapter_rank=4, twin_layers=2)


@pytest.mark.parametrize("capacity", [{"adapter_rank": 4}, {"twin_layers": 1}])
def test_mask_row_training_keeps_the_source_model_and_drafts_through_the_reference_backend(sources, data, tmp_path,
                                                                                           capacity):
    from click.testing import CliRunner

    from bitmtp_edge.runtime.decoding import DecodeOptions, DecodeStats, decode
    from export.cli import main as export_main
    from tools import eval_acceptance
    from tools.eval_quality import runtime
    from tools.hf_checkpoint import load_latent_model, load_runtime_model
    from tools.init_checkpoint import load_for_training

    src = sources["bitnet-packed"]
    run = tmp_path / "run"
    (key, value), = capacity.items()
    s = Trainer(tiny(data, run, init=str(src), lr=2e-2, **capacity), log=lambda m: None).run()
    log = json.loads((run / "train_log.json").read_text())
    assert log["history"][-1]["mtp"] < log["history"][0]["mtp"], "the mask rows learn to draft"
    assert s["steps"] == 6

    # every base tensor is the source's, exactly: the clean stream cannot have moved
    trained, ck = load_runtime_model(run / "final", torch.float64)
    assert getattr(ck.mtp, key) == value and getattr(trained, key) == value
    source, _ = load_for_training(str(src), 1, keep_mask_row=True)
    latent, _ = load_latent_model(run / "final")
    for name, t in source.state_dict().items():
        assert torch.equal(latent.state_dict()[name], t), name
    with_capacity = [proj for proj in latent.projections() if proj.adapter is not None]
    assert len(with_capacity) == (7 if key == "twin_layers" else 7 * latent.cfg.num_layers)
    if key == "adapter_rank":
        assert any(proj.adapter.B.abs().sum() > 0 for proj in with_capacity)
    else:  # the twins started as copies of their projections and moved
        assert any(not torch.equal(proj.adapter.linear.weight, proj.weight) for proj in with_capacity)
        assert with_capacity[0] is latent.model.layers[-1].self_attn.q_proj
    assert latent.mask_slot_embedding.abs().sum() > 0

    # drafts move, the decoded text does not (reference backend, from the compact checkpoint)
    model, ck, backend = runtime(str(run / "compact"), "cpu", max_context=256)
    ids = [5, 17, 33, 2, 9, 41, 12]
    outs = {}
    for policy in ("ar", "speculative", "fused"):
        opts = DecodeOptions(policy=policy, max_new_tokens=12, block_size=ck.mtp.block_size)
        outs[policy] = [t for chunk in decode(backend, ids, opts, DecodeStats()) for t in chunk]
    assert outs["speculative"] == outs["ar"] == outs["fused"] and len(outs["ar"]) == 12

    # the backend's draft step and the replay tool see the adapters / twins: without them the
    # same model drafts with other confidences
    def draft_confidences():
        backend.reset()
        backend.prefill(ids[:-1])
        return backend.draft_step([ids[-1]], ck.mtp.block_size).confidences

    with eval_acceptance.exact_float32_int_matmul():
        drafted, (_, replayed, _) = draft_confidences(), eval_acceptance.block_logits(model, ids, 4, 1, 8, set())
        for proj in model.projections():
            proj.adapter = None
        model.mask_slot_embedding = None
        assert draft_confidences() != drafted
        assert not torch.equal(eval_acceptance.block_logits(model, ids, 4, 1, 8, set())[1], replayed)

    res = CliRunner().invoke(export_main, [str(run / "compact"), str(tmp_path / "art"), "-q"])
    assert res.exit_code != 0 and f"{key} {value}" in res.output and "mask-row adapters or twins" in res.output
    assert not (tmp_path / "art").exists()


def test_adapter_training_resumes(sources, data, tmp_path):
    run = tmp_path / "run"
    Trainer(tiny(data, run, init=str(sources["bitnet-packed"]), adapter_rank=2, stop_at=3), log=lambda m: None).run()
    s = Trainer(tiny(data, run, init=str(sources["bitnet-packed"]), adapter_rank=2, resume=True),
                log=lambda m: None).run()
    log = json.loads((run / "train_log.json").read_text())
    assert s["steps"] == 6 and any("resumed at step 3" in e for e in log["events"])


def test_mask_row_capacity_needs_an_init_checkpoint_and_one_kind(sources, data, tmp_path):
    with pytest.raises(ValueError, match="--adapter-rank trains mask-row capacity on an existing model"):
        Trainer(tiny(data, tmp_path / "run", adapter_rank=2), log=lambda m: None)
    with pytest.raises(ValueError, match="--twin-layers trains mask-row capacity on an existing model"):
        Trainer(tiny(data, tmp_path / "run", twin_layers=1), log=lambda m: None)
    with pytest.raises(ConfigError, match="alternatives"):
        Trainer(tiny(data, tmp_path / "run", init=str(sources["bitnet-packed"]), adapter_rank=2, twin_layers=1),
                log=lambda m: None)


def test_mask_row_training_keeps_the_sources_mask_row_where_it_has_one(sources):
    """With mask-row capacity the source's own mask row stays (a tied head reads it as a logit of
    the clean stream); only a mask token new to the vocabulary gets the mean row."""
    from tools.init_checkpoint import load_for_training

    src = sources["bitnet-online"]  # an AR-only checkpoint whose tokenizer holds the mask token (id 1)
    averaged, info = load_for_training(src, mask_token_id=1)
    kept, kept_info = load_for_training(src, mask_token_id=1, keep_mask_row=True)
    assert info.mask_row == "mean" and kept_info.mask_row == "kept"
    source_rows = load_for_training(src, mask_token_id=600)[0].model.embed_tokens.weight[:512]
    assert torch.equal(kept.model.embed_tokens.weight, source_rows)
    assert not torch.equal(averaged.model.embed_tokens.weight[1], source_rows[1])
    grown, grown_info = load_for_training(src, mask_token_id=600, keep_mask_row=True)
    assert grown_info.mask_row == "mean" and grown.cfg.vocab_size == 601


def test_twins_reading_the_history_change_only_the_block_rows_and_need_a_replay_not_a_kv_buffer():
    ids, pos, mask, clean = training_rows(11)
    base = random_runtime_model(12)
    plain = base(ids, pos, mask)
    twinned = random_runtime_model(12)
    twinned.attach_mask_twins(1, 4, read_history=True)
    twinned.double()
    attn = twinned.model.layers[-1].self_attn
    assert twinned.twin_kv and attn.twin_reads_history and not twinned.model.layers[0].self_attn.twin_reads_history
    assert [p.adapter.reads_history for p in twinned.projections(twinned.model.layers[-1:])] == [
        False, True, True, False, False, False, False]
    assert torch.equal(twinned(ids, pos, mask, adapter_from=clean), plain)  # fresh copies: no change
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():  # only the value twin moves: the q/k/o twins and the MLP stay the base's
        attn.v_proj.adapter.linear.codes.copy_(torch.randint(-1, 2, attn.v_proj.codes.shape, generator=g))
    out = twinned(ids, pos, mask, adapter_from=clean)
    assert torch.equal(out[:, :clean], plain[:, :clean])
    assert (out[:, clean:] - plain[:, clean:]).abs().amin(-1).gt(0).all()
    # without reading the history the same twin changes the block rows through their own values only
    attn.v_proj.adapter.reads_history = attn.k_proj.adapter.reads_history = False
    own_rows_only = twinned(ids, pos, mask, adapter_from=clean)
    assert torch.equal(own_rows_only[:, :clean], plain[:, :clean]) and not torch.equal(own_rows_only, out)
    attn.v_proj.adapter.reads_history = attn.k_proj.adapter.reads_history = True
    kv = [torch.zeros(CFG.num_kv_heads, 32, CFG.head_dim, dtype=torch.float64) for _ in range(2)]
    with pytest.raises(ValueError, match="second KV buffer"):
        attn(torch.randn(1, 2, CFG.hidden_size, dtype=torch.float64), *rope_for(2), torch.ones(1, 2, 32, dtype=torch.bool),
             kv_layer=kv, write_slots=torch.arange(2))


def rope_for(n: int):
    from kernels_ampere.numerics import rope_cos_sin
    return rope_cos_sin(torch.arange(n).unsqueeze(0), CFG.head_dim, CFG.rope_theta, torch.float64)


def test_twin_kv_needs_twins():
    assert MTPConfig.from_dict(MTPConfig(4, 1, twin_layers=2, twin_kv=True).to_dict()).twin_kv
    assert "twin_kv" not in MTPConfig(4, 1, twin_layers=2).to_dict()
    with pytest.raises(ConfigError, match="needs twin_layers"):
        MTPConfig(4, 1, twin_kv=True)
    with pytest.raises(ConfigError, match="true or false"):
        MTPConfig(4, 1, twin_layers=1, twin_kv=1)
    with pytest.raises(ValueError, match="needs twin_layers"):
        random_runtime_model(1).attach_mask_rows(0, 0, 4, twin_kv=True)


def test_twin_kv_training_round_trips_and_replays_while_the_kv_backends_refuse_it(sources, data, tmp_path):
    from tools import eval_acceptance
    from tools.eval_quality import runtime
    from tools.hf_checkpoint import load_latent_model, load_runtime_model

    run = tmp_path / "run"
    Trainer(tiny(data, run, init=str(sources["bitnet-packed"]), lr=2e-2, twin_layers=1, twin_kv=True),
            log=lambda m: None).run()
    log = json.loads((run / "train_log.json").read_text())
    assert log["history"][-1]["mtp"] < log["history"][0]["mtp"]
    latent, ck = load_latent_model(run / "final")
    assert ck.mtp.twin_kv and latent.twin_kv
    attn = latent.model.layers[-1].self_attn
    assert not torch.equal(attn.k_proj.adapter.linear.weight, attn.k_proj.weight)  # the history's keys trained
    model, _ = load_runtime_model(run / "compact", torch.float64)
    assert model.twin_kv
    with eval_acceptance.exact_float32_int_matmul():
        _, replayed, _ = eval_acceptance.block_logits(model, [5, 17, 33, 2, 9], 4, 1, 6, set())
        assert torch.isfinite(replayed).all()
    _, _, backend = runtime(str(run / "compact"), "cpu", max_context=64)
    with pytest.raises(ValueError, match="twin_kv"):
        backend.prefill([5, 17, 33])
    with pytest.raises(ValueError, match="--twin-kv gives twins their own keys and values"):
        Trainer(tiny(data, tmp_path / "other", init=str(sources["bitnet-packed"]), twin_kv=True), log=lambda m: None)
