"""Checking an untrusted artifact before anything is allocated from it.

An artifact folder may come from anywhere (a download, a shared disk, a USB stick), so the
loader treats ``manifest.json`` and the safetensors header as hostile input, in this order:

1. ``manifest.json`` is a regular file of at most ``MAX_MANIFEST_BYTES``, holding one JSON
   object (``manifest.read_manifest``);
2. every size, id, width and capacity in it has the right type, lies within the bounds
   below and agrees with the others (``check_manifest``);
3. every file it names is a plain file name that resolves inside the folder to a regular
   file, hashed no further than its size (``artifact_file``, ``read_regular``);
4. every dimension agrees with the tensors' shapes in the safetensors *header*, read
   without loading a tensor (``check_weights_header``): from then on the sizes the runtime
   allocates from are pinned to what the file really holds;
5. after loading, the float tensors are finite (``check_finite``).

Every failure is an ``ArtifactError`` naming the file, the field and what to do.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .files import MANIFEST, WEIGHTS, ArtifactError
from .roles import step_widths
from .segments import DTYPE_BYTES, kv_bytes_per_slot, min_context
from .tensors import (DRAFT_HEAD_INT8, DRAFT_HEAD_KINDS, DRAFT_HEAD_SCALE, DRAFT_HEAD_WEIGHT, EMBED,
                      FINAL_NORM, LM_HEAD, PACKED_SUFFIX, PROJECTIONS, SCALE_SUFFIX, layer_prefix)

if TYPE_CHECKING:  # for annotations only: the manifest reader calls these checks
    from .manifest import Manifest

# Upper bounds. Each is several times the largest released model of its kind, so no real
# artifact meets one; they exist so that an edited number is refused before it becomes an
# allocation (``vocab_size: 8000000`` once cost 16 GB before anything failed).
MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few KiB; 1 MiB leaves room for long source notes
MAX_VOCAB = 1 << 20  # the largest vocabularies in use are ~262k (Gemma 3)
MAX_HIDDEN = 1 << 16  # hidden sizes of the largest dense models are 16-25k
MAX_INTERMEDIATE = 1 << 18  # FFN widths reach ~100k
MAX_LAYERS = 1024  # the deepest released decoders have ~130 layers
MAX_HEADS = 1024  # query heads; the widest models use 128
MAX_HEAD_DIM = 1024  # 64-256 in practice
MAX_CONTEXT = 1 << 20  # 1M tokens: the longest RoPE contexts published
MAX_WORKSPACE = 1024  # the widest step is 2·D ≤ 32 slots (block size ≤ 16)

# safetensors dtype strings the loader accepts for float tensors (the exporter writes 16-bit
# dense tensors and float32 scales; the loader casts, so wider is harmless).
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
SCALE_DTYPES = ("F32", "F64")


def plain_file_name(name: Any, where: str = MANIFEST) -> str:
    """A manifest's file entry must name a file *in* the artifact folder: no separators,
    no ``..``, not absolute, no NUL."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or os.path.isabs(name):
        raise ArtifactError(f"{where}: file entry {name!r} is not a plain file name inside the artifact "
                            "folder; the manifest was edited or is hostile — re-export the artifact")
    return name


def artifact_file(folder: Path, name: str) -> Path:
    """The regular file ``name`` inside ``folder`` (a link may point elsewhere *inside* the
    folder, never out of it); refuses devices, FIFOs, sockets and folders."""
    plain_file_name(name, str(folder / MANIFEST))
    path = folder / name
    try:
        real = path.resolve(strict=True)
        inside = real.is_relative_to(folder.resolve(strict=True))
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        raise ArtifactError(f"{path}: listed in the manifest but missing; copy the whole artifact folder") from None
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise ArtifactError(f"{path}: cannot be resolved ({e}); re-copy the artifact folder") from None
    if not inside:
        raise ArtifactError(f"{path}: is a link to {real}, outside the artifact folder; replace it with "
                            "the file itself (cp -L) or re-export the artifact")
    if not stat.S_ISREG(mode):
        raise ArtifactError(f"{path}: not a regular file; replace it with the artifact's own file")
    return real


