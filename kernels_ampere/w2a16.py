"""Packed ternary weights x unquantised 16/32-bit activations (weight-only, Bonsai-style).

    out[m, n] = sum_g w_scale[n, g] * sum_{k in g} x[m, k] * W[n, k]        (group-128)
    out[m, n] = w_scale[n] * sum_k x[m, k] * W[n, k]                        (per row)

Same packed layout and the same two kernels as ``w2a8.py`` (read its docstring), with
float arithmetic: ``gemv`` turns each code into ``c - 1`` in float32 and multiplies-adds in
registers; ``dot`` unpacks a byte tile to ``c - 1`` in the activation dtype (exact: the
values are -1, 0, 1) and feeds ``tl.dot`` with float32 accumulators. Group scales are
applied once per 128-chunk, after the chunk's sum, so a step never straddles two groups.

Float32 activations go through ``tl.dot`` at full IEEE precision (no TF32), so every
input dtype is accumulated in float32 from exact products. Results differ from the twin
only by float32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (bf16_dot_upcast, check_dtype, check_launchable, check_packed_weight, next_pow2,
                     scale_strides)
from .packing import BYTES_PER_CHUNK, CHUNK_K, unpack_ternary
from .tuning import GEMV, LinearConfig, default_linear, linear_key, lookup

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _w2a16_gemv_kernel(
    x_ptr,  # [M, K] float16 / bfloat16 / float32
    w_ptr,  # [N, K/4] uint8 packed codes
    w_scale_ptr,  # [N] or [N, K/128] float32
    out_ptr,  # [M, N]
    M, N,
    stride_xm, stride_wn, stride_sn, stride_sg, stride_om,
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
    k_of_b = 128 * (rb // 32) + rb % 32  # input index of byte column b, lane 0

    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_KB), tl.float32)
    facc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for b0 in range(0, KB, BLOCK_KB):
        mask_b = (b0 + rb) < KB
        wb = tl.load(w_ptr + rn[:, None] * stride_wn + (b0 + rb)[None, :],
                     mask=mask_n[:, None] & mask_b[None, :], other=0)  # [BLOCK_N, BLOCK_KB] uint8
        if GROUPED:
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_KB), tl.float32)
        for i in tl.static_range(4):
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (4 * b0 + 32 * i + k_of_b)[None, :],
                        mask=mask_m[:, None] & mask_b[None, :], other=0.0).to(tl.float32)
            w = ((wb >> (2 * i)) & 3).to(tl.float32) - 1.0
            acc += w[None, :, :] * x[:, None, :]
        if GROUPED:  # BLOCK_KB == 32: this step was exactly chunk g
            s = tl.load(w_scale_ptr + rn * stride_sn + (b0 // 32) * stride_sg, mask=mask_n, other=0.0)
            facc += tl.sum(acc, axis=2) * s[None, :]

    if GROUPED:
        y = facc
    else:
        ws = tl.load(w_scale_ptr + rn * stride_sn, mask=mask_n, other=0.0)
        y = tl.sum(acc, axis=2) * ws[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _w2a16_dot_kernel(
    x_ptr,  # [M, K] float16 / bfloat16 / float32
    w_ptr,  # [N, K/4] uint8 packed codes
    w_scale_ptr,  # [N] or [N, K/128] float32
    out_ptr,  # [M, N]
    M, N,
    stride_xm, stride_wn, stride_sn, stride_sg, stride_om,
    K: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 activations: no TF32 rounding
    UPCAST: tl.constexpr,  # interpreter only: bf16 tl.dot is wrong there (common.py)
):
    KB: tl.constexpr = K // 4
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_KB)
    mask_m = rm < M
    mask_n = rn < N
    k_of_b = 128 * (rb // 32) + rb % 32

    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    facc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for b0 in range(0, KB, BLOCK_KB):
        mask_b = (b0 + rb) < KB
        wb = tl.load(w_ptr + rn[:, None] * stride_wn + (b0 + rb)[None, :],
                     mask=mask_n[:, None] & mask_b[None, :], other=0)  # [BLOCK_N, BLOCK_KB] uint8
        if GROUPED:
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for i in tl.static_range(4):
            x = tl.load(x_ptr + rm[None, :] * stride_xm + (4 * b0 + 32 * i + k_of_b)[:, None],
                        mask=mask_m[None, :] & mask_b[:, None], other=0.0)  # [BLOCK_KB, BLOCK_M]
            # -1 / 0 / 1 are exact in every float dtype; the float32 hop avoids an int->bf16
            # convert that the interpreter gets wrong and costs one cvt on the GPU
            w = (((wb >> (2 * i)) & 3).to(tl.float32) - 1.0).to(x.dtype)
            if UPCAST:
                acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, x, acc, input_precision=PRECISION)
        if GROUPED:
            s = tl.load(w_scale_ptr + rn * stride_sn + (b0 // 32) * stride_sg, mask=mask_n, other=0.0)
            facc += acc * s[:, None]

    if GROUPED:
        y = facc
    else:
        ws = tl.load(w_scale_ptr + rn * stride_sn, mask=mask_n, other=0.0)
        y = acc * ws[:, None]
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
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in X_DTYPES:
        raise TypeError(f"w2a16_linear: out_dtype {out_dtype} not supported, expected one of {X_DTYPES}")
    if config is None:
        config = (lookup("w2a16_linear", linear_key(n, k, m, grouped), packed.device)
                  or default_linear(m, grouped, weight_only=True))
    if grouped and config.block_kb != BYTES_PER_CHUNK:
        raise ValueError(f"w2a16_linear: group-128 scales need block_kb={BYTES_PER_CHUNK}, "
                         f"config has {config.block_kb}")

    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    stride_sn, stride_sg = scale_strides(w_scale, grouped)
    common = dict(K=k, GROUPED=grouped, BLOCK_N=config.block_n, BLOCK_KB=config.block_kb,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    strides = (x.stride(0), packed.stride(0), stride_sn, stride_sg, out.stride(0))
    if config.kernel == GEMV:
        check_launchable(_w2a16_gemv_kernel, x, packed, w_scale)
        block_m = min(next_pow2(m), 8)
        grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m))
        _w2a16_gemv_kernel[grid](x, packed, w_scale, out, m, n, *strides, BLOCK_M=block_m, **common)
    else:
        check_launchable(_w2a16_dot_kernel, x, packed, w_scale)
        block_m = max(16, min(next_pow2(m), 64))
        grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m))
        _w2a16_dot_kernel[grid](x, packed, w_scale, out, m, n, *strides, BLOCK_M=block_m,
                                PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                                UPCAST=bf16_dot_upcast(_w2a16_dot_kernel, x), **common)
    return out


def w2a16_linear_reference(
    x: torch.Tensor,  # [M, K] float
    packed: torch.Tensor,  # [N, K/4] uint8
    w_scale: torch.Tensor,  # [N, K/128] / [N] / [1] float32
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [M, N]
    """The pure-PyTorch twin: float32 per-group partial sums, scaled, summed."""
    codes = unpack_ternary(packed).float()  # [N, K]
    m, k = x.shape
    n = codes.shape[0]
    x32 = x.float()
    if w_scale.dim() == 2:
        g = k // CHUNK_K
        part = torch.einsum("mgk,ngk->mng", x32.view(m, g, CHUNK_K), codes.view(n, g, CHUNK_K))
        y = (part * w_scale[None]).sum(-1)
    else:
        y = (x32 @ codes.t()) * w_scale.expand(n)[None, :]
    return y.to(x.dtype if out_dtype is None else out_dtype)
