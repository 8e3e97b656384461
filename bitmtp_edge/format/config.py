"""Model and quantisation configuration: small frozen dataclasses, written to and read
from the artifact manifest (``manifest.json``) and from Hugging Face ``config.json``."""

from __future__ import annotations

import math
from dataclasses import MISSING as _MISSING, asdict, dataclass, fields
from typing import Any, Literal

Family = Literal["bitnet", "qwen3"]
WeightScheme = Literal["per_tensor", "group128"]
ActivationScheme = Literal["int8_per_token", "none"]

FAMILIES = ("bitnet", "qwen3")


class ConfigError(ValueError):
    """A configuration (config.json, bitmtp.json or a manifest section) is unusable."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one ternary decoder-only transformer.

    ``bitnet``: attention and FFN sub-norms, ReLU² GLU, no q/k norm (BitNet b1.58).
    ``qwen3``: per-head q/k RMSNorm before RoPE, SiLU GLU, no sub-norms.
    Both use half-split (rotate_half) RoPE and GQA.
    """

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown model family {self.family!r}; supported: {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def has_sub_norms(self) -> bool:
        return self.family == "bitnet"

    @property
    def has_qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def activation(self) -> str:
        return "relu2" if self.family == "bitnet" else "silu"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return cls(**_known_fields(cls, d, "model config"))


@dataclass(frozen=True)
class QuantConfig:
    """How the projections are quantised.

    ``weights``: ``per_tensor`` absmean ternary (BitNet) or ``group128`` (Bonsai).
    ``activations``: ``int8_per_token`` (W1.58A8) or ``none`` (weight-only, Bonsai).
    """

    weights: WeightScheme = "per_tensor"
    activations: ActivationScheme = "int8_per_token"

    def __post_init__(self) -> None:
        if self.weights not in ("per_tensor", "group128"):
            raise ConfigError(f"unknown weight scheme {self.weights!r}")
        if self.activations not in ("int8_per_token", "none"):
            raise ConfigError(f"unknown activation scheme {self.activations!r}")

    @property
    def quantize_activations(self) -> bool:
        return self.activations == "int8_per_token"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantConfig":
        return cls(**_known_fields(cls, d, "quantization"))


# The decoding defaults a model carries when its bitmtp.json names none: the confidence
# threshold τ and the minimum confident prefix m of the hybrid policy (the paper's setting).
DEFAULT_TAU = 0.9
DEFAULT_MIN_PREFIX = 3
# Draft blocks per fused pass (policy "fused"): measured on the embedded model
# (tools/results/fused_candidates.md): the smallest c whose tokens per forward pass beat
# speculative's by 1.2x.
DEFAULT_CANDIDATES = 3
# The candidate counts a graph backend captures and times at load, so that policy fused picks
# c among them on the device (``runtime/candidates.py``); DEFAULT_CANDIDATES where nothing was
# timed. The two regimes: a step the W2A8 bytes set (a 2B model on a board: c = 1) and one
# launch latency sets (a small model on the H200: c = 3). c = 2 is left out: its width 24 costs
# nearly what c = 3's 32 does (H200 2B 1565 vs 1647 µs, 8 SMs 7170 vs 7802) and hits less, and
# each captured width adds kernel variants and graphs to a cold start (c = 1 beside c = 3 on
# the 2B shape: 2 variants, 4 graphs; tools/results/session18/README.md).
AUTO_CANDIDATES = (1, 3)


@dataclass(frozen=True)
class MTPConfig:
    """The multi-token-prediction head of a BitMTP model (absent for an AR-only model).

    ``confidence_calibration``: optional per-slot (a_j, b_j), one pair per block slot; a greedy
    draft's confidence c of slot j becomes sigmoid(a_j · logit(c) + b_j) (Platt scaling fitted
    on training-split prompts by ``tools.calibrate``: c then estimates the chance that the
    verifier agrees with the draft, or with it and every draft before it, as fitted). None:
    the raw max-softmax, as models without it always had.

    ``adapter_rank``: the rank of the mask-row adapters (``runtime.model.MaskRowAdapter``: a
    low-rank update of every projection and a per-slot input offset, on the draft blocks'
    rows only), 0 without them. ``twin_layers``: instead, how many of the last layers give the
    draft rows full-rank ternary copies of their projections (``runtime.model.MaskRowTwin``);
    ``twin_kv``: the twinned layers' draft rows also read the history through the twins' own
    keys and values (every row's, a second KV buffer at runtime).
    The causal rows never use either, so a runtime that ignored them would still decode the
    AR text, with worse drafts."""

    block_size: int
    mask_token_id: int
    tau: float = DEFAULT_TAU
    min_prefix: int = DEFAULT_MIN_PREFIX
    confidence_calibration: tuple[tuple[float, float], ...] | None = None
    adapter_rank: int = 0
    twin_layers: int = 0
    twin_kv: bool = False

    def __post_init__(self) -> None:
        if self.confidence_calibration is not None:
            object.__setattr__(self, "confidence_calibration", _calibration_pairs(self.confidence_calibration,
                                                                                  int(self.block_size)))
        if not 2 <= int(self.block_size) <= 16:
            raise ConfigError(f"block_size must be in 2..16, got {self.block_size}")
        if int(self.mask_token_id) < 0:
            raise ConfigError(f"mask_token_id must be a token id, got {self.mask_token_id}")
        if not 0.0 < float(self.tau) <= 1.0:
            raise ConfigError(f"tau must be in (0, 1], got {self.tau}")
        if not 1 <= int(self.min_prefix) <= int(self.block_size):
            raise ConfigError(f"min_prefix must be in 1..block_size, got {self.min_prefix}")
        for name in ("adapter_rank", "twin_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a whole number >= 0 (0: none), got {value!r}")
        if self.adapter_rank and self.twin_layers:
            raise ConfigError("adapter_rank and twin_layers are alternatives; a model has one of them at most")
        if not isinstance(self.twin_kv, bool):
            raise ConfigError(f"twin_kv must be true or false, got {self.twin_kv!r}")
        if self.twin_kv and not self.twin_layers:
            raise ConfigError("twin_kv reads the history through twins: it needs twin_layers >= 1")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.confidence_calibration is None:
            del d["confidence_calibration"]  # manifests without it read as before, by any runtime
        else:
            d["confidence_calibration"] = [list(p) for p in self.confidence_calibration]
        for name in ("adapter_rank", "twin_layers", "twin_kv"):
            if not d[name]:
                del d[name]  # likewise for models without mask-row capacity
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MTPConfig":
        return cls(**_known_fields(cls, d, "mtp"))


def _calibration_pairs(value: Any, block_size: int) -> tuple[tuple[float, float], ...]:
    """[[a, b] per slot] -> a tuple of float pairs, checked: one pair per slot, finite, a > 0
    (increasing in c, so a calibration never reorders confidences within a slot)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != block_size:
        raise ConfigError(f"confidence_calibration must hold one [a, b] pair per block slot ({block_size}), "
                          f"got {value!r}")
    pairs = []
    for j, pair in enumerate(value):
        if isinstance(pair, (str, bytes)) or not hasattr(pair, "__len__") or len(pair) != 2 or any(
                isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) for x in pair):
            raise ConfigError(f"confidence_calibration[{j}] must be two finite numbers [a, b], got {pair!r}")
        if pair[0] <= 0:
            raise ConfigError(f"confidence_calibration[{j}]: a = {pair[0]} must be > 0 (an increasing map)")
        pairs.append((float(pair[0]), float(pair[1])))
    return tuple(pairs)


def _known_fields(cls, d: dict[str, Any], what: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ConfigError(f"{what}: expected a JSON object, got {type(d).__name__}")
    names = {f.name for f in fields(cls)}
    kwargs = {k: v for k, v in d.items() if k in names}
    missing = [f.name for f in fields(cls)
               if f.name not in kwargs and f.default is _MISSING and f.default_factory is _MISSING]
    if missing:
        raise ConfigError(f"{what}: missing key(s) {', '.join(missing)}")
    return kwargs

