"""Packed ternary weights x unquantised 16/32-bit activations (weight-only, Bonsai-style).

    out[m, n] = sum_g w_scale[n, g] * sum_{k in g} x[m, k] * W[n, k]        (group-128)
    out[m, n] = w_scale[n] * sum_k x[m, k] * W[n, k]                        (per row)

Same packed layout, the same two kernels and the same split-K as ``w2a8.py`` (read its
docstring), with float arithmetic: ``gemv`` turns each code into ``c - 1`` in float32 and
multiplies-adds in registers over a ``[BLOCK_N, CHUNKS, 32]`` byte tile; ``dot`` unpacks a
chunk's byte tile to ``c - 1`` in the activation dtype (exact: the values are -1, 0, 1) and
feeds ``tl.dot`` with float32 accumulators. Group scales are applied once per 128-chunk,
after the chunk's sum.

Float32 activations go through ``tl.dot`` at full IEEE precision (no TF32), so every
input dtype is accumulated in float32 from exact products. Results differ from the twin
only by float32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (bf16_dot_upcast, check_dtype, check_launchable, check_packed_weight, gdc_prologue, next_pow2,
                     pdl_options, scale_strides, split_k_chunks, split_k_reduce)
from .packing import BYTES_PER_CHUNK, CHUNK_K, unpack_ternary
from .tuning import GEMV, W2A8_ONLY, LinearConfig, default_linear, linear_key, lookup

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _w2a16_gemv_kernel(
    x_ptr,  # [M, K] float16 / bfloat16 / float32
    w_ptr,  # [N, K/4] uint8 packed codes
    w_scale_ptr,  # [N] or [N, K/128] float32
    out_ptr,  # [M, N] (SPLIT: [S, M, N] float32 partial sums)
    M, N, chunks_per_split,
    stride_xm, stride_wn, stride_sn, stride_sg, stride_om,
    K: tl.constexpr,
    GROUPED: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
):
    gdc_prologue(USE_GDC)
    N_CHUNKS: tl.constexpr = (K + 127) // 128  # the last chunk may be padded (zero weights)
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_lo = tl.program_id(2) * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, N_CHUNKS)
    rc = tl.arange(0, CHUNKS)
    rb = tl.arange(0, 32)
    mask_n = rn < N

    acc = tl.zeros((BLOCK_N, CHUNKS, 32), tl.float32)
    facc = tl.zeros((BLOCK_N,), tl.float32)
    for c0 in range(c_lo, c_hi, CHUNKS):
        c = c0 + rc
        mask_c = c < c_hi
        wb = tl.load(w_ptr + rn[:, None, None] * stride_wn + c[None, :, None] * 32 + rb[None, None, :],
                     mask=mask_n[:, None, None] & mask_c[None, :, None], other=0)  # [BLOCK_N, CHUNKS, 32]
        if GROUPED:
            acc = tl.zeros((BLOCK_N, CHUNKS, 32), tl.float32)
        for i in tl.static_range(4):
            kx = c[:, None] * 128 + 32 * i + rb[None, :]
            x = tl.load(x_ptr + m * stride_xm + kx, mask=mask_c[:, None] & (kx < K), other=0.0).to(tl.float32)
            w = ((wb >> (2 * i)) & 3).to(tl.float32) - 1.0
            acc += w * x[None, :, :]
        if GROUPED:
            s = tl.load(w_scale_ptr + rn[:, None] * stride_sn + c[None, :] * stride_sg,
                        mask=mask_n[:, None] & mask_c[None, :], other=0.0)  # [BLOCK_N, CHUNKS]
            facc += tl.sum(tl.sum(acc, axis=2) * s, axis=1)

    y = facc if GROUPED else tl.sum(tl.sum(acc, axis=2), axis=1)
    if SPLIT:
        tl.store(out_ptr + (tl.program_id(2) * M + m) * N + rn, y, mask=mask_n)
    else:
        if not GROUPED:
            y = y * tl.load(w_scale_ptr + rn * stride_sn, mask=mask_n, other=0.0)
        tl.store(out_ptr + m * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _w2a16_dot_kernel(
    x_ptr,  # [M, K] float16 / bfloat16 / float32
    w_ptr,  # [N, K/4] uint8 packed codes
    w_scale_ptr,  # [N] or [N, K/128] float32
    out_ptr,  # [M, N] (SPLIT: [S, M, N] float32 partial sums)
    M, N, chunks_per_split,
    stride_xm, stride_wn, stride_sn, stride_sg, stride_om,
    K: tl.constexpr,
    GROUPED: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 activations: no TF32 rounding
    UPCAST: tl.constexpr,  # interpreter only: bf16 tl.dot is wrong there (common.py)
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
):
    gdc_prologue(USE_GDC)
    N_CHUNKS: tl.constexpr = (K + 127) // 128  # the last chunk may be padded (zero weights)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    c_lo = tl.program_id(2) * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, N_CHUNKS)
    rb = tl.arange(0, 32)
    mask_m = rm < M
    mask_n = rn < N

    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    facc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for c0 in range(c_lo, c_hi, CHUNKS):
        for cc in tl.static_range(CHUNKS):
            c = c0 + cc
            ok = (c * 32 + rb) < c_hi * 32
            wb = tl.load(w_ptr + rn[:, None] * stride_wn + c * 32 + rb[None, :],
                         mask=mask_n[:, None] & ok[None, :], other=0)  # [BLOCK_N, 32] uint8
            if GROUPED:
                acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for i in tl.static_range(4):
                kx = c * 128 + 32 * i + rb
                x = tl.load(x_ptr + rm[None, :] * stride_xm + kx[:, None],
                            mask=mask_m[None, :] & (ok & (kx < K))[:, None], other=0.0)  # [32, BLOCK_M]
                # -1 / 0 / 1 are exact in every float dtype; the float32 hop avoids an int->bf16
                # convert that the interpreter gets wrong and costs one cvt on the GPU
                w = (((wb >> (2 * i)) & 3).to(tl.float32) - 1.0).to(x.dtype)
                if UPCAST:
                    acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w, x, acc, input_precision=PRECISION)
            if GROUPED:
                s = tl.load(w_scale_ptr + rn * stride_sn + c * stride_sg, mask=mask_n & (rn * 0 + c < c_hi),
                            other=0.0)
                facc += acc * s[:, None]

    y = facc if GROUPED else acc
    if SPLIT:
        tl.store(out_ptr + (tl.program_id(2) * M + rm[None, :]) * N + rn[:, None], y,
                 mask=mask_n[:, None] & mask_m[None, :])
    else:
        if not GROUPED:
            y = y * tl.load(w_scale_ptr + rn * stride_sn, mask=mask_n, other=0.0)[:, None]
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], y.to(out_ptr.dtype.element_ty),
                 mask=mask_n[:, None] & mask_m[None, :])


def w2a16_linear(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    packed: torch.Tensor,  # [N, K/4] uint8, layout ternary-2bit-k128x4-v1
    w_scale: torch.Tensor,  # [N, K/128] float32 per 128-group, or [N] float32 per row
    *,
    out_dtype: torch.dtype | None = None,  # default: x.dtype
    config: LinearConfig | None = None,
) -> torch.Tensor:  # [M, N]
    """``x @ (W * scale)^T`` with float32 accumulation; weight-only (no activation quant)."""
    check_dtype(x, X_DTYPES, "w2a16_linear: x")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"w2a16_linear: x must be 2-D [M, K] with contiguous rows, got {tuple(x.shape)}")
    m, k = x.shape
    n, grouped = check_packed_weight(packed, w_scale, k, "w2a16_linear")
    if w_scale.dim() == 0:
        w_scale = w_scale.reshape(1)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in X_DTYPES:
        raise TypeError(f"w2a16_linear: out_dtype {out_dtype} not supported, expected one of {X_DTYPES}")
    if config is None:
        config = (lookup("w2a16_linear", linear_key(n, k, m, grouped), packed.device)
                  or default_linear(m, grouped, weight_only=True, n=n, k=k))

    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    stride_sn, stride_sg = scale_strides(w_scale, grouped)
    chunks = config.block_kb // BYTES_PER_CHUNK
    per_split, n_split = split_k_chunks(triton.cdiv(k, CHUNK_K), config.split_k, chunks)
    split = n_split > 1
    target = torch.empty((n_split, m, n), dtype=torch.float32, device=x.device) if split else out
    common = dict(K=k, GROUPED=grouped, SPLIT=split, BLOCK_N=config.block_n, CHUNKS=chunks,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    args = (x, packed, w_scale, target, m, n, per_split,
            x.stride(0), packed.stride(0), stride_sn, stride_sg, out.stride(0))
    if config.kernel in W2A8_ONLY:
        raise ValueError(f"w2a16_linear: the {config.kernel!r} kernel is W2A8 only; use 'gemv' or 'dot'")
    if config.kernel == GEMV:
        check_launchable(_w2a16_gemv_kernel, x, packed, w_scale)
        _w2a16_gemv_kernel[(m, triton.cdiv(n, config.block_n), n_split)](*args, **common,
                                                                          **pdl_options(_w2a16_gemv_kernel))
    else:
        check_launchable(_w2a16_dot_kernel, x, packed, w_scale)
        block_m = max(16, min(next_pow2(m), 64))
        grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m), n_split)
        _w2a16_dot_kernel[grid](*args, BLOCK_M=block_m,
                                PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                                UPCAST=bf16_dot_upcast(_w2a16_dot_kernel, x), **common,
                                **pdl_options(_w2a16_dot_kernel))
    if split:
        split_k_reduce(target, out, None, None if grouped else w_scale, stride_sn)
    return out


def w2a16_linear_reference(
    x: torch.Tensor,  # [M, K] float
    packed: torch.Tensor,  # [N, K/4] uint8
    w_scale: torch.Tensor,  # [N, K/128] / [N] / [1] float32
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [M, N]
    """The pure-PyTorch twin: float32 per-group partial sums, scaled, summed."""
    codes = unpack_ternary(packed).float()  # [N, Kp]: K padded to whole chunks with zero weights
    m, k = x.shape
    n, kp = codes.shape
    x32 = torch.nn.functional.pad(x.float(), (0, kp - k))  # the padding inputs meet zero weights
    if w_scale.dim() == 2:
        g = kp // CHUNK_K
        part = torch.einsum("mgk,ngk->mng", x32.view(m, g, CHUNK_K), codes.view(n, g, CHUNK_K))
        y = (part * w_scale[None]).sum(-1)
    else:
        y = (x32 @ codes.t()) * w_scale.expand(n)[None, :]
    return y.to(x.dtype if out_dtype is None else out_dtype)