def read_regular(path: Path, consume, chunk: int = 1 << 20, limit: int | None = None) -> int:
    """Feed the bytes of the regular file ``path`` to ``consume``, no further than the size
    ``fstat`` reports when it is opened: a special file (a FIFO, a device, ``/proc``) can
    neither block the open nor stream forever. Returns the number of bytes read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise ArtifactError(f"{path}: cannot be opened ({e.strerror}); check its permissions") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{path}: not a regular file; replace it with the artifact's own file")
        if limit is not None and st.st_size > limit:
            raise ArtifactError(f"{path}: {st.st_size} bytes, more than the {limit} this file may have; "
                                "it is not an artifact's file")
        left = st.st_size
        while left > 0:
            block = os.read(fd, min(chunk, left))
            if not block:  # shrank while reading: the checksum comparison reports it
                break
            consume(block)
            left -= len(block)
        return st.st_size - left
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the manifest


def _fail(field: str, problem: str) -> ArtifactError:
    return ArtifactError(f"{MANIFEST}: {field} {problem}; the manifest was edited or is corrupt — "
                         "re-export the artifact")


def _int(value: Any, field: str, lo: int, hi: int, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(field, f"must be an integer, got {value!r} ({type(value).__name__})")
    if not lo <= value <= hi:
        raise _fail(field, f"= {value} is outside {lo}..{hi}{' (' + why + ')' if why else ''}")
    return value


def _real(value: Any, field: str, lo_open: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(field, f"must be a finite number, got {value!r}")
    if not lo_open < value <= hi:
        raise _fail(field, f"= {value} is outside ({lo_open}, {hi}]")
    return float(value)


def check_manifest(m: Manifest) -> None:
    """Types, bounds and cross-checks that need no tensor (see the module docstring)."""
    c = m.model
    vocab = _int(c.vocab_size, "model.vocab_size", 2, MAX_VOCAB)
    _int(c.hidden_size, "model.hidden_size", 1, MAX_HIDDEN)
    _int(c.intermediate_size, "model.intermediate_size", 1, MAX_INTERMEDIATE)
    _int(c.num_layers, "model.num_layers", 1, MAX_LAYERS)
    heads = _int(c.num_heads, "model.num_heads", 1, MAX_HEADS)
    _int(c.num_kv_heads, "model.num_kv_heads", 1, heads, "at most num_heads")
    head_dim = _int(c.head_dim, "model.head_dim", 2, MAX_HEAD_DIM)
    if head_dim % 2:
        raise _fail("model.head_dim", f"= {head_dim} is odd; half-split RoPE needs an even head_dim")
    positions = _int(c.max_position_embeddings, "model.max_position_embeddings", 1, MAX_CONTEXT)
    _real(c.rope_theta, "model.rope_theta", 0.0, 1e12)
    _real(c.rms_norm_eps, "model.rms_norm_eps", 0.0, 1.0)
    if not isinstance(c.tie_word_embeddings, bool):
        raise _fail("model.tie_word_embeddings", f"must be true or false, got {c.tie_word_embeddings!r}")
    if c.bos_token_id is not None:
        _int(c.bos_token_id, "model.bos_token_id", 0, vocab - 1, "a token id")
    for t in c.eos_token_ids:
        _int(t, "model.eos_token_ids", 0, vocab - 1, "token ids")

    if m.mtp is not None:
        _int(m.mtp.block_size, "mtp.block_size", 2, 16)
        _int(m.mtp.mask_token_id, "mtp.mask_token_id", 0, vocab - 1, "a token id")
        _int(m.mtp.min_prefix, "mtp.min_prefix", 1, m.mtp.block_size)
        _real(m.mtp.tau, "mtp.tau", 0.0, 1.0)
        for name in ("adapter_rank", "twin_layers"):  # bitmtp-export refuses such checkpoints: nothing in
            if getattr(m.mtp, name):  # an artifact holds their tensors
                raise _fail(f"mtp.{name}", f"= {getattr(m.mtp, name)}, but artifacts carry no mask-row adapters or twins")
        trained = (m.source.get("bitmtp") or {}).get("block_size") if isinstance(m.source, dict) else None
        if trained is not None and trained != m.mtp.block_size:
            raise _fail("mtp.block_size", f"= {m.mtp.block_size} but the checkpoint was trained with "
                                          f"block_size {trained} (source.bitmtp)")
    expected = step_widths(m.mtp.block_size if m.mtp is not None else None)
    if {k: list(v) for k, v in m.widths.items()} != expected:
        raise _fail("widths", f"= {m.widths} do not match the MTP block (expected {expected})")
    if m.draft_head is not None and m.draft_head not in DRAFT_HEAD_KINDS:
        raise _fail("draft_head", f"= {m.draft_head!r} is unknown (this runtime reads {', '.join(DRAFT_HEAD_KINDS)})")

    kv = m.kv
    if kv.dtype not in DTYPE_BYTES:
        raise _fail("kv.dtype", f"= {kv.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    per_slot = kv_bytes_per_slot(c, kv.dtype)
    if kv.bytes_per_slot != per_slot:
        raise _fail("kv.bytes_per_slot", f"= {kv.bytes_per_slot} but the model needs {per_slot}")
    widest = max((w for ws in expected.values() for w in ws), default=1)
    _int(kv.workspace, "kv.workspace", widest, MAX_WORKSPACE, f"the widest step needs {widest} slots")
    for i, seg in enumerate(kv.segments):
        where = f"kv.segments[{i}]"
        _int(seg.capacity, f"{where}.capacity", 1, positions, "at most model.max_position_embeddings")
        if seg.workspace != kv.workspace:
            raise _fail(f"{where}.workspace", f"= {seg.workspace!r} differs from kv.workspace {kv.workspace}")
        if seg.bytes != (seg.capacity + seg.workspace) * per_slot:
            raise _fail(f"{where}.bytes", f"= {seg.bytes!r} does not match its capacity and workspace")
    if kv.max_context != kv.segments[-1].capacity:
        raise _fail("kv.max_context", f"= {kv.max_context} is not the largest segment's capacity")
    need = min_context(m.mtp.block_size if m.mtp is not None else None)
    if kv.max_context < need:
        raise _fail("kv.max_context", f"= {kv.max_context}, but decoding this model needs at least {need} (a "
                                      "one-token prompt and the slots its steps keep free); re-export with "
                                      f"--max-context {need} or more")

    for name, digest in m.files.items():
        plain_file_name(name)
        if not (isinstance(digest, str) and len(digest) == 64 and all(ch in "0123456789abcdef" for ch in digest)):
            raise _fail(f"files[{name!r}]", "is not a sha256 hex digest")


# ----------------------------------------------------------------------------- the weights header


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``name -> (dtype, shape)`` from the safetensors header, no tensor loaded."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"{path}: unreadable safetensors file ({e}); re-export the artifact") from None


def _packed_width(k: int) -> int:
    """Bytes per packed row for K inputs: whole 128-chunks of 32 bytes (``kernels_ampere.packing``)."""
    return -(-k // 128) * 32


def check_weights_header(m: Manifest, path: Path) -> None:
    """Every dimension of the manifest against the tensors the file really holds."""
    header = read_header(path)
    c = m.model
    expected: set[str] = set()

    def expect(name: str, shape: tuple[int, ...], dtypes: tuple[str, ...], what: str = "") -> None:
        expected.add(name)
        if name not in header:
            raise ArtifactError(f"{path}: tensor {name!r} is missing; the artifact is incomplete, re-export it")
        dtype, got = header[name]
        if got != shape:
            raise ArtifactError(f"{path}: tensor {name!r} has shape {list(got)} but {MANIFEST} implies "
                                f"{list(shape)}{' (' + what + ')' if what else ''}; the manifest and the weights "
                                "disagree — re-export the artifact")
        if dtype not in dtypes:
            raise ArtifactError(f"{path}: tensor {name!r} is {dtype}, expected {' or '.join(dtypes)}; re-export it")

    v, h = c.vocab_size, c.hidden_size
    expect(EMBED, (v, h), FLOAT_DTYPES, "model.vocab_size × model.hidden_size")
    expect(FINAL_NORM, (h,), FLOAT_DTYPES, "model.hidden_size")
    if not c.tie_word_embeddings:
        expect(LM_HEAD, (v, h), FLOAT_DTYPES, "model.vocab_size × model.hidden_size")
    layers = {int(k.split(".")[2]) for k in header if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    if layers != set(range(c.num_layers)):
        raise ArtifactError(f"{path}: holds layers {min(layers, default=0)}..{max(layers, default=-1)} but "
                            f"{MANIFEST} says model.num_layers = {c.num_layers}; re-export the artifact")
    hq, hkv, hd, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim, c.intermediate_size
    shapes = {"self_attn.q_proj": (hq, h), "self_attn.k_proj": (hkv, h), "self_attn.v_proj": (hkv, h),
              "self_attn.o_proj": (h, hq), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    assert set(shapes) == set(PROJECTIONS)
    group = m.quant.weights == "group128"
    for i in range(c.num_layers):
        p = layer_prefix(i)
        expect(p + "input_layernorm.weight", (h,), FLOAT_DTYPES, "model.hidden_size")
        expect(p + "post_attention_layernorm.weight", (h,), FLOAT_DTYPES, "model.hidden_size")
        if c.has_sub_norms:
            expect(p + "self_attn.attn_sub_norm.weight", (hq,), FLOAT_DTYPES, "num_heads × head_dim")
            expect(p + "mlp.ffn_sub_norm.weight", (inter,), FLOAT_DTYPES, "model.intermediate_size")
        if c.has_qk_norm:
            expect(p + "self_attn.q_norm.weight", (hd,), FLOAT_DTYPES, "model.head_dim")
            expect(p + "self_attn.k_norm.weight", (hd,), FLOAT_DTYPES, "model.head_dim")
        for proj, (n, k) in shapes.items():
            expect(p + proj + PACKED_SUFFIX, (n, _packed_width(k)), ("U8",), f"[{n}, {k}] packed 4 codes a byte")
            scale = (n, -(-k // 128)) if group else (1,)
            expect(p + proj + SCALE_SUFFIX, scale, SCALE_DTYPES, "group-128 scales" if group else "one per-tensor scale")
    if m.draft_head == DRAFT_HEAD_INT8:
        expect(DRAFT_HEAD_WEIGHT, (v, h), ("I8",), "model.vocab_size × model.hidden_size")
        expect(DRAFT_HEAD_SCALE, (v,), SCALE_DTYPES, "one scale per vocabulary row")
    unexpected = sorted(set(header) - expected)
    if unexpected:  # e.g. an lm_head.weight while the manifest says the head is tied
        raise ArtifactError(f"{path}: holds tensor(s) {', '.join(map(repr, unexpected[:3]))} that {MANIFEST} "
                            "does not describe; the manifest and the weights disagree — re-export the artifact")


# ----------------------------------------------------------------------------- values and memory


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """Refuse NaN/Inf in any float tensor (norms, scales, embeddings): they would turn every
    logit into NaN and the greedy choice into token 0. One pass over memory already read."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ArtifactError(f"{WEIGHTS}: tensor {name!r} holds {bad} non-finite value(s) (NaN or Inf); "
                                "the weights are corrupt — re-export the artifact from a healthy checkpoint")


def check_kv_fits(m: Manifest, element_bytes: int, device: torch.device) -> None:
    """The largest KV segment (the graph backend allocates it at load, the reference backend
    when a context grows into it) must fit in the memory this device has free."""
    c = m.model
    need = (m.kv.segments[-1].capacity + m.kv.workspace) * c.num_layers * 2 * c.num_kv_heads * c.head_dim \
        * element_bytes
    free = available_memory(device)
    if free is not None and need > free:
        raise ArtifactError(
            f"{MANIFEST}: the largest KV segment ({m.kv.segments[-1].capacity} tokens) needs {need / 2**30:.1f} GiB "
            f"on {device}, more than the {free / 2**30:.1f} GiB free; re-export with a smaller --max-context "
            "or a --board / --kv-budget-mib that fits this machine")


def available_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no psutil reading: do not guess
        return None
