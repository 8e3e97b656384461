"""The model as the fast backends run it: packed weights, fused projections, kernel ops.

Built straight from the artifact's tensors (the codes stay packed). Per layer the fast
path fuses what shares an input: Q/K/V become one ``[Hq·hd + 2·Hkv·hd, K]`` projection and
gate/up one ``[2·I, K]`` projection, each keeping its own per-row scales (a per-tensor
scale is broadcast over its rows, so the fused matrix still multiplies every segment by
its own scale). QK-norm, RoPE and the K/V stores are one launch (``rope_qkv_to_cache``),
the residual adds ride in the projections' epilogues, and gate/up are read as column views
by the fused activation kernels: about ten launches a layer. The residual stream stays
float32: at batch 1 activations are a few KB, and float32 keeps this path's greedy choices
on the reference backend's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels_ampere.numerics import (quantize_activations, quantize_rows_int4, quantize_rows_int8, rope_cos_sin,
                                     rope_inv_freq, unpack_int4_rows)

from ..format.manifest import Manifest
from ..format.tensors import (DRAFT_HEAD_INT8, DRAFT_HEAD_SCALE, DRAFT_HEAD_WEIGHT, EMBED, FINAL_NORM,
                              PACKED_SUFFIX, SCALE_SUFFIX, head_name, layer_prefix)
from .ops import Ops


@dataclass
class Projection:
    packed: torch.Tensor  # [N, K/4] uint8
    scale: torch.Tensor  # [N] float32 per row, or [N, K/128] float32 per group
    # the packed weights of the projection the step runs after this one (the last layer's
    # down: the first layer's QKV, the next step's first): its launch asks the L2 for them
    next_weights: torch.Tensor | None = None


@dataclass
class Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    attn_sub_norm: torch.Tensor | None
    ffn_sub_norm: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def _row_scale(scale: torch.Tensor, rows: int) -> torch.Tensor:
    if scale.dim() == 2:
        return scale.float()
    return scale.float().reshape(-1).expand(rows).clone() if scale.numel() == 1 else scale.float().reshape(rows)


def _fuse(tensors, names: list[str], device) -> Projection:
    packed = [tensors[n + PACKED_SUFFIX] for n in names]
    scales = [_row_scale(tensors[n + SCALE_SUFFIX], p.shape[0]) for n, p in zip(names, packed)]
    return Projection(torch.cat(packed).to(device).contiguous(), torch.cat(scales).to(device).contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


# The verify role's head: the checkpoint's 16-bit one; the int8 one (half the bytes, a different
# argmax at near-ties); or "certified", the 16-bit head's tokens read from the int8 head wherever
# a bound proves them (kernels_ampere/certified_head.py), else from the 16-bit head after all.
HEADS = ("16bit", "int8", "certified")
# The draft role's head: the artifact's int8 head; or int4, quantised here per row from the
# 16-bit head (a quarter of its bytes: on a board a 2B draft step streams 328 MB of int8 head
# beside its 521 MB ternary stack, 164 MB at int4); fp8 on the server path.
DRAFT_HEADS = ("int8", "int4", "fp8")
_INT4_QUANTISE_ROWS = 16384  # rows widened to float32 at a time while the int4 head is built (a 2B head: 8 chunks)


def int4_head_on(head: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_int4`` of a [V, H] head, on ``device``, a block of rows at a time (the
    whole head in float32 would be 1.3 GB for BitNet-2B)."""
    parts = [quantize_rows_int4(head[i:i + _INT4_QUANTISE_ROWS].to(device))
             for i in range(0, head.shape[0], _INT4_QUANTISE_ROWS)]
    return (torch.cat([p for p, _ in parts]).contiguous(),
            torch.cat([s for _, s in parts]).to(dtype=torch.float32).contiguous())


