"""The operator set a fast backend runs its model with: Triton kernels, or their twins.

``kernel_ops`` binds ``kernels_ampere``'s Triton kernels (no FP8); ``twin_ops`` binds each
kernel's pure-PyTorch twin — the same signatures and numerics, so a CPU run of the fast
backend checks every line of its static-buffer logic against the reference backend.
Both are ordinary imports: go-to-definition on any line below lands in the kernel.
``specialize_widths=False`` is the Generic ablation: one launch configuration for every
width M instead of the width-specialised table (paper Table 5, "Generic").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Ops:
    """Bound operator functions (``ops.rmsnorm_quant(...)`` etc.), kernels or twins."""

    name: str
    twin: bool
    specialize_widths: bool
    w2a8_linear: Callable
    w2a16_linear: Callable
    rmsnorm_quant: Callable
    rmsnorm_cast: Callable
    act_quant: Callable
    relu2_mul_rmsnorm_quant: Callable
    silu_mul_quant: Callable
    rope_qkv_to_cache: Callable
    small_width_attention: Callable
    int8_head_argmax: Callable
    int4_head_argmax: Callable
    f16_head_argmax: Callable
    certify_tokens: Callable  # kernels_ampere.certified_head: the int8 pass and its candidates
    certify_fused_rows: Callable  # ... and a fused step's rows: verify rows certified, draft rows' int8 argmax

    def certified_head_argmax(self, h, w16, w_int8, w_scale, err_norm, magnitude, code_norm, drafts=None):
        """The 16-bit head's argmax, from the int8 head where certified (``certified_head.py``)."""
        from kernels_ampere.certified_head import certified_head_argmax

        return certified_head_argmax(h, w16, w_int8, w_scale, err_norm, magnitude, code_norm,
                                     certify=self.certify_tokens, f16_head=self.f16_head_argmax, drafts=drafts)

    def certified_fused_head(self, h, w16, w_int8, w_scale, err_norm, magnitude, code_norm, *, n, drafts):
        """A fused step's head rows with the certified head (``certified_head.certified_fused_head``)."""
        from kernels_ampere.certified_head import certified_fused_head

        return certified_fused_head(h, w16, w_int8, w_scale, err_norm, magnitude, code_norm, n=n, drafts=drafts,
                                    certify_rows=self.certify_fused_rows, f16_head=self.f16_head_argmax)

    def linear_w2a8(self, a_int8, a_scale, packed, w_scale, out_dtype=torch.float32, residual=None,
                    next_weights=None):
        """``next_weights``: the packed weights the step reads next, which the kernel asks the L2
        for (a hint: the twin has no cache to warm)."""
        if self.twin:
            return self.w2a8_linear(a_int8, a_scale, packed, w_scale, out_dtype=out_dtype, residual=residual)
        return self.w2a8_linear(a_int8, a_scale, packed, w_scale, out_dtype=out_dtype, residual=residual,
                                config=None if self.specialize_widths else _generic_linear(w_scale.dim() == 2),
                                next_weights=next_weights)

    def linear_w2a16(self, x, packed, w_scale, out_dtype=torch.float32):
        if self.twin:
            return self.w2a16_linear(x, packed, w_scale, out_dtype=out_dtype)
        return self.w2a16_linear(x, packed, w_scale, out_dtype=out_dtype,
                                 config=None if self.specialize_widths else _generic_linear(w_scale.dim() == 2))


def kernel_ops(specialize_widths: bool = True) -> Ops:
    """The Triton kernels (imports Triton)."""
    from kernels_ampere.attention import small_width_attention
    from kernels_ampere.certified_head import certify_fused_rows, certify_tokens
    from kernels_ampere.fused_quant import (act_quant, relu2_mul_rmsnorm_quant, rmsnorm_cast, rmsnorm_quant,
                                            silu_mul_quant)
    from kernels_ampere.heads import f16_head_argmax, int4_head_argmax, int8_head_argmax
    from kernels_ampere.rope_cache import rope_qkv_to_cache
    from kernels_ampere.w2a8 import w2a8_linear
    from kernels_ampere.w2a16 import w2a16_linear

    return Ops("triton", False, specialize_widths, w2a8_linear=w2a8_linear, w2a16_linear=w2a16_linear,
               rmsnorm_quant=rmsnorm_quant, rmsnorm_cast=rmsnorm_cast, act_quant=act_quant,
               relu2_mul_rmsnorm_quant=relu2_mul_rmsnorm_quant, silu_mul_quant=silu_mul_quant,
               rope_qkv_to_cache=rope_qkv_to_cache, small_width_attention=small_width_attention,
               int8_head_argmax=int8_head_argmax, int4_head_argmax=int4_head_argmax,
               f16_head_argmax=f16_head_argmax, certify_tokens=certify_tokens, certify_fused_rows=certify_fused_rows)


def twin_ops(specialize_widths: bool = True) -> Ops:
    """The kernels' pure-PyTorch twins (they live next to their kernels, so this imports Triton too)."""
    from kernels_ampere.attention import small_width_attention_reference
    from kernels_ampere.certified_head import certify_fused_rows_reference, certify_tokens_reference
    from kernels_ampere.fused_quant import (act_quant_reference, relu2_mul_rmsnorm_quant_reference,
                                            rmsnorm_cast_reference, rmsnorm_quant_reference,
                                            silu_mul_quant_reference)
    from kernels_ampere.heads import (f16_head_argmax_reference, int4_head_argmax_reference,
                                      int8_head_argmax_reference)
    from kernels_ampere.rope_cache import rope_qkv_to_cache_reference
    from kernels_ampere.w2a8 import w2a8_linear_reference
    from kernels_ampere.w2a16 import w2a16_linear_reference

    return Ops("torch-twins", True, specialize_widths, w2a8_linear=w2a8_linear_reference,
               w2a16_linear=w2a16_linear_reference, rmsnorm_quant=rmsnorm_quant_reference,
               rmsnorm_cast=rmsnorm_cast_reference, act_quant=act_quant_reference,
               relu2_mul_rmsnorm_quant=relu2_mul_rmsnorm_quant_reference, silu_mul_quant=silu_mul_quant_reference,
               rope_qkv_to_cache=rope_qkv_to_cache_reference,
               small_width_attention=small_width_attention_reference,
               int8_head_argmax=int8_head_argmax_reference, int4_head_argmax=int4_head_argmax_reference,
               f16_head_argmax=f16_head_argmax_reference,
               certify_tokens=certify_tokens_reference, certify_fused_rows=certify_fused_rows_reference)


def _generic_linear(grouped: bool):
    from kernels_ampere.tuning import default_linear

    # One tensor-core configuration for every width: what a width-agnostic runtime runs.
    return default_linear(16, grouped)


def kernel_ops_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        kernel_ops()
    except ImportError:
        return False
    return True
