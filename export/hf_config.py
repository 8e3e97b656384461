"""From a checkpoint's JSON files to the artifact's configs.

``config.json`` comes in two transformers dialects and both are read:

* v4: top-level ``rope_theta``, ``rope_scaling`` (null for default RoPE), ``torch_dtype``;
* v5: ``rope_parameters: {"rope_theta": …, "rope_type": "default"}``, ``dtype``.

A key the file leaves out takes the transformers class default of its architecture
(``FAMILY_DEFAULTS``), as ``from_pretrained`` would. BitNet's ``quantization_config``
decides what a stored ``weight_scale`` means (formats.md §1.4, pitfall #1):
``linear_class: "autobitlinear"`` multiplies, ``"bitlinear"`` (the default when the key is
absent) divides, and the pre-release ``{"offline_quantization": true}`` reads as
autobitlinear (multiplies). ``bitmtp.json`` carries the MTP block (``MTPConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from bitmtp_edge.config import ConfigError, ModelConfig, MTPConfig, QuantConfig

from .checkpoint import Checkpoint
from .errors import ExportError

ARCHITECTURES = {"BitNetForCausalLM": "bitnet", "Qwen3ForCausalLM": "qwen3"}
MODEL_TYPES = {"bitnet": "BitNetForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class FamilyDefaults:
    """transformers' class defaults (BitNetConfig / Qwen3Config, v5.2x) for omitted keys."""

    hidden_act: str
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    head_dim: int | None  # None: hidden_size // num_attention_heads


FAMILY_DEFAULTS = {
    "bitnet": FamilyDefaults("relu2", 500000.0, 1e-5, 2048, None),
    "qwen3": FamilyDefaults("silu", 10000.0, 1e-6, 32768, 128),
}


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
    d = FAMILY_DEFAULTS[family]
    fix = "config.json does not describe a complete model: re-save it with transformers"

    def integer(key: str, default: int | None = None) -> int:
        v = cfg.get(key)
        v = default if v is None else v  # transformers reads an explicit null as "use the default"
        if v is None:
            raise ExportError(where, f"missing {key!r}", fix)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ExportError(where, f"{key!r} must be a positive integer, got {v!r}", fix)
        return v

    def number(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ExportError(where, f"{key!r} must be a positive number, got {value!r}", fix)
        return float(value)

    hidden, heads = integer("hidden_size"), integer("num_attention_heads")
    kv_heads = integer("num_key_value_heads", heads)
    head_dim = integer("head_dim", d.head_dim if d.head_dim is not None else hidden // heads)
    act = cfg.get("hidden_act", d.hidden_act)
    if act != d.hidden_act:
        raise ExportError(where, f"hidden_act {act!r} but {family} models use {d.hidden_act!r}",
                          "this runtime implements only the stock activation of each architecture")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ExportError(where, f"{key} is true (the runtime's projections have no bias)",
                              "export a checkpoint without biases")
    if cfg.get("use_sliding_window"):
        raise ExportError(where, "use_sliding_window is true (the runtime implements full attention only)",
                          "set use_sliding_window to false if the model was trained without it")
    theta = number("rope_theta", _rope_theta(cfg, where, d.rope_theta))
    eos = _token_ids(cfg.get("eos_token_id"), where, "eos_token_id")
    bos = _token_ids(cfg.get("bos_token_id"), where, "bos_token_id")
    if ckpt.generation is not None:
        gpath = ckpt.folder / "generation_config.json"
        eos += [t for t in _token_ids(ckpt.generation.get("eos_token_id"), gpath, "eos_token_id") if t not in eos]
        bos = bos or _token_ids(ckpt.generation.get("bos_token_id"), gpath, "bos_token_id")
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ExportError(where, f"tie_word_embeddings must be true or false, got {tie!r}", fix)
    try:
        model = ModelConfig(
            family=family,
            vocab_size=integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size"),
            num_layers=integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=number("rms_norm_eps", cfg.get("rms_norm_eps", d.rms_norm_eps)),
            max_position_embeddings=integer("max_position_embeddings", d.max_position_embeddings),
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


def _rope_theta(cfg: dict[str, Any], where, default: float) -> Any:
    unsupported = "the runtime implements default RoPE only: export a model trained without RoPE scaling"
    scaling = cfg.get("rope_scaling")  # v4 dialect
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ExportError(where, f"rope_scaling {scaling!r} is not supported", unsupported)
    params = cfg.get("rope_parameters")  # v5 dialect
    if params is not None and not isinstance(params, dict):
        raise ExportError(where, f"rope_parameters must be an object, got {params!r}",
                          "re-save the config with transformers")
    if isinstance(params, dict) and params.get("rope_type", "default") != "default":
        raise ExportError(where, f"rope_parameters.rope_type {params.get('rope_type')!r} is not supported",
                          unsupported)
    if cfg.get("rope_theta") is not None:
        return cfg["rope_theta"]
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return params["rope_theta"]
    return default


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
    skipped = [m for m in qc.get("modules_to_not_convert") or [] if m not in ("lm_head", "lm_head.weight")]
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
    if mtp.mask_token_id >= model.vocab_size:
        raise ExportError(where, f"mask_token_id {mtp.mask_token_id} is outside the vocabulary "
                          f"(vocab_size {model.vocab_size} in config.json)",
                          "set it to the id of the mask token the model was trained with")
    return mtp
