"""The 16-bit head's greedy token, read from the int8 head wherever a bound certifies it.

An AR or verify step takes the argmax of the 16-bit head: on a Jetson, where a step streams
its weights from DRAM, that head is as many bytes as the whole ternary stack of a 2B model
(656 MB against 521). The int8 head (the artifact's draft head: per-row scales ``s``, codes
``q``) is half of it, but its argmax differs at near-ties. Here the int8 rows answer for the
16-bit head, exactly, when they can prove it:

    l[v]     = s[v] · (q[v] · h)                      W8A16: int8 codes times the 16-bit h the
                                                      16-bit head reads (no activation rounding)
    |head16[v] - l[v]| <= B[v] = ||w[v] - s[v]q[v]||_2 · ||h||_2      (Cauchy-Schwarz, exact e)
                               + gamma · (max|w[v]| + s[v]) · ||h||_1  (float32 sums, both heads)

with ``head16[v]`` the logit the 16-bit head *computes* (its own float32 rounding included).
Then ``v*``, the row with the largest upper bound ``l + B``, is the 16-bit head's argmax as
soon as its lower bound ``l - B`` is strictly above every other row's upper bound: no tie and
no rounding can reorder them. One pass over the int8 rows finds, per vocabulary tile, the
largest upper bound, its row, the second largest and that row's lower bound; ``certify``
folds the tiles. Where any row of a call is not certified, the 16-bit head runs after all
(``f16_head_argmax(..., skip=...)``: inside a CUDA graph both launches are captured, and the
16-bit one returns at once when every row was certified), so the tokens are the 16-bit
head's in every case. The per-row constants ``||e_v||_2`` and ``max|w_v| + s_v`` are
computed once at load (``head_error_bounds``), rounded up.

On the embedded model's held-out prompts (27M, H = 512, V = 8192) 88% of AR rows certify: a
step reads the int8 head and, for the other 12%, the 16-bit head as well.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import bf16_dot_upcast, check_dtype, check_launchable, gdc_prologue, pdl_options
from .numerics import quantize_rows_int8
from .tuning import default_head, lookup

_NO_INDEX = tl.constexpr(2**31 - 1)
CERT_ROW_TILE = 16  # activation rows per program (tl.dot's least)
# The float32 sums of either head: |computed - exact| <= H u / (1 - H u) sum|w h| with u = 2**-24
# for sequential round-to-nearest; 2**-22 leaves room for any accumulation order and mode.
ROUNDING_UNIT = 2.0**-22
# The bounds themselves and the comparisons of the certificate run in float32: each side
# widened by this share of |l| + B (a few float32 roundings are < 2**-22 of it).
COMPARISON_SLACK = 2.0**-18
_SLACK = tl.constexpr(COMPARISON_SLACK)


def rounding_gamma(hidden: int) -> float:
    """The share of ``sum |w h|`` one float32 sum over ``hidden`` terms can be off by, twice
    (the 16-bit head's own sum and ``l``'s), with a 4x margin on the unit roundoff."""
    nu = hidden * ROUNDING_UNIT
    if nu >= 0.5:
        raise ValueError(f"certified head: H={hidden} is too wide for the float32 rounding bound")
    return 2 * nu / (1 - nu)


def head_error_bounds(w16: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor,
                      chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row constants of the bound, on ``w16``'s device -> (``||w_v - s_v q_v||_2``,
    ``max|w_v| + s_v``), float32, each rounded up (float64 sums, times 1 + 2**-20)."""
    if w16.shape != w_int8.shape or w_scale.shape != (w16.shape[0],):
        raise ValueError(f"certified head: 16-bit head {tuple(w16.shape)}, int8 head {tuple(w_int8.shape)} and "
                         f"row scales {tuple(w_scale.shape)} do not match")
    err, mag = [], []
    for v0 in range(0, w16.shape[0], chunk):
        w = w16[v0:v0 + chunk].double()
        s = w_scale[v0:v0 + chunk].double()
        err.append((w - s[:, None] * w_int8[v0:v0 + chunk].double()).norm(dim=1))
        mag.append(w.abs().amax(dim=1) + s)
    up = 1 + 2.0**-20
    return (torch.cat(err) * up).float(), (torch.cat(mag) * up).float()


