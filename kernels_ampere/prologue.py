"""Per-token int8 quantisation as a *prologue*: the statistics of an activation row in a fixed
summation order, and the int8 value of any element from them.

The fused-quant kernels and the W2A8 linears that quantise their own input (``w2a8``'s
``fused_w2a8_linear``) share these helpers, so an AR row, the same row inside a verify, and
the row quantised by a separate launch all get the same bits (see ``fused_quant`` for the
formula). What makes that possible is the order of ``sum(h**2)``:

    acc[l] = sum over j = 0, 1, ... of h[256 j + l]**2      (256 lanes, each summed in order)
    total  = pairwise tree over the lanes: (0+1), (2+3), ... then pairs of those, ...

Both steps are elementwise adds of two named operands, and a sum of two floats does not
depend on which comes first, so the result is a function of the row alone: not of the
kernel's tile shape, its ``num_warps``, or how many rows a call has (``tl.sum``'s order
follows the register layout, which follows all three). The twin below sums in the same
order, so the fused-quant kernels are now bit-exact to their twins (SiLU's ``exp`` aside).
Launches that use these helpers must disable FMA contraction (``enable_fp_fusion=False``):
``acc + h*h`` must round the product first, as torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitmtp_edge.quant import ACT_NONE, ACT_QMAX, ACT_RELU2, ACT_SILU, SCALE_EPS, div_f32, sqrt_f32  # noqa: F401

from .common import round_half_even

STAT_LANES = tl.constexpr(256)
LANES = 256
QMAX = tl.constexpr(ACT_QMAX)  # q = QMAX / max(absmax, EPS_AMAX), as quantize_activations
EPS_AMAX = tl.constexpr(SCALE_EPS)



@triton.jit
def _halve(v, R: tl.constexpr, H: tl.constexpr):
    """[R, 2H] -> [R, H]: element 2i + 2i+1 of every row."""
    a, b = tl.split(tl.reshape(v, (R, H, 2)))
    return a + b


@triton.jit
def lane_tree_sum(v, R: tl.constexpr):
    """[R, 256] -> [R]: the fixed pairwise tree over the lanes."""
    v = _halve(v, R, 128)
    v = _halve(v, R, 64)
    v = _halve(v, R, 32)
    v = _halve(v, R, 16)
    v = _halve(v, R, 8)
    v = _halve(v, R, 4)
    v = _halve(v, R, 2)
    v = _halve(v, R, 1)
    return tl.reshape(v, (R,))


@triton.jit
def activation(x_ptr, up_ptr, offs_x, offs_u, mask, ACT: tl.constexpr):
    """h in float32: x itself, relu(gate)**2 * up, or silu(gate) * up (any tile shape)."""
    h = tl.load(x_ptr + offs_x, mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:
        up = tl.load(up_ptr + offs_u, mask=mask, other=0.0).to(tl.float32)
        r = tl.maximum(h, 0.0)
        h = r * r * up
    elif ACT == 2:
        up = tl.load(up_ptr + offs_u, mask=mask, other=0.0).to(tl.float32)
        h = h / (1.0 + tl.exp(-h)) * up
    return h


@triton.jit
def normed(h, w_ptr, cols, mask, inv, NORM: tl.constexpr):
    """w * (h * inv) where the op has an RMSNorm (``inv`` broadcast to h's shape by the caller)."""
    if NORM:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        h = w * (h * inv)
    return h


@triton.jit
def quantized(h, q):
    """clamp(round_half_even(h * q), -128, 127), still float32 (an integer value)."""
    return tl.minimum(tl.maximum(round_half_even(h * q), -128.0), 127.0)


@triton.jit
def row_inv_rms(x_ptr, up_ptr, rows, mask_r, stride_xm, stride_um, K, eps,
                R: tl.constexpr, STEPS: tl.constexpr, ACT: tl.constexpr):
    """[R] ``1 / sqrt(mean(h**2) + eps)`` of the rows ``rows`` (``mask_r``: valid), the mean
    square in the fixed order; 256-lane steps (``STEPS = cdiv(K, 256)``), unrolled so the
    loads issue together."""
    lanes = tl.arange(0, STAT_LANES)
    acc = tl.zeros((R, STAT_LANES), tl.float32)
    for j in tl.static_range(STEPS):
        cols = j * STAT_LANES + lanes
        mask = mask_r[:, None] & (cols < K)[None, :]
        h = activation(x_ptr, up_ptr, rows[:, None] * stride_xm + cols[None, :],
                       rows[:, None] * stride_um + cols[None, :], mask, ACT)
        acc = acc + h * h
    # K and eps as float32 tensors: the interpreter keeps scalar arguments in float64, which
    # would turn ``ms + eps`` into a float64 add (the GPU adds in float32)
    ms = tl.div_rn(lane_tree_sum(acc, R), tl.full((R,), K, tl.float32))
    return tl.div_rn(1.0, tl.sqrt_rn(ms + tl.full((R,), eps, tl.float32)))


@triton.jit
def row_quant_stats(x_ptr, up_ptr, w_ptr, rows, mask_r, stride_xm, stride_um, K, eps,
                    R: tl.constexpr, STEPS: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr,
                    QMAX: tl.constexpr, EPS_AMAX: tl.constexpr):
    """(inv_rms [R], q = QMAX / absmax [R]) of the rows ``rows``: the norm's scale (1 without
    a norm), then a second pass for the absmax of the normed row."""
    if NORM:
        inv = row_inv_rms(x_ptr, up_ptr, rows, mask_r, stride_xm, stride_um, K, eps, R, STEPS, ACT)
    else:
        inv = tl.full((R,), 1.0, tl.float32)
    lanes = tl.arange(0, STAT_LANES)
    amax = tl.zeros((R, STAT_LANES), tl.float32)
    for j in tl.static_range(STEPS):
        cols = j * STAT_LANES + lanes
        mask = mask_r[:, None] & (cols < K)[None, :]
        h = activation(x_ptr, up_ptr, rows[:, None] * stride_xm + cols[None, :],
                       rows[:, None] * stride_um + cols[None, :], mask, ACT)
        h = normed(h, w_ptr, cols[None, :], mask, inv[:, None], NORM)
        amax = tl.maximum(amax, tl.abs(h))
    amax = tl.maximum(tl.max(amax, axis=1), EPS_AMAX)
    return inv, tl.div_rn(QMAX, amax)


def stat_steps(k: int) -> int:
    return triton.cdiv(max(int(k), 1), LANES)


# --- the twin's order ----------------------------------------------------------------------

def mean_square_reference(h: torch.Tensor) -> torch.Tensor:
    """[M, K] float32 -> [M, 1]: ``sum(h**2) / K`` summed in the kernels' fixed order."""
    m, k = h.shape
    padded = torch.zeros((m, stat_steps(k) * LANES), dtype=torch.float32, device=h.device)
    padded[:, :k] = h
    sq = (padded * padded).view(m, -1, LANES)
    acc = sq[:, 0]
    for j in range(1, sq.shape[1]):
        acc = acc + sq[:, j]
    while acc.shape[1] > 1:
        pairs = acc.view(m, -1, 2)
        acc = pairs[..., 0] + pairs[..., 1]
    return div_f32(acc, float(k))  # [M, 1]


def rms_norm_fixed_order_reference(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * (h * (1 / sqrt(mean(h**2) + eps)))`` in float32, the kernels' order and roundings."""
    h = h.float()
    inv = div_f32(1.0, sqrt_f32(mean_square_reference(h) + torch.tensor(eps, dtype=torch.float32)))
    return weight.float() * (h * inv)
