"""The artifact: the contract between ``bitmtp-export`` and the runtime.

An artifact folder holds ``manifest.json``, ``weights.safetensors`` and the tokenizer
files (optionally ``model.onnx``). The manifest records the format version, the model and
quantisation configs, the packing layout, the MTP block (absent for AR-only models), the
draft-head kind, the step widths of every role (``roles.py``), the KV capacity segments
(``segments.py``) and the sha256 of every file. The tensor names are in ``tensors.py``.
Loading verifies every checksum and never unpickles anything (safetensors + JSON).
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

from kernels_ampere.packing import PACKING_LAYOUT

from .config import ConfigError, ModelConfig, MTPConfig, QuantConfig
from .files import MANIFEST, WEIGHTS, ArtifactError  # noqa: F401  (re-exported: the reader's names)
from .roles import max_width, step_widths
from .segments import KVPlan
from .tensors import DRAFT_HEAD_INT8

FORMAT_NAME = "bitmtp-artifact"
FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Manifest:
    model: ModelConfig
    quant: QuantConfig
    kv: KVPlan
    mtp: MTPConfig | None = None
    packing_layout: str = PACKING_LAYOUT
    draft_head: str | None = DRAFT_HEAD_INT8
    widths: dict[str, list[int]] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    exporter_version: str = ""
    format_version: int = FORMAT_VERSION

    @property
    def max_width(self) -> int:
        return max_width(self.widths)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "exporter_version": self.exporter_version,
            "model": self.model.to_dict(),
            "quantization": self.quant.to_dict(),
            "packing_layout": self.packing_layout,
            "mtp": self.mtp.to_dict() if self.mtp else None,
            "draft_head": self.draft_head,
            "widths": self.widths,
            "kv": self.kv.to_dict(),
            "files": self.files,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = MANIFEST) -> "Manifest":
        if not isinstance(d, dict):
            raise ArtifactError(f"{where}: holds a JSON {type(d).__name__}, not the manifest's object; re-export the artifact")
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
            manifest = cls(
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
        except (TypeError, ValueError, AttributeError) as e:  # a section of the wrong JSON type
            raise ArtifactError(f"{where}: malformed ({e}); the file is hand-edited or corrupt, re-export the artifact") from None
        block_size = manifest.mtp.block_size if manifest.mtp else None
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)):
            raise ArtifactError(f"{where}: mtp.block_size must be an integer, got {block_size!r}; re-export the artifact")
        expected = step_widths(block_size)
        if manifest.widths != expected:
            raise ArtifactError(f"{where}: widths {manifest.widths} do not match the MTP block (expected {expected}); "
                                "the file was hand-edited: re-export the artifact")
        return manifest


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The sha256 of a regular file, read no further than its size (never blocks on a FIFO)."""
    from .validate import read_regular

    h = hashlib.sha256()
    read_regular(Path(path), h.update, chunk)
    return h.hexdigest()


def write_artifact_files(folder: Path, manifest: Manifest, tensors: dict[str, torch.Tensor],
                         extra_files: dict[str, Path]) -> Manifest:
    """Write an artifact's files into the empty ``folder``; returns the manifest with their sha256.

    Placing the folder (atomically, replacing only an artifact) is the caller's job:
    ``export.out_folder`` for ``bitmtp-export``."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS),
              metadata={"format": "pt", "producer": "bitmtp-export"})
    for name, src in extra_files.items():
        shutil.copyfile(src, folder / name)
    files = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file()}
    final = Manifest(**{**manifest.__dict__, "files": files})
    (folder / MANIFEST).write_text(json.dumps(final.to_dict(), indent=2) + "\n")
    return final


def write_artifact(out_dir: str | os.PathLike, manifest: Manifest, tensors: dict[str, torch.Tensor],
                   extra_files: dict[str, Path], overwrite: bool = False) -> Path:
    """Write a new artifact folder atomically (a temporary sibling renamed into place)."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_artifact_files(tmp, manifest, tensors, extra_files)
        if out.exists():
            trash = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(trash)
            tmp.rename(out)
            if trash.is_dir() and not trash.is_symlink():
                shutil.rmtree(trash, ignore_errors=True)
            else:
                trash.unlink()
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def rewrite_manifest(folder: Path, manifest: Manifest, added: list[Path]) -> Manifest:
    """Record ``added`` files (written into ``folder`` after the artifact, e.g. the ONNX graphs)
    with their sha256 in ``manifest.json``, atomically (temporary file + ``os.replace``)."""
    files = dict(manifest.files)
    files.update({p.name: sha256_file(p) for p in added})
    updated = Manifest(**{**manifest.__dict__, "files": dict(sorted(files.items()))})
    target = folder / MANIFEST
    tmp = folder / f".{MANIFEST}.tmp-{os.getpid()}"  # same folder: os.replace is an atomic rename
    try:
        tmp.write_text(json.dumps(updated.to_dict(), indent=2) + "\n")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return updated


def read_manifest(path: str | os.PathLike) -> Manifest:
    folder = Path(path)
    mf = folder / MANIFEST
    if not folder.is_dir():
        raise ArtifactError(f"{folder}: no such artifact folder; export one with `bitmtp-export CKPT {folder}`")
    if not mf.is_file():
        raise ArtifactError(f"{mf}: missing; {folder} is not an artifact (export one with bitmtp-export)")
    from .validate import MAX_MANIFEST_BYTES, check_manifest, read_regular

    raw = bytearray()
    read_regular(mf, raw.extend, limit=MAX_MANIFEST_BYTES)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mf}: not valid JSON ({e}); re-export the artifact") from None
    except RecursionError:
        raise ArtifactError(f"{mf}: nested too deeply to be a manifest; re-export the artifact") from None
    manifest = Manifest.from_dict(data, where=str(mf))
    try:
        check_manifest(manifest)
    except ArtifactError as e:  # its messages start "manifest.json: ": say which folder's
        raise ArtifactError(f"{folder}{os.sep}{e}") from None
    return manifest


def verify_files(folder: Path, manifest: Manifest) -> None:
    """Check that every file the manifest lists exists and matches its sha256."""
    from .validate import artifact_file

    for name, digest in manifest.files.items():
        p = artifact_file(folder, name)  # a plain name, a regular file inside the folder
        if sha256_file(p) != digest:
            raise ArtifactError(f"{p}: sha256 mismatch (the file is corrupt or was modified); re-export or re-copy it")
    if WEIGHTS not in manifest.files:
        raise ArtifactError(f"{folder / MANIFEST}: lists no {WEIGHTS}")
    if "tokenizer.json" not in manifest.files:
        raise ArtifactError(f"{folder}: the artifact has no tokenizer.json; re-export from a checkpoint that has one")


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .validate import artifact_file

    p = artifact_file(folder, WEIGHTS)
    try:
        return load_file(str(p))
    except (SafetensorError, OSError, ValueError) as e:
        raise ArtifactError(f"{p}: unreadable safetensors file ({e}); re-export the artifact") from None
