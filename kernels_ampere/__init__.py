"""Triton kernels for ternary LLM decoding on Ampere-class GPUs (sm_80+, no FP8).

One concept per module, each a ``@triton.jit`` kernel, a launcher that checks and
allocates, and a ``*_reference`` pure-PyTorch twin that the tests compare against:

=================================  ======================  ==========================================
name                               module                  what
=================================  ======================  ==========================================
pack_ternary / unpack_ternary      packing                 the INT2 layout ``ternary-2bit-k128x4-v1``
w2a8_linear                        w2a8                    packed ternary x int8, exact int32 accum
w2a16_linear                       w2a16                   packed ternary x 16/32-bit (weight-only)
rmsnorm_quant                      fused_quant             RMSNorm + per-token int8 quantisation
act_quant                          fused_quant             per-token int8 quantisation alone
rmsnorm_cast                       fused_quant             RMSNorm + cast (the 16-bit head's input)
relu2_mul_rmsnorm_quant            fused_quant             relu(g)^2 * u + sub-norm + quantisation
silu_mul_quant                     fused_quant             silu(g) * u + quantisation
rope_qkv_to_cache                  rope_cache              QK-norm + RoPE, K/V stored at their slots
small_width_attention              attention               M rows over a shared KV buffer, GQA
int8_head_argmax / f16_head_argmax heads                   head matmul fused with argmax + max-softmax
=================================  ======================  ==========================================

Module names never equal an exported function's name: importing a submodule binds it as
a package attribute, which would shadow the lazily exported function of the same name.

``import kernels_ampere`` imports only ``packing`` (torch alone): the exporter and the CPU
reference runtime use the layout without Triton. The kernels (and Triton) load on first
attribute access. Under the Triton interpreter (``TRITON_INTERPRET=1`` set before triton
is first imported in the process) the same kernels run on CPU tensors.
"""

from __future__ import annotations

import importlib

from .packing import PACKING_LAYOUT, pack_ternary, unpack_ternary

_LAZY = {
    "w2a8_linear": "w2a8",
    "w2a8_linear_reference": "w2a8",
    "w2a16_linear": "w2a16",
    "w2a16_linear_reference": "w2a16",
    "rmsnorm_quant": "fused_quant",
    "rmsnorm_quant_reference": "fused_quant",
    "rmsnorm_cast": "fused_quant",
    "rmsnorm_cast_reference": "fused_quant",
    "act_quant": "fused_quant",
    "act_quant_reference": "fused_quant",
    "relu2_mul_rmsnorm_quant": "fused_quant",
    "relu2_mul_rmsnorm_quant_reference": "fused_quant",
    "silu_mul_quant": "fused_quant",
    "silu_mul_quant_reference": "fused_quant",
    "small_width_attention": "attention",
    "small_width_attention_reference": "attention",
    "rope_qkv_to_cache": "rope_cache",
    "rope_qkv_to_cache_reference": "rope_cache",
    "int8_head_argmax": "heads",
    "int8_head_argmax_reference": "heads",
    "f16_head_argmax": "heads",
    "f16_head_argmax_reference": "heads",
}

__all__ = ["PACKING_LAYOUT", "pack_ternary", "unpack_ternary", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels_ampere' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
