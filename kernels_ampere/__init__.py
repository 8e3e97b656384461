"""Triton kernels without FP8 (Jetson Orin sm_87, RTX 30xx sm_86, and newer GPUs)."""

from .packing import PACKING_LAYOUT, pack_ternary, unpack_ternary

__all__ = ["PACKING_LAYOUT", "pack_ternary", "unpack_ternary"]