def int8_rows(w16: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """``numerics.quantize_rows_int8`` of ``w16`` [V, H] on its own device, ``chunk`` rows at a
    time (a 2B head is 1.3 GB as float32): the int8 head of a checkpoint that ships none."""
    parts = [quantize_rows_int8(w16[v0:v0 + chunk]) for v0 in range(0, w16.shape[0], chunk)]
    return torch.cat([q for q, _ in parts]).contiguous(), torch.cat([s for _, s in parts]).contiguous()


def activation_norms(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, H] 16-bit -> (||h_m||_1, ||h_m||_2) [M] float32, rounded up (float64 sums)."""
    h64 = h.double()
    up = 1 + 2.0**-20
    return (h64.abs().sum(dim=1) * up).float(), (h64.norm(dim=1) * up).float()


@triton.jit
def _certify_partial_kernel(
    h_ptr,  # [M, H] float16 / bfloat16: what the 16-bit head reads
    q_ptr,  # [V, H] int8 codes
    s_ptr, err_ptr, mag_ptr,  # [V] float32: row scale, ||e_v||_2, max|w_v| + s_v
    n1_ptr, n2_ptr,  # [M] float32: ||h_m||_1, ||h_m||_2
    u1_ptr, i1_ptr, u2_ptr, low_ptr,  # [P, M]: per vocabulary tile
    M, V, H, stride_hm, stride_qv, gamma,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
):
    pid = tl.program_id(1)
    rv = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rh = tl.arange(0, BLOCK_H)
    mask_v = rv < V
    mask_m = rm < M
    # constants: read before the wait
    s = tl.load(s_ptr + rv, mask=mask_v, other=0.0)
    err = tl.load(err_ptr + rv, mask=mask_v, other=0.0)
    mag = tl.load(mag_ptr + rv, mask=mask_v, other=0.0)
    gdc_prologue(USE_GDC)
    acc = tl.zeros((BLOCK_V, BLOCK_M), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        mask_h = (h0 + rh) < H
        q = tl.load(q_ptr + rv[:, None] * stride_qv + (h0 + rh)[None, :],
                    mask=mask_v[:, None] & mask_h[None, :], other=0)  # [BLOCK_V, BLOCK_H] int8
        x = tl.load(h_ptr + rm[None, :] * stride_hm + (h0 + rh)[:, None],
                    mask=mask_m[None, :] & mask_h[:, None], other=0.0)  # [BLOCK_H, BLOCK_M]
        if UPCAST:  # the interpreter multiplies bf16 tiles as raw bits: float32, exact here
            acc = tl.dot(q.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        else:  # |q| <= 127: exact in either 16-bit type, so each product is exact in float32
            acc = tl.dot(q.to(x.dtype), x, acc, out_dtype=tl.float32)
    n1 = tl.load(n1_ptr + rm, mask=mask_m, other=0.0)
    n2 = tl.load(n2_ptr + rm, mask=mask_m, other=0.0)
    logit = acc * s[:, None]
    bound = err[:, None] * n2[None, :] + gamma * mag[:, None] * n1[None, :]
    bound = bound + (tl.abs(logit) + bound) * _SLACK
    up = tl.where(mask_v[:, None], logit + bound, float("-inf"))
    low = tl.where(mask_v[:, None], logit - bound, float("-inf"))
    u1 = tl.max(up, axis=0)
    i1 = tl.min(tl.where(up == u1[None, :], rv[:, None], _NO_INDEX), axis=0)
    best = rv[:, None] == i1[None, :]
    u2 = tl.max(tl.where(best, float("-inf"), up), axis=0)
    low1 = tl.max(tl.where(best, low, float("-inf")), axis=0)
    out = pid * M + rm
    tl.store(u1_ptr + out, u1, mask=mask_m)
    tl.store(i1_ptr + out, i1, mask=mask_m)
    tl.store(u2_ptr + out, u2, mask=mask_m)
    tl.store(low_ptr + out, low1, mask=mask_m)


def _check(h, w_int8, w_scale, err, mag):
    check_dtype(h, (torch.float16, torch.bfloat16), "certified head: h")
    check_dtype(w_int8, (torch.int8,), "certified head: w_int8")
    for t, name in ((w_scale, "w_scale"), (err, "err_norm"), (mag, "magnitude")):
        check_dtype(t, (torch.float32,), f"certified head: {name}")
        if t.shape != (w_int8.shape[0],):
            raise ValueError(f"certified head: {name} must be [V]={w_int8.shape[0]}, got {tuple(t.shape)}")
    if h.dim() != 2 or w_int8.dim() != 2 or h.shape[1] != w_int8.shape[1] or h.stride(1) != 1 or w_int8.stride(1) != 1:
        raise ValueError(f"certified head: h must be [M, H] and w_int8 [V, H] with contiguous rows; got "
                         f"h {tuple(h.shape)}, w_int8 {tuple(w_int8.shape)}")


def certify_partials(h, w_int8, w_scale, err, mag, n1, n2, *, config=None):
    """Per vocabulary tile and row: (largest upper bound, its row, second largest upper bound,
    the lower bound of the largest's row), each [P, M]. The Triton kernel."""
    _check(h, w_int8, w_scale, err, mag)
    m, hdim = h.shape
    v = w_int8.shape[0]
    check_launchable(_certify_partial_kernel, h, w_int8, w_scale, err, mag, n1, n2)
    if config is None:  # the 16-bit head's M = 1 tiling: the same vocabulary walk, half the bytes
        config = lookup("f16_head_argmax", {"V": v, "H": hdim, "M": 1}, h.device) or default_head(1)
    parts = triton.cdiv(v, config.block_v)
    u1 = torch.empty((parts, m), dtype=torch.float32, device=h.device)
    i1 = torch.empty((parts, m), dtype=torch.int32, device=h.device)
    u2, low = torch.empty_like(u1), torch.empty_like(u1)
    if m:
        _certify_partial_kernel[(triton.cdiv(m, CERT_ROW_TILE), parts)](
            h, w_int8, w_scale, err, mag, n1, n2, u1, i1, u2, low, m, v, hdim, h.stride(0), w_int8.stride(0),
            rounding_gamma(hdim), BLOCK_M=CERT_ROW_TILE, BLOCK_V=config.block_v, BLOCK_H=config.block_h,
            UPCAST=bf16_dot_upcast(_certify_partial_kernel, h), num_warps=config.num_warps,
            num_stages=config.num_stages, **pdl_options(_certify_partial_kernel),
        )
    return u1, i1, u2, low


def certify_partials_reference(h, w_int8, w_scale, err, mag, n1, n2, *, config=None, block_v: int = 128):
    """``certify_partials``' twin: the same bounds from a float32 torch matmul, in tiles of
    ``block_v`` vocabulary rows (the kernel's ``config.block_v`` when given)."""
    _check(h, w_int8, w_scale, err, mag)
    m, hdim = h.shape
    v = w_int8.shape[0]
    block_v = config.block_v if config is not None else block_v
    logit = (h.float() @ w_int8.float().t()) * w_scale[None, :]  # [M, V]
    bound = err[None, :] * n2[:, None] + rounding_gamma(hdim) * mag[None, :] * n1[:, None]
    bound = bound + (logit.abs() + bound) * COMPARISON_SLACK
    parts = -(-v // block_v)
    pad = parts * block_v - v
    up = torch.nn.functional.pad(logit + bound, (0, pad), value=float("-inf")).view(m, parts, block_v)
    low = torch.nn.functional.pad(logit - bound, (0, pad), value=float("-inf")).view(m, parts, block_v)
    u1, j = up.max(dim=2)  # torch.max: the first index of the maximum
    rest = up.scatter(2, j[..., None], float("-inf"))
    u2 = rest.amax(dim=2)
    low1 = low.gather(2, j[..., None])[..., 0]
    i1 = (j + torch.arange(parts, device=h.device)[None, :] * block_v).to(torch.int32)
    return u1.t().contiguous(), i1.t().contiguous(), u2.t().contiguous(), low1.t().contiguous()


def certify(u1: torch.Tensor, i1: torch.Tensor, u2: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the tiles' partials [P, M] -> (token [M] int64, certified [M] bool). A row is
    certified when the lower bound of the row with the largest upper bound is strictly above
    every other upper bound (two tiles tied at the largest: not certified)."""
    if u1.shape[0] == 1:
        best = torch.zeros_like(i1[0], dtype=torch.int64)[None]
        second = u2[0]
    else:
        top2, tiles = u1.topk(2, dim=0)  # [2, M]
        best = tiles[:1]
        second = torch.maximum(top2[1], u2.gather(0, best)[0])
    token = i1.gather(0, best)[0].long()
    return token, low.gather(0, best)[0] > second


def certified_head_argmax(h, w16, w_int8, w_scale, err, mag, *, partials, f16_head):
    """-> (top1 [M] int64: the 16-bit head's argmax, check [M] float32, certified [1] int32).

    ``partials``: ``certify_partials`` or its twin; ``f16_head``: ``f16_head_argmax`` (or its
    twin), called with ``skip`` = 1 when every row was certified (the kernel then reads no
    weights; the twin computes anyway). ``check`` is the 16-bit head's confidence where it ran
    and 1 where it did not: a value to test for NaN (a non-finite h never certifies), not a
    confidence to act on."""
    n1, n2 = activation_norms(h)
    token, ok = certify(*partials(h, w_int8, w_scale, err, mag, n1, n2))
    skip = ok.all().to(torch.int32).reshape(1)
    top16, conf16 = f16_head(h, w16, skip=skip)
    every = skip.bool()
    return torch.where(every, token, top16), torch.where(every, torch.ones_like(conf16), conf16), skip
