"""``build_onnx``: an artifact's decode step as standard ONNX graphs (opset 17, IR version 8).

What is written next to ``manifest.json`` (and recorded, with its sha256, in the manifest's
``files``):

* ``model.onnx`` — the **verify role** step: prefill, AR and verify (the exact,
  checkpoint-precision LM head);
* ``model_draft.onnx`` — the **draft role** step at the artifact's block size D (MTP
  artifacts only): the same backbone, the int8 W8A8 draft head, and the block's argmax
  tokens and confidences;
* ``model.onnx.data`` — the weights of both graphs (ONNX external data, written once and
  shared: both graphs point into the same file, so the ternary codes are stored once and
  models past protobuf's 2 GB limit still load).

One step, both graphs (batch 1; ``S`` rows this step, ``P`` materialised history rows)::

    input_ids       [1, S]             int64   tokens of this step's rows
    positions       [1, S]             int64   absolute RoPE position of each row
    past_key        [L, Hkv, P, hd]    float32 history K of every layer (P may be 0)
    past_value      [L, Hkv, P, hd]    float32 history V
    attention_mask  [S, P + S]         bool    True = row may attend the slot; slots are
                                               the P history rows, then this step's S rows
    -> verify graph (outputs in this order)
    logits          [S, V]             float32 verify-role logits of every row
    present_key     [L, Hkv, P + S, hd] float32 past_key with this step's rows appended
    present_value   [L, Hkv, P + S, hd] float32
    -> draft graph (outputs in this order)
    draft_tokens    [D]                int64   argmax of the last D rows
    draft_confidences [D]              float32 their confidences, as the runtime's draft step
                                               reports them: the max softmax, through the
                                               artifact's per-slot confidence calibration
                                               (``mtp.confidence_calibration``) when it has one
    draft_logits    [D, V]             float32 the draft head's logits of those rows
    present_key, present_value         as above

The masks are the runtime's own (``bitmtp_edge.runtime.masks`` with capacity = P, workspace = S):
``causal_step_mask`` for prefill / AR / verify (the verifier hides the repeated anchor's
history row by clearing its column), ``draft_step_mask`` for a draft step whose S = k + D
rows are k pending tokens then the block ``[anchor, mask × (D-1)]``. What becomes history:
every row of a prefill / AR step; after a verify ``[anchor, d_1..d_D]`` at positions
P-1..P+D-1, rows P+1..P+a of ``present_*`` (d_1..d_a; row P repeats the anchor's history row);
after a draft step, rows 0..P+k-1 (the k pending tokens).

Numerics, as ``bitmtp_edge.runtime.model`` defines them, in float32: RMSNorm; per-token int8
activations ``round(x * 127 / max|x|)`` clamped to [-128, 127] (ONNX ``Round`` is half to
even, as ``torch.round``); ternary codes as int8 initialisers ``[K, N]``; ``MatMulInteger``
-> int32 (exact), then ``Cast`` and ``Mul`` by the activation and weight scales. Weight-only
artifacts (Bonsai: group-128, no activation quantisation) dequantise ``codes × scale`` in
the graph and use a float ``MatMul``. BitNet sub-norms + ReLU², Qwen3 q/k norm + SiLU,
half-split RoPE and GQA follow ``model.py``. Embeddings and the verify head keep the
artifact's 16-bit (or 32-bit) values and are cast to float32 in the graph.

Not covered: group-128 weights *with* int8 activations (no exporter input produces it;
``build_onnx`` refuses it with ``OnnxExportError``). Not in the graphs at all: KV capacity
segments, history promotion, graph replay and the decoding policies — they stay in the
Python runtime; a caller of these graphs owns its KV and its masks.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bitmtp_edge.format.manifest import (
    MANIFEST,
    WEIGHTS,
    ArtifactError,
    Manifest,
    load_tensors,
    read_manifest,
    rewrite_manifest,
    verify_files,
)
from bitmtp_edge.format.tensors import (
    DRAFT_HEAD_INT8,
    DRAFT_HEAD_KINDS,
    DRAFT_HEAD_SCALE,
    DRAFT_HEAD_WEIGHT,
    EMBED,
    FINAL_NORM,
    PACKED_SUFFIX,
    SCALE_SUFFIX,
    head_name,
    layer_prefix,
)
from kernels_ampere.packing import PACKING_LAYOUT, unpack_ternary

from .errors import ExportError
from .writer import EXPORTER_VERSION

OPSET = 17
IR_VERSION = 8  # the IR opset 17 shipped with, so older runtimes (onnxruntime >= 1.13) load the files
ONNX_FILE = "model.onnx"
DRAFT_SUFFIX = "_draft"
DATA_SUFFIX = ".data"
# What build_onnx writes into an artifact folder (and records in its manifest).
ARTIFACT_ONNX_FILES = (ONNX_FILE, "model" + DRAFT_SUFFIX + ".onnx", ONNX_FILE + DATA_SUFFIX)
# Tensors above this many bytes go to the shared external data file; smaller ones stay inline.
EXTERNAL_MIN_BYTES = 1024
# Offsets in the data file are page-aligned so a runtime may mmap each tensor in place.
DATA_ALIGN = 4096

INPUTS = ("input_ids", "positions", "past_key", "past_value", "attention_mask")
VERIFY_OUTPUTS = ("logits", "present_key", "present_value")
DRAFT_OUTPUTS = ("draft_tokens", "draft_confidences", "draft_logits", "present_key", "present_value")

_DOCS = {
    "input_ids": "[1, S] int64: the step's token ids (prefill chunk, AR token, [anchor, d_1..d_D] to verify, "
                 "or k pending tokens then the draft block [anchor, mask x (D-1)]).",
    "positions": "[1, S] int64: absolute position of each row (RoPE); a repeated anchor keeps its own position.",
    "past_key": "[layers, Hkv, P, head_dim] float32: materialised history K, positions 0..P-1 in order (P may be 0).",
    "past_value": "[layers, Hkv, P, head_dim] float32: materialised history V.",
    "attention_mask": "[S, P+S] bool: True where row i may attend slot j; slots 0..P-1 are history, "
                      "P..P+S-1 this step's rows (bitmtp_edge.runtime.masks with capacity=P, workspace=S).",
    "logits": "[S, V] float32: verify-role logits (exact checkpoint-precision head) of every row.",
    "present_key": "[layers, Hkv, P+S, head_dim] float32: past_key with this step's K rows appended; "
                   "the caller keeps the rows that become history (all for prefill/AR, accepted ones after verify).",
    "present_value": "[layers, Hkv, P+S, head_dim] float32: past_value with this step's V rows appended.",
    "draft_tokens": "[D] int64: argmax token of each draft-block row (the last D rows): d_1..d_D.",
    "draft_confidences": "[D] float32: confidence of each draft-block row, c_1..c_D, as the runtime's draft step "
                         "reports it: the max softmax probability, through the artifact's per-slot confidence "
                         "calibration sigmoid(a_j * logit(c) + b_j) when it has one "
                         "(manifest mtp.confidence_calibration).",
    "draft_logits": "[D, V] float32: logits of the draft head (int8 W8A8; the verify head for an artifact "
                    "without one) for the draft-block rows.",
}


class OnnxExportError(ExportError):
    """The artifact cannot be written as ONNX: ``<file>: <what was wrong>; <what to do>``."""


@dataclass(frozen=True)
class OnnxFiles:
    """The files one ``build_onnx`` call wrote (draft is None for an AR-only artifact)."""

    verify: Path
    draft: Path | None
    data: Path


# --- public API --------------------------------------------------------------------------

def check_onnx_coverage(manifest: Manifest, where: str | os.PathLike = MANIFEST) -> None:
    """Raise ``OnnxExportError`` if the ONNX builder does not cover this artifact."""
    q = manifest.quant
    if manifest.packing_layout != PACKING_LAYOUT:
        raise OnnxExportError(where, f"packing layout {manifest.packing_layout!r} is not the one the ONNX builder "
                              f"reads ({PACKING_LAYOUT})", "re-export the artifact with this bitmtp-export version")
    if q.weights == "group128" and q.quantize_activations:
        raise OnnxExportError(where, "group-128 ternary weights with int8 activations are not covered by the ONNX "
                              "builder (it covers per-tensor W1.58A8 and weight-only group-128/per-tensor)",
                              "run this artifact with the Python runtime (Engine), or export it without --onnx")
    if manifest.draft_head not in (None, *DRAFT_HEAD_KINDS):
        raise OnnxExportError(where, f"draft head {manifest.draft_head!r} is not covered by the ONNX builder "
                              f"({DRAFT_HEAD_INT8} only)", "re-export the artifact with this bitmtp-export version")
    if manifest.model.head_dim % 2:
        raise OnnxExportError(where, f"head_dim {manifest.model.head_dim} is odd (half-split RoPE needs it even)",
                              "check the checkpoint's config.json")


def build_onnx(artifact_dir: str | os.PathLike, out_path: str | os.PathLike | None = None) -> Path:
    """Write the artifact's ONNX graphs; returns the verify graph's path.

    Default ``out_path``: ``<artifact_dir>/model.onnx`` (+ ``model_draft.onnx`` for an MTP
    artifact, + ``model.onnx.data``), recorded with their sha256 in ``manifest.json``
    (rewritten atomically). Another ``out_path`` writes the same three files there
    (``<stem>_draft.onnx``, ``<name>.data``); it leaves the manifest alone unless it lies in
    the artifact folder (then the files are recorded as above).
    Raises ``OnnxExportError`` (an ``ExportError``) for an artifact the builder does not
    cover or cannot read, or files it cannot write (a read-only folder, a full disk). On any
    failure or interrupt no half-written file is left, the manifest lists no ONNX file whose
    bytes changed, and the artifact still loads: either the earlier ONNX files stay as they
    were, or (when the failure came while they were being replaced) none is left.
    """
    return build_onnx_files(artifact_dir, out_path).verify


def build_onnx_files(artifact_dir: str | os.PathLike, out_path: str | os.PathLike | None = None) -> OnnxFiles:
    """``build_onnx``, returning every file it wrote."""
    folder = Path(artifact_dir)
    try:
        import onnx  # noqa: F401  (the optional [onnx] extra)
    except ImportError:
        raise OnnxExportError(folder, "the onnx package is not installed",
                              "pip install 'bitmtp-edge[onnx]'") from None
    try:
        manifest = read_manifest(folder)
        check_onnx_coverage(manifest, folder / MANIFEST)
        # ONNX files of an earlier build are about to be replaced: check everything else.
        verify_files(folder, dataclasses.replace(
            manifest, files={k: v for k, v in manifest.files.items() if k not in ARTIFACT_ONNX_FILES}))
        tensors = load_tensors(folder)
    except ArtifactError as e:  # "<file>: <what was wrong>; <what to do>", re-raised as an ExportError
        where, _, rest = str(e).partition(": ")
        problem, _, fix = rest.rpartition("; ")
        raise OnnxExportError(where, problem or fix, fix if problem else "re-export the artifact") from None
    target = Path(out_path) if out_path is not None else folder / ONNX_FILE
    files = OnnxFiles(verify=target,
                      draft=target.with_name(target.stem + DRAFT_SUFFIX + target.suffix) if manifest.mtp else None,
                      data=target.with_name(target.name + DATA_SUFFIX))
    in_artifact = target.parent.resolve() == folder.resolve()
    staged = {path: _tmp_sibling(path) for path in (files.data, files.verify, files.draft) if path is not None}
    replaced = False
    try:
        files.verify.parent.mkdir(parents=True, exist_ok=True)
        with _DataFile(staged[files.data], files.data.name) as data:
            weights = _Weights(manifest, tensors, data)
            for path, role in ((files.verify, "verify"), (files.draft, "draft")):
                if path is not None:  # one graph in memory at a time; its weights already on disk
                    staged[path].write_bytes(build_step_model(manifest, weights, role).SerializeToString())
        if in_artifact and any(p.name in manifest.files for p in staged):
            # The manifest must never list a file whose bytes are about to change: from here until
            # the final rewrite it lists no ONNX file, so the artifact loads whatever happens.
            manifest = rewrite_manifest(folder, dataclasses.replace(
                manifest, files={k: v for k, v in manifest.files.items() if k not in {p.name for p in staged}}), [])
        for path, tmp in staged.items():  # the data first: a graph never points at missing bytes
            os.replace(tmp, path)
            replaced = True
        if in_artifact:
            rewrite_manifest(folder, manifest, list(staged))
    except BaseException as e:
        if replaced:  # a mix of new and old graphs, or new ones the manifest does not record: keep none
            for path in staged:
                _remove(path)
        if isinstance(e, OSError):
            raise OnnxExportError(target.parent, f"cannot write the ONNX files ({e.strerror or e})",
                                  "make the folder writable or free some space, then run again "
                                  "(the artifact itself is unchanged and still loads)") from None
        raise
    finally:
        for tmp in staged.values():
            _remove(tmp)
    return files


# --- weights -----------------------------------------------------------------------------

class _DataFile:
    """The external data file both graphs share: each large tensor is written once, page-aligned."""

    def __init__(self, path: Path, location: str):
        self.path, self.location = path, location
        self._offsets: dict[str, tuple[int, int]] = {}

    def __enter__(self):
        self._f = open(self.path, "wb")
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def externalise(self, proto):
        """Move ``proto``'s raw bytes into the file (once per name); returns the proto."""
        from onnx import TensorProto
        from onnx.external_data_helper import set_external_data

        if len(proto.raw_data) < EXTERNAL_MIN_BYTES:
            return proto
        if proto.name not in self._offsets:
            self._f.write(b"\0" * (-self._f.tell() % DATA_ALIGN))
            self._offsets[proto.name] = (self._f.tell(), len(proto.raw_data))
            self._f.write(proto.raw_data)
        offset, length = self._offsets[proto.name]
        set_external_data(proto, location=self.location, offset=offset, length=length)
        proto.ClearField("raw_data")
        proto.data_location = TensorProto.EXTERNAL
        return proto


