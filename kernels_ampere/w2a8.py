"""Packed ternary weights x per-token int8 activations ("W2A8"), exact int32 accumulation.

    out[m, n] = (sum_k a[m, k] * W[n, k]) * a_scale[m] * w_scale[n]                (per row)
    out[m, n] = (sum_g float(sum_{k in g} a[m, k] * W[n, k]) * w_scale[n, g]) * a_scale[m]
                                                                          (group-128, Bonsai)

``W`` in {-1, 0, 1} arrives packed as layout ``ternary-2bit-k128x4-v1`` (``packing.py``):
byte ``32*g + j`` of a row holds, in bits ``2i..2i+1``, the code ``c = W + 1`` of input
``128*g + 32*i + j``. Both kernels keep the codes unsigned and correct once per row:
``sum_k a*(c - 1) = sum_k a*c - sum_k a`` (the offset trick of llama.cpp's TQ2_0), so
decoding is a shift and a mask, nothing more.

Three kernels, picked per (N, K, M) by the tuned table (``tuning.py``):

* ``gemv`` (M = 1, 2): one activation row per program, a ``[BLOCK_N, CHUNKS, 8]`` tile of
  int32 words per K step. Word ``j`` of chunk ``c`` holds, in lane ``i``, the codes of the
  four *consecutive* inputs ``128c + 32i + 4j .. +3`` -- exactly activation word
  ``32c + 8i + j`` -- so ``(word >> 2i) & 0x03030303`` and one ``dp4a`` do four
  multiply-adds: about three integer instructions per four weights, all in registers, and
  the activation words of a lane are contiguous (vector loads).
* ``rows`` (M = 3 .. 2D+1): the gemv kernel with up to 16 activation rows per program, so
  each weight word is loaded and decoded once for every row; dp4a work grows with M, the
  weight bytes do not.
* ``dot`` (M >= 3): per 128-chunk, the ``[BLOCK_N, 32]`` byte tile is shifted/masked per
  lane into int8 codes that multiply (``tl.dot``, int8 tensor cores, int32 accumulators)
  the activations of inputs ``128c + 32i + 0..31``. The weights are the dot's first
  operand ("swap AB"): N fills the tensor-core M side and the width only pads to 16.
  (Expanding a chunk's four lanes side by side into one K = 128 dot was measured slower
  on the H200, 11.7 vs 9.5 µs per call over the 2B layer mix at M = 9: the reshape costs a
  layout conversion through shared memory.)

Group-128 scales are applied per chunk after its exact int32 sum. ``split_k > 1`` gives
each program a slice of the chunks; slices write int32 (per-row scales: still exact) or
float32 (group scales applied) partials that ``common.split_k_reduce`` adds in slice order
-- deterministic, no atomics, no zero-fill.

The epilogue multiplies in the same order as the twin, ``(float(acc) * a_scale) * w_scale``,
so per-row results in float32 are bit-identical to ``w2a8_linear_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .numerics import int_matmul

from .common import (check_dtype, check_launchable, check_packed_weight, check_residual, dp4a, gdc_prologue,
                     is_interpreted, next_pow2, pdl_options, scale_strides, split_k_chunks, split_k_reduce)
from .packing import BYTES_PER_CHUNK, CHUNK_K, unpack_ternary
from .tuning import GEMV, ROWS, LinearConfig, default_linear, linear_key, lookup

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROWS_MAX_BLOCK_M = 16  # activation rows one ``rows`` program multiplies (registers: BLOCK_N·BLOCK_M·words)


@triton.jit
def _w2a8_gemv_kernel(
    a_ptr,  # [M, K/4] int32: four int8 activations per word
    a_scale_ptr,  # [M] float32
    w_ptr,  # [N, K/16] int32: sixteen 2-bit codes per word, 8 words per 128-chunk
    w_scale_ptr,  # [N] or [N, K/128] float32
    out_ptr,  # [M, N] (SPLIT: [S, M, N] int32 or float32 partial sums)
    res_ptr,  # [M, N] float32 residual added in the epilogue (read only when RESIDUAL)
    M, N, chunks_per_split,
    stride_am, stride_wn, stride_sn, stride_sg, stride_om, stride_rm,
    K: tl.constexpr,
    GROUPED: tl.constexpr, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,  # rows per program, 128-chunks per K step
    USE_ASM: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
):
    gdc_prologue(USE_GDC)
    N_CHUNKS: tl.constexpr = K // 128
    m = tl.program_id(0)  # one activation row per program; rows of one N tile run side by side
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_lo = tl.program_id(2) * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, N_CHUNKS)
    rc = tl.arange(0, CHUNKS)
    rj = tl.arange(0, 8)  # word j of a chunk holds inputs 4j..4j+3 of each 32-wide lane
    mask_n = rn < N
    ones = tl.full((CHUNKS, 8), 0x01010101, tl.int32)

    acc = tl.zeros((BLOCK_N, CHUNKS, 8), tl.int32)
    asum = tl.zeros((CHUNKS, 8), tl.int32)
    facc = tl.zeros((BLOCK_N,), tl.float32)
    for c0 in range(c_lo, c_hi, CHUNKS):
        c = c0 + rc
        mask_c = c < c_hi
        # padding words read as 0 and meet activation 0: they add nothing to acc or asum
        wt = tl.load(w_ptr + rn[:, None, None] * stride_wn + c[None, :, None] * 8 + rj[None, None, :],
                     mask=mask_n[:, None, None] & mask_c[None, :, None], other=0)  # [BLOCK_N, CHUNKS, 8]
        if GROUPED:
            acc = tl.zeros((BLOCK_N, CHUNKS, 8), tl.int32)
            asum = tl.zeros((CHUNKS, 8), tl.int32)
        for i in tl.static_range(4):
            # lane i of word j = inputs 128c + 32i + 4j .. +3 = activation word 32c + 8i + j
            a = tl.load(a_ptr + m * stride_am + c[:, None] * 32 + 8 * i + rj[None, :],
                        mask=mask_c[:, None], other=0)  # [CHUNKS, 8]
            codes = (wt >> (2 * i)) & 0x03030303
            acc = dp4a(codes, a[None, :, :], acc, USE_ASM)
            asum = dp4a(a, ones, asum, USE_ASM)
        if GROUPED:
            s = tl.load(w_scale_ptr + rn[:, None] * stride_sn + c[None, :] * stride_sg,
                        mask=mask_n[:, None] & mask_c[None, :], other=0.0)  # [BLOCK_N, CHUNKS]
            chunk = tl.sum(acc, axis=2) - tl.sum(asum, axis=1)[None, :]
            facc += tl.sum(chunk.to(tl.float32) * s, axis=1)

    if GROUPED:
        y = facc
    else:
        y = tl.sum(tl.sum(acc, axis=2), axis=1) - tl.sum(tl.sum(asum, axis=1), axis=0)  # int32
    if SPLIT:
        tl.store(out_ptr + (tl.program_id(2) * M + m) * N + rn, y, mask=mask_n)
    else:
        a_s = tl.load(a_scale_ptr + m)
        if GROUPED:
            y = y * a_s
        else:
            y = y.to(tl.float32) * a_s * tl.load(w_scale_ptr + rn * stride_sn, mask=mask_n, other=0.0)
        if RESIDUAL:
            y = tl.load(res_ptr + m * stride_rm + rn, mask=mask_n, other=0.0) + y
        tl.store(out_ptr + m * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _store_tile(y, rn, rm, M, N, a_scale_ptr, w_scale_ptr, stride_sn, out_ptr, stride_om, res_ptr, stride_rm,
                GROUPED: tl.constexpr, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr):
    """Epilogue of a ``[BLOCK_N, BLOCK_M]`` tile (the rows and dot kernels): a split-K partial
    as is, or ``(acc · a_scale) · w_scale`` (group scales: already applied) ``+ residual``."""
    mask = (rn < N)[:, None] & (rm < M)[None, :]
    if SPLIT:
        tl.store(out_ptr + (tl.program_id(2) * M + rm[None, :]) * N + rn[:, None], y, mask=mask)
    else:
        a_s = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
        if GROUPED:
            y = y * a_s[None, :]
        else:
            ws = tl.load(w_scale_ptr + rn * stride_sn, mask=rn < N, other=0.0)
            y = y.to(tl.float32) * a_s[None, :] * ws[:, None]
        if RESIDUAL:
            y = tl.load(res_ptr + rm[None, :] * stride_rm + rn[:, None], mask=mask, other=0.0) + y
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w2a8_rows_kernel(
    a_ptr,  # [M, K/4] int32: four int8 activations per word
    a_scale_ptr,  # [M] float32
    w_ptr,  # [N, K/16] int32 packed words (as the gemv kernel reads them)
    w_scale_ptr,  # [N] or [N, K/128] float32
    out_ptr,  # [M, N] (SPLIT: [S, M, N] int32 or float32 partial sums)
    res_ptr,  # [M, N] float32 residual (RESIDUAL)
    M, N, chunks_per_split,
    stride_am, stride_wn, stride_sn, stride_sg, stride_om, stride_rm,
    K: tl.constexpr,
    GROUPED: tl.constexpr, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    USE_ASM: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
):
    """The gemv kernel with BLOCK_M activation rows per program: each weight word is loaded
    and decoded once and multiplies every row (dp4a), instead of once per row."""
    gdc_prologue(USE_GDC)
    N_CHUNKS: tl.constexpr = K // 128
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    c_lo = tl.program_id(2) * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, N_CHUNKS)
    rc = tl.arange(0, CHUNKS)
    rj = tl.arange(0, 8)
    mask_n = rn < N
    mask_m = rm < M
    ones = tl.full((BLOCK_M, CHUNKS, 8), 0x01010101, tl.int32)

    acc = tl.zeros((BLOCK_N, BLOCK_M, CHUNKS, 8), tl.int32)
    asum = tl.zeros((BLOCK_M, CHUNKS, 8), tl.int32)
    facc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for c0 in range(c_lo, c_hi, CHUNKS):
        c = c0 + rc
        mask_c = c < c_hi
        wt = tl.load(w_ptr + rn[:, None, None] * stride_wn + c[None, :, None] * 8 + rj[None, None, :],
                     mask=mask_n[:, None, None] & mask_c[None, :, None], other=0)  # [BLOCK_N, CHUNKS, 8]
        if GROUPED:
            acc = tl.zeros((BLOCK_N, BLOCK_M, CHUNKS, 8), tl.int32)
            asum = tl.zeros((BLOCK_M, CHUNKS, 8), tl.int32)
        for i in tl.static_range(4):
            a = tl.load(a_ptr + rm[:, None, None] * stride_am + c[None, :, None] * 32 + 8 * i + rj[None, None, :],
                        mask=mask_m[:, None, None] & mask_c[None, :, None], other=0)  # [BLOCK_M, CHUNKS, 8]
            codes = (wt >> (2 * i)) & 0x03030303
            acc = dp4a(codes[:, None, :, :], a[None, :, :, :], acc, USE_ASM)
            asum = dp4a(a, ones, asum, USE_ASM)
        if GROUPED:
            s = tl.load(w_scale_ptr + rn[:, None] * stride_sn + c[None, :] * stride_sg,
                        mask=mask_n[:, None] & mask_c[None, :], other=0.0)  # [BLOCK_N, CHUNKS]
            chunk = tl.sum(acc, axis=3) - tl.sum(asum, axis=2)[None, :, :]  # [BLOCK_N, BLOCK_M, CHUNKS]
            facc += tl.sum(chunk.to(tl.float32) * s[:, None, :], axis=2)

    if GROUPED:
        y = facc
    else:
        y = tl.sum(tl.sum(acc, axis=3), axis=2) - tl.sum(tl.sum(asum, axis=2), axis=1)[None, :]  # int32
    _store_tile(y, rn, rm, M, N, a_scale_ptr, w_scale_ptr, stride_sn, out_ptr, stride_om, res_ptr, stride_rm,
                GROUPED, SPLIT, RESIDUAL)


@triton.jit
def _w2a8_dot_kernel(
    a_ptr,  # [M, K] int8
    a_scale_ptr,  # [M] float32
    w_ptr,  # [N, K/4] uint8 packed codes
    w_scale_ptr,  # [N] or [N, K/128] float32
    out_ptr,  # [M, N] (SPLIT: [S, M, N] int32 or float32 partial sums)
    res_ptr,  # [M, N] float32 residual (RESIDUAL)
    M, N, chunks_per_split,
    stride_am, stride_wn, stride_sn, stride_sg, stride_om, stride_rm,
    K: tl.constexpr,
    GROUPED: tl.constexpr, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
):
    gdc_prologue(USE_GDC)
    N_CHUNKS: tl.constexpr = K // 128
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    c_lo = tl.program_id(2) * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, N_CHUNKS)
    rb = tl.arange(0, 32)  # byte j of a chunk holds input 32i + j of lane i
    mask_m = rm < M
    mask_n = rn < N

    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
    asum = tl.zeros((BLOCK_M,), tl.int32)
    facc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for c0 in range(c_lo, c_hi, CHUNKS):
        for cc in tl.static_range(CHUNKS):  # one 32-byte column block per chunk: scales stay per chunk
            c = c0 + cc
            ok = (c * 32 + rb) < c_hi * 32  # [32]: the whole chunk is in this slice or not
            wb = tl.load(w_ptr + rn[:, None] * stride_wn + c * 32 + rb[None, :],
                         mask=mask_n[:, None] & ok[None, :], other=0)  # [BLOCK_N, 32] uint8
            if GROUPED:
                acc = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
                asum = tl.zeros((BLOCK_M,), tl.int32)
            for i in tl.static_range(4):
                a = tl.load(a_ptr + rm[None, :] * stride_am + c * 128 + 32 * i + rb[:, None],
                            mask=mask_m[None, :] & ok[:, None], other=0)  # [32, BLOCK_M] int8
                codes = ((wb >> (2 * i)) & 3).to(tl.int8)
                acc = tl.dot(codes, a, acc, out_dtype=tl.int32)  # [BLOCK_N, BLOCK_M]
                asum += tl.sum(a.to(tl.int32), axis=0)
            if GROUPED:
                s = tl.load(w_scale_ptr + rn * stride_sn + c * stride_sg, mask=mask_n & (rn * 0 + c < c_hi), other=0.0)
                facc += (acc - asum[None, :]).to(tl.float32) * s[:, None]

    if GROUPED:
        y = facc
    else:
        y = acc - asum[None, :]  # int32
    _store_tile(y, rn, rm, M, N, a_scale_ptr, w_scale_ptr, stride_sn, out_ptr, stride_om, res_ptr, stride_rm,
                GROUPED, SPLIT, RESIDUAL)


def w2a8_linear(
    a_int8: torch.Tensor,  # [M, K] int8
    a_scale: torch.Tensor,  # [M] float32 (absmax / 127, i.e. 1/q)
    packed: torch.Tensor,  # [N, K/4] uint8, layout ternary-2bit-k128x4-v1
    w_scale: torch.Tensor,  # [N] float32 per row, or [N, K/128] float32 per 128-group
    *,
    out_dtype: torch.dtype = torch.float16,
    residual: torch.Tensor | None = None,  # [M, N] float32, added in the epilogue
    config: LinearConfig | None = None,
) -> torch.Tensor:  # [M, N] out_dtype
    """``(a_int8 @ W^T) * a_scale[:, None] * w_scale`` (``+ residual``), exact int32 accumulation.

    ``residual`` (float32 output only) fuses the transformer's ``x + f(x)``: the product is
    rounded to float32 first and then added, so the result equals the unfused sum bit for bit.
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
    check_residual(residual, m, n, out_dtype, "w2a8_linear")
    if config is None:
        config = (lookup("w2a8_linear", linear_key(n, k, m, grouped), packed.device)
                  or default_linear(m, grouped, n=n, k=k))

    out = torch.empty((m, n), dtype=out_dtype, device=a_int8.device)
    if m == 0 or n == 0:
        return out
    stride_sn, stride_sg = scale_strides(w_scale, grouped)
    chunks = config.block_kb // BYTES_PER_CHUNK
    per_split, n_split = split_k_chunks(k // CHUNK_K, config.split_k, chunks)
    split = n_split > 1
    # split-K slices write int32 (per-row: still exact) or float32 (group scales applied) partials
    target = torch.empty((n_split, m, n), dtype=torch.float32 if grouped else torch.int32,
                         device=out.device) if split else out
    res = residual if residual is not None else out
    # No FMA contraction: the epilogue's ``residual + (acc·a_s)·w_s`` must round the product
    # first, as the twin (and the unfused sum) does; the main loops are integer anyway.
    common = dict(K=k, GROUPED=grouped, SPLIT=split, RESIDUAL=residual is not None and not split,
                  BLOCK_N=config.block_n, CHUNKS=chunks, num_warps=config.num_warps, num_stages=config.num_stages,
                  enable_fp_fusion=False)
    if config.kernel in (GEMV, ROWS):
        kernel = _w2a8_gemv_kernel if config.kernel == GEMV else _w2a8_rows_kernel
        check_launchable(kernel, a_int8, a_scale, packed, w_scale)
        if a_int8.stride(0) % 4 or a_int8.data_ptr() % 4 or packed.stride(0) % 4 or packed.data_ptr() % 4:
            raise ValueError("w2a8_linear: the gemv kernels read 4-byte words; a_int8 and packed rows "
                             "must start 4-byte aligned")
        a_words = a_int8.view(torch.int32)  # [M, K/4]
        w_words = packed.view(torch.int32)  # [N, K/16]
        rows = {} if config.kernel == GEMV else {"BLOCK_M": min(next_pow2(m), ROWS_MAX_BLOCK_M)}
        grid = (m, triton.cdiv(n, config.block_n), n_split) if config.kernel == GEMV else \
            (triton.cdiv(n, config.block_n), triton.cdiv(m, rows["BLOCK_M"]), n_split)
        kernel[grid](
            a_words, a_scale, w_words, w_scale, target, res, m, n, per_split,
            a_words.stride(0), w_words.stride(0), stride_sn, stride_sg, out.stride(0), res.stride(0),
            USE_ASM=not is_interpreted(kernel), **rows, **common, **pdl_options(kernel),
        )
    else:
        check_launchable(_w2a8_dot_kernel, a_int8, a_scale, packed, w_scale)
        block_m = max(16, min(next_pow2(m), 64))  # tl.dot needs 16 rows at least
        grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m), n_split)
        _w2a8_dot_kernel[grid](
            a_int8, a_scale, packed, w_scale, target, res, m, n, per_split,
            a_int8.stride(0), packed.stride(0), stride_sn, stride_sg, out.stride(0), res.stride(0),
            BLOCK_M=block_m, **common, **pdl_options(_w2a8_dot_kernel),
        )
    if split:
        split_k_reduce(target, out, a_scale, None if grouped else w_scale, stride_sn, residual)
    return out


def w2a8_linear_reference(
    a_int8: torch.Tensor,  # [M, K] int8
    a_scale: torch.Tensor,  # [M] float32
    packed: torch.Tensor,  # [N, K/4] uint8
    w_scale: torch.Tensor,  # [N] / [1] / [N, K/128] float32
    *,
    out_dtype: torch.dtype = torch.float16,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N]
    """The pure-PyTorch twin: exact integer products (float64), float32 epilogue."""
    check_residual(residual, a_int8.shape[0], packed.shape[0], out_dtype, "w2a8_linear_reference")
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
    return y.to(out_dtype) if residual is None else residual + y
