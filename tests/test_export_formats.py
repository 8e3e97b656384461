"""Each input format converts to the right codes, scales, tensors and manifest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bitmtp_edge.format.config import MTPConfig, QuantConfig
from bitmtp_edge.format.manifest import WEIGHTS, read_manifest, sha256_file, verify_files
from bitmtp_edge.format.segments import DEVICE_KV_BUDGET_MIB, MIB
from export import ExportOptions, export_checkpoint
from kernels_ampere.numerics import dequantize_ternary, quantize_rows_int8, ternarize_absmean
from kernels_ampere.packing import unpack_hf_bitnet, unpack_ternary
from tests.export_fixtures import checkpoint, copy_ckpt, run_cli
from tools import fake_checkpoints as fc

PROJ = "model.layers.1.mlp.down_proj"


def export(ckpt: Path, out: Path, **options):
    export_checkpoint(ckpt, out, ExportOptions(**options))
    return read_manifest(out), load_file(str(out / WEIGHTS))


def codes_and_scales(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {k[: -len(".packed")]: (unpack_ternary(v), tensors[k[: -len(".packed")] + ".scale"])
            for k, v in tensors.items() if k.endswith(".packed")}


@pytest.fixture(scope="module")
def online_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("online") / "out"
    return export(checkpoint("bitnet-online"), out)


# --- BitNet -------------------------------------------------------------------------------

def test_latent_projections_are_ternarised_with_absmean(online_export):
    manifest, tensors = online_export
    src = fc.load_safetensors(checkpoint("bitnet-online"))
    projections = codes_and_scales(tensors)
    assert len(projections) == 2 * 7
    for base, (codes, scale) in projections.items():
        ref_codes, ref_scale = ternarize_absmean(src[base + ".weight"])
        assert torch.equal(codes, ref_codes), base
        assert scale.dtype == torch.float32 and torch.equal(scale, ref_scale), base
    assert manifest.quant == QuantConfig("per_tensor", "int8_per_token")
    assert manifest.source["weights_format"] == "bitnet-latent"


def test_dense_tensors_pass_through_in_their_dtype(online_export):
    manifest, tensors = online_export
    src = fc.load_safetensors(checkpoint("bitnet-online"))
    dense = [k for k in tensors if k.endswith(".weight")]
    assert "model.layers.0.self_attn.attn_sub_norm.weight" in dense and "lm_head.weight" not in dense
    for k in dense:
        assert tensors[k].dtype == src[k].dtype and torch.equal(tensors[k], src[k]), k
    assert manifest.source["dense_dtypes"] == {"float32": len(dense)}
    assert "float32" in manifest.source["note"]


def test_bf16_checkpoint_keeps_bf16_embeddings_and_norms(tmp_path):
    _, tensors = export(checkpoint("bitnet-online-bf16"), tmp_path / "out")
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    assert tensors[PROJ + ".scale"].dtype == torch.float32


def test_draft_head_is_int8_rows_of_the_tied_embedding(online_export):
    _, tensors = online_export
    w, s = quantize_rows_int8(tensors["model.embed_tokens.weight"])
    assert tensors["draft_head.int8"].dtype == torch.int8
    assert torch.equal(tensors["draft_head.int8"], w) and torch.equal(tensors["draft_head.scale"], s)


def test_untied_lm_head_is_exported_and_feeds_the_draft_head(tmp_path):
    manifest, tensors = export(checkpoint("bitnet-online-untied"), tmp_path / "out")
    src = fc.load_safetensors(checkpoint("bitnet-online-untied"))
    assert not manifest.model.tie_word_embeddings
    assert torch.equal(tensors["lm_head.weight"], src["lm_head.weight"])
    assert torch.equal(tensors["draft_head.int8"], quantize_rows_int8(src["lm_head.weight"])[0])


def test_tied_lm_head_stored_equal_to_the_embedding_is_accepted(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    state = fc.load_safetensors(ckpt)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    fc.save_safetensors(ckpt, state)
    _, tensors = export(ckpt, tmp_path / "out")
    assert "lm_head.weight" not in tensors


@pytest.mark.parametrize("kind, meaning", [
    ("bitnet-packed-autobitlinear", "multiply"),
    ("bitnet-packed-bitlinear", "divide"),
    ("bitnet-packed-legacy", "multiply"),  # pre-release {"offline_quantization": true}: autobitlinear
])
def test_packed_checkpoint_gives_the_latent_checkpoints_codes_and_scales(tmp_path, online_export, kind, meaning):
    manifest, tensors = export(checkpoint(kind), tmp_path / "out")
    assert manifest.source["weights_format"] == "bitnet-packed"
    assert manifest.source["weight_scale"] == meaning
    latent = codes_and_scales(online_export[1])
    for base, (codes, scale) in codes_and_scales(tensors).items():
        assert torch.equal(codes, latent[base][0]), base
        # bitlinear stores 1/mean|W|; inverting it back costs at most an ulp or two.
        torch.testing.assert_close(scale, latent[base][1], rtol=3e-7, atol=0)


def test_packed_codes_follow_the_hf_bit_order(tmp_path):
    """A hand-checkable case: the transformers docstring's byte 0b10100001 down column 0."""
    ckpt = copy_ckpt("bitnet-packed-autobitlinear", tmp_path / "ckpt")
    name = "model.layers.0.self_attn.k_proj.weight"  # [128, 256] -> packed [32, 256]
    state = fc.load_safetensors(ckpt)
    state[name][0, 0] = 0b10_10_00_01  # rows 0, 32, 64, 96 of column 0 = 0, -1, +1, +1
    fc.save_safetensors(ckpt, state)
    _, tensors = export(ckpt, tmp_path / "out")
    codes = unpack_ternary(tensors["model.layers.0.self_attn.k_proj.packed"])
    assert codes[[0, 32, 64, 96], 0].tolist() == [0, -1, 1, 1]
    assert torch.equal(codes, unpack_hf_bitnet(state[name]))