class _Weights:
    """Artifact tensors as ONNX initialisers, made once and shared by both graphs.

    Large tensors go straight to the data file; what is kept here are small protos that
    point into it, so a multi-GB model never sits in memory twice.
    """

    def __init__(self, manifest: Manifest, tensors: dict[str, torch.Tensor], data: _DataFile):
        self.manifest, self.tensors, self.data = manifest, tensors, data
        self._made: dict[str, object] = {}

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise OnnxExportError(WEIGHTS, f"tensor {name!r} is missing", "re-export the artifact")
        return self.tensors[name]

    def _cache(self, name: str, make):
        if name not in self._made:
            self._made[name] = self.data.externalise(make())
        return self._made[name]

    def in_features(self, proj: str) -> int:
        """K of ``proj`` (the packed rows may hold more: zero weights up to whole 128-chunks)."""
        cfg = self.manifest.model
        if proj.endswith("o_proj"):
            return cfg.num_heads * cfg.head_dim
        return cfg.intermediate_size if proj.endswith("down_proj") else cfg.hidden_size

    def codes_t(self, proj: str, padded: bool = False):
        """Ternary codes of ``proj`` as int8 ``[K, N]`` (MatMulInteger's B operand); ``padded``:
        ``[K rounded up to whole 128-chunks, N]``, the padding rows zero (group-128 reshapes)."""
        k = None if padded else self.in_features(proj)
        return self._cache(proj + (".codes_t_padded" if padded else ".codes_t"), lambda: _tensor_proto(
            unpack_ternary(self._get(proj + PACKED_SUFFIX), k).t().contiguous(),
            proj + (".codes_t_padded" if padded else ".codes_t")))

    def scale(self, proj: str):
        """``[1]`` per tensor, or ``[K/128, 1, N]`` group-128 (broadcast over the codes_t groups)."""
        def make():
            s = self._get(proj + SCALE_SUFFIX).float()
            if s.dim() == 2:
                s = s.t().unsqueeze(1).contiguous()
            return _tensor_proto(s, proj + SCALE_SUFFIX)
        return self._cache(proj + SCALE_SUFFIX, make)

    def dense(self, name: str):
        """A norm, the embedding or the LM head, in its stored dtype (cast to float32 in the graph)."""
        return self._cache(name, lambda: _tensor_proto(self._get(name).contiguous(), name))

    def draft_head(self):
        """(int8 ``[H, V]``, float32 row scales ``[V]``)."""
        transposed = DRAFT_HEAD_WEIGHT + "_t"
        return (self._cache(transposed, lambda: _tensor_proto(
                    self._get(DRAFT_HEAD_WEIGHT).t().contiguous(), transposed)),
                self._cache(DRAFT_HEAD_SCALE, lambda: _tensor_proto(
                    self._get(DRAFT_HEAD_SCALE).float(), DRAFT_HEAD_SCALE)))


