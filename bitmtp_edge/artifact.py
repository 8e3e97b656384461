"""The artifact: the contract between ``bitmtp-export`` and the runtime.

An artifact folder holds ``manifest.json``, ``weights.safetensors`` and the tokenizer
files (optionally ``model.onnx``). The manifest records the format version, the model and
quantisation configs, the packing layout, the MTP block (absent for AR-only models), the
widths and roles the runtime specialises, the KV capacity segments and the sha256 of every
file. Loading verifies every checksum and never unpickles anything (safetensors + JSON).

Tensor names in ``weights.safetensors``:

* ``<proj>.packed`` uint8 [N, K/4] (layout ``manifest.packing_layout``) and
  ``<proj>.scale`` float32 ([1] per tensor, [N, K/128] group-128) for every projection
  ``model.layers.{i}.self_attn.{q,k,v,o}_proj`` and ``model.layers.{i}.mlp.{gate,up,down}_proj``;
* norms, ``model.embed_tokens.weight`` and (untied) ``lm_head.weight`` as the checkpoint
  has them (16-bit);
* ``draft_head.int8`` int8 [V, H] and ``draft_head.scale`` float32 [V] (the draft role's head).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernels_ampere.packing import PACKING_LAYOUT, unpack_ternary

from .config import ConfigError, ModelConfig, MTPConfig, QuantConfig
from .segments import KVPlan

FORMAT_NAME = "bitmtp-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
ROLES = ("verify", "draft")


class ArtifactError(RuntimeError):
    """An artifact folder cannot be read: says which file and what to do."""


@dataclass(frozen=True)
class Manifest:
    model: ModelConfig
    quant: QuantConfig
    kv: KVPlan
    mtp: MTPConfig | None = None
    packing_layout: str = PACKING_LAYOUT
    draft_head: str | None = "int8_per_row"
    widths: dict[str, list[int]] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    exporter_version: str = ""
    format_version: int = FORMAT_VERSION

    @staticmethod
    def widths_for(mtp: MTPConfig | None) -> dict[str, list[int]]:
        """Step widths per role: AR/prefill-tail 1 and verify D+1; draft k + D for k in 1..D."""
        if mtp is None:
            return {"verify": [1], "draft": []}
        d = mtp.block_size
        return {"verify": [1, d + 1], "draft": list(range(d + 1, 2 * d + 1))}

    @property
    def max_width(self) -> int:
        return max(w for ws in self.widths.values() for w in ws)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "exporter_version": self.exporter_version,
            "model": self.model.to_dict(),
            "quantization": self.quant.to_dict(),
            "packing_layout": self.packing_layout,
            "mtp": self.mtp.to_dict() if self.mtp else None,
            "roles": list(ROLES),
            "draft_head": self.draft_head,
            "widths": self.widths,
            "kv": self.kv.to_dict(),
            "files": self.files,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = MANIFEST) -> "Manifest":
        if d.get("format") != FORMAT_NAME:
            raise ArtifactError(f"{where}: not a BitMTP artifact manifest (format={d.get('format')!r})")
        version = d.get("format_version")
        if not isinstance(version, int):
            raise ArtifactError(f"{where}: format_version missing or not an integer")
        if version > FORMAT_VERSION:
            raise ArtifactError(
                f"{where}: format version {version} is newer than this runtime understands "
                f"({FORMAT_VERSION}); upgrade bitmtp-edge or re-export with this version"
            )
        try:
            return cls(
                model=ModelConfig.from_dict(d["model"]),
                quant=QuantConfig.from_dict(d["quantization"]),
                kv=KVPlan.from_dict(d["kv"]),
                mtp=MTPConfig.from_dict(d["mtp"]) if d.get("mtp") else None,
                packing_layout=d["packing_layout"],
                draft_head=d.get("draft_head"),
                widths={k: [int(w) for w in v] for k, v in d["widths"].items()},
                files=dict(d["files"]),
                source=dict(d.get("source", {})),
                exporter_version=d.get("exporter_version", ""),
                format_version=version,
            )
        except KeyError as e:
            raise ArtifactError(f"{where}: missing key {e}; the file is incomplete or hand-edited") from None
        except ConfigError as e:
            raise ArtifactError(f"{where}: {e}") from None


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_artifact(out_dir: str | os.PathLike, manifest: Manifest, tensors: dict[str, torch.Tensor],
                   extra_files: dict[str, Path], overwrite: bool = False) -> Path:
    """Write an artifact atomically: a temporary sibling folder, renamed into place at the end."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS),
                  metadata={"format": "pt", "producer": "bitmtp-export"})
        for name, src in extra_files.items():
            shutil.copyfile(src, tmp / name)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        final = Manifest(**{**manifest.__dict__, "files": files})
        (tmp / MANIFEST).write_text(json.dumps(final.to_dict(), indent=2) + "\n")
        if out.exists():
            trash = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(trash)
            tmp.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_manifest(path: str | os.PathLike) -> Manifest:
    folder = Path(path)
    mf = folder / MANIFEST
    if not folder.is_dir():
        raise ArtifactError(f"{folder}: no such artifact folder; export one with `bitmtp-export CKPT {folder}`")
    if not mf.is_file():
        raise ArtifactError(f"{mf}: missing; {folder} is not an artifact (export one with bitmtp-export)")
    try:
        data = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mf}: not valid JSON ({e}); re-export the artifact") from None
    return Manifest.from_dict(data, where=str(mf))


