"""bitmtp-export refuses bad input with exit code 2 and ONE line naming the file and the fault.

Every test breaks one thing in a copy of a good fake checkpoint and checks: exit code 2,
a single stderr line ``error: <file>: <what>; <what to do>`` that names the file and the
fault, no traceback, and no OUT/ (nor a temporary sibling) left behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.export_fixtures import checkpoint, copy_ckpt, run_cli
from tools import fake_checkpoints as fc


def assert_refused(result, out: Path, *needles: str, out_existed: bool = False) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: "), line
    assert line.count("; ") == 1, f"expected '<file>: <what was wrong>; <what to do>', got {line!r}"
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    if not out_existed:
        assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temporary folder left behind"
    return line


def edit_config(ckpt: Path, **changes) -> None:
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def edit_weights(ckpt: Path, edit) -> None:
    state = fc.load_safetensors(ckpt)
    edit(state)
    fc.save_safetensors(ckpt, state)


# --- the folder and its JSON files --------------------------------------------------------

def test_missing_checkpoint_folder(tmp_path):
    out = tmp_path / "out"
    assert_refused(run_cli(tmp_path / "nope", out), out, str(tmp_path / "nope"), "no such checkpoint folder")


def test_missing_config_json(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    (ckpt / "config.json").unlink()
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "config.json"), "missing")


def test_malformed_config_json(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    (ckpt / "config.json").write_text('{"architectures": ["BitNetForCausalLM"],')
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "config.json"), "not valid JSON", "line 1")


def test_config_missing_a_dimension(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    edit_config(ckpt, hidden_size=None)
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, "config.json", "missing 'hidden_size'")


def test_unknown_architecture(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    edit_config(ckpt, architectures=["LlamaForCausalLM"], model_type="llama")
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "config.json"), "unknown architecture 'LlamaForCausalLM'",
                   "BitNetForCausalLM")


def test_rope_scaling_is_refused(tmp_path):
    ckpt = copy_ckpt("qwen3-fp16", tmp_path / "ckpt")
    edit_config(ckpt, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, "config.json", "'yarn' is not supported")


def test_missing_tokenizer(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    (ckpt / "tokenizer.json").unlink()
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "tokenizer.json"), "missing", "copy tokenizer.json")


def test_bin_only_checkpoint_is_refused_without_unpickling(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    (ckpt / "model.safetensors").unlink()
    # Not even a valid pickle: the exporter must refuse it by name, never open it.
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04 not a pickle")
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "pytorch_model.bin"), "pickle", "safetensors")


# --- bitmtp.json ------------------------------------------------------------------------

@pytest.mark.parametrize("content, needle", [
    ({"block_size": 4}, "missing key(s) mask_token_id"),
    ({"block_size": 1, "mask_token_id": 1}, "block_size must be in 2..16"),
    ({"block_size": 4, "mask_token_id": 4096}, "outside the vocabulary"),
    ({"block_size": "4", "mask_token_id": 1}, "block_size must be an integer"),
])
def test_bad_bitmtp_json(tmp_path, content, needle):
    ckpt = copy_ckpt("bitmtp", tmp_path / "ckpt")
    (ckpt / "bitmtp.json").write_text(json.dumps(content))
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "bitmtp.json"), needle)


# --- tensors ------------------------------------------------------------------------------

def test_tensor_with_wrong_shape(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    name = "model.layers.1.mlp.down_proj.weight"
    edit_weights(ckpt, lambda s: s.__setitem__(name, s[name][:, :640].clone()))
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "model.safetensors"), name, "[256, 640]", "[256, 768]")


def test_tensor_with_wrong_dtype(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    name = "model.layers.0.input_layernorm.weight"
    edit_weights(ckpt, lambda s: s.__setitem__(name, s[name].to(torch.int32)))
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "model.safetensors"), name, "dtype I32")


def test_missing_tensor(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    name = "model.layers.1.self_attn.attn_sub_norm.weight"
    edit_weights(ckpt, lambda s: s.pop(name))
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "model.safetensors"), name, "missing")


def test_unexpected_tensor(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    name = "model.layers.0.self_attn.q_proj.bias"
    edit_weights(ckpt, lambda s: s.__setitem__(name, torch.zeros(256)))
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "model.safetensors"), name, "unexpected")


def test_nan_in_latent_weight(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    name = "model.layers.0.mlp.up_proj.weight"

    def poison(s):
        s[name][3, 7] = float("nan")
    edit_weights(ckpt, poison)
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, "model.safetensors", name, "NaN")


def test_bonsai_group_that_is_not_ternary(tmp_path):
    ckpt = copy_ckpt("qwen3-fp16", tmp_path / "ckpt")
    name = "model.layers.1.mlp.gate_proj.weight"

    def nudge(s):
        w = s[name]
        w[5, 130] = w[5, 128:256].abs().max() * 0.5  # inside group 1 of row 5: not {-s, 0, +s}
    edit_weights(ckpt, nudge)
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "model.safetensors"), name, "row 5, group 1",
                   "{-s, 0, +s}")


def test_packed_code_3(tmp_path):
    ckpt = copy_ckpt("bitnet-packed-autobitlinear", tmp_path / "ckpt")
    name = "model.layers.0.self_attn.k_proj.weight"

    def corrupt(s):
        s[name][2, 9] = 0b11_01_01_01  # lane 3 holds code 3
    edit_weights(ckpt, corrupt)
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "model.safetensors"), name, "code 3", "byte [2, 9]")


def test_packed_weights_with_online_config(tmp_path):
    ckpt = copy_ckpt("bitnet-packed-autobitlinear", tmp_path / "ckpt")
    edit_config(ckpt, quantization_config={"quant_method": "bitnet", "linear_class": "autobitlinear",
                                           "quantization_mode": "online"})
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "config.json"), "online", "packed uint8")


def test_tied_lm_head_that_differs_from_embedding(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    edit_weights(ckpt, lambda s: s.__setitem__("lm_head.weight", s["model.embed_tokens.weight"] * 1.5))
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "model.safetensors"), "lm_head.weight differs",
                   "tie_word_embeddings")


def test_truncated_safetensors(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(f), "not a readable safetensors file", "truncated")


# --- sharded checkpoints ----------------------------------------------------------------

def sharded_copy(tmp_path) -> tuple[Path, dict]:
    ckpt = fc.shard(copy_ckpt("bitnet-online", tmp_path / "ckpt"), max_shard_bytes=400_000)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    return ckpt, index


def test_sharded_checkpoint_with_a_missing_shard(tmp_path):
    ckpt, index = sharded_copy(tmp_path)
    shard = sorted(set(index["weight_map"].values()))[1]
    (ckpt / shard).unlink()
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / shard), "missing", "model.safetensors.index.json")


def test_sharded_checkpoint_with_a_truncated_shard(tmp_path):
    ckpt, index = sharded_copy(tmp_path)
    shard = ckpt / max(index["weight_map"].values())
    shard.write_bytes(shard.read_bytes()[:-100])
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(shard), "not a readable safetensors file")


def test_index_maps_a_key_its_shard_does_not_hold(tmp_path):
    ckpt, index = sharded_copy(tmp_path)
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = min(index["weight_map"].values())
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, "model-00001-of-", "does not hold tensor model.layers.9.mlp.up_proj.weight")


def test_tensor_stored_in_two_shards(tmp_path):
    ckpt, index = sharded_copy(tmp_path)
    shards = sorted(set(index["weight_map"].values()))
    from safetensors.torch import load_file, save_file

    dup = next(k for k, v in index["weight_map"].items() if v == shards[0])
    last = load_file(str(ckpt / shards[-1]))
    last[dup] = load_file(str(ckpt / shards[0]))[dup]
    save_file(last, str(ckpt / shards[-1]))
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, shards[-1], f"tensor {dup} is stored twice")


def test_index_with_duplicate_key(tmp_path):
    ckpt, _ = sharded_copy(tmp_path)
    p = ckpt / "model.safetensors.index.json"
    text = p.read_text().replace('"weight_map": {', '"weight_map": {\n "model.norm.weight": "x.safetensors",', 1)
    p.write_text(text)
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(p), "'model.norm.weight' appears twice")


# --- OUT/ and options ---------------------------------------------------------------------

def test_out_exists_without_overwrite_is_left_untouched(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = assert_refused(run_cli(copy_ckpt("bitnet-online", tmp_path / "ckpt"), out), out, str(out),
                          "already exists", "--overwrite", out_existed=True)
    assert "already exists" in line
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_out_inside_the_checkpoint_is_refused(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    out = ckpt / "artifact"
    assert_refused(run_cli(ckpt, out), out, str(out), "overlaps the checkpoint folder")


def test_max_context_beyond_the_model(tmp_path):
    out = tmp_path / "out"
    assert_refused(run_cli(copy_ckpt("bitnet-online", tmp_path / "ckpt"), out, "--max-context", "1024"), out,
                   "--max-context", "exceeds max_position_embeddings 256")


def test_kv_budget_too_small(tmp_path):
    out = tmp_path / "out"
    assert_refused(run_cli(copy_ckpt("bitnet-online", tmp_path / "ckpt"), out, "--kv-budget-mib", "0.01"), out,
                   "--kv-budget-mib", "cannot hold even the smallest segment")


def test_device_and_kv_budget_together(tmp_path):
    out = tmp_path / "out"
    assert_refused(run_cli(copy_ckpt("bitnet-online", tmp_path / "ckpt"), out, "--board", "h200",
                           "--kv-budget-mib", "64"), out, "--kv-budget-mib", "--board")


def test_untied_config_without_lm_head_says_how_to_tie(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    edit_config(ckpt, tie_word_embeddings=None)  # absent: transformers' default is false
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "model.safetensors"), "lm_head.weight is missing",
                   '"tie_word_embeddings": true')


def test_offline_float_weights_that_are_not_ternary(tmp_path):
    ckpt = copy_ckpt("bitnet-packed-autobitlinear", tmp_path / "ckpt")
    name = "model.layers.1.self_attn.o_proj.weight"

    def to_floats(s):
        from kernels_ampere.packing import unpack_hf_bitnet

        for k in [k for k in s if k.endswith("_proj.weight")]:
            s[k] = unpack_hf_bitnet(s[k]).float()
        s[name][4, 2] = 0.5
    edit_weights(ckpt, to_floats)
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "model.safetensors"), name, "[4, 2] = 0.5",
                   "ternary values {-1, 0, 1}")


# --- sizes are checked against the weights before anything is sized by them ----------------

@pytest.mark.parametrize("key, value, needles", [
    ("num_hidden_layers", 10**6, ("num_hidden_layers = 1000000", "the weights hold 2 (layers 0-1)")),
    ("vocab_size", 8_000_000, ("vocab_size = 8000000", "model.embed_tokens.weight is [")),
    ("hidden_size", 2**20, ("hidden_size = 1048576", "model.embed_tokens.weight is [")),
])
def test_absurd_sizes_are_refused_before_any_allocation(tmp_path, key, value, needles):
    """num_hidden_layers: 10**6 once reached 3.8 GB before the refusal; now the config is held
    against the safetensors header first, and the whole refusal stays within a few MB."""
    import tracemalloc

    from export import ExportError, export_checkpoint

    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    edit_config(ckpt, **{key: value})
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "config.json"), *needles)
    tracemalloc.start()
    try:
        with pytest.raises(ExportError):
            export_checkpoint(ckpt, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MiB allocated before refusing"


@pytest.mark.parametrize("value", ["256", 256.0, True, -4])
def test_a_dimension_of_the_wrong_type_names_the_key(tmp_path, value):
    ckpt = copy_ckpt("qwen3-fp16", tmp_path / "ckpt")
    edit_config(ckpt, hidden_size=value)
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "config.json"), "'hidden_size' must be a positive integer",
                   repr(value))


def test_a_value_transformers_refuses_is_one_clear_line(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    edit_config(ckpt, rms_norm_eps="tiny")
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "config.json"), "rms_norm_eps")


# --- a max context the model cannot decode in ------------------------------------------------

def test_max_context_too_small_for_the_mtp_block_is_refused(tmp_path):
    """--max-context 3 on a D=4 model once exported fine, then every MTP policy refused the
    artifact ("holds 3, with 8 slots for decoding") while doctor called it healthy."""
    out = tmp_path / "out"
    line = assert_refused(run_cli(checkpoint("bitmtp"), out, "--max-context", "3"), out,
                          "--max-context", "3", "D=4", "pass --max-context 9 or more")
    assert "8 slots" in line


def test_the_smallest_max_context_the_export_accepts_decodes_with_every_policy(tmp_path):
    """The exporter's minimum is exactly the runtime's: 2*D + 1 decodes under every policy, one less is refused."""
    from bitmtp_edge import POLICIES, Engine

    out = tmp_path / "out"
    assert_refused(run_cli(checkpoint("bitmtp"), out, "--max-context", "8"), out, "--max-context 9 or more")
    result = run_cli(checkpoint("bitmtp"), out, "--max-context", "9", "--quiet")
    assert result.exit_code == 0, result.output
    eng = Engine.load(out, backend="reference", device="cpu")
    for policy in POLICIES:
        assert len(eng.generate([5], max_new_tokens=4, policy=policy).token_ids) >= 1, policy


def test_an_ar_only_model_needs_only_room_for_one_token(tmp_path):
    out = tmp_path / "out"
    result = run_cli(checkpoint("bitnet-online"), out, "--max-context", "2", "--quiet")
    assert result.exit_code == 0, result.output


def test_max_context_too_small_through_the_python_api_names_the_option(tmp_path):
    from export import ExportError, ExportOptions, export_checkpoint

    out = tmp_path / "out"
    with pytest.raises(ExportError) as e:
        export_checkpoint(checkpoint("bitmtp"), out, ExportOptions(max_context=1))
    assert e.value.path == "--max-context" and "9 or more" in e.value.fix
    assert not out.exists()


def test_kv_budget_too_small_names_the_board_option_not_the_old_device(tmp_path):
    out = tmp_path / "out"
    line = assert_refused(run_cli(checkpoint("bitnet-online"), out, "--kv-budget-mib", "0.01"), out,
                          "--kv-budget-mib", "--board")
    assert "--device" not in line  # renamed --board: --device is refused as a usage error
