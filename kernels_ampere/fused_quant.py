"""Fused prologues that end in per-token int8 quantisation: the producer of every W2A8 input.

One row per program, read in 256-lane steps (``prologue.py``: the statistics pass or two,
then the int8 row and its scale). Everything is float32 whatever the input dtype:

    h = x                                  (rmsnorm_quant, act_quant)
    h = relu(gate)**2 * up                 (relu2_mul_rmsnorm_quant: BitNet FFN + ffn_sub_norm)
    h = silu(gate) * up                    (silu_mul_quant: Qwen3 / Bonsai FFN, no sub-norm)
    h = w * (h * rsqrt(mean(h**2) + eps))  (the RMSNorm, when the op has one: not act_quant)
    q = 127 / max(max|h|, 1e-5);  x_int8 = clamp(round_half_even(h * q), -128, 127);  a_scale = 1 / q

The quantisation is ``bitmtp_edge.quant.quantize_activations`` step for step: ``q`` and
``1/q`` are correctly rounded divisions (``div_rn``), ``rsqrt`` is ``1 / sqrt_rn`` as
torch's CPU rsqrt computes it, and ``mean(h**2)`` is summed in ``prologue.py``'s fixed order
by kernel and twin alike, so the results are bit-identical to the twins -- except SiLU,
whose ``exp`` is the GPU's: it can move an element across a rounding boundary (an int8
value by one), rarely. The same helpers quantise inside ``w2a8.fused_w2a8_linear``, so a
separate quantisation launch and a fused one give the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bitmtp_edge.quant import ACT_QMAX, SCALE_EPS, quantize_activations

from .common import bf16_rne, check_dtype, check_launchable
from .prologue import (ACT_NONE, ACT_RELU2, ACT_SILU, STAT_LANES, activation, normed, quantized, rms_norm_fixed_order_reference,
                       row_inv_rms, row_quant_stats, stat_steps)
IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _fused_quant_kernel(
    x_ptr,  # [M, K] float: the input, or the gate when ACT != NONE
    up_ptr,  # [M, K] float (read only when ACT != NONE)
    w_ptr,  # [K] float RMSNorm weight (read only when NORM)
    q_ptr,  # [M, K] int8 out
    scale_ptr,  # [M] float32 out: absmax / 127 (= 1/q)
    stride_xm, stride_um, stride_qm,
    K, eps,
    ACT: tl.constexpr, NORM: tl.constexpr,
    QMAX: tl.constexpr, EPS_AMAX: tl.constexpr,
    STEPS: tl.constexpr,  # cdiv(K, 256)
    QUANT: tl.constexpr = True, OUT_BF16: tl.constexpr = False,  # QUANT=False: store h in q_ptr's dtype
):
    rows = tl.program_id(0) + tl.arange(0, 1)  # one row per program
    valid = rows >= 0
    if QUANT:
        inv, q = row_quant_stats(x_ptr, up_ptr, w_ptr, rows, valid, stride_xm, stride_um, K, eps,
                                 1, STEPS, ACT, NORM, QMAX, EPS_AMAX)
        tl.store(scale_ptr + rows, tl.div_rn(1.0, q))
    elif NORM:
        inv = row_inv_rms(x_ptr, up_ptr, rows, valid, stride_xm, stride_um, K, eps, 1, STEPS, ACT)
    else:
        inv = tl.full((1,), 1.0, tl.float32)
    lanes = tl.arange(0, STAT_LANES)
    for j in tl.static_range(STEPS):
        cols = j * STAT_LANES + lanes
        mask = (cols < K)[None, :]
        h = activation(x_ptr, up_ptr, rows[:, None] * stride_xm + cols[None, :],
                       rows[:, None] * stride_um + cols[None, :], mask, ACT)
        h = normed(h, w_ptr, cols[None, :], mask, inv[:, None], NORM)
        if QUANT:
            tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], quantized(h, q[:, None]).to(tl.int8), mask=mask)
        else:
            if OUT_BF16:
                h = bf16_rne(h)
            tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], h.to(q_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, up: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
            act: int, name: str, out_dtype: torch.dtype | None = None):
    """-> (x_int8, a_scale); with ``out_dtype``, no quantisation: h itself in that dtype."""
    check_dtype(x, IN_DTYPES, f"{name}: input")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name}: input must be 2-D [M, K] with contiguous rows, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    m, k = x.shape
    if up is not None:
        check_dtype(up, IN_DTYPES, f"{name}: up")
        if up.shape != x.shape or up.stride(1) != 1:
            raise ValueError(f"{name}: gate {tuple(x.shape)} and up {tuple(up.shape)} must match, rows contiguous")
    if weight is not None:
        if weight.shape != (k,):
            raise ValueError(f"{name}: norm weight must be [K]={k}, got {tuple(weight.shape)}")
        weight = weight.contiguous()
    if out_dtype is not None and out_dtype not in IN_DTYPES:
        raise TypeError(f"{name}: out_dtype {out_dtype} not supported, expected one of {IN_DTYPES}")
    out = torch.empty((m, k), dtype=out_dtype or torch.int8, device=x.device)
    a_scale = torch.empty((m,), dtype=torch.float32, device=x.device) if out_dtype is None else None
    if m:
        check_launchable(_fused_quant_kernel, *(t for t in (x, up, weight) if t is not None))
        _fused_quant_kernel[(m,)](
            x, x if up is None else up, x if weight is None else weight, out, out if a_scale is None else a_scale,
            x.stride(0), 0 if up is None else up.stride(0), out.stride(0),
            k, float(eps),
            ACT=act, NORM=weight is not None, QMAX=ACT_QMAX, EPS_AMAX=SCALE_EPS,
            STEPS=stat_steps(k), QUANT=out_dtype is None, OUT_BF16=out_dtype == torch.bfloat16,
            num_warps=2,  # a [1, 256] tile per step: two warps hold it with four lanes a thread
            # no FMA contraction: h * q and h * h must round to float32 before the adds, as in
            # the twin (a fused multiply-add would round once, differently)
            enable_fp_fusion=False,
        )
    return out if out_dtype is not None else (out, a_scale)


def rmsnorm_quant(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    weight: torch.Tensor,  # [K] RMSNorm weight
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, K] int8, [M] float32)
    """RMSNorm then per-token absmax int8 quantisation, in one pass."""
    return _launch(x, None, weight, eps, ACT_NONE, "rmsnorm_quant")


def rmsnorm_cast(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    weight: torch.Tensor,  # [K] RMSNorm weight
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, K] out_dtype
    """RMSNorm in float32, then a cast: the 16-bit head's input. One program per row, so a
    row's bits do not depend on how many rows the call has (torch's reductions pick their
    strategy from the shape: an AR row and the same row in a verify could differ)."""
    return _launch(x, None, weight, eps, ACT_NONE, "rmsnorm_cast", out_dtype=out_dtype)


def act_quant(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, K] int8, [M] float32)
    """Per-token absmax int8 quantisation alone (an input without a norm in front)."""
    return _launch(x, None, None, 0.0, ACT_NONE, "act_quant")


def relu2_mul_rmsnorm_quant(
    gate: torch.Tensor,  # [M, F] float (may be a column slice of the fused gate/up output)
    up: torch.Tensor,  # [M, F] float
    subnorm_weight: torch.Tensor,  # [F] ffn_sub_norm weight
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, F] int8, [M] float32)
    """BitNet FFN middle: relu(gate)**2 * up, RMSNorm (sub-norm), int8 quantisation."""
    return _launch(gate, up, subnorm_weight, eps, ACT_RELU2, "relu2_mul_rmsnorm_quant")


def silu_mul_quant(
    gate: torch.Tensor,  # [M, F] float
    up: torch.Tensor,  # [M, F] float
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, F] int8, [M] float32)
    """Qwen3-style FFN middle: silu(gate) * up, then int8 quantisation (no sub-norm)."""
    return _launch(gate, up, None, 0.0, ACT_SILU, "silu_mul_quant")


# --- pure-PyTorch twins --------------------------------------------------------------------

def rms_norm_reference(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * (h * rsqrt(mean(h**2) + eps)) in float32 (torch's order: the RoPE twin's QK-norm)."""
    h = h.float()
    return weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


def rmsnorm_cast_reference(x, weight, eps, out_dtype):
    return rms_norm_fixed_order_reference(x, weight, eps).to(out_dtype)


def fused_quant_reference(x, up, norm_weight, eps, act):
    """The twin of every op here (and of a ``fused_w2a8_linear`` prologue), by (act, norm)."""
    if act == ACT_RELU2:
        r = F.relu(x.float())
        h = r * r * up.float()
    elif act == ACT_SILU:
        h = F.silu(x.float()) * up.float()
    else:
        h = x.float()
    return quantize_activations(h if norm_weight is None else rms_norm_fixed_order_reference(h, norm_weight, eps))


def act_quant_reference(x):
    return fused_quant_reference(x, None, None, 0.0, ACT_NONE)


def rmsnorm_quant_reference(x, weight, eps):
    return fused_quant_reference(x, None, weight, eps, ACT_NONE)


def relu2_mul_rmsnorm_quant_reference(gate, up, subnorm_weight, eps):
    return fused_quant_reference(gate, up, subnorm_weight, eps, ACT_RELU2)


def silu_mul_quant_reference(gate, up):
    return fused_quant_reference(gate, up, None, 0.0, ACT_SILU)