def _tensor_proto(t: torch.Tensor, name: str):
    from onnx import TensorProto, numpy_helper

    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: store the raw bits
        proto = TensorProto(name=name, data_type=TensorProto.BFLOAT16, dims=list(t.shape))
        proto.raw_data = t.view(torch.int16).numpy().tobytes()
        return proto
    return numpy_helper.from_array(t.numpy(), name)


# --- graph construction ------------------------------------------------------------------

class _Builder:
    """Nodes and initialisers of one graph, with unique value names."""

    def __init__(self):
        self.nodes, self.inits, self._names = [], {}, 0

    def fresh(self, hint: str) -> str:
        self._names += 1
        return f"{hint}_{self._names}"

    def op(self, op_type: str, inputs, hint: str | None = None, outputs: int = 1, **attrs):
        from onnx import helper

        outs = [self.fresh(hint or op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self.fresh("n_" + op_type), **attrs))
        return outs[0] if outputs == 1 else outs

    def init(self, proto) -> str:
        self.inits[proto.name] = proto
        return proto.name

    def const(self, value, dtype, hint: str = "c") -> str:
        from onnx import numpy_helper

        return self.init(numpy_helper.from_array(np.asarray(value, dtype=dtype), self.fresh(hint)))

    def float32(self, name: str) -> str:
        """A float32 view of an initialiser stored in another float dtype."""
        from onnx import TensorProto

        if self.inits[name].data_type == TensorProto.FLOAT:
            return name
        return self.op("Cast", [name], name + ".f32", to=TensorProto.FLOAT)