def verify_files(folder: Path, manifest: Manifest) -> None:
    """Check that every file the manifest lists exists and matches its sha256."""
    for name, digest in manifest.files.items():
        p = folder / name
        if not p.is_file():
            raise ArtifactError(f"{p}: listed in the manifest but missing; copy the whole artifact folder")
        if sha256_file(p) != digest:
            raise ArtifactError(f"{p}: sha256 mismatch (the file is corrupt or was modified); re-export or re-copy it")
    if WEIGHTS not in manifest.files:
        raise ArtifactError(f"{folder / MANIFEST}: lists no {WEIGHTS}")
    if "tokenizer.json" not in manifest.files:
        raise ArtifactError(f"{folder}: the artifact has no tokenizer.json; re-export from a checkpoint that has one")


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = folder / WEIGHTS
    try:
        return load_file(str(p))
    except (SafetensorError, OSError, ValueError) as e:
        raise ArtifactError(f"{p}: unreadable safetensors file ({e}); re-export the artifact") from None


def build_model(manifest: Manifest, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str):
    """Instantiate the runtime ``TernaryLM`` from the artifact's tensors (unpacking the codes)."""
    from .model import TernaryLM

    if manifest.packing_layout != PACKING_LAYOUT:
        raise ArtifactError(
            f"packing layout {manifest.packing_layout!r} is not supported by this runtime ({PACKING_LAYOUT}); "
            "re-export the artifact with this version"
        )
    # Cast before loading: load_state_dict copies into the parameters' existing dtype.
    model = TernaryLM(manifest.model, manifest.quant).to(dtype)
    state = {}
    expected = model.state_dict()
    for name, ref in expected.items():
        if name.endswith(".codes"):
            base = name[: -len(".codes")]
            packed = _tensor(tensors, base + ".packed")
            try:  # K padded to whole 128-chunks in the file: checked to be zero weights and cut off
                codes = unpack_ternary(packed, ref.shape[1])
            except ValueError as e:
                raise ArtifactError(f"{WEIGHTS}: {base}.packed: {e}") from None
            if codes.shape != ref.shape:
                raise ArtifactError(f"{WEIGHTS}: {base}.packed unpacks to {tuple(codes.shape)}, expected {tuple(ref.shape)}")
            state[name] = codes
        else:
            t = _tensor(tensors, name)
            if t.shape != ref.shape:
                raise ArtifactError(f"{WEIGHTS}: {name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
            state[name] = t.float() if name.endswith(".scale") else t.to(dtype)
    model.load_state_dict(state)
    if manifest.draft_head == "int8_per_row":
        model.attach_draft_head(_tensor(tensors, "draft_head.int8"), _tensor(tensors, "draft_head.scale"))
    return model.to(device).eval()


def _tensor(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ArtifactError(f"{WEIGHTS}: tensor {name!r} is missing; the artifact is incomplete, re-export it")
    return tensors[name]
