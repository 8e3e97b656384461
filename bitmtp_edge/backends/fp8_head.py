"""The server path's draft-role head: FP8 e4m3 weights and activations (sm_89 / sm_90+).

Per-row weight scales and per-token activation scales (absmax / 448, the e4m3 maximum),
multiplied by ``torch._scaled_mm`` with row-wise scaling on the tensor cores. Half the
bytes of the bf16 head, like the int8 head of the Jetson path, but through Hopper's FP8
MMA. Only the draft role uses it: verification keeps the exact 16-bit head.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
_ALIGN = 16  # _scaled_mm wants every dimension a multiple of 16


def fp8_supported(device: torch.device) -> bool:
    return (device.type == "cuda" and hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


def quantize_rows_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[V, H] float -> (e4m3 [V, H], row scale [V] float32)."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=-1) / E4M3_MAX).clamp(min=1e-12)
    return (w32 / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def _quantize_tokens(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (h.float().abs().amax(dim=-1) / E4M3_MAX).clamp(min=1e-12)
    return (h.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def fp8_head_logits(h: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """h [M, H] float (normed) -> [M, V] float32 logits through FP8 tensor cores."""
    a, a_scale = _quantize_tokens(h)
    m = a.shape[0]
    pad = (-m) % _ALIGN
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
        a_scale = torch.cat([a_scale, a_scale.new_ones(pad)])
    out = torch._scaled_mm(a, w_fp8.t(), scale_a=a_scale.unsqueeze(1), scale_b=w_scale.unsqueeze(0),
                           out_dtype=torch.bfloat16)
    return out[:m].float()


def fp8_head_logits_reference(h: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The twin: the same e4m3 roundings, dequantised and multiplied in float32."""
    a, a_scale = _quantize_tokens(h)
    return (a.float() * a_scale.unsqueeze(1)) @ (w_fp8.float() * w_scale.unsqueeze(1)).t()


def fp8_head_argmax(h, w_fp8, w_scale, twin: bool = False):
    logits = (fp8_head_logits_reference if twin else fp8_head_logits)(h, w_fp8, w_scale)
    return logits.argmax(dim=-1), torch.softmax(logits, dim=-1).amax(dim=-1)
