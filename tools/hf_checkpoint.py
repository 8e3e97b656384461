"""Training checkpoints in Hugging Face BitNet layout, plus ``bitmtp.json``.

A checkpoint folder is what ``bitmtp-export`` and ``transformers`` both read:

* ``config.json``: ``BitNetConfig`` fields (``model_type`` bitnet, ``BitNetForCausalLM``,
  ReLU², sub-norms, tied embeddings, ``rope_theta``) and a ``quantization_config``;
* ``model.safetensors``: the ``TernaryLM`` state dict, whose names *are* the HF names;
* the tokenizer files; ``generation_config.json``;
* ``bitmtp.json``: ``{"block_size", "mask_token_id", "tau", "min_prefix", "corpus_sha256"}``
  for a BitMTP model (``adapter_rank`` or ``twin_layers`` too when it has mask-row capacity,
  whose tensors ``…proj.adapter.A`` / ``.B`` or ``…proj.adapter.linear.weight`` (a ternary
  projection like the others) and ``mask_slot_embedding`` sit beside the others); absent for
  an AR-only (SFT) model, which then exports as AR-only.

Two weight forms (docs/artifact.md §Source checkpoints):

* **latent** (``autobitlinear`` + ``online``): float32 master weights; the quantisers are
  applied on the fly. What training resumes from.
* **compact** (``autobitlinear`` + ``offline``): every projection ``…proj.weight`` is the
  ternary code matrix packed HF-style (uint8 ``[N/4, K]``, ``kernels_ampere.packing.pack_hf_bitnet``)
  with ``…proj.weight_scale`` ``[1]`` = mean|W|, a *multiplier*; every float tensor (scales,
  norms, embedding) in bfloat16. About 14 MB for the 27M model: the release form.

Qwen3-layout (Ternary-Bonsai) models fine-tuned with ``tools.train --init`` keep their layout:
``model_type`` qwen3, group-128 ternary projections without activation quantisation. Their
compact form is the ``-unpacked`` release form the exporter reads (bfloat16 projections that
are exactly {-s, 0, +s} in every 128-group); their latent form carries
``"quantization_config": {"quant_method": "bitmtp-latent"}`` so nothing mistakes its float
masters for an exportable checkpoint.

Why bfloat16 throughout: transformers (v5) keeps a quantised checkpoint's stored dtypes, so
one float32 norm or scale beside bfloat16 weights breaks its forward with a dtype mismatch;
and training ran under bf16 autocast, where ``codes * scale`` and every normed activation
were already rounded to bfloat16 before each projection — the rounding the release form keeps.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from bitmtp_edge.format.config import ModelConfig, MTPConfig, QuantConfig
from bitmtp_edge.runtime.model import LatentTernaryLinear, PackedTernaryLinear, TernaryLM
from kernels_ampere.numerics import dequantize_ternary, ternarize_absmean, ternarize_group_absmax
from kernels_ampere.packing import pack_hf_bitnet, unpack_hf_bitnet

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
BITMTP = "bitmtp.json"
TOKENIZER_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
QUANT_ONLINE = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"}
RELEASE_DTYPE = torch.bfloat16
QUANT_OFFLINE = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "offline"}
QWEN3_LATENT = {"quant_method": "bitmtp-latent", "weights": "group128"}


class CheckpointError(RuntimeError):
    """A checkpoint folder cannot be read: names the file and what to do."""


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    model: ModelConfig
    mtp: MTPConfig | None
    corpus_sha256: str | None
    compact: bool

    @property
    def quant(self) -> QuantConfig:
        return quant_config(self.model)


def quant_config(cfg: ModelConfig) -> QuantConfig:
    """BitNet: per-tensor absmean weights + int8 activations; Qwen3 (Bonsai): group-128, weight-only."""
    return QuantConfig() if cfg.family == "bitnet" else QuantConfig(weights="group128", activations="none")


def hf_config(cfg: ModelConfig, compact: bool) -> dict:
    eos = list(cfg.eos_token_ids)
    qwen3 = cfg.family == "qwen3"
    d = {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "BitNetForCausalLM"],
        "model_type": "qwen3" if qwen3 else "bitnet",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu" if qwen3 else "relu2",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "use_cache": True,
        "torch_dtype": "bfloat16" if compact else "float32",
    }
    if qwen3:  # the compact Qwen3 form carries no quantization_config
        if not compact:
            d["quantization_config"] = dict(QWEN3_LATENT)
        return d
    d.update(initializer_range=0.02, pad_token_id=eos[0] if eos else None,
             quantization_config=dict(QUANT_OFFLINE if compact else QUANT_ONLINE))
    return d


def model_config_from_hf(d: dict, where: str) -> ModelConfig:
    try:
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return ModelConfig(
            family=d["model_type"], vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"], num_kv_heads=d["num_key_value_heads"],
            head_dim=d.get("head_dim", d["hidden_size"] // d["num_attention_heads"]),
            rope_theta=float(d.get("rope_theta", 10000.0)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids,
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: missing key {e}; not a BitNet config written by tools.train") from None


def _projection_names(model: TernaryLM) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (LatentTernaryLinear, PackedTernaryLinear))]


def _write_side_files(folder: Path, cfg: ModelConfig, compact: bool, tokenizer_dir: Path | None,
                      mtp: MTPConfig | None, corpus_sha256: str | None) -> None:
    (folder / CONFIG).write_text(json.dumps(hf_config(cfg, compact), indent=2) + "\n")
    eos = list(cfg.eos_token_ids)
    (folder / "generation_config.json").write_text(json.dumps({
        "eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": eos[0] if eos else None,
        "do_sample": False,
    }, indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in TOKENIZER_SIDE_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file() and src.resolve() != (folder / name).resolve():
                shutil.copyfile(src, folder / name)
    if mtp is not None:
        (folder / BITMTP).write_text(json.dumps({**mtp.to_dict(), "corpus_sha256": corpus_sha256}, indent=2) + "\n")
    elif corpus_sha256 is not None:
        # AR-only: no bitmtp.json (the exporter reads its absence as AR-only); keep the data hash.
        (folder / "training_data.json").write_text(json.dumps({"corpus_sha256": corpus_sha256}, indent=2) + "\n")


def _atomic_folder(folder: Path):
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return folder, tmp


def _publish(tmp: Path, folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)


def save_latent(model: TernaryLM, folder: str | Path, tokenizer_dir: Path | None, mtp: MTPConfig | None,
                corpus_sha256: str | None, metadata: dict[str, str] | None = None) -> Path:
    """Float32 master weights (``online``): the form training resumes from. ``metadata``: more
    string pairs for the safetensors header (the trainer stamps its step on OUT/latest)."""
    from safetensors.torch import save_file

    folder, tmp = _atomic_folder(Path(folder))
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / WEIGHTS), metadata={**(metadata or {}), "format": "pt", "producer": "tools.train"})
    _write_side_files(tmp, model.cfg, False, tokenizer_dir, mtp, corpus_sha256)
    _publish(tmp, folder)
    return folder


def compact_state(model: TernaryLM) -> dict[str, torch.Tensor]:
    """The compact tensors of a latent-weight model: packed ``offline`` BitNet, or Qwen3
    group-128 projections as exact {-s, 0, +s} bfloat16 (scales rounded to bfloat16 first)."""
    projections = set(_projection_names(model))
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        base = name.rsplit(".", 1)[0]
        if base in projections and model.cfg.family == "qwen3":
            codes, scale = ternarize_group_absmax(t.detach().float().cpu())
            out[name] = dequantize_ternary(codes, scale.to(RELEASE_DTYPE), RELEASE_DTYPE).contiguous()
        elif base in projections:
            codes, scale = ternarize_absmean(t.detach().float().cpu())
            out[f"{base}.weight"] = pack_hf_bitnet(codes).contiguous()
            out[f"{base}.weight_scale"] = scale.to(RELEASE_DTYPE).reshape(1)
        else:
            out[name] = t.detach().to(RELEASE_DTYPE).cpu().contiguous()
    return out


def recast_compact(src: str | Path, dst: str | Path) -> Path:
    """Copy a compact checkpoint with every float tensor in ``RELEASE_DTYPE`` (codes untouched)."""
    from safetensors.torch import save_file

    ck = read_checkpoint(src)
    if not ck.compact:
        raise CheckpointError(f"{src}: not a compact checkpoint")
    state = {k: (v.to(RELEASE_DTYPE) if v.is_floating_point() else v).contiguous()
             for k, v in _load_state(ck.folder).items()}
    folder, tmp = _atomic_folder(Path(dst))
    save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt", "producer": "tools.pack_checkpoint"})
    _write_side_files(tmp, ck.model, True, ck.folder, ck.mtp, ck.corpus_sha256)
    _publish(tmp, folder)
    return folder


def save_compact(model: TernaryLM, folder: str | Path, tokenizer_dir: Path | None, mtp: MTPConfig | None,
                 corpus_sha256: str | None) -> Path:
    """Packed ternary codes + float32 scales (``offline``): the release form."""
    from safetensors.torch import save_file

    folder, tmp = _atomic_folder(Path(folder))
    save_file(compact_state(model), str(tmp / WEIGHTS), metadata={"format": "pt", "producer": "tools.train"})
    _write_side_files(tmp, model.cfg, True, tokenizer_dir, mtp, corpus_sha256)
    _publish(tmp, folder)
    return folder


def read_checkpoint(folder: str | Path) -> Checkpoint:
    folder = Path(folder)
    cfg_path = folder / CONFIG
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: {'a file' if folder.exists() else 'no such folder'}; give a checkpoint "
                              "folder (tools.train writes OUT/final and OUT/compact)")
    if not cfg_path.is_file():
        if (folder / "manifest.json").is_file():
            raise CheckpointError(f"{folder}: an exported artifact (manifest.json), not a checkpoint; give the "
                                  "checkpoint folder it was exported from (tools.train's OUT/compact)")
        raise CheckpointError(f"{cfg_path}: missing; {folder} is not a checkpoint written by tools.train")
    try:
        d = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    model_type = d.get("model_type") if isinstance(d, dict) else None
    if model_type not in ("bitnet", "qwen3"):
        raise CheckpointError(f"{cfg_path}: model_type {model_type!r}, expected 'bitnet' (or 'qwen3')")
    q = d.get("quantization_config") or {}
    compact = q.get("quantization_mode") == "offline" if d["model_type"] == "bitnet" else not q
    mtp, corpus = None, None
    if (folder / BITMTP).is_file():
        b = json.loads((folder / BITMTP).read_text())
        mtp = MTPConfig.from_dict(b)
        corpus = b.get("corpus_sha256")
    elif (folder / "training_data.json").is_file():
        corpus = json.loads((folder / "training_data.json").read_text()).get("corpus_sha256")
    return Checkpoint(folder, model_config_from_hf(d, str(cfg_path)), mtp, corpus, compact)


def _load_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    p = folder / WEIGHTS
    if not p.is_file():
        raise CheckpointError(f"{p}: missing; the checkpoint is incomplete")
    return load_file(str(p))


def load_latent_model(folder: str | Path) -> tuple[TernaryLM, Checkpoint]:
    """A latent (``online``) checkpoint -> the QAT model (``LatentTernaryLinear``), float32."""
    ck = read_checkpoint(folder)
    if ck.compact:
        raise CheckpointError(f"{ck.folder}: a compact (packed) checkpoint has no latent weights to train on; "
                              "resume from the run's latent checkpoint instead")
    model = TernaryLM(ck.model, ck.quant, linear_cls=LatentTernaryLinear)
    attach_adapters(model, ck)
    model.load_state_dict(_load_state(ck.folder))
    return model, ck


def attach_adapters(model: TernaryLM, ck: Checkpoint) -> None:
    """The checkpoint's mask-row capacity (``bitmtp.json`` ``adapter_rank`` / ``twin_layers`` /
    ``twin_kv``), before its tensors load."""
    if ck.mtp is not None:
        model.attach_mask_rows(ck.mtp.adapter_rank, ck.mtp.twin_layers, ck.mtp.block_size, ck.mtp.twin_kv)


def load_runtime_model(folder: str | Path, dtype: torch.dtype = torch.float64, device="cpu") -> tuple[TernaryLM, Checkpoint]:
    """Either form -> the runtime model (``PackedTernaryLinear``, exact integer semantics)
    with its int8 draft head attached, as an exported artifact would build it."""
    ck = read_checkpoint(folder)
    raw = _load_state(ck.folder)
    model = TernaryLM(ck.model, ck.quant)
    attach_adapters(model, ck)
    model = model.to(dtype)  # int8 codes stay int8
    state = {}
    for name, ref in model.state_dict().items():
        base, _, leaf = name.rpartition(".")
        if ck.quant.weights == "group128" and leaf in ("codes", "scale"):
            codes, scale = ternarize_group_absmax(raw[f"{base}.weight"])
            state[name] = codes if leaf == "codes" else scale
        elif leaf == "codes":
            if ck.compact:
                state[name] = unpack_hf_bitnet(raw[f"{base}.weight"])
            else:
                state[name], _ = ternarize_absmean(raw[f"{base}.weight"])
        elif leaf == "scale":
            state[name] = (raw[f"{base}.weight_scale"] if ck.compact
                           else ternarize_absmean(raw[f"{base}.weight"])[1]).float().reshape(ref.shape)
        else:
            state[name] = raw[name]
    model.load_state_dict(state)
    model.attach_draft_head()  # quantised from the verify head, as the exporter does
    return model.to(device).eval(), ck
