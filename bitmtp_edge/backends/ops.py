"""The operator set a fast backend runs its model with: Triton kernels, or their twins.

``KernelOps`` calls ``kernels_ampere`` (Triton, no FP8); ``TwinOps`` calls each kernel's
pure-PyTorch twin — the same signatures and numerics, so a CPU run of the fast backend
checks every line of its static-buffer logic against the reference backend.
``specialize_widths=False`` is the Generic ablation: one launch configuration for every
width M instead of the width-specialised table (paper Table 5, "Generic").
"""

from __future__ import annotations

import torch

KERNELS = ("w2a8_linear", "w2a16_linear", "rmsnorm_quant", "rmsnorm_cast", "act_quant", "relu2_mul_rmsnorm_quant",
           "silu_mul_quant", "rope_qkv_to_cache", "small_width_attention", "int8_head_argmax", "f16_head_argmax")


def _resolve(name: str, twin: bool):
    import kernels_ampere

    return getattr(kernels_ampere, f"{name}_reference" if twin else name)


class Ops:
    """Bound operator functions (``ops.w2a8_linear(...)`` etc.)."""

    def __init__(self, twin: bool, specialize_widths: bool = True):
        self.twin, self.specialize_widths = twin, specialize_widths
        self.name = "torch-twins" if twin else "triton"
        for name in KERNELS:
            setattr(self, name, _resolve(name, twin))

    def linear_w2a8(self, a_int8, a_scale, packed, w_scale, out_dtype=torch.float32, residual=None):
        if self.twin:
            return self.w2a8_linear(a_int8, a_scale, packed, w_scale, out_dtype=out_dtype, residual=residual)
        return self.w2a8_linear(a_int8, a_scale, packed, w_scale, out_dtype=out_dtype, residual=residual,
                                config=None if self.specialize_widths else _generic_linear(w_scale.dim() == 2))

    def linear_w2a16(self, x, packed, w_scale, out_dtype=torch.float32):
        if self.twin:
            return self.w2a16_linear(x, packed, w_scale, out_dtype=out_dtype)
        return self.w2a16_linear(x, packed, w_scale, out_dtype=out_dtype,
                                 config=None if self.specialize_widths else _generic_linear(w_scale.dim() == 2))


def _generic_linear(grouped: bool):
    from kernels_ampere.tuning import default_linear

    # One tensor-core configuration for every width: what a width-agnostic runtime runs.
    return default_linear(16, grouped)


def kernel_ops_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401

        for name in KERNELS:
            _resolve(name, twin=False)
    except (ImportError, AttributeError):
        return False
    return True
