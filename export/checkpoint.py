"""Reading a Hugging Face checkpoint folder: config files, tokenizer and safetensors weights.

A checkpoint is a folder with ``config.json``, ``tokenizer.json`` and either one
``model.safetensors`` or a sharded set listed by ``model.safetensors.index.json``
(``{"weight_map": {tensor: shard file}}``). The same lookup order as transformers: the
single file wins when both exist. Every check that needs no tensor data happens when the
folder is opened, before any conversion work:

* ``config.json`` (and ``bitmtp.json`` / ``generation_config.json`` when present) parse as
  JSON objects;
* every shard the index names exists, is a readable safetensors file, and holds exactly the
  tensors the index maps to it: no key missing, none stored twice;
* ``tokenizer.json`` exists and loads with ``tokenizers``;
* the tokenizer files the artifact will carry are regular files inside the checkpoint: a
  link that leaves it (``chat_template.jinja -> /etc/passwd``) is refused, since the file
  would be copied into an artifact that gets shared. Links into the Hugging Face cache's
  ``blobs/`` folder of the same model (``snapshots/<rev>/x -> ../../blobs/<sha>``) are fine;
* pickle (``*.bin``) weights are refused, never unpickled.

Tensors are then read lazily, one at a time (``safe_open`` memory-maps each shard), so a
multi-GB checkpoint never sits in memory whole.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bitmtp_edge.format.manifest import TOKENIZER_FILES

from .errors import ExportError

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
BITMTP = "bitmtp.json"
GENERATION = "generation_config.json"
TOKENIZER = "tokenizer.json"
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")

# safetensors dtype strings -> torch dtypes the exporter accepts in a checkpoint.
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
UINT8 = "U8"


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string: "F16", "BF16", "F32", "U8", ...
    file: Path


@dataclass
class Checkpoint:
    """An opened checkpoint folder: parsed JSON files and a lazy tensor index."""

    folder: Path
    config: dict[str, Any]
    bitmtp: dict[str, Any] | None
    generation: dict[str, Any] | None
    weight_files: tuple[Path, ...]
    index_file: Path | None
    tensors: dict[str, TensorInfo]
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)

    @property
    def config_path(self) -> Path:
        return self.folder / CONFIG

    @property
    def bitmtp_path(self) -> Path:
        return self.folder / BITMTP

    @property
    def weights_path(self) -> Path:
        """The file that defines the tensor set (the index, or the single weights file)."""
        return self.index_file or self.weight_files[0]

    def tokenizer_files(self) -> dict[str, Path]:
        """The tokenizer / generation files the artifact carries, as found in the folder."""
        return {name: self.folder / name for name in TOKENIZER_FILES if (self.folder / name).is_file()}

    def source_files(self) -> list[Path]:
        """Every file the export reads, for the manifest's source hashes."""
        files = [self.config_path]
        files += [self.folder / n for n in (BITMTP, GENERATION) if (self.folder / n).is_file()]
        if self.index_file is not None:
            files.append(self.index_file)
        files += list(self.weight_files)
        files += [p for n, p in self.tokenizer_files().items() if n != GENERATION]
        return files

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def load(self, name: str) -> torch.Tensor:
        """Read one tensor's data; a read failure names the shard."""
        from safetensors import SafetensorError

        info = self.tensors[name]
        try:
            return self._handle(info.file).get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ExportError(info.file, f"cannot read tensor {name} ({e})",
                              "the file is corrupt or truncated: download it again") from None

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = _safe_open(path)
        return self._handles[path]


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """Open and validate a checkpoint folder (no tensor data is read here)."""
    folder = Path(folder)
    if not folder.exists():
        raise ExportError(folder, "no such checkpoint folder",
                          "pass the folder that holds config.json and the *.safetensors weights")
    if not folder.is_dir():
        raise ExportError(folder, "is a file, not a checkpoint folder",
                          f"pass the folder that holds it (and {CONFIG}) instead")
    config = read_json(folder / CONFIG, required=True,
                       fix="export from a Hugging Face checkpoint folder (save_pretrained writes config.json)")
    bitmtp = read_json(folder / BITMTP, required=False,
                       fix="fix bitmtp.json (it needs at least block_size and mask_token_id) or remove it "
                           "to export an AR-only model")
    generation = read_json(folder / GENERATION, required=False,
                           fix="fix generation_config.json or remove it")
    weight_files, index_file, tensors = _find_weights(folder)
    _check_tokenizer(folder / TOKENIZER)
    for name in TOKENIZER_FILES:
        _check_stays_inside(folder, folder / name)
    return Checkpoint(folder=folder, config=config, bitmtp=bitmtp, generation=generation,
                      weight_files=weight_files, index_file=index_file, tensors=tensors)


