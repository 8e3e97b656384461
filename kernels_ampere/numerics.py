"""The integer reference numerics: one definition shared by the kernels' twins, the
reference runtime, training (straight-through, ``bitmtp_edge/runtime/model.py``) and export.

They live here, below the runtime, because the kernel twins compare against them and
``kernels_ampere`` imports nothing of ``bitmtp_edge``.

Numerics follow transformers' BitNet integration exactly (``integrations/bitnet.py``):

* weights, per tensor (BitNet): ``s = mean|W|`` clamped at 1e-5, codes
  ``round(W * (1/s))`` clamped to [-1, 1]; dequantised ``W ≈ codes * s``;
* weights, per 128-group along K (Bonsai): ``s = max|W|`` of the group; a released Bonsai
  checkpoint is exactly {-s, 0, +s} per group, which the exporter asserts;
* activations, per token: ``q = 127 / max|x|`` clamped at 1e-5, ``x_int8 = round(x * q)``
  clamped to [-128, 127]; the *dequantisation multiplier* handed to the linear is ``1/q``;
* the int8 draft head, per output row: ``s = max|W_row| / 127``, ``W_int8 = round(W / s)``.

``torch.round`` rounds half to even, as ``rint`` / ``__float2int_rn`` do in kernels.
Every quantiser computes in float32 whatever the input dtype, as transformers does.
RoPE is the half-split (``rotate_half``) convention of Llama / BitNet / Qwen3 in transformers.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 128
ACT_QMAX = 127.0
SCALE_EPS = 1e-5


def ternarize_absmean(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (codes [N, K] int8, scale [1] float32): per-tensor absmean ternary."""
    w32 = w.float()
    scale = w32.abs().mean().clamp(min=SCALE_EPS)
    codes = torch.round(w32 * (1.0 / scale)).clamp(-1, 1)
    return codes.to(torch.int8), scale.reshape(1)


def ternarize_group_absmax(w: torch.Tensor, group: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (codes int8 [N, K], scales float32 [N, ceil(K / group)]): absmax per group
    (a last, shorter group where K is not a multiple of ``group``)."""
    n, k = w.shape
    groups = -(-k // group)
    g = torch.nn.functional.pad(w.float(), (0, groups * group - k)).view(n, groups, group)  # zeros: no effect on max|.|
    scale = g.abs().amax(dim=-1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(g / safe.unsqueeze(-1)).clamp(-1, 1)
    return codes.to(torch.int8).view(n, groups * group)[:, :k].contiguous(), scale


def dequantize_ternary(codes: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """codes [N, K] int8 and scale ([1], [N] or [N, ceil(K/128)]) -> [N, K] float weight."""
    c = codes.to(dtype)
    if scale.dim() == 2:  # group-128 (the last group shorter where K is not a multiple of 128)
        n, k = codes.shape
        return c * scale.to(dtype).repeat_interleave(GROUP_SIZE, dim=1)[:, :k]
    if scale.numel() == codes.shape[0] and scale.numel() != 1:
        return c * scale.to(dtype).unsqueeze(1)
    return c * scale.to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (x_int8 [..., K] int8, dequant scale [...] float32), per token absmax."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True).clamp(min=SCALE_EPS)
    q = div_f32(ACT_QMAX, amax)
    x_int = torch.round(x32 * q).clamp(-128, 127)
    return x_int.to(torch.int8), div_f32(1.0, q).squeeze(-1)


def div_f32(a, b) -> torch.Tensor:
    """float32 ``a / b`` correctly rounded, as a GPU's ``div.rn.f32`` (the kernels' div_rn).

    torch's CPU float32 ops are not: a division by or of a Python scalar becomes a reciprocal
    and a multiply (two roundings, an ulp off at times). Dividing in float64 and rounding
    once more is exact (53 >= 2 * 24 + 2 bits)."""
    a64 = a.double() if torch.is_tensor(a) else torch.full_like(b, a, dtype=torch.float64)
    b64 = b.double() if torch.is_tensor(b) else torch.full_like(a64, b)
    return (a64 / b64).float()


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[V, H] float -> (W_int8 [V, H], row scale [V] float32): the int8 draft head."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=-1) / ACT_QMAX).clamp(min=SCALE_EPS / ACT_QMAX)
    q = torch.round(w32 / scale.unsqueeze(-1)).clamp(-127, 127)
    return q.to(torch.int8), scale


def int_matmul(a_int8: torch.Tensor, w_int8: torch.Tensor) -> torch.Tensor:
    """Exact int32 product [M, K] x [N, K]^T -> [M, N].

    Done in float64 on every device: each partial sum is an integer below 2**53, so the
    result is exact and identical on CPU and CUDA (CPU torch has no int32 GEMM, and TF32
    cannot touch float64).
    """
    return (a_int8.double() @ w_int8.double().t()).to(torch.int32)


# --- rotary position embedding (the rope_cache kernel's twin uses it) ---------------------

def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """[head_dim] float32: the inverse frequencies, repeated for both halves (half-split /
    rotate_half convention). A constant: a decode step that computed it would pay five
    launches for it every step."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    return torch.cat((inv_freq, inv_freq))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 inv_freq: torch.Tensor | None = None):
    """positions [..., S] -> cos, sin [..., S, head_dim] (half-split / rotate_half convention);
    ``inv_freq``: ``rope_inv_freq(head_dim, theta)`` on the positions' device, if kept."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    # integer positions become float32 inside the product, as .float() would make them
    emb = (positions.float() if positions.is_floating_point() else positions).unsqueeze(-1) * inv_freq
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, hd]; cos/sin [B, S, hd]."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)