def test_offline_autobitlinear_with_ternary_float_weights(tmp_path, online_export):
    ckpt = copy_ckpt("bitnet-packed-autobitlinear", tmp_path / "ckpt")
    state = fc.load_safetensors(ckpt)
    for k in [k for k in state if k.endswith("_proj.weight")]:
        state[k] = unpack_hf_bitnet(state[k]).float()
    fc.save_safetensors(ckpt, state)
    manifest, tensors = export(ckpt, tmp_path / "out")
    assert manifest.source["weights_format"] == "bitnet-ternary-float"
    latent = codes_and_scales(online_export[1])
    for base, (codes, _) in codes_and_scales(tensors).items():
        assert torch.equal(codes, latent[base][0]), base


def test_bitnet_config_without_quantization_config_reads_as_latent(tmp_path, online_export):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _, tensors = export(ckpt, tmp_path / "out")
    assert torch.equal(tensors[PROJ + ".packed"], online_export[1][PROJ + ".packed"])


def test_rotary_inv_freq_buffers_of_older_checkpoints_are_ignored(tmp_path, online_export):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    state = fc.load_safetensors(ckpt)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(32)
    fc.save_safetensors(ckpt, state)
    _, tensors = export(ckpt, tmp_path / "out")
    assert tensors.keys() == online_export[1].keys()


# --- Qwen3 group-128 (Bonsai -unpacked) --------------------------------------------------

