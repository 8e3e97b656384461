"""The ternary transformer, defined once.

One module tree serves every use: prefill, AR, draft and verify steps at the runtime (any
width M, with a KV buffer and a boolean visibility mask over it) and full-sequence
training (no KV buffer, a [S, S] block mask). Module and parameter names follow Hugging
Face's ``BitNetForCausalLM`` / ``Qwen3ForCausalLM`` so a training checkpoint's
``state_dict`` *is* an HF checkpoint.

The projections are pluggable (``linear_cls``):

* ``PackedTernaryLinear`` (runtime): int8 codes + float32 scales, exact integer semantics:
  ``y = (x_int8 @ codesᵀ) · a_scale · w_scale`` with int8 per-token activations, or
  ``y = x @ (codes · scale)ᵀ`` for weight-only artifacts;
* ``LatentTernaryLinear`` (training): latent float weights with the straight-through
  quantisers below (the numerics of ``kernels_ampere/numerics.py``) — the same numbers in the forward pass.

Mask-row capacity (optional): low-rank 16-bit updates of every projection
(``attach_mask_adapters``) or full-rank ternary copies of the last layers' projections
(``attach_mask_twins``), plus a per-slot input offset, used only by the rows of draft blocks
(the rows from ``adapter_from`` on in a call: a step's blocks always follow its causal rows).
The causal rows, hence prefill, AR and verify steps, are the base model bit for bit. Twins may
also give the draft rows their own keys and values of the history (``read_history``).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels_ampere.numerics import (
    apply_rope,
    dequantize_ternary,
    int_matmul,
    quantize_activations,
    quantize_rows_int4,
    quantize_rows_int8,
    rope_cos_sin,
    ternarize_absmean,
    ternarize_group_absmax,
    unpack_int4_rows,
)

from ..format.config import ModelConfig, QuantConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As Llama/BitNet/Qwen3 in transformers: normalise in float32, cast, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class PackedTernaryLinear(nn.Module):
    """Runtime projection: ternary codes [N, K] int8 with scale [1] | [N] | [N, K/128]."""

    def __init__(self, in_features: int, out_features: int, quant: QuantConfig):
        super().__init__()
        self.in_features, self.out_features, self.quant = in_features, out_features, quant
        self.register_buffer("codes", torch.zeros(out_features, in_features, dtype=torch.int8))
        n_scale = (out_features, -(-in_features // 128)) if quant.weights == "group128" else (1,)
        self.register_buffer("scale", torch.ones(n_scale, dtype=torch.float32))
        self.adapter: MaskRowAdapter | MaskRowTwin | None = None  # the draft rows' own capacity

    def forward(self, x: torch.Tensor, adapter_from: int | None = None) -> torch.Tensor:
        return project_rows(self, x, adapter_from)

    def adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the adapter multiplies: the input on the int8 grid the projection uses, dequantised."""
        if not self.quant.quantize_activations:
            return x
        x_int, a_scale = quantize_activations(x)
        return (x_int.double() * a_scale.double().unsqueeze(-1)).to(x.dtype)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if not self.quant.quantize_activations:
            w = dequantize_ternary(self.codes, self.scale, torch.float64)
            return (x2.double() @ w.t()).to(x.dtype).reshape(*shape[:-1], self.out_features)
        x_int, a_scale = quantize_activations(x2)  # [M, K] int8, [M] float32
        if self.scale.dim() == 2:
            w = dequantize_ternary(self.codes, self.scale, torch.float64)
            y = (x_int.double() @ w.t()) * a_scale.double().unsqueeze(1)
        else:
            acc = int_matmul(x_int, self.codes)  # [M, N] int32, exact
            w_scale = self.scale.double()
            y = acc.double() * a_scale.double().unsqueeze(1) * (w_scale.unsqueeze(0) if w_scale.numel() > 1 else w_scale)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


# --- straight-through quantisers for quantisation-aware training ----------------------------