class _StepGraph:
    """The decode step of ``TernaryLM`` in ONNX operators (see the module docstring)."""

    def __init__(self, manifest: Manifest, weights: _Weights, b: _Builder):
        self.m, self.cfg, self.q, self.w, self.b = manifest, manifest.model, manifest.quant, weights, b

    # -- pieces --------------------------------------------------------------------------
    def rms_norm(self, x: str, weight: str) -> str:
        b = self.b
        ms = b.op("ReduceMean", [b.op("Mul", [x, x])], axes=[-1], keepdims=1)
        inv = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [ms, b.const(self.cfg.rms_norm_eps, np.float32)])])])
        return b.op("Mul", [b.op("Mul", [x, inv]), b.float32(b.init(self.w.dense(weight)))], hint="normed")

    def quantize_activations(self, x: str) -> tuple[str, str]:
        """x [M, K] float32 -> (x_int8 [M, K], dequant scale [M, 1]): per-token absmax."""
        b = self.b
        amax = b.op("ReduceMax", [b.op("Abs", [x])], axes=[-1], keepdims=1)
        q = b.op("Div", [b.const(127.0, np.float32), b.op("Max", [amax, b.const(1e-5, np.float32)])], hint="q")
        rounded = b.op("Round", [b.op("Mul", [x, q])])
        clipped = b.op("Clip", [rounded, b.const(-128.0, np.float32), b.const(127.0, np.float32)])
        from onnx import TensorProto

        return b.op("Cast", [clipped], hint="x_int8", to=TensorProto.INT8), b.op("Reciprocal", [q], hint="a_scale")

    def linear(self, x: str, proj: str) -> str:
        """x [M, K] float32 -> [M, N] float32 through the ternary projection ``proj``."""
        from onnx import TensorProto

        b = self.b
        scale = b.init(self.w.scale(proj))
        group = self.q.weights == "group128"
        if not self.q.quantize_activations:
            # Weight-only (Bonsai): dequantise codes x scale once, then a float MatMul.
            if group:  # whole 128-groups (K padded with zero weights), scaled, then cut back to K
                kp, n = self.w.codes_t(proj, padded=True).dims
                w = b.op("Cast", [b.init(self.w.codes_t(proj, padded=True))], to=TensorProto.FLOAT)
                w = b.op("Reshape", [w, b.const([kp // 128, 128, n], np.int64)])
                w = b.op("Reshape", [b.op("Mul", [w, scale]), b.const([kp, n], np.int64)])
                k = self.w.in_features(proj)
                if k != kp:
                    w = b.op("Slice", [w, b.const([0], np.int64), b.const([k], np.int64), b.const([0], np.int64)])
            else:
                w = b.op("Cast", [b.init(self.w.codes_t(proj))], to=TensorProto.FLOAT)
                w = b.op("Mul", [w, scale])
            return b.op("MatMul", [x, w], hint=proj.rsplit(".", 1)[-1])
        x_int8, a_scale = self.quantize_activations(x)
        acc = b.op("MatMulInteger", [x_int8, b.init(self.w.codes_t(proj))], hint="acc_int32")
        y = b.op("Mul", [b.op("Cast", [acc], to=TensorProto.FLOAT), a_scale])
        return b.op("Mul", [y, scale], hint=proj.rsplit(".", 1)[-1])

    def rope_tables(self, positions: str) -> tuple[str, str]:
        """positions [S] int64 -> cos, sin [S, hd] (half-split convention, float32 as model.py)."""
        from onnx import TensorProto

        b, hd = self.b, self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        pos = b.op("Unsqueeze", [b.op("Cast", [positions], to=TensorProto.FLOAT), b.const([1], np.int64)])
        freqs = b.op("Mul", [pos, b.const(inv_freq.numpy(), np.float32, "inv_freq")])
        emb = b.op("Concat", [freqs, freqs], axis=-1)
        return b.op("Cos", [emb], hint="cos"), b.op("Sin", [emb], hint="sin")

    def apply_rope(self, x: str, cos: str, sin: str) -> str:
        """x [H, S, hd]; cos/sin [S, hd]."""
        b, half = self.b, self.cfg.head_dim // 2
        x1, x2 = b.op("Split", [x, b.const([half, half], np.int64)], outputs=2, axis=-1)
        rotated = b.op("Concat", [b.op("Neg", [x2]), x1], axis=-1)
        return b.op("Add", [b.op("Mul", [x, cos]), b.op("Mul", [rotated, sin])], hint="roped")

    def attention(self, x: str, i: int, cos: str, sin: str, past_k: str, past_v: str, mask: str):
        """x [S, H] -> (attention output [S, H], K rows [Hkv, P+S, hd], V rows)."""
        b, cfg = self.b, self.cfg
        hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pre = layer_prefix(i) + "self_attn."
        q = b.op("Reshape", [self.linear(x, pre + "q_proj"), b.const([-1, hq, hd], np.int64)])
        k = b.op("Reshape", [self.linear(x, pre + "k_proj"), b.const([-1, hkv, hd], np.int64)])
        v = b.op("Reshape", [self.linear(x, pre + "v_proj"), b.const([-1, hkv, hd], np.int64)])
        if cfg.has_qk_norm:
            q, k = self.rms_norm(q, pre + "q_norm.weight"), self.rms_norm(k, pre + "k_norm.weight")
        q = self.apply_rope(b.op("Transpose", [q], perm=[1, 0, 2]), cos, sin)  # [Hq, S, hd]
        k = self.apply_rope(b.op("Transpose", [k], perm=[1, 0, 2]), cos, sin)  # [Hkv, S, hd]
        v = b.op("Transpose", [v], perm=[1, 0, 2])
        layer = b.const(i, np.int64, f"layer{i}")
        k_all = b.op("Concat", [b.op("Gather", [past_k, layer], axis=0), k], axis=1, hint=f"k{i}")  # [Hkv, P+S, hd]
        v_all = b.op("Concat", [b.op("Gather", [past_v, layer], axis=0), v], axis=1, hint=f"v{i}")
        # GQA without copies: query head h = kv * G + g reads KV head kv (repeat_interleave).
        groups = hq // hkv
        q4 = b.op("Reshape", [q, b.const([hkv, groups, -1, hd], np.int64)])  # [Hkv, G, S, hd]
        k4 = b.op("Unsqueeze", [k_all, b.const([1], np.int64)])  # [Hkv, 1, T, hd]
        v4 = b.op("Unsqueeze", [v_all, b.const([1], np.int64)])
        scores = b.op("MatMul", [q4, b.op("Transpose", [k4], perm=[0, 1, 3, 2])])
        scores = b.op("Mul", [scores, b.const(1.0 / float(np.sqrt(hd)), np.float32)], hint="scores")
        scores = b.op("Where", [mask, scores, b.const(-np.inf, np.float32)])
        probs = b.op("Softmax", [scores], axis=-1, hint="attn")
        out = b.op("MatMul", [probs, v4])  # [Hkv, G, S, hd]
        out = b.op("Transpose", [b.op("Reshape", [out, b.const([hq, -1, hd], np.int64)])], perm=[1, 0, 2])
        out = b.op("Reshape", [out, b.const([-1, hq * hd], np.int64)])  # [S, Hq*hd]
        if cfg.has_sub_norms:
            out = self.rms_norm(out, pre + "attn_sub_norm.weight")
        return self.linear(out, pre + "o_proj"), k_all, v_all

    def mlp(self, x: str, i: int) -> str:
        b, pre = self.b, layer_prefix(i) + "mlp."
        gate, up = self.linear(x, pre + "gate_proj"), self.linear(x, pre + "up_proj")
        if self.cfg.activation == "relu2":
            r = b.op("Relu", [gate])
            h = b.op("Mul", [b.op("Mul", [r, r]), up])
        else:
            h = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up])
        if self.cfg.has_sub_norms:
            h = self.rms_norm(h, pre + "ffn_sub_norm.weight")
        return self.linear(h, pre + "down_proj")

    # -- the step ------------------------------------------------------------------------
    def backbone(self) -> str:
        """Inputs -> final-normed hidden [S, H]; also emits present_key / present_value."""
        b = self.b
        axis0 = b.const([0], np.int64)
        ids = b.op("Squeeze", ["input_ids", axis0])
        positions = b.op("Squeeze", ["positions", axis0])
        embed = b.init(self.w.dense(EMBED))
        x = b.op("Gather", [embed, ids], axis=0)
        from onnx import TensorProto

        if self.w.dense(EMBED).data_type != TensorProto.FLOAT:
            x = b.op("Cast", [x], to=TensorProto.FLOAT)
        cos, sin = self.rope_tables(positions)
        ks, vs = [], []
        for i in range(self.cfg.num_layers):
            pre = layer_prefix(i)
            attn, k_all, v_all = self.attention(self.rms_norm(x, pre + "input_layernorm.weight"), i, cos, sin,
                                                "past_key", "past_value", "attention_mask")
            x = b.op("Add", [x, attn], hint=f"resid{i}a")
            x = b.op("Add", [x, self.mlp(self.rms_norm(x, pre + "post_attention_layernorm.weight"), i)],
                     hint=f"resid{i}")
            ks.append(b.op("Unsqueeze", [k_all, axis0]))
            vs.append(b.op("Unsqueeze", [v_all, axis0]))
        hidden = self.rms_norm(x, FINAL_NORM)
        b.nodes.append(_identity(b.op("Concat", ks, axis=0) if len(ks) > 1 else ks[0], "present_key"))
        b.nodes.append(_identity(b.op("Concat", vs, axis=0) if len(vs) > 1 else vs[0], "present_value"))
        return hidden

    def verify_head(self, hidden: str) -> None:
        head = head_name(self.cfg.tie_word_embeddings)
        w = self.b.float32(self.b.init(self.w.dense(head)))
        self.b.nodes.append(_identity(self.b.op("Gemm", [hidden, w], transB=1), "logits"))

    def draft_head(self, hidden: str) -> None:
        """The last D rows through the int8 draft head; argmax and max softmax per row."""
        from onnx import TensorProto

        b, d = self.b, self.m.mtp.block_size
        rows = b.op("Slice", [hidden, b.const([-d], np.int64), b.const([np.iinfo(np.int64).max], np.int64),
                              b.const([0], np.int64)], hint="block_hidden")
        if self.m.draft_head == DRAFT_HEAD_INT8:
            w_int8, row_scale = (b.init(p) for p in self.w.draft_head())
            h_int8, h_scale = self.quantize_activations(rows)
            acc = b.op("MatMulInteger", [h_int8, w_int8], hint="acc_int32")
            logits = b.op("Mul", [b.op("Mul", [b.op("Cast", [acc], to=TensorProto.FLOAT), h_scale]), row_scale])
        else:  # no int8 head in the artifact: the runtime drafts with the verify head
            head = head_name(self.cfg.tie_word_embeddings)
            logits = b.op("Gemm", [rows, b.float32(b.init(self.w.dense(head)))], transB=1)
        probs = b.op("Softmax", [logits], axis=-1)
        b.nodes.append(_identity(logits, "draft_logits"))
        conf = b.op("ReduceMax", [probs], axes=[-1], keepdims=0, hint="max_softmax")
        calibration = self.m.mtp.confidence_calibration
        if calibration is not None:  # as runtime.calibration: slot j -> sigmoid(a_j * logit(c) + b_j)
            ab = np.asarray(calibration, np.float32)  # [D, 2]
            odds = b.op("Div", [conf, b.op("Sub", [b.const(1.0, np.float32), conf])])
            scaled = b.op("Mul", [b.op("Log", [odds], hint="logit"), b.const(ab[:, 0], np.float32, "calib_a")])
            conf = b.op("Sigmoid", [b.op("Add", [scaled, b.const(ab[:, 1], np.float32, "calib_b")])], hint="calibrated")
        b.nodes.append(_identity(conf, "draft_confidences"))
        b.nodes.append(_identity(b.op("ArgMax", [probs], axis=-1, keepdims=0, select_last_index=0), "draft_tokens"))


def _identity(src: str, dst: str):
    from onnx import helper

    return helper.make_node("Identity", [src], [dst], name=f"n_out_{dst}")


def build_step_model(manifest: Manifest, weights: _Weights, role: str):
    """The ``onnx.ModelProto`` of one role (``verify`` or ``draft``) over ``weights``' initialisers."""
    from onnx import TensorProto, helper

    if role not in ("verify", "draft"):
        raise ValueError(f"role must be 'verify' or 'draft', got {role!r}")
    if role == "draft" and manifest.mtp is None:
        raise OnnxExportError(MANIFEST, "the artifact is AR-only (no MTP block), so it has no draft role",
                              "build the verify graph only")
    cfg = manifest.model
    b = _Builder()
    step = _StepGraph(manifest, weights, b)
    hidden = step.backbone()
    if role == "verify":
        step.verify_head(hidden)
    else:
        step.draft_head(hidden)
    kv = [cfg.num_layers, cfg.num_kv_heads]
    shapes = {
        "input_ids": (TensorProto.INT64, [1, "S"]),
        "positions": (TensorProto.INT64, [1, "S"]),
        "past_key": (TensorProto.FLOAT, kv + ["P", cfg.head_dim]),
        "past_value": (TensorProto.FLOAT, kv + ["P", cfg.head_dim]),
        "attention_mask": (TensorProto.BOOL, ["S", "P_plus_S"]),
        "logits": (TensorProto.FLOAT, ["S", cfg.vocab_size]),
        "present_key": (TensorProto.FLOAT, kv + ["P_plus_S", cfg.head_dim]),
        "present_value": (TensorProto.FLOAT, kv + ["P_plus_S", cfg.head_dim]),
    }
    if manifest.mtp is not None:
        d = manifest.mtp.block_size
        shapes.update({"draft_tokens": (TensorProto.INT64, [d]), "draft_confidences": (TensorProto.FLOAT, [d]),
                       "draft_logits": (TensorProto.FLOAT, [d, cfg.vocab_size])})

    def info(name):
        vi = helper.make_tensor_value_info(name, *shapes[name])
        vi.doc_string = _DOCS[name]
        return vi

    outputs = VERIFY_OUTPUTS if role == "verify" else DRAFT_OUTPUTS
    graph = helper.make_graph(b.nodes, f"bitmtp_{role}_step", [info(n) for n in INPUTS], [info(n) for n in outputs],
                              list(b.inits.values()), doc_string=_graph_doc(manifest, role))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="bitmtp-export", producer_version=EXPORTER_VERSION,
                              doc_string=f"BitMTP {role}-role decode step ({cfg.family}, {manifest.quant.weights} "
                                         f"ternary, activations {manifest.quant.activations})")
    meta = {"bitmtp.role": role, "bitmtp.family": cfg.family, "bitmtp.weights": manifest.quant.weights,
            "bitmtp.activations": manifest.quant.activations, "bitmtp.num_layers": str(cfg.num_layers),
            "bitmtp.weights_sha256": manifest.files.get(WEIGHTS, ""), "bitmtp.exporter_version": EXPORTER_VERSION}
    if manifest.mtp is not None:
        meta.update({"bitmtp.block_size": str(manifest.mtp.block_size),
                     "bitmtp.mask_token_id": str(manifest.mtp.mask_token_id)})
    helper.set_model_props(model, meta)
    return model


def _graph_doc(manifest: Manifest, role: str) -> str:
    if role == "verify":
        what = ("Verify-role step (prefill, AR, verify): S rows over P history rows, causal mask from "
                "bitmtp_edge.runtime.masks.causal_step_mask(P, S, P, S) (a verify of [anchor, d_1..d_D] at positions "
                "P-1..P+D-1 adds hidden_slot=P-1: the anchor's history row); logits from the exact verify head.")
    else:
        d = manifest.mtp.block_size
        what = (f"Draft-role step at D={d}: S = k + {d} rows, k pending tokens then the block [anchor, "
                f"mask_token_id={manifest.mtp.mask_token_id} x {d - 1}] (the anchor repeated at its own position), "
                f"mask from bitmtp_edge.runtime.masks.draft_step_mask(P, S, P, k, {d}); outputs the argmax and max softmax "
                "of the last D rows through the int8 W8A8 draft head"
                + (" (the softmax through the artifact's per-slot confidence calibration)"
                   if manifest.mtp.confidence_calibration is not None else "")
                + ". Keep rows 0..P+k-1 of present_* (the history and the k pending rows), not the block's.")
    return (what + " Ternary projections: int8 codes [K, N] and float32 scales, int8 per-token activations "
            "(round(x*127/max|x|), clamp [-128, 127]), MatMulInteger -> int32 -> Cast -> Mul by scales. "
            "KV segments, promotion, graph replay and decoding policies are not in this graph: they stay in "
            "the Python runtime (bitmtp_edge).")


# --- writing -----------------------------------------------------------------------------

def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # not a file of ours (a folder of that name) or not removable: leave it
        pass


def _tmp_sibling(path: Path) -> Path:
    # Same folder, so os.replace is an atomic rename; the pid keeps concurrent writers apart.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


__all__ = ["DRAFT_OUTPUTS", "INPUTS", "ONNX_FILE", "OPSET", "VERIFY_OUTPUTS", "OnnxExportError", "OnnxFiles",
           "build_onnx", "build_onnx_files", "build_step_model", "check_onnx_coverage"]
