"""From a checkpoint's JSON files to the artifact's configs.

``config.json`` is read by transformers' own config class for its architecture
(``AutoConfig.for_model``: BitNetConfig, Qwen3Config), so an omitted key takes the default
``from_pretrained`` would give it and both dialects read alike (v4: top-level ``rope_theta``
and ``rope_scaling``; v5: ``rope_parameters``). What transformers cannot decide stays here:

* sizes checked against the safetensors headers *before* anything is sized by them
  (``num_hidden_layers: 1000000`` must not build a million-layer inventory first);
* the five dimensions that define a model are required (a class default for
  ``hidden_size`` would describe some other model), and every value is type-checked with an
  error naming the key (transformers 4.x checks no types);
* what this runtime implements: the stock activation, no biases, full attention, default RoPE;
* token ids only as the files state them (the class defaults are Llama-3's ids), merged with
  ``generation_config.json``;
* BitNet's ``quantization_config``, which decides what a stored ``weight_scale`` means
  (docs/artifact.md §Source checkpoints): ``linear_class: "autobitlinear"`` multiplies, ``"bitlinear"``
  (the default when the key is absent) divides, and the pre-release
  ``{"offline_quantization": true}`` reads as autobitlinear (multiplies);
* ``bitmtp.json``, the MTP block (``MTPConfig``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from bitmtp_edge.format.config import ConfigError, ModelConfig, MTPConfig, QuantConfig
from bitmtp_edge.format.tensors import LM_HEAD

from .checkpoint import Checkpoint
from .errors import ExportError

ARCHITECTURES = {"BitNetForCausalLM": "bitnet", "Qwen3ForCausalLM": "qwen3"}
MODEL_TYPES = {"bitnet": "BitNetForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# The activation the runtime implements for each family (the architectures' stock one).
STOCK_ACTIVATION = {"bitnet": "relu2", "qwen3": "silu"}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class BitNetQuant:
    """How an HF BitNet checkpoint stores its projections (``quantization_config``)."""

    declared: bool  # config.json has a quantization_config at all
    linear_class: Literal["bitlinear", "autobitlinear"]
    mode: Literal["online", "offline"]
    legacy: bool  # the pre-release {"offline_quantization": true} form

    @property
    def weight_scale(self) -> Literal["multiply", "divide"]:
        return "multiply" if self.linear_class == "autobitlinear" else "divide"


@dataclass(frozen=True)
class SourceSpec:
    """Everything the JSON files say about a checkpoint."""

    architecture: str
    model: ModelConfig
    quant: QuantConfig
    mtp: MTPConfig | None
    bitnet: BitNetQuant | None  # None for Qwen3


def read_spec(ckpt: Checkpoint) -> SourceSpec:
    cfg, where = ckpt.config, ckpt.config_path
    arch = _architecture(cfg, where)
    family = ARCHITECTURES[arch]
    model = _model_config(cfg, family, ckpt)
    bitnet = _bitnet_quant(cfg, where) if family == "bitnet" else None
    if family == "qwen3" and cfg.get("quantization_config") is not None:
        qm = cfg["quantization_config"].get("quant_method") if isinstance(cfg["quantization_config"], dict) else None
        raise ExportError(where, f"Qwen3 checkpoint with quantization_config (quant_method {qm!r})",
                          "export the dequantized ternary checkpoint (e.g. Ternary-Bonsai -unpacked), "
                          "whose projections are plain float tensors")
    quant = QuantConfig() if family == "bitnet" else QuantConfig(weights="group128", activations="none")
    mtp = _mtp_config(ckpt, model)
    return SourceSpec(architecture=arch, model=model, quant=quant, mtp=mtp, bitnet=bitnet)


def _architecture(cfg: dict[str, Any], where) -> str:
    supported = ", ".join(ARCHITECTURES)
    archs = cfg.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
            raise ExportError(where, f"'architectures' should be a list of class names, got {archs!r}",
                              f"set it to one of: {supported}")
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise ExportError(where, f"unknown architecture {archs[0]!r}",
                              f"bitmtp-export reads {supported} checkpoints")
        return known[0]
    model_type = cfg.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ExportError(where, f"unknown architecture (no 'architectures', model_type {model_type!r})",
                      f"bitmtp-export reads {supported} checkpoints")


def _model_config(cfg: dict[str, Any], family: str, ckpt: Checkpoint) -> ModelConfig:
    where = ckpt.config_path
    fix = "config.json does not describe a complete model: re-save it with transformers"

    def integer(key: str, v: Any) -> int:
        if v is None:
            raise ExportError(where, f"missing {key!r}", fix)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ExportError(where, f"{key!r} must be a positive integer, got {v!r}", fix)
        return v

    def number(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ExportError(where, f"{key!r} must be a positive number, got {value!r}", fix)
        return float(value)

    for key in REQUIRED:
        integer(key, cfg.get(key))
    _check_sizes_against_weights(cfg, ckpt)
    hf = _transformers_config(cfg, family, where)
    hidden, heads = integer("hidden_size", hf.hidden_size), integer("num_attention_heads", hf.num_attention_heads)
    kv_heads = integer("num_key_value_heads", getattr(hf, "num_key_value_heads", None) or heads)
    head_dim = integer("head_dim", getattr(hf, "head_dim", None) or hidden // heads)
    act = hf.hidden_act
    if act != STOCK_ACTIVATION[family]:
        raise ExportError(where, f"hidden_act {act!r} but {family} models use {STOCK_ACTIVATION[family]!r}",
                          "this runtime implements only the stock activation of each architecture")
    for key in ("attention_bias", "mlp_bias"):
        if getattr(hf, key, False):
            raise ExportError(where, f"{key} is true (the runtime's projections have no bias)",
                              "export a checkpoint without biases")
    if getattr(hf, "use_sliding_window", False):
        raise ExportError(where, "use_sliding_window is true (the runtime implements full attention only)",
                          "set use_sliding_window to false if the model was trained without it")
    theta = number("rope_theta", _rope_theta(hf, where))
    eos = _token_ids(cfg.get("eos_token_id"), where, "eos_token_id")
    bos = _token_ids(cfg.get("bos_token_id"), where, "bos_token_id")
    if ckpt.generation is not None:
        gpath = ckpt.folder / "generation_config.json"
        eos += [t for t in _token_ids(ckpt.generation.get("eos_token_id"), gpath, "eos_token_id") if t not in eos]
        bos = bos or _token_ids(ckpt.generation.get("bos_token_id"), gpath, "bos_token_id")
    tie = hf.tie_word_embeddings
    if not isinstance(tie, bool):
        raise ExportError(where, f"tie_word_embeddings must be true or false, got {tie!r}", fix)
    try:
        model = ModelConfig(
            family=family,
            vocab_size=integer("vocab_size", hf.vocab_size),
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size", hf.intermediate_size),
            num_layers=integer("num_hidden_layers", hf.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=number("rms_norm_eps", hf.rms_norm_eps),
            max_position_embeddings=integer("max_position_embeddings", hf.max_position_embeddings),
            tie_word_embeddings=tie,
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=tuple(eos),
        )
    except ConfigError as e:
        raise ExportError(where, str(e), fix) from None
    # Inputs need not split into whole 128-chunks: the packed layout pads K with zero weights.
    # out_features must split into 4 row blocks (Hugging Face's packing).
    if (model.num_kv_heads * model.head_dim) % 4:
        raise ExportError(where, f"num_key_value_heads * head_dim = {model.num_kv_heads * model.head_dim} "
                          "is not a multiple of 4", "this model cannot be exported")
    return model


def _check_sizes_against_weights(cfg: dict[str, Any], ckpt: Checkpoint) -> None:
    """The sizes that everything else is built from, against the safetensors headers, first:
    a config that says a million layers or an 8-million-token vocabulary is refused here,
    before a tensor inventory, a KV plan or a transformers config is sized by it."""
    where, fix = ckpt.config_path, "config.json does not belong to these weights: use the checkpoint's own"
    layers = {int(m.group(1)) for name in ckpt.tensors if (m := _LAYER_RE.match(name))}
    n = cfg["num_hidden_layers"]
    if n != len(layers):
        held = f"layers 0-{max(layers)}" if layers else "no model.layers.* tensors"
        raise ExportError(where, f"num_hidden_layers = {n} but the weights hold {len(layers)} ({held})", fix)
    embed = ckpt.tensors.get("model.embed_tokens.weight")
    if embed is not None and len(embed.shape) == 2:
        for key, size in (("vocab_size", embed.shape[0]), ("hidden_size", embed.shape[1])):
            if cfg[key] != size:
                raise ExportError(where, f"{key} = {cfg[key]} but model.embed_tokens.weight is "
                                  f"{list(embed.shape)}", fix)


def _transformers_config(cfg: dict[str, Any], family: str, where):
    """transformers' config object for the family, from config.json's keys."""
    from transformers import AutoConfig

    # An explicit null means "the default" to transformers 4.x; 5.x refuses it. Read it as 4.x does.
    keys = {k: v for k, v in cfg.items() if v is not None and k not in ("model_type", "auto_map")}
    try:
        return AutoConfig.for_model(family, **keys)
    except Exception as e:  # 5.x: huggingface_hub's StrictDataclassFieldValidationError, 4.x: ValueError...
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ExportError(where, f"transformers cannot read it ({first})", "fix the value in the file") from None


def _rope_theta(hf, where) -> Any:
    """RoPE base of a transformers config, v5 (``rope_parameters``) or v4 (``rope_theta`` +
    ``rope_scaling``); anything but default RoPE is refused."""
    unsupported = "the runtime implements default RoPE only: export a model trained without RoPE scaling"
    params = getattr(hf, "rope_parameters", None)
    if params is not None and not isinstance(params, dict):
        raise ExportError(where, f"rope_parameters must be an object, got {params!r}",
                          "re-save the config with transformers")
    scaling = params if params is not None else getattr(hf, "rope_scaling", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if rope_type != "default":
        raise ExportError(where, f"RoPE type {rope_type!r} is not supported", unsupported)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return params["rope_theta"]
    return getattr(hf, "rope_theta", None)


def _token_ids(value: Any, where, key: str) -> list[int]:
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ExportError(where, f"{key} must be a token id or a list of them, got {value!r}",
                          "fix the value in the file")
    return list(dict.fromkeys(ids))


def _bitnet_quant(cfg: dict[str, Any], where) -> BitNetQuant:
    qc = cfg.get("quantization_config")
    if qc is None:
        # A bare BitNet config (e.g. a training checkpoint): latent weights, ternarised as
        # the online mode does; the reader checks the tensors are float.
        return BitNetQuant(declared=False, linear_class="autobitlinear", mode="online", legacy=False)
    fix = ("use quantization_config {\"quant_method\": \"bitnet\", \"linear_class\": "
           "\"autobitlinear\"|\"bitlinear\", \"quantization_mode\": \"online\"|\"offline\"}")
    if not isinstance(qc, dict):
        raise ExportError(where, f"quantization_config must be an object, got {qc!r}", fix)
    if qc.get("quant_method") != "bitnet":
        raise ExportError(where, f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported",
                          "bitmtp-export reads BitNet (quant_method \"bitnet\") and ternary Qwen3 checkpoints")
    if qc.get("use_rms_norm"):
        raise ExportError(where, "quantization_config.use_rms_norm is true (an RMSNorm inside every BitLinear)",
                          "the runtime does not implement it: export a model trained without it")
    skipped = [m for m in qc.get("modules_to_not_convert") or [] if m not in ("lm_head", LM_HEAD)]
    if skipped:
        raise ExportError(where, f"quantization_config.modules_to_not_convert lists {skipped[0]!r}",
                          "only lm_head may stay unquantised: every projection must be ternary")
    legacy = "linear_class" not in qc and ("offline_quantization" in qc or "online_quantization" in qc)
    if legacy:
        # Pre-release form (transformers PR #37503): the MS packed repo, autobitlinear semantics.
        mode = "online" if qc.get("online_quantization") else "offline"
        return BitNetQuant(declared=True, linear_class="autobitlinear", mode=mode, legacy=True)
    linear_class = qc.get("linear_class", "bitlinear")
    mode = qc.get("quantization_mode", "offline")
    if linear_class not in ("bitlinear", "autobitlinear"):
        raise ExportError(where, f"quantization_config.linear_class {linear_class!r} is unknown", fix)
    if mode not in ("online", "offline"):
        raise ExportError(where, f"quantization_config.quantization_mode {mode!r} is unknown", fix)
    return BitNetQuant(declared=True, linear_class=linear_class, mode=mode, legacy=False)


def _mtp_config(ckpt: Checkpoint, model: ModelConfig) -> MTPConfig | None:
    if ckpt.bitmtp is None:
        return None
    where = ckpt.bitmtp_path
    fix = 'bitmtp.json needs {"block_size": D, "mask_token_id": id} as the training run wrote them'
    for key in ("block_size", "mask_token_id", "min_prefix"):
        v = ckpt.bitmtp.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ExportError(where, f"{key} must be an integer, got {v!r}", fix)
    tau = ckpt.bitmtp.get("tau")
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float))):
        raise ExportError(where, f"tau must be a number, got {tau!r}", fix)
    try:
        mtp = MTPConfig.from_dict(ckpt.bitmtp)
    except ConfigError as e:
        raise ExportError(where, str(e), fix) from None
    if mtp.adapter_rank or mtp.twin_layers:
        # Refused rather than dropped: an artifact without them would decode the right text with
        # the drafts of a model that was never trained to draft alone.
        what = f"adapter_rank {mtp.adapter_rank}" if mtp.adapter_rank else f"twin_layers {mtp.twin_layers}"
        raise ExportError(where, f"{what}: this checkpoint drafts through mask-row adapters or twins, which "
                          "the artifact format does not carry yet",
                          "evaluate it from the checkpoint (python -m tools.eval_quality / tools.eval_acceptance), "
                          "or export a model trained without --adapter-rank / --twin-layers")
    if mtp.mask_token_id >= model.vocab_size:
        raise ExportError(where, f"mask_token_id {mtp.mask_token_id} is outside the vocabulary "
                          f"(vocab_size {model.vocab_size} in config.json)",
                          "set it to the id of the mask token the model was trained with")
    return mtp
