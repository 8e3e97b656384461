"""Triton kernels for ternary LLM decoding on Ampere-class GPUs (sm_80+, no FP8).

One concept per module, each a ``@triton.jit`` kernel, a launcher that checks and
allocates, and a ``*_reference`` pure-PyTorch twin that the tests compare against:

=================================  ======================  ==========================================
function                           module                  what
=================================  ======================  ==========================================
pack_ternary / unpack_ternary      packing                 the INT2 layout ``ternary-2bit-k128x4-v1``
quantisers, int_matmul, RoPE       numerics                the integer reference numerics of the twins
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
LinearConfig, default_linear       tuning                  launch table per GPU, SM-count defaults
main (python -m ...)               autotune                tunes the linears, writes this GPU's table
=================================  ======================  ==========================================

Import a kernel from its module (``from kernels_ampere.w2a8 import w2a8_linear``);
``bitmtp_edge.backends.ops`` binds the whole set. ``import kernels_ampere`` itself imports
only ``packing`` (torch alone): the exporter and the CPU reference runtime use the layout
without Triton; ``numerics`` (the integer reference numerics every twin shares) needs only
torch too. Under the Triton interpreter (``TRITON_INTERPRET=1`` set before triton is first
imported in the process) the same kernels run on CPU tensors.
"""

from __future__ import annotations

from .packing import PACKING_LAYOUT, pack_ternary, unpack_ternary

__all__ = ["PACKING_LAYOUT", "pack_ternary", "unpack_ternary"]