def read_json(path: Path, required: bool, fix: str) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ExportError(path, "missing", fix)
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ExportError(path, f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})", fix) from None
    except UnicodeDecodeError:
        raise ExportError(path, "not UTF-8 text", fix) from None
    except _DuplicateKey as e:
        raise ExportError(path, f"key {e.key!r} appears twice", fix) from None
    if not isinstance(data, dict):
        raise ExportError(path, f"expected a JSON object, found {type(data).__name__}", fix)
    return data


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    counts = Counter(k for k, _ in pairs)
    for k, n in counts.items():
        if n > 1:
            raise _DuplicateKey(k)
    return dict(pairs)


def _find_weights(folder: Path) -> tuple[tuple[Path, ...], Path | None, dict[str, TensorInfo]]:
    single, index = folder / SINGLE_FILE, folder / INDEX
    if single.is_file():
        return (single,), None, _read_header(single)
    if index.is_file():
        return _read_index(index)
    pickles = sorted(p.name for pat in PICKLE_PATTERNS for p in folder.glob(pat))
    if pickles:
        raise ExportError(folder / pickles[0],
                          "PyTorch pickle weights only (the exporter never unpickles: loading a pickle "
                          "can run arbitrary code)",
                          "convert the checkpoint to safetensors first, e.g. "
                          "AutoModelForCausalLM.from_pretrained(CKPT).save_pretrained(NEW, safe_serialization=True)")
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    hint = f" (found {', '.join(others[:3])}, which no index lists)" if others else ""
    raise ExportError(folder, f"no {SINGLE_FILE} and no {INDEX}{hint}",
                      "pass a Hugging Face checkpoint folder saved with safetensors")


def _read_index(index: Path) -> tuple[tuple[Path, ...], Path, dict[str, TensorInfo]]:
    fix_index = "re-download the checkpoint or regenerate the index"
    data = read_json(index, required=True, fix=fix_index)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ExportError(index, "has no weight_map (tensor name -> shard file)", fix_index)
    bad = [k for k, v in weight_map.items() if not isinstance(v, str)]
    if bad:
        raise ExportError(index, f"weight_map entry {bad[0]!r} is not a file name", fix_index)
    shard_names = sorted(set(weight_map.values()))
    for name in shard_names:
        p = index.parent / name
        if Path(name).name != name or p.suffix != ".safetensors":
            raise ExportError(index, f"weight_map names {name!r}, which is not a .safetensors file in this folder",
                              fix_index)
        if not p.is_file():
            raise ExportError(p, f"missing (listed in {INDEX})",
                              "download every shard of the checkpoint into the same folder")
    tensors: dict[str, TensorInfo] = {}
    for name in shard_names:
        shard = index.parent / name
        for key, info in _read_header(shard).items():
            if key in tensors:
                raise ExportError(shard, f"tensor {key} is stored twice (also in {tensors[key].file.name})",
                                  "remove the stale shard or re-download the checkpoint")
            if key not in weight_map:
                raise ExportError(shard, f"holds tensor {key}, which {INDEX} does not list", fix_index)
            if weight_map[key] != name:
                raise ExportError(shard, f"holds tensor {key}, which {INDEX} maps to {weight_map[key]}", fix_index)
            tensors[key] = info
    missing = [k for k in weight_map if k not in tensors]
    if missing:
        shard = index.parent / weight_map[missing[0]]
        raise ExportError(shard, f"does not hold tensor {missing[0]} that {INDEX} maps to it"
                          + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""),
                          "the shard is stale or incomplete: download it again")
    return tuple(index.parent / n for n in shard_names), index, tensors


def _safe_open(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ExportError(path, f"not a readable safetensors file ({e})",
                          "the file is truncated or corrupt: download it again") from None


def _read_header(path: Path) -> dict[str, TensorInfo]:
    handle = _safe_open(path)
    out = {}
    for key in handle.keys():
        s = handle.get_slice(key)
        out[key] = TensorInfo(shape=tuple(int(d) for d in s.get_shape()), dtype=str(s.get_dtype()), file=path)
    return out


def _check_stays_inside(folder: Path, path: Path) -> None:
    """Refuse a file that is a link out of the checkpoint, or not a regular file at all."""
    if not path.is_symlink() and not path.exists():
        return
    if path.is_symlink():
        target = path.resolve()
        roots = [folder.resolve()]
        if folder.resolve().parent.name == "snapshots":  # the Hugging Face hub cache layout
            roots.append(folder.resolve().parent.parent / "blobs")
        if not any(target.is_relative_to(r) for r in roots):
            raise ExportError(path, f"is a link to {target}, outside the checkpoint folder (the artifact would "
                              "carry a copy of it)", "replace the link with the file itself")
    if not path.is_file():
        raise ExportError(path, "is not a regular file", "replace it with the file the tokenizer needs")


def _check_tokenizer(path: Path) -> None:
    fix = "copy tokenizer.json (and tokenizer_config.json) from the base model into the checkpoint folder"
    if not path.is_file():
        raise ExportError(path, "missing (the artifact must carry the tokenizer)", fix)
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception subclass for any parse error
        raise ExportError(path, f"not a valid Hugging Face tokenizers file ({e})", fix) from None