def _ste(value: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    return value + (quantized - value).detach()


def ternary_absmean_ste(w: torch.Tensor) -> torch.Tensor:
    """Fake-quantised per-tensor ternary weight with a straight-through gradient."""
    codes, scale = ternarize_absmean(w.detach())
    return _ste(w, (codes.float() * scale).to(w.dtype))


def ternary_group_absmax_ste(w: torch.Tensor) -> torch.Tensor:
    """Fake-quantised group-128 (absmax) ternary weight with a straight-through gradient."""
    codes, scale = ternarize_group_absmax(w.detach())
    return _ste(w, dequantize_ternary(codes, scale, torch.float32).to(w.dtype))


def activations_int8_ste(x: torch.Tensor) -> torch.Tensor:
    """Fake-quantised per-token int8 activations with a straight-through gradient."""
    x_int, dq = quantize_activations(x.detach())
    return _ste(x, (x_int.float() * dq.unsqueeze(-1)).to(x.dtype))


class LatentTernaryLinear(nn.Module):
    """Training projection: latent weight, straight-through ternary (per-tensor absmean or
    group-128 absmax) + int8 fake quantisation of the activations when the scheme has it."""

    def __init__(self, in_features: int, out_features: int, quant: QuantConfig):
        super().__init__()
        self.in_features, self.out_features, self.quant = in_features, out_features, quant
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.normal_(self.weight, std=0.02)
        self.adapter: MaskRowAdapter | MaskRowTwin | None = None  # the draft rows' own capacity

    def forward(self, x: torch.Tensor, adapter_from: int | None = None) -> torch.Tensor:
        return project_rows(self, x, adapter_from)

    def adapter_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input on the int8 grid (straight-through), as ``PackedTernaryLinear.adapter_input``."""
        return activations_int8_ste(x) if self.quant.quantize_activations else x

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant.weights == "group128" or not self.quant.quantize_activations:
            if self.quant.quantize_activations:
                x = activations_int8_ste(x)
            w = ternary_group_absmax_ste(self.weight) if self.quant.weights == "group128" else ternary_absmean_ste(self.weight)
            return F.linear(x, w)
        # W1.58A8 as the runtime computes it: the product of the integer grids (exact in float64,
        # and in the float32 accumulators of a bf16 GEMM: |sum| <= 127 * K < 2**24), then the two
        # scales in the runtime's order. The straight-through terms (t - t.detach()) are exactly
        # zero in value, so in float64 this forward is bit-identical to PackedTernaryLinear.
        x_int, a_scale = quantize_activations(x.detach())
        codes, w_scale = ternarize_absmean(self.weight.detach())
        xs = x / a_scale.unsqueeze(-1).to(x.dtype)
        ws = self.weight / w_scale.to(self.weight.dtype)
        acc = F.linear(x_int.to(x.dtype) + (xs - xs.detach()), codes.to(ws.dtype) + (ws - ws.detach()))
        return acc * a_scale.unsqueeze(-1) * w_scale


class MaskRowAdapter(nn.Module):
    """A low-rank update ``B · A`` of one ternary projection for the draft blocks' rows (the
    gated LoRA of arXiv 2507.11851). Capacity the clean stream never uses: drafting needs more
    than a 27M-parameter backbone spares without costing next-token quality, and a gate by row
    leaves the verifier untouched. ``B`` starts at zero, so a fresh adapter changes nothing."""

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.normal_(self.A, std=in_features ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A.to(x.dtype)), self.B.to(x.dtype))


class MaskRowTwin(nn.Module):
    """A full-rank ternary copy of one projection that the draft blocks' rows use instead of it
    (``linear``: the same class as the projection, initialised from it): the draft rows' own
    weights, at the ternary price of two bits each, where an adapter buys low rank in 16 bits.

    ``reads_history`` (on a layer's key and value twins): the draft rows also read the history
    through this copy — every row's keys and values computed by the twins, not the verifier's —
    which at runtime means a second KV buffer for the twinned layers."""

    def __init__(self, projection: nn.Module, reads_history: bool = False):
        super().__init__()
        self.linear = copy.deepcopy(projection)
        self.linear.adapter = None
        self.reads_history = reads_history

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def project_rows(linear: nn.Module, x: torch.Tensor, adapter_from: int | None) -> torch.Tensor:
    """``linear._project(x)`` (x [..., S, K]) with rows ``adapter_from..`` (the draft blocks')
    updated by the projection's adapter, or computed by its twin instead (the base projection
    then runs on the causal rows alone); the causal rows keep the base model's bits."""
    if linear.adapter is None or adapter_from is None or adapter_from >= x.shape[-2]:
        return linear._project(x)
    rows = x[..., adapter_from:, :]
    if isinstance(linear.adapter, MaskRowTwin):
        causal = linear._project(x[..., :adapter_from, :])
        return torch.cat([causal, linear.adapter(rows).to(causal.dtype)], dim=-2)
    y = linear._project(x)
    block = y[..., adapter_from:, :] + linear.adapter(linear.adapter_input(rows)).to(y.dtype)
    return torch.cat([y[..., :adapter_from, :], block], dim=-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantConfig, linear_cls):
        super().__init__()
        self.cfg = cfg
        h, hq, hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = linear_cls(h, hq * hd, quant)
        self.k_proj = linear_cls(h, hkv * hd, quant)
        self.v_proj = linear_cls(h, hkv * hd, quant)
        self.o_proj = linear_cls(hq * hd, h, quant)
        if cfg.has_qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        if cfg.has_sub_norms:
            self.attn_sub_norm = RMSNorm(hq * hd, cfg.rms_norm_eps)

    @property
    def twin_reads_history(self) -> bool:
        """Whether this layer's draft rows read every row's keys and values through their twins
        (``TernaryLM.attach_mask_twins(..., read_history=True)``), not the base model's."""
        return isinstance(self.k_proj.adapter, MaskRowTwin) and self.k_proj.adapter.reads_history

    def forward(self, x, cos, sin, attn_mask, kv_layer=None, write_slots=None, adapter_from=None):
        """x [B, S, H]; attn_mask [B, S, S_kv] bool (True = may attend).

        Without ``kv_layer`` the keys are this call's own tokens (training, S_kv = S).
        With ``kv_layer = (k_buf, v_buf)`` ([Hkv, S_buf, hd] each, B = 1) the new K/V rows are
        written at ``write_slots`` [S] and the queries attend over the whole buffer.
        """
        cfg = self.cfg
        b, s, _ = x.shape
        if self.twin_reads_history and kv_layer is not None:
            raise ValueError("this model's draft rows read the history through twin keys and values (mtp.twin_kv), "
                             "which need a second KV buffer that no runtime backend keeps yet: replay it with "
                             "tools.eval_acceptance, or train the twins without --twin-kv")
        q = self._heads(self.q_proj(x, adapter_from), cfg.num_heads, cos, sin, getattr(self, "q_norm", None))
        k = self._heads(self.k_proj(x, adapter_from), cfg.num_kv_heads, cos, sin, getattr(self, "k_norm", None))
        v = self._heads(self.v_proj(x, adapter_from), cfg.num_kv_heads)
        if kv_layer is not None:
            k_buf, v_buf = kv_layer
            k_buf.index_copy_(1, write_slots, k[0].to(k_buf.dtype))
            v_buf.index_copy_(1, write_slots, v[0].to(v_buf.dtype))
            k, v = k_buf.unsqueeze(0).to(q.dtype), v_buf.unsqueeze(0).to(q.dtype)
        out = self._attend(q, k, v, attn_mask)
        if self.twin_reads_history and adapter_from is not None and adapter_from < s:
            # The block rows again, over keys and values the twins computed for every row (the
            # causal rows' ones as well): the rows above stay the base model's, bit for bit.
            k_twin = self._heads(self.k_proj.adapter(x).to(x.dtype), cfg.num_kv_heads, cos, sin,
                                 getattr(self, "k_norm", None))
            v_twin = self._heads(self.v_proj.adapter(x).to(x.dtype), cfg.num_kv_heads)
            blocks = self._attend(q[:, :, adapter_from:], k_twin, v_twin, attn_mask[:, adapter_from:])
            out = torch.cat([out[:, :, :adapter_from], blocks], dim=2)
        out = out.transpose(1, 2).reshape(b, s, cfg.num_heads * cfg.head_dim)
        if cfg.has_sub_norms:
            out = self.attn_sub_norm(out)
        return self.o_proj(out, adapter_from)

    def _heads(self, y, heads, cos=None, sin=None, norm=None):
        """[B, S, heads·hd] -> [B, heads, S, hd], normed and rotated where given."""
        b, s, _ = y.shape
        y = y.view(b, s, heads, self.cfg.head_dim)
        if norm is not None:
            y = norm(y)
        y = y.transpose(1, 2)
        return apply_rope(y, cos, sin) if cos is not None else y

    def _attend(self, q, k, v, attn_mask):
        groups = self.cfg.num_heads // self.cfg.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask.unsqueeze(1),
                                              scale=1.0 / math.sqrt(self.cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantConfig, linear_cls):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = linear_cls(cfg.hidden_size, cfg.intermediate_size, quant)
        self.up_proj = linear_cls(cfg.hidden_size, cfg.intermediate_size, quant)
        self.down_proj = linear_cls(cfg.intermediate_size, cfg.hidden_size, quant)
        if cfg.has_sub_norms:
            self.ffn_sub_norm = RMSNorm(cfg.intermediate_size, cfg.rms_norm_eps)

    def forward(self, x, adapter_from=None):
        gate, up = self.gate_proj(x, adapter_from), self.up_proj(x, adapter_from)
        if self.cfg.activation == "relu2":
            # ReLU² overflows fp16; callers run it in bf16 or fp32 (see docs/artifact.md §Model config).
            h = torch.relu(gate).square() * up
        else:
            h = F.silu(gate) * up
        if self.cfg.has_sub_norms:
            h = self.ffn_sub_norm(h)
        return self.down_proj(h, adapter_from)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantConfig, linear_cls):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, quant, linear_cls)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, quant, linear_cls)

    def forward(self, x, cos, sin, attn_mask, kv_layer=None, write_slots=None, adapter_from=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, kv_layer, write_slots, adapter_from)
        return x + self.mlp(self.post_attention_layernorm(x), adapter_from)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantConfig, linear_cls):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, quant, linear_cls) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TernaryLM(nn.Module):
    """Decoder-only ternary LM with a 16-bit verify head and an optional int8 draft head."""

    def __init__(self, cfg: ModelConfig, quant: QuantConfig, linear_cls=PackedTernaryLinear):
        super().__init__()
        self.cfg, self.quant = cfg, quant
        self.model = Backbone(cfg, quant, linear_cls)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # The int8 draft head (runtime only, filled from the artifact or by attach_draft_head).
        self.register_buffer("draft_head_int8", None, persistent=False)
        self.register_buffer("draft_head_scale", None, persistent=False)
        self.draft_head_kind = "int8"  # or "int4": attach_int4_draft_head
        self.int8_verify = False  # ``use_int8_verify_head``: the verify role reads the int8 head too
        self.mask_slot_embedding: nn.Parameter | None = None  # [D, H] with mask-row adapters or twins

    def projections(self, layers=None) -> list[nn.Module]:
        """The ternary projections of every layer (or of ``layers``), in order."""
        return [m for layer in (self.model.layers if layers is None else layers) for m in (
            layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
            layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]

    @property
    def adapter_rank(self) -> int:
        """The rank of the mask-row adapters, 0 without them."""
        first = self.projections()[0].adapter
        return first.A.shape[0] if isinstance(first, MaskRowAdapter) else 0

    @property
    def twin_layers(self) -> int:
        """How many layers (the last ones) have mask-row twins, 0 without them."""
        return sum(isinstance(layer.self_attn.q_proj.adapter, MaskRowTwin) for layer in self.model.layers)

    @property
    def twin_kv(self) -> bool:
        """Whether the twinned layers' draft rows read the history through twin keys and values."""
        return any(layer.self_attn.twin_reads_history for layer in self.model.layers)

    def attach_mask_adapters(self, rank: int, block_size: int) -> None:
        """Give every projection a fresh ``MaskRowAdapter`` of ``rank`` and the draft rows a
        per-slot input offset (zero: the model computes what it did until they are trained).
        The offset stands in for a trainable mask embedding, which a tied head would also
        read as the mask token's logit — a change the clean stream would see."""
        if rank < 1:
            raise ValueError(f"adapter rank must be at least 1, got {rank}")
        for proj in self.projections():
            proj.adapter = MaskRowAdapter(proj.in_features, proj.out_features, rank).to(self.head_weight.device)
        self._attach_slot_embedding(block_size)

    def attach_mask_twins(self, layers: int, block_size: int, read_history: bool = False) -> None:
        """Give every projection of the last ``layers`` layers a ``MaskRowTwin`` (a copy of it, so
        the model computes what it did until they are trained) and the draft rows the per-slot
        input offset of ``attach_mask_adapters``. ``read_history``: the draft rows of those
        layers attend over keys and values their twins computed for every row, so what they
        read of the history is theirs to train too (the verifier's keys are fixed by NTP)."""
        if not 1 <= layers <= len(self.model.layers):
            raise ValueError(f"twin layers must be in 1..{len(self.model.layers)}, got {layers}")
        for layer in self.model.layers[len(self.model.layers) - layers:]:
            attn = layer.self_attn
            for proj in self.projections([layer]):
                reads = read_history and proj in (attn.k_proj, attn.v_proj)
                proj.adapter = MaskRowTwin(proj, reads_history=reads).requires_grad_(True)
        self._attach_slot_embedding(block_size)

    def attach_mask_rows(self, adapter_rank: int, twin_layers: int, block_size: int, twin_kv: bool = False) -> None:
        """The draft rows' own capacity as a model's MTP config names it (either, or none)."""
        if adapter_rank and twin_layers:
            raise ValueError("mask-row adapters and twins are alternatives; give one of adapter_rank, twin_layers")
        if twin_kv and not twin_layers:
            raise ValueError("twin_kv reads the history through twins: it needs twin_layers")
        if adapter_rank:
            self.attach_mask_adapters(adapter_rank, block_size)
        elif twin_layers:
            self.attach_mask_twins(twin_layers, block_size, read_history=twin_kv)

    def _attach_slot_embedding(self, block_size: int) -> None:
        self.mask_slot_embedding = nn.Parameter(torch.zeros(block_size, self.cfg.hidden_size,
                                                            device=self.head_weight.device))

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids, positions, attn_mask, kv=None, write_slots=None, adapter_from=None):
        """input_ids, positions [B, S]; attn_mask [B, S, S_kv] bool -> final-normed hidden [B, S, H].

        ``kv``: a ``KVView`` (``kv.k[layer]``, ``kv.v[layer]`` of [Hkv, S_buf, hd]) with
        ``write_slots`` [S] (B must be 1), or None for a self-contained sequence.
        ``adapter_from``: the first row of the call's draft blocks (D rows each, to the end), where
        the mask-row adapters or twins apply; None (or neither): every row is the base model's.
        """
        x = self.model.embed_tokens(input_ids)
        if self.mask_slot_embedding is not None and adapter_from is not None and adapter_from < x.shape[1]:
            d = self.mask_slot_embedding.shape[0]
            blocks = x.shape[1] - adapter_from
            if blocks % d:
                raise ValueError(f"rows {adapter_from}.. of a {x.shape[1]}-row call are not whole {d}-row draft blocks")
            offset = self.mask_slot_embedding.to(x.dtype).repeat(blocks // d, 1)
            x = torch.cat([x[:, :adapter_from], x[:, adapter_from:] + offset], dim=1)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        if self.mask_slot_embedding is None:
            adapter_from = None
        for i, layer in enumerate(self.model.layers):
            kv_layer = (kv.k[i], kv.v[i]) if kv is not None else None
            x = layer(x, cos, sin, attn_mask, kv_layer, write_slots, adapter_from)
        return self.model.norm(x)

    def verify_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] float32 logits with the exact (checkpoint-precision) head, or
        the int8 head after ``use_int8_verify_head``."""
        if self.int8_verify:
            return self._int8_logits(hidden.reshape(-1, hidden.shape[-1]), *self.int8_verify_head).reshape(
                *hidden.shape[:-1], -1)
        w = self.head_weight
        return F.linear(hidden.to(w.dtype) if w.dtype != hidden.dtype else hidden, w).float()

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] -> [M, V] float32 logits of the int8 draft head (W8A8, per-row scales)."""
        if self.draft_head_int8 is None:
            return self.verify_logits(hidden)
        return self._int8_logits(hidden, self.draft_head_int8, self.draft_head_scale)

    @staticmethod
    def _int8_logits(hidden: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
        h_int, h_scale = quantize_activations(hidden)
        acc = int_matmul(h_int, w_int8)
        return (acc.double() * h_scale.double().unsqueeze(1) * w_scale.double()).float()

    def use_int8_verify_head(self) -> None:
        """Every role reads the int8 head (the artifact's draft head, else quantised here from the
        16-bit one): AR, verify and scoring then take the argmax of the same W8A8 logits the
        drafts come from. Half the head's bytes per step — on a Jetson, where an AR step of a 2B
        model streams its 16-bit head (656 MB) as well as its ternary stack (521 MB), about a
        quarter of the step — for a greedy text that differs from the 16-bit head's at near-ties
        (docs/runtime.md, "The int8 head"). Decoding stays lossless against this head's own AR."""
        if self.draft_head_int8 is None:
            self.attach_draft_head()
        if self.draft_head_kind == "int8":
            self.int8_verify_head = (self.draft_head_int8, self.draft_head_scale)
        else:  # the drafts read an int4 head: the verify role still reads int8 rows
            w_int8, scale = quantize_rows_int8(self.head_weight.detach())
            self.int8_verify_head = (w_int8, scale.float())
        self.int8_verify = True

    def attach_draft_head(self, w_int8: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> None:
        """Install the int8 draft head (given, or quantised here from the verify head)."""
        if w_int8 is None:
            w_int8, scale = quantize_rows_int8(self.head_weight.detach())
        self.draft_head_int8, self.draft_head_scale = w_int8, scale.float()

    def attach_int4_draft_head(self) -> None:
        """The int4 draft head (``numerics.quantize_rows_int4`` of the verify head), held widened
        to int8 codes in [-7, 7]: the same exact integer logits as the kernels' packed rows."""
        packed, scale = quantize_rows_int4(self.head_weight.detach())
        self.attach_draft_head(unpack_int4_rows(packed, self.head_weight.shape[1]), scale)
        self.draft_head_kind = "int4"
