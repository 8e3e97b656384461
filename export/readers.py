"""Per-format conversion: checkpoint tensors -> canonical ternary codes + scales, and dense tensors.

Weight formats (``detect_format``), with the rule each projection ``[N, K]`` follows:

``bitnet-latent``
    HF BitNet ``-bf16`` / ``quantization_mode: online`` and BitMTP training checkpoints:
    latent float weights, ternarised here with ``ternarize_absmean`` (per tensor, the same
    float32 arithmetic as transformers' ``WeightQuant``).
``bitnet-packed``
    HF BitNet offline: ``weight`` uint8 ``[N/4, K]`` in the HF row-block packing
    (``unpack_hf_bitnet``) and ``weight_scale`` ``[1]``; scale = ``weight_scale``
    (autobitlinear) or ``1 / weight_scale`` (bitlinear).
``bitnet-ternary-float``
    autobitlinear + offline with float weights already in {-1, 0, +1} and ``weight_scale``
    (transformers accepts this; scale = ``weight_scale``).
``qwen3-group128``
    Ternary-Bonsai ``-unpacked``: float weights that are exactly {-s, 0, +s} in every
    128-group along K. ``ternarize_group_absmax`` recovers codes and scales, and the
    reconstruction ``codes * s`` must equal the stored weight bit for bit.

Everything is checked against the config before any tensor data is read: the tensor set
(nothing missing, nothing unexpected), every shape and every dtype. Norms, the embedding
and an untied ``lm_head`` are passed through in their stored dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from bitmtp_edge.format.config import ModelConfig
from bitmtp_edge.format.tensors import EMBED, FINAL_NORM, LM_HEAD, PROJECTIONS, layer_prefix, projection_name
from kernels_ampere.numerics import GROUP_SIZE, dequantize_ternary, ternarize_absmean, ternarize_group_absmax
from kernels_ampere.packing import unpack_hf_bitnet

from .checkpoint import FLOAT_DTYPES, UINT8, Checkpoint
from .errors import ExportError
from .hf_config import SourceSpec

BITNET_LATENT = "bitnet-latent"
BITNET_PACKED = "bitnet-packed"
BITNET_TERNARY_FLOAT = "bitnet-ternary-float"
QWEN3_GROUP128 = "qwen3-group128"

# Buffers older checkpoints carry that the runtime recomputes (as mlx-lm's sanitize drops them).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
FLOAT_NAMES = "/".join(FLOAT_DTYPES)


@dataclass(frozen=True)
class Ternary:
    """One projection in canonical form."""

    name: str  # e.g. "model.layers.0.self_attn.q_proj"
    codes: torch.Tensor  # [N, K] int8 in {-1, 0, 1}
    scale: torch.Tensor  # float32 [1] (per tensor) or [N, K/128] (group-128)


@dataclass(frozen=True)
class Dense:
    """A tensor the artifact keeps as the checkpoint has it (norms, embedding, lm_head)."""

    name: str
    tensor: torch.Tensor


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``model.layers.{i}.<proj>`` -> [out_features, in_features]."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    per_layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
                 "mlp.down_proj": (h, i)}
    assert tuple(per_layer) == PROJECTIONS
    return {projection_name(layer, p): shape for layer in range(cfg.num_layers) for p, shape in per_layer.items()}


def dense_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Norms, embedding and (untied) head, in the order the reader emits them."""
    h = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, h), FINAL_NORM: (h,)}
    for layer in range(cfg.num_layers):
        p = layer_prefix(layer)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.has_sub_norms:
            out[p + "self_attn.attn_sub_norm.weight"] = (cfg.num_heads * cfg.head_dim,)
            out[p + "mlp.ffn_sub_norm.weight"] = (cfg.intermediate_size,)
        if cfg.has_qk_norm:
            out[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            out[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
    if not cfg.tie_word_embeddings:
        out[LM_HEAD] = (cfg.vocab_size, h)
    return out


def detect_format(ckpt: Checkpoint, spec: SourceSpec) -> str:
    """Which weight format the checkpoint uses, from config.json and the first projection's dtype."""
    if spec.model.family == "qwen3":
        return QWEN3_GROUP128
    first = projection_name(0, PROJECTIONS[0]) + ".weight"
    if first not in ckpt.tensors:
        raise ExportError(ckpt.weights_path, f"tensor {first} is missing",
                          "the weights do not belong to a BitNetForCausalLM: check the checkpoint folder")
    dtype, bq, where = ckpt.info(first).dtype, spec.bitnet, ckpt.config_path
    if dtype == UINT8:
        if not bq.declared:
            raise ExportError(where, f"the projections are packed uint8 ({first}) but there is no "
                              "quantization_config, so the meaning of weight_scale is unknown",
                              'add "quantization_config": {"quant_method": "bitnet", "linear_class": '
                              '"autobitlinear" (weight_scale multiplies) or "bitlinear" (it divides), '
                              '"quantization_mode": "offline"}')
        if bq.linear_class == "autobitlinear" and bq.mode == "online":
            raise ExportError(where, f"quantization_mode is online (latent float weights) but {first} is "
                              "packed uint8", 'set "quantization_mode": "offline" for a packed checkpoint')
        return BITNET_PACKED
    if bq.declared and bq.linear_class == "bitlinear":
        raise ExportError(where, f"linear_class bitlinear stores packed uint8 weights, but {first} is {dtype}",
                          'for latent weights use "linear_class": "autobitlinear", "quantization_mode": "online"')
    if bq.mode == "offline":
        return BITNET_TERNARY_FLOAT
    return BITNET_LATENT


def source_tensors(ckpt: Checkpoint, spec: SourceSpec, fmt: str) -> list[str]:
    """Validate the checkpoint's tensor set, shapes and dtypes; return the names to read, in order."""
    cfg = spec.model
    expected: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}
    floats = tuple(FLOAT_DTYPES)
    for name, shape in dense_shapes(cfg).items():
        expected[name] = (shape, floats)
    for base, (n, k) in projection_shapes(cfg).items():
        if fmt == BITNET_PACKED:
            expected[base + ".weight"] = ((n // 4, k), (UINT8,))
        else:
            expected[base + ".weight"] = ((n, k), floats)
        if fmt in (BITNET_PACKED, BITNET_TERNARY_FLOAT):
            expected[base + ".weight_scale"] = ((1,), floats)
    if cfg.tie_word_embeddings and LM_HEAD in ckpt.tensors:
        expected[LM_HEAD] = ((cfg.vocab_size, cfg.hidden_size), floats)  # checked equal to the embedding

    present = {k for k in ckpt.tensors if not k.endswith(IGNORED_SUFFIXES)}
    missing = [k for k in expected if k not in present]
    if missing == [LM_HEAD]:
        raise ExportError(ckpt.weights_path, f"tensor {LM_HEAD} is missing and config.json does not tie it to the "
                          "embedding (tie_word_embeddings is false or absent, and transformers' default is false)",
                          'set "tie_word_embeddings": true in config.json if the head shares the embedding')
    if missing:
        more = f" ({len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ExportError(ckpt.weights_path, f"tensor {missing[0]} is missing{more} (config.json "
                          f"describes a {spec.architecture}, {fmt})",
                          "the weights and config.json do not belong together: re-download the checkpoint")
    unexpected = sorted(present - set(expected))
    if unexpected:
        more = f" ({len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ExportError(ckpt.info(unexpected[0]).file,
                          f"unexpected tensor {unexpected[0]}{more} for {spec.architecture} ({fmt})",
                          f"bitmtp-export reads the stock {spec.architecture} layout: check config.json matches "
                          "the weights")
    for name, (shape, dtypes) in expected.items():
        info = ckpt.info(name)
        ok_shape = info.shape == shape or (name.endswith(".weight_scale") and info.shape in ((), (1,)))
        if not ok_shape:
            raise ExportError(info.file, f"tensor {name} has shape {list(info.shape)}, but config.json implies "
                              f"{list(shape)}", "the weights and config.json do not belong together")
        if info.dtype not in dtypes:
            want = " or ".join(dtypes) if dtypes != floats else FLOAT_NAMES
            raise ExportError(info.file, f"tensor {name} has dtype {info.dtype}, expected {want} for {fmt}",
                              "the weights and config.json do not belong together")
    return [k for k in expected if not k.endswith(".weight_scale")]


def read_tensors(ckpt: Checkpoint, spec: SourceSpec, fmt: str, names: list[str],
                 advance: Callable[[str], None] = lambda name: None) -> Iterator[Ternary | Dense]:
    """Yield every projection in canonical form and every dense tensor, one at a time."""
    embed = None
    for name in names:
        file = ckpt.info(name).file
        t = ckpt.load(name)
        if name.endswith("_proj.weight"):
            base = name[: -len(".weight")]
            if fmt == BITNET_PACKED:
                codes, scale = _unpack(ckpt, base, t), _weight_scale(ckpt, base, spec)
            elif fmt == BITNET_TERNARY_FLOAT:
                codes, scale = _ternary_floats(name, file, t), _weight_scale(ckpt, base, spec)
            elif fmt == BITNET_LATENT:
                _check_finite(name, file, t)
                codes, scale = ternarize_absmean(t)
            else:
                codes, scale = _group128(name, file, t)
            yield Ternary(base, codes, scale)
        elif name == LM_HEAD and spec.model.tie_word_embeddings:
            if not torch.equal(t, embed):
                raise ExportError(file, f"{LM_HEAD} differs from {EMBED} although config.json says "
                                  "tie_word_embeddings: true",
                                  "set tie_word_embeddings to false in config.json if the head is separate")
        else:
            _check_finite(name, file, t)
            if name == EMBED:
                embed = t
            yield Dense(name, t)
        advance(name)


def _check_finite(name: str, file, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ExportError(file, f"tensor {name} holds NaN or infinite values",
                          "the checkpoint is corrupt or training diverged: export an earlier checkpoint")


def _unpack(ckpt: Checkpoint, base: str, packed: torch.Tensor) -> torch.Tensor:
    try:
        return unpack_hf_bitnet(packed)
    except ValueError:
        bad = ((packed.to(torch.int32).unsqueeze(0) >> torch.arange(0, 8, 2).view(4, 1, 1)) & 3) == 3
        lane, r, c = (int(i) for i in bad.nonzero()[0])
        raise ExportError(ckpt.info(base + ".weight").file,
                          f"tensor {base}.weight holds the 2-bit code 3 (byte [{r}, {c}], bits {2 * lane}-"
                          f"{2 * lane + 1}), which is not a ternary value",
                          "the file is corrupt or not in Hugging Face BitNet packing: download it again") from None


def _weight_scale(ckpt: Checkpoint, base: str, spec: SourceSpec) -> torch.Tensor:
    name = base + ".weight_scale"
    ws = ckpt.load(name).float().reshape(1)
    if not bool(torch.isfinite(ws).all()) or float(ws) <= 0:
        raise ExportError(ckpt.info(name).file, f"tensor {name} = {float(ws)} is not a positive scale",
                          "the checkpoint is corrupt: download it again")
    # docs/artifact.md §Source checkpoints: autobitlinear multiplies by weight_scale, bitlinear divides by it.
    return ws if spec.bitnet.weight_scale == "multiply" else 1.0 / ws


def _ternary_floats(name: str, file, w: torch.Tensor) -> torch.Tensor:
    bad = (w != -1) & (w != 0) & (w != 1)
    if bool(bad.any()):
        r, c = (int(i) for i in bad.nonzero()[0])
        raise ExportError(file, f"tensor {name} should hold ternary values {{-1, 0, 1}} (offline "
                          f"autobitlinear), but [{r}, {c}] = {float(w[r, c])}",
                          'for latent weights set "quantization_mode": "online" in config.json')
    return w.to(torch.int8)


def _group128(name: str, file, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = ternarize_group_absmax(w, GROUP_SIZE)
    exact = dequantize_ternary(codes, scale, torch.float32) == w.float()
    if not bool(exact.all()):
        r, c = (int(i) for i in (~exact).nonzero()[0])
        g = c // GROUP_SIZE
        raise ExportError(file, f"tensor {name}: row {r}, group {g} (columns {g * GROUP_SIZE}-"
                          f"{(g + 1) * GROUP_SIZE - 1}) is not exactly {{-s, 0, +s}} (value {float(w[r, c]):.6g}, "
                          f"s = max|group| = {float(scale[r, g]):.6g})",
                          "this is not a ternary group-128 checkpoint: export Ternary-Bonsai's -unpacked release, "
                          "whose every 128-group is exactly {-s, 0, +s}")
    return codes, scale
