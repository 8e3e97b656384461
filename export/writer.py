"""``export_checkpoint``: checkpoint folder -> artifact folder (the Python API behind the CLI).

The steps, each able to refuse the input with an ``ExportError`` before anything is
written: check OUT/, open and validate the checkpoint (``checkpoint``), read its configs
(``hf_config``), validate the tensor inventory and convert every tensor (``readers``), pack
the codes (``kernels_ampere.packing``), quantise the int8 draft head, plan the KV segments,
and write everything (``bitmtp_edge.format.manifest.write_artifact_files``) into a temporary
sibling folder that is renamed into place (``out_folder``), so a failure never leaves a
half-written OUT/ and ``--overwrite`` replaces only an artifact.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from bitmtp_edge.format.config import ConfigError, ModelConfig
from bitmtp_edge.format.manifest import Manifest, write_artifact_files
from bitmtp_edge.format.roles import max_width, step_widths
from bitmtp_edge.format.segments import DEVICE_KV_BUDGET_MIB, MIB, KVPlan, min_context, plan_segments
from bitmtp_edge.format.tensors import DRAFT_HEAD_SCALE, DRAFT_HEAD_WEIGHT, PACKED_SUFFIX, SCALE_SUFFIX, head_name
from kernels_ampere.numerics import quantize_rows_int8
from kernels_ampere.packing import pack_ternary

from .checkpoint import Checkpoint, open_checkpoint
from .errors import ExportError
from .hf_config import SourceSpec, read_spec
from .out_folder import Note, check_out, clean_leftovers, staged_folder
from .readers import Dense, Ternary, detect_format, read_tensors, source_tensors

EXPORTER_VERSION = "0.1.0"
DEFAULT_MAX_CONTEXT = 4096
KV_DTYPE = "float16"


@dataclass(frozen=True)
class ExportOptions:
    max_context: int | None = None  # default: min(max_position_embeddings, DEFAULT_MAX_CONTEXT)
    board: str | None = None  # a DEVICE_KV_BUDGET_MIB preset (``--board``)
    kv_budget_mib: float | None = None  # explicit KV budget; exclusive with board
    overwrite: bool = False


class ProgressSink(Protocol):
    """What a UI gets told: ``start`` (tensors to convert), ``advance`` per tensor, then ``phase``."""

    def start(self, total: int) -> None: ...
    def advance(self, name: str) -> None: ...
    def phase(self, what: str) -> None: ...


@dataclass(frozen=True)
class ExportResult:
    out: Path
    manifest: Manifest


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, options: ExportOptions = ExportOptions(),
                      progress: ProgressSink | None = None, note: Note | None = None) -> ExportResult:
    """Export one checkpoint folder into an artifact folder; raises ``ExportError`` on bad input.

    ``note`` hears about leftovers of killed exports found beside OUT/ (default: ignored)."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    note = note or (lambda message: None)
    clean_leftovers(out_dir, note)
    _check_out(ckpt_dir, out_dir, options.overwrite)
    with open_checkpoint(ckpt_dir) as ckpt:
        spec = read_spec(ckpt)
        widths = step_widths(spec.mtp.block_size if spec.mtp else None)
        kv = _kv_plan(spec.model, ckpt, widths, options, spec.mtp.block_size if spec.mtp else None)
        fmt = detect_format(ckpt, spec)
        names = source_tensors(ckpt, spec, fmt)
        if progress is not None:
            progress.start(len(names))
        tensors, dtypes = _convert(ckpt, spec, fmt, names, progress.advance if progress else lambda n: None)
    if progress is not None:
        progress.phase("hashing sources")
    manifest = Manifest(
        model=spec.model, quant=spec.quant, kv=kv, mtp=spec.mtp, widths=widths,
        source=_source_info(ckpt, spec, fmt, dtypes), exporter_version=EXPORTER_VERSION,
    )
    if progress is not None:
        progress.phase("writing")
    check_out(out_dir, options.overwrite)  # again: OUT/ may have appeared during the conversion
    try:
        with staged_folder(out_dir, note, options.overwrite) as tmp:
            manifest = write_artifact_files(tmp, manifest, tensors, ckpt.tokenizer_files())
    except OSError as e:
        raise ExportError(out_dir, f"cannot write the artifact ({e.strerror or e})",
                          "check the disk space and permissions of the destination") from None
    return ExportResult(out=out_dir, manifest=manifest)


def _check_out(ckpt_dir: Path, out_dir: Path, overwrite: bool) -> None:
    check_out(out_dir, overwrite)
    src, dst = ckpt_dir.resolve(), out_dir.resolve()
    if src == dst or src in dst.parents or dst in src.parents:
        raise ExportError(out_dir, f"overlaps the checkpoint folder {ckpt_dir}",
                          "write the artifact to a folder outside the checkpoint")


