"""Packed ternary weights x per-token int8 activations ("W2A8"), exact int32 accumulation.

    out[m, n] = (sum_k a[m, k] * W[n, k]) * a_scale[m] * w_scale[n]                (per row)
    out[m, n] = (sum_g float(sum_{k in g} a[m, k] * W[n, k]) * w_scale[n, g]) * a_scale[m]
                                                                          (group-128, Bonsai)

``W`` in {-1, 0, 1} arrives packed as layout ``ternary-2bit-k128x4-v1`` (``packing.py``):
byte ``32*g + j`` of a row holds, in bits ``2i..2i+1``, the code ``c = W + 1`` of input
``128*g + 32*i + j``. Both kernels keep the codes unsigned and correct once per row:
``sum_k a*(c - 1) = sum_k a*c - sum_k a`` (the offset trick of llama.cpp's TQ2_0), so
decoding is a shift and a mask, nothing more.

Two kernels, picked per width M by the tuned table (``tuning.py``):

* ``gemv`` (M = 1, a few rows): the packed row is read as int32 words. For lane ``i``,
  ``(word >> 2i) & 0x03030303`` holds the codes of four *consecutive* inputs
  ``128g + 32i + 4(w%8) + 0..3`` in its four bytes -- exactly the int8 activation word at
  index ``32g + 8i + w%8`` -- so one ``dp4a`` does four multiply-adds: about three integer
  instructions per four weights, all in registers.
* ``dot`` (M >= 3 or so): the byte tile ``[BLOCK_N, BLOCK_KB]`` is shifted/masked per lane
  into an int8 tile of codes that multiplies (``tl.dot``, int8 tensor cores, int32
  accumulators) the activations gathered at ``k = 128*(b//32) + 32*i + b%32``. The
  weights are the dot's first operand ("swap AB"), so the big dimension N fills the
  tensor-core M side and the width only pads to 16.

The epilogue multiplies in the same order as the twin, ``(float(acc) * a_scale) * w_scale``,
so per-row results in float32 are bit-identical to ``w2a8_linear_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitmtp_edge.quant import int_matmul

from .common import (check_dtype, check_launchable, check_packed_weight, dp4a, is_interpreted, next_pow2,
                     scale_strides)
from .packing import BYTES_PER_CHUNK, CHUNK_K, unpack_ternary
from .tuning import DOT, GEMV, LinearConfig, default_linear, linear_key, lookup

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
WORDS_PER_CHUNK = BYTES_PER_CHUNK // 4  # 8 int32 words hold one 128-input chunk of a row


@triton.jit
def _w2a8_gemv_kernel(
    a_ptr,  # [M, K/4] int32: four int8 activations per word
    a_scale_ptr,  # [M] float32
    w_ptr,  # [N, K/16] int32: sixteen 2-bit codes per word
    w_scale_ptr,  # [N] or [N, K/128] float32
    out_ptr,  # [M, N]
    M, N,
    stride_am, stride_wn, stride_sn, stride_sg, stride_om,
    K: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    KW: tl.constexpr = K // 16
    pid_n = tl.program_id(0)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, BLOCK_W)
    mask_m = rm < M
    mask_n = rn < N
    # activation word matching weight word w for lane 0 (lane i adds 8*i); BLOCK_W % 8 == 0
    a_word = 32 * (rw // 8) + rw % 8
    ones = tl.full((BLOCK_M, BLOCK_W), 0x01010101, tl.int32)

    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_W), tl.int32)
    asum = tl.zeros((BLOCK_M, BLOCK_W), tl.int32)
    facc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for w0 in range(0, KW, BLOCK_W):
        mask_w = (w0 + rw) < KW
        # padding words read as 0 and meet activation 0: they add nothing to acc or asum
        wt = tl.load(w_ptr + rn[:, None] * stride_wn + (w0 + rw)[None, :],
                     mask=mask_n[:, None] & mask_w[None, :], other=0)  # [BLOCK_N, BLOCK_W]
        if GROUPED:
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_W), tl.int32)
            asum = tl.zeros((BLOCK_M, BLOCK_W), tl.int32)
        for i in tl.static_range(4):
            a = tl.load(a_ptr + rm[:, None] * stride_am + (4 * w0 + 8 * i + a_word)[None, :],
                        mask=mask_m[:, None] & mask_w[None, :], other=0)  # [BLOCK_M, BLOCK_W]
            codes = (wt >> (2 * i)) & 0x03030303
            acc = dp4a(codes[None, :, :], a[:, None, :], acc, USE_ASM)
            asum = dp4a(a, ones, asum, USE_ASM)
        if GROUPED:  # BLOCK_W == 8: this step was exactly chunk g of every row
            s = tl.load(w_scale_ptr + rn * stride_sn + (w0 // 8) * stride_sg, mask=mask_n, other=0.0)
            chunk = tl.sum(acc, axis=2) - tl.sum(asum, axis=1)[:, None]
            facc += chunk.to(tl.float32) * s[None, :]

    a_s = tl.load(a_scale_ptr + rm, mask=mask_m, other=0.0)
    if GROUPED:
        y = facc * a_s[:, None]
    else:
        ws = tl.load(w_scale_ptr + rn * stride_sn, mask=mask_n, other=0.0)
        tot = tl.sum(acc, axis=2) - tl.sum(asum, axis=1)[:, None]
        y = tot.to(tl.float32) * a_s[:, None] * ws[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _w2a8_dot_kernel(
    a_ptr,  # [M, K] int8
    a_scale_ptr,  # [M] float32
    w_ptr,  # [N, K/4] uint8 packed codes
    w_scale_ptr,  # [N] or [N, K/128] float32
    out_ptr,  # [M, N]
    M, N,
    stride_am, stride_wn, stride_sn, stride_sg, stride_om,
    K: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
):
    KB: tl.constexpr = K // 4
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_KB)
    mask_m = rm < M
    mask_n = rn < N
    # input index of byte column b for lane 0 (lane i adds 32*i); BLOCK_KB % 32 == 0
    k_of_b = 128 * (rb // 32) + rb % 32

    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
    asum = tl.zeros((BLOCK_M,), tl.int32)
    facc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for b0 in range(0, KB, BLOCK_KB):
        mask_b = (b0 + rb) < KB
        wb = tl.load(w_ptr + rn[:, None] * stride_wn + (b0 + rb)[None, :],
                     mask=mask_n[:, None] & mask_b[None, :], other=0)  # [BLOCK_N, BLOCK_KB] uint8
        if GROUPED:
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
            asum = tl.zeros((BLOCK_M,), tl.int32)
        for i in tl.static_range(4):
            a = tl.load(a_ptr + rm[None, :] * stride_am + (4 * b0 + 32 * i + k_of_b)[:, None],
                        mask=mask_m[None, :] & mask_b[:, None], other=0)  # [BLOCK_KB, BLOCK_M] int8
            codes = ((wb >> (2 * i)) & 3).to(tl.int8)
            acc = tl.dot(codes, a, acc)  # [BLOCK_N, BLOCK_M] int32
            asum += tl.sum(a.to(tl.int32), axis=0)
        if GROUPED:  # BLOCK_KB == 32: this step was exactly chunk g
            s = tl.load(w_scale_ptr + rn * stride_sn + (b0 // 32) * stride_sg, mask=mask_n, other=0.0)
            facc += (acc - asum[None, :]).to(tl.float32) * s[:, None]

    a_s = tl.load(a_scale_ptr + rm, mask=mask_m, other=0.0)
    if GROUPED:
        y = facc * a_s[None, :]
    else:
        ws = tl.load(w_scale_ptr + rn * stride_sn, mask=mask_n, other=0.0)
        y = (acc - asum[None, :]).to(tl.float32) * a_s[None, :] * ws[:, None]
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], y.to(out_ptr.dtype.element_ty),
             mask=mask_n[:, None] & mask_m[None, :])


def w2a8_linear(
    a_int8: torch.Tensor,  # [M, K] int8
    a_scale: torch.Tensor,  # [M] float32 (absmax / 127, i.e. 1/q)
    packed: torch.Tensor,  # [N, K/4] uint8, layout ternary-2bit-k128x4-v1
    w_scale: torch.Tensor,  # [N] float32 per row, or [N, K/128] float32 per 128-group
    *,
    out_dtype: torch.dtype = torch.float16,
    config: LinearConfig | None = None,
) -> torch.Tensor:  # [M, N] out_dtype
    """``(a_int8 @ W^T) * a_scale[:, None] * w_scale``, exact int32 accumulation.

    ``config`` overrides the tuned table (the benchmark's tuner uses it); leave it None.
    """
    if a_int8.dtype != torch.int8 or a_int8.dim() != 2 or a_int8.stride(1) != 1:
        raise TypeError(f"w2a8_linear: a_int8 must be a 2-D int8 [M, K] tensor with contiguous rows, "
                        f"got {a_int8.dtype} {tuple(a_int8.shape)}")
    m, k = a_int8.shape
    n, grouped = check_packed_weight(packed, w_scale, k, "w2a8_linear")
    check_dtype(a_scale, (torch.float32,), "w2a8_linear: a_scale")
    if a_scale.shape != (m,):
        raise ValueError(f"w2a8_linear: a_scale must be [M]={m}, got {tuple(a_scale.shape)}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"w2a8_linear: out_dtype {out_dtype} not supported, expected one of {OUT_DTYPES}")
    if config is None:
        config = lookup("w2a8_linear", linear_key(n, k, m, grouped), packed.device) or default_linear(m, grouped)
    if grouped and config.block_kb != BYTES_PER_CHUNK:
        raise ValueError(f"w2a8_linear: group-128 scales need block_kb={BYTES_PER_CHUNK} (one chunk "
                         f"per step), config has {config.block_kb}")

    out = torch.empty((m, n), dtype=out_dtype, device=a_int8.device)
    if m == 0 or n == 0:
        return out
    stride_sn, stride_sg = scale_strides(w_scale, grouped)
    if config.kernel == GEMV:
        check_launchable(_w2a8_gemv_kernel, a_int8, a_scale, packed, w_scale)
        if a_int8.stride(0) % 4 or a_int8.data_ptr() % 4 or packed.stride(0) % 4 or packed.data_ptr() % 4:
            raise ValueError("w2a8_linear: the gemv kernel reads 4-byte words; a_int8 and packed rows "
                             "must start 4-byte aligned")
        a_words = a_int8.view(torch.int32)  # [M, K/4]
        w_words = packed.view(torch.int32)  # [N, K/16]
        block_m = min(next_pow2(m), 8)
        grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m))
        _w2a8_gemv_kernel[grid](
            a_words, a_scale, w_words, w_scale, out,
            m, n,
            a_words.stride(0), w_words.stride(0), stride_sn, stride_sg, out.stride(0),
            K=k, GROUPED=grouped,
            BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_W=config.block_kb // 4,
            USE_ASM=not is_interpreted(_w2a8_gemv_kernel),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    else:
        check_launchable(_w2a8_dot_kernel, a_int8, a_scale, packed, w_scale)
        block_m = max(16, min(next_pow2(m), 64))  # tl.dot needs 16 rows at least
        grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m))
        _w2a8_dot_kernel[grid](
            a_int8, a_scale, packed, w_scale, out,
            m, n,
            a_int8.stride(0), packed.stride(0), stride_sn, stride_sg, out.stride(0),
            K=k, GROUPED=grouped,
            BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_KB=config.block_kb,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out


def w2a8_linear_reference(
    a_int8: torch.Tensor,  # [M, K] int8
    a_scale: torch.Tensor,  # [M] float32
    packed: torch.Tensor,  # [N, K/4] uint8
    w_scale: torch.Tensor,  # [N] / [1] / [N, K/128] float32
    *,
    out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:  # [M, N]
    """The pure-PyTorch twin: exact integer products (float64), float32 epilogue."""
    codes = unpack_ternary(packed)  # [N, K] int8
    m, k = a_int8.shape
    n = codes.shape[0]
    if w_scale.dim() == 2:
        g = k // CHUNK_K
        acc = torch.einsum("mgk,ngk->mng", a_int8.double().view(m, g, CHUNK_K),
                           codes.double().view(n, g, CHUNK_K))  # [M, N, G], exact integers
        y = (acc.float() * w_scale[None]).sum(-1) * a_scale[:, None]
    else:
        acc = int_matmul(a_int8, codes).float()  # [M, N]
        y = acc * a_scale[:, None] * w_scale.expand(n)[None, :]
    return y.to(out_dtype)
