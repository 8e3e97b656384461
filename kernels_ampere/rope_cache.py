"""The attention prologue in one launch: (QK-norm) + RoPE on Q and K, K and V into the KV buffer.

Input is the fused QKV projection's output, one row per query position::

    qkv[m] = [ q heads (Hq · hd) | k heads (Hkv · hd) | v heads (Hkv · hd) ]   float32

Program ``(m, h)`` handles one head of one row: query heads ``h < Hq`` are rotated and
written to ``q_out[m, h]`` in the KV dtype (what the attention kernel reads), KV heads
are rotated (K only) and stored straight into ``k_buf[h, slot[m]]`` / ``v_buf[h, slot[m]]``.
Unfused, the same work is ~15 launches per layer (norms, ``rotate_half``'s cat, the
multiplies, two ``index_copy_``, dtype casts); at batch 1 each costs more than its bytes.

RoPE is the half-split (``rotate_half``) convention of ``numerics.apply_rope``:
``y[i] = x[i]·cos[i] - x[i + hd/2]·sin[i]`` for the first half, ``x[i]·cos[i] + x[i - hd/2]·sin[i]``
for the second. The twin computes ``x·cos`` and ``rotate_half(x)·sin`` as separate float32
roundings and then adds; the kernel does the same (FMA contraction off), so both write the
same bits. QK-norm (Qwen3) is an RMSNorm over each head's ``hd`` values before the rotation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import bf16_rne, check_dtype, check_launchable, gdc_prologue, next_pow2, pdl_options
from .fused_quant import rms_norm_reference
from .numerics import apply_rope

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rope_cache_kernel(
    qkv_ptr,  # [M, (Hq + 2 Hkv) hd] float32
    cos_ptr, sin_ptr,  # [M, hd] float32
    slot_ptr,  # [M] int64: the buffer slot each row's K/V is written to
    qn_ptr, kn_ptr,  # [hd] float32 QK-norm weights (read only when QK_NORM)
    q_out_ptr,  # [M, Hq, hd] KV dtype
    k_ptr, v_ptr,  # [Hkv, S, hd] KV dtype
    Hq, Hkv, HD, eps,
    stride_xm, stride_cm, stride_qm, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs,
    QK_NORM: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
):
    gdc_prologue(USE_GDC)
    m = tl.program_id(0)
    h = tl.program_id(1)
    rd = tl.arange(0, BLOCK_D)
    mask = rd < HD
    half = HD // 2
    partner = tl.where(rd < half, rd + half, rd - half)
    sign = tl.where(rd < half, -1.0, 1.0)
    is_q = h < Hq
    kvh = h - Hq
    base = qkv_ptr + m * stride_xm + h * HD  # q heads, then k heads: contiguous in the row
    slot = tl.load(slot_ptr + m)  # with the other loads: not a round trip of its own before the stores
    x = tl.load(base + rd, mask=mask, other=0.0)
    xr = tl.load(base + partner, mask=mask, other=0.0)
    if QK_NORM:
        ss = tl.div_rn(tl.sum(x * x, axis=0), HD * 1.0)
        inv = tl.div_rn(1.0, tl.sqrt_rn(ss + eps))
        w = tl.where(is_q, tl.load(qn_ptr + rd, mask=mask, other=0.0), tl.load(kn_ptr + rd, mask=mask, other=0.0))
        wr = tl.where(is_q, tl.load(qn_ptr + partner, mask=mask, other=0.0),
                      tl.load(kn_ptr + partner, mask=mask, other=0.0))
        x = w * (x * inv)
        xr = wr * (xr * inv)
    c = tl.load(cos_ptr + m * stride_cm + rd, mask=mask, other=0.0)
    s = tl.load(sin_ptr + m * stride_cm + rd, mask=mask, other=0.0)
    y = x * c + (sign * xr) * s
    v = tl.load(base + Hkv * HD + rd, mask=mask, other=0.0)
    if OUT_BF16:  # round here: the interpreter's own bfloat16 cast truncates
        y = bf16_rne(y)
        v = bf16_rne(v)
    if is_q:
        tl.store(q_out_ptr + m * stride_qm + h * stride_qh + rd, y.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(k_ptr + kvh * stride_kh + slot * stride_ks + rd, y.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + kvh * stride_vh + slot * stride_vs + rd, v.to(v_ptr.dtype.element_ty), mask=mask)


def _check(qkv, cos, sin, k_buf, v_buf, write_slots, num_heads, num_kv_heads, op):
    check_dtype(qkv, (torch.float32,), f"{op}: qkv")
    check_dtype(k_buf, KV_DTYPES, f"{op}: k_buf")
    if qkv.dim() != 2 or qkv.stride(1) != 1:
        raise ValueError(f"{op}: qkv must be [M, (Hq + 2 Hkv) hd] with contiguous rows, got {tuple(qkv.shape)}")
    m = qkv.shape[0]
    hkv, _, hd = k_buf.shape
    if hkv != num_kv_heads or v_buf.shape != k_buf.shape or v_buf.dtype != k_buf.dtype:
        raise ValueError(f"{op}: k_buf {tuple(k_buf.shape)} / v_buf {tuple(v_buf.shape)} must both be "
                         f"[Hkv={num_kv_heads}, S, hd] of one dtype")
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * hd or hd % 2:
        raise ValueError(f"{op}: qkv width {qkv.shape[1]} != (Hq + 2 Hkv) * hd = "
                         f"({num_heads} + 2·{num_kv_heads}) * {hd} (hd even)")
    if cos.shape != (m, hd) or sin.shape != (m, hd):
        raise ValueError(f"{op}: cos/sin must be [M, hd] = [{m}, {hd}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if write_slots.shape != (m,) or write_slots.dtype != torch.long:
        raise ValueError(f"{op}: write_slots must be [M] int64, got {write_slots.dtype} {tuple(write_slots.shape)}")
    return m, hd


def rope_qkv_to_cache(
    qkv: torch.Tensor,  # [M, (Hq + 2 Hkv) hd] float32
    cos: torch.Tensor,  # [M, hd] float32
    sin: torch.Tensor,  # [M, hd] float32
    k_buf: torch.Tensor,  # [Hkv, S, hd]: written at write_slots
    v_buf: torch.Tensor,  # [Hkv, S, hd]
    write_slots: torch.Tensor,  # [M] int64, each < S (not checked on the device)
    *,
    num_heads: int,
    q_norm: torch.Tensor | None = None,  # [hd] (Qwen3 QK-norm) or None
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:  # q [M, Hq, hd] in the KV dtype
    """RoPE (after the optional QK-norm) on Q and K; K and V stored at their slots; returns Q."""
    hkv = k_buf.shape[0]
    m, hd = _check(qkv, cos, sin, k_buf, v_buf, write_slots, num_heads, hkv, "rope_qkv_to_cache")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rope_qkv_to_cache: give both q_norm and k_norm, or neither")
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("rope_qkv_to_cache: k_buf / v_buf need a contiguous last dim")
    q_out = torch.empty((m, num_heads, hd), dtype=k_buf.dtype, device=qkv.device)
    if m == 0:
        return q_out
    norm = q_norm is not None
    check_launchable(_rope_cache_kernel, qkv, cos, sin, k_buf, v_buf, write_slots)
    qn = q_norm.float().contiguous() if norm else cos
    kn = k_norm.float().contiguous() if norm else cos
    _rope_cache_kernel[(m, num_heads + hkv)](
        qkv, cos, sin, write_slots, qn, kn, q_out, k_buf, v_buf,
        num_heads, hkv, hd, float(eps),
        qkv.stride(0), cos.stride(0), q_out.stride(0), q_out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        QK_NORM=norm, OUT_BF16=k_buf.dtype == torch.bfloat16, BLOCK_D=next_pow2(hd), num_warps=1,
        enable_fp_fusion=False,  # x·cos and xr·sin round separately, as in the twin
        **pdl_options(_rope_cache_kernel),
    )
    return q_out


def rope_qkv_to_cache_reference(qkv, cos, sin, k_buf, v_buf, write_slots, *, num_heads, q_norm=None,
                                k_norm=None, eps=1e-6):
    """The pure-PyTorch twin (same arguments, same in-place writes, same returned Q)."""
    hkv = k_buf.shape[0]
    m, hd = _check(qkv, cos, sin, k_buf, v_buf, write_slots, num_heads, hkv, "rope_qkv_to_cache_reference")
    q, k, v = qkv.split([num_heads * hd, hkv * hd, hkv * hd], dim=-1)
    q, k = q.view(1, m, num_heads, hd), k.view(1, m, hkv, hd)
    if q_norm is not None:
        q, k = rms_norm_reference(q, q_norm, eps), rms_norm_reference(k, k_norm, eps)
    c, s = cos.unsqueeze(0), sin.unsqueeze(0)
    q = apply_rope(q.transpose(1, 2), c, s)[0].transpose(0, 1)  # [M, Hq, hd]
    k = apply_rope(k.transpose(1, 2), c, s)[0]  # [Hkv, M, hd]
    k_buf.index_copy_(1, write_slots, k.to(k_buf.dtype))
    v_buf.index_copy_(1, write_slots, v.reshape(m, hkv, hd).transpose(0, 1).to(v_buf.dtype))
    return q.to(k_buf.dtype).contiguous()