@pytest.mark.parametrize("kind", ["qwen3-fp16", "qwen3-fp32"])
def test_qwen3_group128_codes_and_scales_reconstruct_exactly(tmp_path, kind):
    manifest, tensors = export(checkpoint(kind), tmp_path / "out")
    src = fc.load_safetensors(checkpoint(kind))
    assert manifest.quant == QuantConfig(weights="group128", activations="none")
    assert manifest.model.family == "qwen3"
    assert manifest.model.head_dim == 128 != manifest.model.hidden_size // manifest.model.num_heads
    assert manifest.model.rope_theta == 1e6 and manifest.model.rms_norm_eps == 1e-6
    for base, (codes, scale) in codes_and_scales(tensors).items():
        w = src[base + ".weight"]
        assert scale.shape == (w.shape[0], w.shape[1] // 128) and scale.dtype == torch.float32
        assert torch.equal(dequantize_ternary(codes, scale), w.float()), base
    assert tensors["model.layers.0.self_attn.q_norm.weight"].dtype == src["model.embed_tokens.weight"].dtype
    assert torch.equal(tensors["model.embed_tokens.weight"], src["model.embed_tokens.weight"])


# --- config dialects, shards, MTP, manifest ---------------------------------------------

@pytest.mark.parametrize("kind", ["bitnet-online", "qwen3-fp16"])
def test_v4_and_v5_config_dialects_export_the_same_model(tmp_path, kind):
    v5, t5 = export(checkpoint(kind), tmp_path / "v5")
    ckpt = fc.to_v4_dialect(copy_ckpt(kind, tmp_path / "ckpt"))
    cfg = json.loads((ckpt / "config.json").read_text())
    assert "rope_theta" in cfg and "rope_parameters" not in cfg
    v4, t4 = export(ckpt, tmp_path / "v4")
    assert v4.model == v5.model
    assert v4.model.rope_theta == (500000.0 if kind == "bitnet-online" else 1e6)
    assert t4.keys() == t5.keys() and all(torch.equal(t4[k], t5[k]) for k in t4)


def test_sharded_checkpoint_exports_like_the_single_file(tmp_path, online_export):
    ckpt = fc.shard(copy_ckpt("bitnet-online", tmp_path / "ckpt"), max_shard_bytes=300_000)
    manifest, tensors = export(ckpt, tmp_path / "out")
    ref = online_export[1]
    assert tensors.keys() == ref.keys() and all(torch.equal(tensors[k], ref[k]) for k in ref)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2
    assert shards | {"model.safetensors.index.json"} <= set(manifest.source["files"])


def test_bitmtp_checkpoint_manifest(tmp_path):
    ckpt = checkpoint("bitmtp")
    out = tmp_path / "out"
    manifest, _ = export(ckpt, out)
    bitmtp = json.loads((ckpt / "bitmtp.json").read_text())
    assert manifest.mtp == MTPConfig(block_size=4, mask_token_id=bitmtp["mask_token_id"], tau=0.9, min_prefix=2)
    assert manifest.widths == {"verify": [1, 5], "draft": [5, 6, 7, 8]}
    assert manifest.kv.workspace == 8 and manifest.kv.dtype == "float16"
    assert [s.capacity for s in manifest.kv.segments] == [256]  # min(max_position_embeddings, 4096)
    assert manifest.source["kind"] == "bitmtp" and manifest.source["bitmtp"] == bitmtp
    assert manifest.exporter_version
    verify_files(out, manifest)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (ckpt / name).read_bytes()
    for name, digest in manifest.source["files"].items():
        assert sha256_file(ckpt / name) == digest
    assert set(manifest.source["files"]) >= {"config.json", "bitmtp.json", "model.safetensors", "tokenizer.json"}


def test_the_manifest_widths_are_checked_against_the_mtp_block(tmp_path):
    """The runtime reads the step widths the exporter wrote; a manifest whose widths do not
    follow from its block size is refused instead of silently recomputed."""
    from bitmtp_edge.format.manifest import ArtifactError

    out = tmp_path / "out"
    manifest, _ = export(checkpoint("bitmtp"), out)
    assert manifest.max_width == manifest.kv.workspace == 2 * manifest.mtp.block_size
    data = json.loads((out / "manifest.json").read_text())
    assert "roles" not in data and set(data["widths"]) == {"verify", "draft"}
    data["widths"]["draft"] = [5, 6]
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="widths .* do not match the MTP block"):
        read_manifest(out)


def test_checkpoint_without_bitmtp_json_is_ar_only(online_export):
    manifest, _ = online_export
    assert manifest.mtp is None
    assert manifest.widths == {"verify": [1], "draft": []}
    assert manifest.kv.workspace == 1


