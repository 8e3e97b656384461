"""Fused prologues that end in per-token int8 quantisation: the producer of every W2A8 input.

One row per program, the whole row in registers, one read of the input and one write of
the int8 row and its scale. Everything is float32 whatever the input dtype:

    h = x                                  (rmsnorm_quant, act_quant)
    h = relu(gate)**2 * up                 (relu2_mul_rmsnorm_quant: BitNet FFN + ffn_sub_norm)
    h = silu(gate) * up                    (silu_mul_quant: Qwen3 / Bonsai FFN, no sub-norm)
    h = w * (h * rsqrt(mean(h**2) + eps))  (the RMSNorm, when the op has one: not act_quant)
    q = 127 / max(max|h|, 1e-5);  x_int8 = clamp(round_half_even(h * q), -128, 127);  a_scale = 1 / q

The quantisation is ``kernels_ampere.numerics.quantize_activations`` step for step: ``q`` and
``1/q`` are correctly rounded divisions (``div_rn``), ``rsqrt`` is ``1 / sqrt_rn`` as
torch's CPU rsqrt computes it. The only differences from the twins are the float32
summation order of ``mean(h**2)`` and, for SiLU, the GPU's ``exp``; each can move an
element across a rounding boundary, i.e. change an int8 value by one, rarely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .numerics import ACT_QMAX, SCALE_EPS, quantize_activations

from .common import bf16_rne, check_dtype, check_launchable, gdc_prologue, next_pow2, pdl_options, round_half_even

ACT_NONE, ACT_RELU2, ACT_SILU = 0, 1, 2
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
    BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr = True, OUT_BF16: tl.constexpr = False,  # QUANT=False: store h in q_ptr's dtype
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
):
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    if NORM:  # a constant: read before waiting for the producer of x (its DRAM latency off the path)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    gdc_prologue(USE_GDC)
    row = tl.program_id(0)
    h = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:
        up = tl.load(up_ptr + row * stride_um + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.maximum(h, 0.0)
        h = r * r * up
    elif ACT == 2:
        up = tl.load(up_ptr + row * stride_um + cols, mask=mask, other=0.0).to(tl.float32)
        h = h / (1.0 + tl.exp(-h)) * up
    if NORM:
        ms = tl.div_rn(tl.sum(h * h, axis=0), K * 1.0)
        inv = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
        h = w * (h * inv)
    if QUANT:
        amax = tl.maximum(tl.max(tl.abs(h), axis=0), EPS_AMAX)
        q = tl.div_rn(QMAX, amax)
        xq = tl.minimum(tl.maximum(round_half_even(h * q), -128.0), 127.0)
        tl.store(q_ptr + row * stride_qm + cols, xq.to(tl.int8), mask=mask)
        tl.store(scale_ptr + row, tl.div_rn(1.0, q))
    else:
        if OUT_BF16:
            h = bf16_rne(h)
        tl.store(q_ptr + row * stride_qm + cols, h.to(q_ptr.dtype.element_ty), mask=mask)


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
        block_k = next_pow2(k)
        _fused_quant_kernel[(m,)](
            x, x if up is None else up, x if weight is None else weight, out, out if a_scale is None else a_scale,
            x.stride(0), 0 if up is None else up.stride(0), out.stride(0),
            k, float(eps),
            ACT=act, NORM=weight is not None, QMAX=ACT_QMAX, EPS_AMAX=SCALE_EPS,
            BLOCK_K=block_k, QUANT=out_dtype is None, OUT_BF16=out_dtype == torch.bfloat16,
            num_warps=min(max(block_k // 512, 1), 16),
            # no FMA contraction: h * q must round to float32 before the round-half-even add,
            # exactly as in the twin (a fused multiply-add would round once, differently)
            enable_fp_fusion=False, **pdl_options(_fused_quant_kernel),
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
    """w * (h * rsqrt(mean(h**2) + eps)) in float32."""
    h = h.float()
    return weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


def rmsnorm_cast_reference(x, weight, eps, out_dtype):
    return rms_norm_reference(x, weight, eps).to(out_dtype)


def act_quant_reference(x):
    return quantize_activations(x.float())


def rmsnorm_quant_reference(x, weight, eps):
    return quantize_activations(rms_norm_reference(x, weight, eps))


def relu2_mul_rmsnorm_quant_reference(gate, up, subnorm_weight, eps):
    h = F.relu(gate.float()) ** 2 * up.float()
    return quantize_activations(rms_norm_reference(h, subnorm_weight, eps))


def silu_mul_quant_reference(gate, up):
    return quantize_activations(F.silu(gate.float()) * up.float())
