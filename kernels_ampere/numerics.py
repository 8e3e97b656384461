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
* the int8 draft head, per output row: ``s = max|W_row| / 127``, ``W_int8 = round(W / s)``;
* the int4 draft head, per output row: ``s = r · max|W_row| / 7`` with the clip ratio ``r``
  of ``INT4_CLIP_RATIOS`` that leaves the least squared error, codes ``round(W / s)`` clamped
  to [-7, 7], two to a byte (``pack_int4_rows``).

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


INT4_QMAX = 7.0
# Clip ratios tried per row, largest first (a tie keeps the larger). Seven levels a side leave
# a row's absmax scale coarse where most weights are small; clipping the few largest trades
# their error for everyone else's. Measured on the embedded model (40 held-out prompts; tools/
# results/int4_draft_head.md): the drafts agree with the int8 head's 97% of the time against 96%
# at absmax, and hybrid's unverified mistakes drop back to the int8 head's.
INT4_CLIP_RATIOS = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.0 .. 0.5


def quantize_rows_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[V, H] float -> (packed [V, ceil(H / 2)] uint8, row scale [V] float32): the int4 draft
    head (``pack_int4_rows``'s layout), a quarter of the 16-bit head's bytes. Each row's scale
    is the clip ratio's of least squared error (float64 sums of exact float64 differences)."""
    w32 = w.float()
    amax = w32.abs().amax(dim=-1).clamp(min=SCALE_EPS)
    best_scale, best_err = None, None
    for ratio in INT4_CLIP_RATIOS:
        scale = amax * ratio / INT4_QMAX
        codes = torch.round(w32 / scale.unsqueeze(-1)).clamp(-INT4_QMAX, INT4_QMAX)
        err = ((codes.double() * scale.double().unsqueeze(-1) - w32.double()) ** 2).sum(dim=-1)
        if best_scale is None:
            best_scale, best_err = scale, err
        else:
            better = err < best_err
            best_scale, best_err = torch.where(better, scale, best_scale), torch.where(better, err, best_err)
    codes = torch.round(w32 / best_scale.unsqueeze(-1)).clamp(-INT4_QMAX, INT4_QMAX).to(torch.int8)
    return pack_int4_rows(codes), best_scale


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """[V, H] int8 in [-8, 7] -> [V, ceil(H / 2)] uint8. Byte ``j`` of a row holds column ``j``
    in its low nibble and column ``ceil(H / 2) + j`` in its high nibble, each as ``code + 8``
    (0..15; an odd H leaves the last high nibble 8, a zero): the two halves of a row's columns
    are two int8 operands a kernel takes with one or two bitwise operations per four bytes
    (``byte & 0x0F`` = code + 8; ``(byte & 0xF0) ^ 0x80`` = 16 x code, as int8)."""
    v, h = codes.shape
    half = -(-h // 2)
    hi = torch.nn.functional.pad(codes[:, half:], (0, 2 * half - h))
    return ((codes[:, :half].to(torch.int16) + 8) | ((hi.to(torch.int16) + 8) << 4)).to(torch.uint8)


def unpack_int4_rows(packed: torch.Tensor, h: int) -> torch.Tensor:
    """``pack_int4_rows``' inverse: [V, ceil(H / 2)] uint8 -> [V, H] int8."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != -(-h // 2):
        raise ValueError(f"unpack_int4_rows: want [V, {-(-h // 2)}] uint8 for H = {h}, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    b = packed.to(torch.int16)
    return torch.cat([(b & 0xF) - 8, (b >> 4) - 8], dim=1)[:, :h].to(torch.int8)


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
