"""Small pieces every kernel module shares: jit helpers and launcher checks.

Two helpers exist because the Triton interpreter (CPU CI) and the compiler disagree on
what they accept:

* ``dp4a``: on a GPU one PTX ``dp4a.s32.s32`` (four int8 products summed into int32, one
  instruction); the interpreter cannot run inline assembly, so there it is emulated with
  shifts. Kernels take ``USE_ASM: tl.constexpr`` and launchers pass ``tensor.is_cuda``.
* ``round_half_even``: ``libdevice.rint`` does not run under the interpreter. Adding and
  subtracting 1.5 * 2**23 rounds any float32 with |x| < 2**22 to the nearest integer,
  ties to even, exactly as ``torch.round`` does; our operands are at most 127.5.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 1.5 * 2**23: float32 has no fraction bits left at this magnitude, so the add rounds.
_RINT_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def round_half_even(x):
    return (x + _RINT_MAGIC) - _RINT_MAGIC


@triton.jit
def dp4a(a, b, c, USE_ASM: tl.constexpr):
    """c + sum over the 4 bytes of (signed byte of a) * (signed byte of b); int32 tensors."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [a, b, c],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        acc = c
        for i in tl.static_range(4):
            # shift the byte to the top, then arithmetic-shift down: sign-extends it
            acc += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return acc


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check_launchable(kernel, *tensors: torch.Tensor) -> None:
    """All tensors on one device; CPU tensors only when Triton runs in interpreter mode."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"kernel inputs are on different devices: {sorted(map(str, devices))}")
    if next(iter(devices)).type == "cpu" and type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "Triton kernels got CPU tensors but the interpreter is off. Set TRITON_INTERPRET=1 "
            "before the first kernels_ampere kernel module is imported, move the tensors to "
            "CUDA, or call the *_reference twin instead."
        )


def check_dtype(t: torch.Tensor, allowed: tuple[torch.dtype, ...], name: str) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {t.dtype} not supported, expected one of {allowed}")