class FastModel:
    def __init__(self, manifest: Manifest, tensors: dict[str, torch.Tensor], ops: Ops, device,
                 head_dtype: torch.dtype | None = None, draft_head: str = "int8", verify_head: str = "16bit"):
        cfg = manifest.model
        self.cfg, self.quant, self.ops, self.device = cfg, manifest.quant, ops, torch.device(device)
        dev = self.device

        def t(name, dtype=torch.float32):
            return tensors[name].to(device=dev, dtype=dtype)

        self.layers: list[Layer] = []
        for i in range(cfg.num_layers):
            p = layer_prefix(i)
            self.layers.append(Layer(
                input_norm=t(p + "input_layernorm.weight"),
                post_norm=t(p + "post_attention_layernorm.weight"),
                qkv=_fuse(tensors, [p + f"self_attn.{x}_proj" for x in "qkv"], dev),
                o=_fuse(tensors, [p + "self_attn.o_proj"], dev),
                gate_up=_fuse(tensors, [p + "mlp.gate_proj", p + "mlp.up_proj"], dev),
                down=_fuse(tensors, [p + "mlp.down_proj"], dev),
                attn_sub_norm=t(p + "self_attn.attn_sub_norm.weight") if cfg.has_sub_norms else None,
                ffn_sub_norm=t(p + "mlp.ffn_sub_norm.weight") if cfg.has_sub_norms else None,
                q_norm=t(p + "self_attn.q_norm.weight") if cfg.has_qk_norm else None,
                k_norm=t(p + "self_attn.k_norm.weight") if cfg.has_qk_norm else None,
            ))
        chain = [proj for layer in self.layers for proj in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        for proj, after in zip(chain, chain[1:] + chain[:1]):
            proj.next_weights = after.packed
        self.final_norm = t(FINAL_NORM)
        self.rope_inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, dev)  # [hd], computed once
        head = tensors[head_name(cfg.tie_word_embeddings)]
        # The verify head keeps the checkpoint's 16-bit type (bf16 stays bf16: exact).
        self.head_dtype = head_dtype or (head.dtype if head.dtype in (torch.float16, torch.bfloat16) else torch.float16)
        # The embedding, float32 for a row gather per token. Tied to a 16-bit head that stays
        # in its own type, it crosses to the device once (656 MB of BitNet-2B) and widens
        # there: the same values as widening on the host, exactly.
        keeps_16bit = verify_head in ("16bit", "certified")
        tied = cfg.tie_word_embeddings and keeps_16bit and head.dtype == self.head_dtype
        self.verify_head = None
        if tied:
            self.verify_head = head.to(device=dev).contiguous()  # [V, H]
            self.embed = self.verify_head.float()  # [V, H]
        else:
            self.embed = t(EMBED)
        if verify_head not in HEADS:
            raise ValueError(f"verify head {verify_head!r}: choose one of {', '.join(HEADS)}")
        if draft_head not in DRAFT_HEADS:
            raise ValueError(f"draft head {draft_head!r}: choose one of {', '.join(DRAFT_HEADS)}")
        self.draft_head = None
        self.draft_head_kind = draft_head
        if draft_head == "fp8":  # the server path: e4m3 rows quantised here from the verify head
            from .fp8_head import quantize_rows_fp8

            self.draft_head = quantize_rows_fp8(self.verify_head if tied else head.to(dev))
        elif draft_head == "int4":
            self.draft_head = int4_head_on(self.verify_head if tied else head, dev)
        elif DRAFT_HEAD_WEIGHT in tensors and manifest.draft_head == DRAFT_HEAD_INT8:
            self.draft_head = (t(DRAFT_HEAD_WEIGHT, torch.int8).contiguous(), t(DRAFT_HEAD_SCALE))
        # The int8 verify head (``verify_head="int8"``): the artifact's int8 draft head (else the
        # 16-bit head quantised per row here, as the exporter does) in every role; the 16-bit
        # head is then not kept on the device at all (656 MB of a 2B model).
        self.int8_head = None
        self.certified_head = None  # (int8 codes, row scales, ||e_v||_2, max|w_v| + s_v, ||q_v||_2): certified
        if keeps_16bit:
            if not tied:
                self.verify_head = head.to(device=dev, dtype=self.head_dtype).contiguous()  # [V, H]
            if verify_head == "certified":  # the artifact's int8 head, else the 16-bit one quantised here
                if self.head_dtype not in (torch.float16, torch.bfloat16):
                    raise ValueError(f"verify head 'certified' answers for a 16-bit head; this one is {self.head_dtype}")
                from kernels_ampere.certified_head import int8_rows

                self._certify_with(self.draft_head if draft_head == "int8" and self.draft_head is not None
                                   else int8_rows(self.verify_head))
        elif draft_head == "int8" and self.draft_head is not None:
            self.int8_head = self.draft_head
        else:
            w, scale = quantize_rows_int8(head.float())
            self.int8_head = (w.to(dev).contiguous(), scale.to(device=dev, dtype=torch.float32))
            if draft_head == "int8":  # no int8 draft head in the artifact: the drafts read this one too
                self.draft_head = self.int8_head

    def _certify_with(self, int8_head: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Keep ``int8_head`` and the per-row constants of the bound (computed here, on the device)."""
        from kernels_ampere.certified_head import head_error_bounds

        self.certified_head = (*int8_head, *head_error_bounds(self.verify_head, *int8_head))
        # [greedy head calls, of them answered by the int8 head alone]: device counters, so a
        # replayed graph counts too (read them with certified_counts; capture's runs count as well)
        self.certified_calls = torch.zeros(2, dtype=torch.int64, device=self.device)

    def certified_counts(self) -> tuple[int, int]:
        """(greedy head calls, certified ones) since load: what share of steps read the int8
        head only. (0, 0) without the certified head. Reads the device (a sync)."""
        if self.certified_head is None:
            return 0, 0
        return tuple(self.certified_calls.tolist())

    @property
    def verify_head_kind(self) -> str:
        """``HEADS``: which head the verify role reads."""
        if self.certified_head is not None:
            return "certified"
        return "16bit" if self.int8_head is None else "int8"

    @contextlib.contextmanager
    def first_layers(self, n: int) -> Iterator[None]:
        """Inside: ``forward`` runs only the first ``n`` layers. The kernel precompile pass
        requests one layer's launches: every layer launches the same kernel variants (the
        same shapes, dtypes, strides and alignments; tests/test_precompile.py checks it), so
        the other layers would only repeat the same requests (29 of every 30 on BitNet-2B)."""
        if n < 1:
            raise ValueError(f"first_layers: n must be >= 1, got {n}")
        layers = self.layers
        self.layers = layers[:n]
        try:
            yield
        finally:
            self.layers = layers

    # -- the step ---------------------------------------------------------------------------
    def forward(self, tokens, positions, k_cache, v_cache, write_slots, mask, history_len, capacity: int,
                attention=None, row_spans=None):
        """tokens, positions, write_slots [M]; k_cache/v_cache [layers, Hkv, S, hd] (views of
        the shared buffer, ``capacity`` history slots then the workspace); mask [M, S] bool, or
        None with row_spans [M, 3] int32 (``masks.spans_to_mask``); history_len [1] int32 ->
        residual stream [M, H] float32 (final norm not applied)."""
        cfg, ops = self.cfg, self.ops
        attention = attention or ops.small_width_attention
        m = tokens.shape[0]
        hq, hd = cfg.num_heads, cfg.head_dim
        # [M, H] float32. On the H200 index_select gathers row after row (7.7 µs for 16 rows, 5.3 for 9)
        # where indexing gathers them at once (1.6 µs); for one row index_select took 2.5 µs, indexing 4.7.
        x = self.embed.index_select(0, tokens) if m == 1 else self.embed[tokens]
        cos, sin = rope_cos_sin(positions, hd, cfg.rope_theta, torch.float32, self.rope_inv_freq)  # [M, hd] each
        for i, layer in enumerate(self.layers):
            qkv = self._project_normed(x, layer.input_norm, layer.qkv)  # [M, (Hq + 2 Hkv) hd] float32
            # QK-norm + RoPE; K and V land at their slots; Q comes back in the KV dtype
            q = ops.rope_qkv_to_cache(qkv, cos, sin, k_cache[i], v_cache[i], write_slots, num_heads=hq,
                                      q_norm=layer.q_norm, k_norm=layer.k_norm, eps=cfg.rms_norm_eps)
            visibility = {} if row_spans is None else {"row_spans": row_spans}
            attn = attention(q, k_cache[i], v_cache[i], mask, history_len, capacity=capacity,
                             **visibility)  # [M, Hq, hd]
            x = self._project_normed(attn.view(m, hq * hd), layer.attn_sub_norm, layer.o, residual=x)
            gu = self._project_normed(x, layer.post_norm, layer.gate_up)  # [M, 2 I]
            gate, up = gu.chunk(2, dim=-1)  # column views: the fused kernels take row strides
            x = self._ffn_down(gate, up, layer, residual=x)
        return x

    def _project_normed(self, x, norm_weight, proj: Projection, residual=None):
        """(optional RMSNorm) -> activation quantisation -> packed projection (+ residual), float32."""
        eps = self.cfg.rms_norm_eps
        if not self.quant.quantize_activations:
            h = rms_norm(x, norm_weight, eps) if norm_weight is not None else x.float()
            y = self.ops.linear_w2a16(h.contiguous(), proj.packed, proj.scale)
            return y if residual is None else residual + y
        if norm_weight is not None:
            a, s = self.ops.rmsnorm_quant(x, norm_weight, eps)
        else:
            a, s = self.ops.act_quant(x)
        return self.ops.linear_w2a8(a, s, proj.packed, proj.scale, residual=residual, next_weights=proj.next_weights)

    def _glu_normed(self, gate, up, layer: Layer):
        """The FFN middle in float (activation × up, then the sub-norm if the family has one)."""
        h = (torch.relu(gate).square() * up) if self.cfg.activation == "relu2" else F.silu(gate) * up
        return rms_norm(h, layer.ffn_sub_norm, self.cfg.rms_norm_eps) if layer.ffn_sub_norm is not None else h

    def _ffn_down(self, gate, up, layer: Layer, residual):
        if not self.quant.quantize_activations:
            y = self.ops.linear_w2a16(self._glu_normed(gate, up, layer).contiguous(), layer.down.packed,
                                      layer.down.scale)
            return residual + y
        if self.cfg.activation == "relu2" and layer.ffn_sub_norm is not None:
            a, s = self.ops.relu2_mul_rmsnorm_quant(gate, up, layer.ffn_sub_norm, self.cfg.rms_norm_eps)
        elif self.cfg.activation == "silu" and layer.ffn_sub_norm is None:
            a, s = self.ops.silu_mul_quant(gate, up)
        else:  # a family/scheme pair without a fused kernel
            a, s = quantize_activations(self._glu_normed(gate, up, layer))
        return self.ops.linear_w2a8(a, s, layer.down.packed, layer.down.scale, residual=residual,
                                    next_weights=layer.down.next_weights)

    # -- heads ----------------------------------------------------------------------------
    def normed(self, x):
        return rms_norm(x, self.final_norm, self.cfg.rms_norm_eps)

    def verify_top1(self, x):
        """[M, H] residual -> (top1 [M] int64, confidence [M] float32) with the 16-bit head (the
        int8 one with ``verify_head="int8"``)."""
        if self.int8_head is not None:
            return self._int8_top1(x, self.int8_head)
        h = self.ops.rmsnorm_cast(x, self.final_norm, self.cfg.rms_norm_eps, self.head_dtype)
        return self.ops.f16_head_argmax(h, self.verify_head)

    def verify_greedy(self, x, drafts=None):
        """[M, H] residual -> (top1 [M] int64, check [M] float32) for the greedy AR and verify
        rows: ``verify_top1``'s tokens. With the certified head they are read from the int8 head
        where its bound proves them (the 16-bit head runs only for a call with a row it does
        not), and ``check`` is then good for a finiteness test only: 1 where the 16-bit head did
        not run (``certified_head.certified_head_argmax``). ``drafts`` [M - 1] (a verify step):
        only the rows up to the first rejection need proving; the tokens after it are then not
        the 16-bit head's, and the accept never reads them."""
        if self.certified_head is None:
            return self.verify_top1(x)
        h = self.ops.rmsnorm_cast(x, self.final_norm, self.cfg.rms_norm_eps, self.head_dtype)
        top, check, certified = self.ops.certified_head_argmax(h, self.verify_head, *self.certified_head,
                                                               drafts=drafts)
        self.certified_calls[0].add_(1)
        self.certified_calls[1].add_(certified[0])
        return top, check

    def fused_head(self, x, n: int, drafts):
        """A fused step's head rows [R, H] (residual) -> (top1, confidence) [R]: ``verify_top1``
        on every row, or with the certified head one int8 pass for all of them — rows ``:n``
        (the verify rows; ``drafts`` [n - 1] their d_1..d_m) the 16-bit head's greedy tokens as
        ``verify_greedy`` gives them, the rest the int8 logits' argmax and confidence (the next
        drafts read an int8 head, as a draft step's do)."""
        if self.certified_head is None:
            return self.verify_top1(x)
        h = self.ops.rmsnorm_cast(x, self.final_norm, self.cfg.rms_norm_eps, self.head_dtype)
        top, conf, certified = self.ops.certified_fused_head(h, self.verify_head, *self.certified_head, n=n,
                                                             drafts=drafts)
        self.certified_calls[0].add_(1)
        self.certified_calls[1].add_(certified[0])
        return top, conf

    def _int8_top1(self, x, head):
        """[M, H] residual -> (top1, confidence) of an int8 head (W8A8, the fused kernel)."""
        a, s = self.ops.rmsnorm_quant(x.contiguous(), self.final_norm, self.cfg.rms_norm_eps)
        return self.ops.int8_head_argmax(a, s, *head)

    def draft_top1(self, x):
        """[M, H] residual -> (top1, confidence) with the draft head (verify head if none)."""
        if self.draft_head is None or not self.ops.specialize_widths:
            return self.verify_top1(x)
        if self.draft_head_kind == "fp8":
            from .fp8_head import fp8_head_argmax

            return fp8_head_argmax(self.normed(x), *self.draft_head, twin=self.ops.twin)
        if self.draft_head_kind == "int4":
            a, s = self.ops.rmsnorm_quant(x.contiguous(), self.final_norm, self.cfg.rms_norm_eps)
            return self.ops.int4_head_argmax(a, s, *self.draft_head)
        return self._int8_top1(x, self.draft_head)

    def verify_sample_logits(self, x):
        """[M, H] residual -> [M, V] float32 logits of the head ``verify_top1`` takes the
        argmax of (same norm, same head), for sampling."""
        if self.int8_head is not None:
            return self._int8_logits(x, self.int8_head)
        h = self.ops.rmsnorm_cast(x, self.final_norm, self.cfg.rms_norm_eps, self.head_dtype)
        return h.float() @ self.verify_head.float().t()

    def _int8_logits(self, x, head):
        """[M, H] residual -> [M, V] float32 logits of an int8 head (W8A8, the int8 product
        accumulated in float32: exact up to 2**24, close beyond)."""
        a, s = self.ops.rmsnorm_quant(x.contiguous(), self.final_norm, self.cfg.rms_norm_eps)
        w, w_scale = head
        return (a.float() @ w.float().t()) * s.float()[:, None] * w_scale[None, :]

    def draft_sample_logits(self, x):
        """[M, H] residual -> [M, V] float32 logits of the head ``draft_top1`` uses, for
        sampling. The int8 product is accumulated in float32 (exact up to 2**24, close
        beyond): any draft distribution q keeps speculative sampling lossless, as long as
        the verify compares against the same q the drafts were drawn from."""
        if self.draft_head is None or not self.ops.specialize_widths:
            return self.verify_sample_logits(x)
        if self.draft_head_kind == "fp8":
            from .fp8_head import fp8_head_logits, fp8_head_logits_reference

            return (fp8_head_logits_reference if self.ops.twin else fp8_head_logits)(self.normed(x), *self.draft_head)
        if self.draft_head_kind == "int4":  # widened per call: sampling keeps no int8 copy of the head
            packed, scale = self.draft_head
            return self._int8_logits(x, (unpack_int4_rows(packed, self.cfg.hidden_size), scale))
        return self._int8_logits(x, self.draft_head)

    def verify_logits(self, x):
        """[M, H] residual -> [M, V] float32 logits (scoring only; decoding never writes them)."""
        if self.int8_head is not None:
            return self._int8_logits(x, self.int8_head)
        return F.linear(self.normed(x).to(self.head_dtype), self.verify_head).float()