def _check_min_context(max_context: int, limit: int, block_size: int | None, ckpt: Checkpoint,
                       defaulted: bool) -> None:
    need = min_context(block_size)
    if max_context >= need:
        return
    why = (f"a model with MTP block size D={block_size} needs a 1-token prompt plus the 2*D = {need - 1} slots "
           "every MTP decoding policy keeps free" if block_size is not None else
           "an AR model needs a 1-token prompt plus 1 slot to decode into")
    if defaulted or need > limit:  # no --max-context can help: the checkpoint's own limit is too small
        raise ExportError(ckpt.config_path, f"max_position_embeddings {limit} is below {need}, the least context "
                          f"the runtime can decode in ({why})", "fix the checkpoint's config.json")
    raise ExportError("--max-context", f"{max_context} is below {need}, the least context the runtime can "
                      f"decode in ({why})", f"pass --max-context {need} or more")


def _kv_plan(cfg: ModelConfig, ckpt: Checkpoint, widths: dict[str, list[int]], options: ExportOptions,
             block_size: int | None) -> KVPlan:
    limit = cfg.max_position_embeddings
    max_context = options.max_context if options.max_context is not None else min(limit, DEFAULT_MAX_CONTEXT)
    if max_context > limit:
        raise ExportError("--max-context", f"{max_context} exceeds max_position_embeddings {limit} of "
                          f"{ckpt.config_path}", f"pass --max-context {limit} or less")
    # Checked on the requested value: a KV budget trims only segments above
    # min(SMALLEST_CAPACITY, max_context), so the planned max context is never below it.
    _check_min_context(max_context, limit, block_size, ckpt, options.max_context is None)
    if options.board is not None and options.kv_budget_mib is not None:
        raise ExportError("--kv-budget-mib", "given together with --board", "pass one of them")
    if options.board is not None:
        if options.board not in DEVICE_KV_BUDGET_MIB:
            raise ExportError("--board", f"unknown board {options.board!r}",
                              f"pick one of {', '.join(DEVICE_KV_BUDGET_MIB)}")
        budget, flag = DEVICE_KV_BUDGET_MIB[options.board] * MIB, "--board"
    elif options.kv_budget_mib is not None:
        budget, flag = int(options.kv_budget_mib * MIB), "--kv-budget-mib"
    else:
        budget, flag = None, "--max-context"
    workspace = max_width(widths)  # the widest step writes its rows into the workspace
    try:
        return plan_segments(cfg, max_context, workspace=workspace, dtype=KV_DTYPE, budget_bytes=budget)
    except ConfigError as e:
        problem, _, fix = str(e).rpartition("; ")
        raise ExportError(flag, problem or fix, fix if problem else "choose another value") from None


def _convert(ckpt: Checkpoint, spec: SourceSpec, fmt: str, names: list[str],
             advance: Callable[[str], None]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Artifact tensors (``bitmtp_edge/format/tensors.py`` names) and the stored dtype of every dense tensor."""
    tensors: dict[str, torch.Tensor] = {}
    dtypes: dict[str, str] = {}
    for item in read_tensors(ckpt, spec, fmt, names, advance):
        if isinstance(item, Ternary):
            tensors[item.name + PACKED_SUFFIX] = pack_ternary(item.codes)
            tensors[item.name + SCALE_SUFFIX] = item.scale.float().contiguous()
        else:
            assert isinstance(item, Dense)
            tensors[item.name] = item.tensor
            dtypes[item.name] = str(item.tensor.dtype).removeprefix("torch.")
    head = tensors[head_name(spec.model.tie_word_embeddings)]
    tensors[DRAFT_HEAD_WEIGHT], tensors[DRAFT_HEAD_SCALE] = quantize_rows_int8(head)
    return tensors, dtypes


def _source_info(ckpt: Checkpoint, spec: SourceSpec, fmt: str, dtypes: dict[str, str]) -> dict[str, Any]:
    from bitmtp_edge.format.manifest import sha256_file

    files = {p.name: sha256_file(p) for p in ckpt.source_files()}
    combined = hashlib.sha256("".join(f"{n}\0{h}\n" for n, h in sorted(files.items())).encode()).hexdigest()
    info: dict[str, Any] = {
        # The checkpoint's own folder name: where it lay on the exporting machine is nobody's business.
        "name": ckpt.folder.resolve().name,
        "kind": "bitmtp" if spec.mtp is not None else fmt,
        "weights_format": fmt,
        "architecture": spec.architecture,
        "files": files,
        "sha256": combined,  # over the sorted (file name, sha256) pairs above
        "dense_dtypes": dict(Counter(dtypes.values())),
    }
    if spec.bitnet is not None:
        info["quantization_config"] = ckpt.config.get("quantization_config")
        if fmt in ("bitnet-packed", "bitnet-ternary-float"):
            info["weight_scale"] = spec.bitnet.weight_scale
    if "float32" in info["dense_dtypes"]:
        info["note"] = "the checkpoint stores embeddings/norms in float32; the artifact keeps them in float32"
    if ckpt.bitmtp is not None:
        info["bitmtp"] = ckpt.bitmtp
    return info