def test_eos_ids_merge_config_and_generation_config(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen["eos_token_id"] = [0, 7]
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    manifest, _ = export(ckpt, tmp_path / "out")
    assert manifest.model.eos_token_ids == (0, 7)
    assert manifest.model.bos_token_id == 0


def test_kv_segments_follow_max_context_and_budget(tmp_path):
    ckpt = copy_ckpt("bitmtp", tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (ckpt / "config.json").write_text(json.dumps(cfg))
    m, _ = export(ckpt, tmp_path / "default")
    assert [s.capacity for s in m.kv.segments] == [256, 512, 1024, 2048, 4096] and m.kv.budget_bytes is None
    m, _ = export(ckpt, tmp_path / "ctx", max_context=1000)
    assert [s.capacity for s in m.kv.segments] == [256, 512, 1000]
    # 1 KiB per slot: the 4096 segment (+ the 2048 one it grows from) does not fit in 5 MiB.
    m, _ = export(ckpt, tmp_path / "budget", kv_budget_mib=5)
    assert m.kv.segments[-1].capacity == 2048 and m.kv.budget_bytes == 5 * MIB
    m, _ = export(ckpt, tmp_path / "board", board="orin-nano-8gb")
    assert m.kv.budget_bytes == DEVICE_KV_BUDGET_MIB["orin-nano-8gb"] * MIB


# --- the CLI on good input ------------------------------------------------------------------

def test_cli_exports_prints_a_summary_and_overwrites_on_request(tmp_path):
    ckpt, out = checkpoint("bitmtp"), tmp_path / "out"
    result = run_cli(ckpt, out, "--board", "orin-nano-8gb")
    assert result.exit_code == 0, result.output
    assert f"-> {out}" in result.output and "D=4" in result.output and "budget 512 MiB" in result.output
    assert read_manifest(out).mtp.block_size == 4
    assert run_cli(ckpt, out).exit_code == 2
    result = run_cli(checkpoint("bitnet-online"), out, "--overwrite", "--quiet")
    assert result.exit_code == 0 and result.output == ""
    assert read_manifest(out).mtp is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folders left


def test_cli_help_lists_the_options():
    result = run_cli("--help")
    assert result.exit_code == 0
    for opt in ("--max-context", "--board", "orin-nano-8gb", "--kv-budget-mib", "--overwrite", "--quiet"):
        assert opt in result.output
    assert "--block-size" not in result.output


# --- what the rest of the project writes and reads ----------------------------------------

def test_training_checkpoints_of_tools_hf_checkpoint_export(tmp_path):
    """Both forms tools.train saves (latent/online and compact/offline) export to the same
    codes; the compact (release) form stores its scales in bfloat16 (tools/hf_checkpoint.py
    says why), so its scales are the latent ones rounded to bfloat16."""
    from bitmtp_edge.format.config import ModelConfig
    from bitmtp_edge.runtime.model import LatentTernaryLinear, TernaryLM
    from tools.hf_checkpoint import save_compact, save_latent

    ids = fc.write_tokenizer(tmp_path / "tok")
    cfg = ModelConfig("bitnet", 512, 256, 768, 2, 4, 2, 64, eos_token_ids=(ids["eos"],))
    torch.manual_seed(0)
    model = TernaryLM(cfg, QuantConfig(), linear_cls=LatentTernaryLinear)
    mtp = MTPConfig(block_size=4, mask_token_id=ids["mask"])
    save_latent(model, tmp_path / "latent", tmp_path / "tok", mtp, "sha-of-corpus")
    save_compact(model, tmp_path / "compact", tmp_path / "tok", mtp, "sha-of-corpus")
    latent, t_latent = export(tmp_path / "latent", tmp_path / "out-latent")
    compact, t_compact = export(tmp_path / "compact", tmp_path / "out-compact")
    assert latent.mtp == compact.mtp == mtp
    assert latent.source["weights_format"] == "bitnet-latent" and compact.source["weights_format"] == "bitnet-packed"
    projections = [k for k in t_latent if k.startswith("model.layers.") and k.endswith((".packed", ".scale"))]
    assert len(projections) == 2 * 2 * 7
    for k in projections:
        expected = t_latent[k].to(torch.bfloat16).float() if k.endswith(".scale") else t_latent[k]
        assert torch.equal(expected, t_compact[k]), k


def test_demo_artifact_runs_every_policy(tmp_path):
    from bitmtp_edge import POLICIES, Engine
    from tools.make_demo_artifact import main as make_demo

    out = tmp_path / "demo"
    from click.testing import CliRunner

    result = CliRunner().invoke(make_demo, [str(out), "--preset", "tiny"])
    assert result.exit_code == 0, result.output
    assert "meaningless" in result.output
    eng = Engine.load(out, backend="reference", device="cpu")
    assert eng.manifest.mtp.block_size == 4 and "meaningless" in eng.manifest.source["bitmtp"]["note"]
    prompt = "def add(a, b):"
    runs = {p: eng.generate(prompt, max_new_tokens=12, policy=p).token_ids for p in POLICIES}
    assert runs["speculative"] == runs["ar"]  # lossless: a sanity check that the artifact is coherent


@pytest.mark.parametrize("kind", ["bitnet-online", "qwen3-fp16"])
def test_omitted_or_null_keys_take_transformers_class_defaults(tmp_path, kind):
    """config.json is read by transformers' own config class, so what a checkpoint leaves out
    (or sets to null) gets exactly the default from_pretrained would give it."""
    from transformers import AutoConfig

    family = {"bitnet-online": "bitnet", "qwen3-fp16": "qwen3"}[kind]
    ckpt = copy_ckpt(kind, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    for key in ("rms_norm_eps", "hidden_act", "rope_parameters", "rope_theta", "rope_scaling"):
        cfg.pop(key, None)
    cfg["max_position_embeddings"] = None
    (ckpt / "config.json").write_text(json.dumps(cfg))
    m, _ = export(ckpt, tmp_path / "out")
    stock = AutoConfig.for_model(family)
    theta = stock.rope_parameters["rope_theta"] if getattr(stock, "rope_parameters", None) else stock.rope_theta
    assert m.model.rms_norm_eps == stock.rms_norm_eps
    assert m.model.rope_theta == theta
    assert m.model.max_position_embeddings == stock.max_position_embeddings
