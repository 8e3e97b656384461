"""The 16-bit head's greedy token, read from the int8 head wherever a bound certifies it.

An AR or verify step takes the argmax of the 16-bit head: on a Jetson, where a step streams
its weights from DRAM, that head is as many bytes as the whole ternary stack of a 2B model
(656 MB against 521). The int8 head (the artifact's draft head: per-row scales ``s``, codes
``q``) is half of it, but its argmax differs at near-ties. Here the int8 rows answer for the
16-bit head, exactly, when they can prove it:

    h ~ a · (128 g1 + g2)                             the 16-bit h the 16-bit head reads, as two
                                                      int8 planes (15 bits: |h - a(128 g1 + g2)| <= a/2)
    l[v] = s[v] · a · (128 (q[v] · g1) + q[v] · g2)   two exact int8 tensor-core sums (no int-to-float
                                                      conversion per weight, which cost 3.6x here)
    |head16[v] - l[v]| <= B[v] = ||w[v] - s[v]q[v]||_2 · ||h||_2      (Cauchy-Schwarz, exact e)
                               + gamma · (max|w[v]| + s[v]) · ||h||_1  (float32 sums, both heads)
                               + s[v] · a/2 · ||q[v]||_1               (the planes' rounding)

with ``head16[v]`` the logit the 16-bit head *computes* (its own float32 rounding included).
Then ``v*``, the row with the largest upper bound ``l + B``, is the 16-bit head's argmax as
soon as its lower bound ``l - B`` is strictly above every other row's upper bound: no tie and
no rounding can reorder them. One pass over the int8 rows finds, per vocabulary tile, the
largest upper bound, its row, the second largest and that row's lower bound; ``certify``
folds the tiles. Where any row of a call is not certified, the 16-bit head runs after all
(``f16_head_argmax(..., skip=...)``: inside a CUDA graph both launches are captured, and the
16-bit one returns at once when every row was certified), so the tokens are the 16-bit
head's in every case. The per-row constants ``||e_v||_2``, ``max|w_v| + s_v`` and ``||q_v||_1``
are computed once at load (``head_error_bounds``), rounded up.

On the embedded model's held-out prompts (27M, H = 512, V = 8192) 89.5% of AR steps certify
(H200, 8 prompts x 96 tokens): a step reads the int8 head and, for the other 10.5%, the 16-bit
head as well. Whether that pays depends on the step being bandwidth-bound on the head
(docs/runtime.md, "The certified head"; ``tools/bench_certified_head.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_dtype, check_launchable, gdc_prologue, pdl_options
from .numerics import int_matmul, quantize_rows_int8
from .tuning import HeadConfig

_NO_INDEX = tl.constexpr(2**31 - 1)
CERT_ROW_TILE = 16  # activation rows per program (tl.dot's least)
# 256 vocabulary rows x 128 features per step, 4 warps, 3 stages: the fastest of 24 tilings on
# 8 SMs of the H200 (board proxy; 700 µs for the 2B head at M = 1, the int8 head's own table
# tiling 1133 µs, the 16-bit head 928; tools/results/session19/certify_configs.py)
CERTIFY_CONFIG = HeadConfig(block_v=256, block_h=128, num_warps=4, num_stages=3)
# The float32 sums of either head: |computed - exact| <= H u / (1 - H u) sum|w h| with u = 2**-24
# for sequential round-to-nearest; 2**-22 leaves room for any accumulation order and mode.
ROUNDING_UNIT = 2.0**-22
# The bounds themselves and the comparisons of the certificate run in float32: each side
# widened by this share of |l| + B (a few float32 roundings are < 2**-22 of it).
COMPARISON_SLACK = 2.0**-18
_SLACK = tl.constexpr(COMPARISON_SLACK)
# the planes' rounding, a/2 per element, widened by 2**-10 for the float32 products of the bound
PLANE_HALF = 0.5 * (1 + 2.0**-10)
_HALF = tl.constexpr(PLANE_HALF)


def rounding_gamma(hidden: int) -> float:
    """The share of ``sum |w h|`` one float32 sum over ``hidden`` terms can be off by, twice
    (the 16-bit head's own sum and ``l``'s), with a 4x margin on the unit roundoff."""
    nu = hidden * ROUNDING_UNIT
    if nu >= 0.5:
        raise ValueError(f"certified head: H={hidden} is too wide for the float32 rounding bound")
    return 2 * nu / (1 - nu)


def head_error_bounds(w16: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor,
                      chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-row constants of the bound, on ``w16``'s device -> (``||w_v - s_v q_v||_2``,
    ``max|w_v| + s_v``, ``||q_v||_1``), float32, rounded up (float64 sums, times 1 + 2**-20;
    the last is an integer below 2**24, exact)."""
    if w16.shape != w_int8.shape or w_scale.shape != (w16.shape[0],):
        raise ValueError(f"certified head: 16-bit head {tuple(w16.shape)}, int8 head {tuple(w_int8.shape)} and "
                         f"row scales {tuple(w_scale.shape)} do not match")
    err, mag, qn = [], [], []
    for v0 in range(0, w16.shape[0], chunk):
        w = w16[v0:v0 + chunk].double()
        s = w_scale[v0:v0 + chunk].double()
        q = w_int8[v0:v0 + chunk].double()
        err.append((w - s[:, None] * q).norm(dim=1))
        mag.append(w.abs().amax(dim=1) + s)
        qn.append(q.abs().sum(dim=1))
    up = 1 + 2.0**-20
    return (torch.cat(err) * up).float(), (torch.cat(mag) * up).float(), torch.cat(qn).float()


def int8_rows(w16: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """``numerics.quantize_rows_int8`` of ``w16`` [V, H] on its own device, ``chunk`` rows at a
    time (a 2B head is 1.3 GB as float32): the int8 head of a checkpoint that ships none."""
    parts = [quantize_rows_int8(w16[v0:v0 + chunk]) for v0 in range(0, w16.shape[0], chunk)]
    return torch.cat([q for q, _ in parts]).contiguous(), torch.cat([s for _, s in parts]).contiguous()


PLANE_STEPS = 127 * 128  # |v| <= 16256: g1 = round(v / 128) in [-127, 127], g2 = v - 128 g1 in [-64, 64]


def activation_planes(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[M, H] 16-bit -> (g1, g2 [M, H] int8, a, ||h||_1, ||h||_2 [M] float32): per row
    ``h ~ a · (128 g1 + g2)`` with ``v = round(h / a)``, ``a = max|h| / 16256``, so every
    element is off by a/2 at most (float64 arithmetic: the rounding is exact); the norms
    rounded up. Torch ops on the rows (a few kB): the same function for the kernel and its twin."""
    h64 = h.double()
    amax = h64.abs().amax(dim=1)
    a = (amax / PLANE_STEPS).float().clamp(min=2.0**-126)  # a float32 step; the planes are exact in it
    v = torch.round(h64 / a.double()[:, None])
    g1 = torch.round(v / 128).clamp(-127, 127)
    g2 = v - 128 * g1
    up = 1 + 2.0**-20
    return (g1.to(torch.int8), g2.to(torch.int8), a, (h64.abs().sum(dim=1) * up).float(),
            (h64.norm(dim=1) * up).float())


@triton.jit
def _certify_partial_kernel(
    g1_ptr, g2_ptr,  # [M, H] int8: the activation planes (activation_planes)
    a_ptr, n1_ptr, n2_ptr,  # [M] float32: plane step, ||h_m||_1, ||h_m||_2
    q_ptr,  # [V, H] int8 codes
    s_ptr, err_ptr, mag_ptr, qn_ptr,  # [V] float32: row scale, ||e_v||_2, max|w_v| + s_v, ||q_v||_1
    u1_ptr, i1_ptr, u2_ptr, low_ptr,  # [P, M]: per vocabulary tile
    M, V, H, stride_gm, stride_qv, gamma,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
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
    qn = tl.load(qn_ptr + rv, mask=mask_v, other=0.0)
    gdc_prologue(USE_GDC)
    acc1 = tl.zeros((BLOCK_V, BLOCK_M), tl.int32)
    acc2 = tl.zeros((BLOCK_V, BLOCK_M), tl.int32)
    for h0 in range(0, H, BLOCK_H):
        mask_h = (h0 + rh) < H
        q = tl.load(q_ptr + rv[:, None] * stride_qv + (h0 + rh)[None, :],
                    mask=mask_v[:, None] & mask_h[None, :], other=0)  # [BLOCK_V, BLOCK_H]
        cols = rm[None, :] * stride_gm + (h0 + rh)[:, None]
        mask = mask_m[None, :] & mask_h[:, None]
        acc1 = tl.dot(q, tl.load(g1_ptr + cols, mask=mask, other=0), acc1, out_dtype=tl.int32)  # exact
        acc2 = tl.dot(q, tl.load(g2_ptr + cols, mask=mask, other=0), acc2, out_dtype=tl.int32)
    a = tl.load(a_ptr + rm, mask=mask_m, other=0.0)
    n1 = tl.load(n1_ptr + rm, mask=mask_m, other=0.0)
    n2 = tl.load(n2_ptr + rm, mask=mask_m, other=0.0)
    # the twin's order, operation for operation (launched without FMA contraction): equal bits
    logit = (acc1.to(tl.float32) * 128.0 + acc2.to(tl.float32)) * a[None, :] * s[:, None]
    bound = err[:, None] * n2[None, :] + gamma * mag[:, None] * n1[None, :] + _HALF * s[:, None] * a[None, :] * qn[:, None]
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


def _check(w_int8, w_scale, err, mag, qn):
    check_dtype(w_int8, (torch.int8,), "certified head: w_int8")
    if w_int8.dim() != 2 or w_int8.stride(1) != 1:
        raise ValueError(f"certified head: w_int8 must be [V, H] with contiguous rows, got {tuple(w_int8.shape)}")
    for t, name in ((w_scale, "w_scale"), (err, "err_norm"), (mag, "magnitude"), (qn, "code_norm")):
        check_dtype(t, (torch.float32,), f"certified head: {name}")
        if t.shape != (w_int8.shape[0],):
            raise ValueError(f"certified head: {name} must be [V]={w_int8.shape[0]}, got {tuple(t.shape)}")


def certify_partials(planes, w_int8, w_scale, err, mag, qn, *, config=None):
    """Per vocabulary tile and row: (largest upper bound, its row, second largest upper bound,
    the lower bound of the largest's row), each [P, M]. ``planes``: ``activation_planes(h)``.
    The Triton kernel."""
    _check(w_int8, w_scale, err, mag, qn)
    g1, g2, a, n1, n2 = planes
    m, hdim = g1.shape
    v = w_int8.shape[0]
    if hdim != w_int8.shape[1]:
        raise ValueError(f"certified head: h has H={hdim}, the head {w_int8.shape[1]}")
    check_launchable(_certify_partial_kernel, g1, g2, a, w_int8, w_scale, err, mag, qn)
    config = config or CERTIFY_CONFIG
    parts = triton.cdiv(v, config.block_v)
    u1 = torch.empty((parts, m), dtype=torch.float32, device=g1.device)
    i1 = torch.empty((parts, m), dtype=torch.int32, device=g1.device)
    u2, low = torch.empty_like(u1), torch.empty_like(u1)
    if m:
        _certify_partial_kernel[(triton.cdiv(m, CERT_ROW_TILE), parts)](
            g1, g2, a, n1, n2, w_int8, w_scale, err, mag, qn, u1, i1, u2, low, m, v, hdim, g1.stride(0),
            w_int8.stride(0), rounding_gamma(hdim), BLOCK_M=CERT_ROW_TILE, BLOCK_V=config.block_v,
            BLOCK_H=config.block_h, num_warps=config.num_warps, num_stages=config.num_stages,
            enable_fp_fusion=False, **pdl_options(_certify_partial_kernel),
        )
    return u1, i1, u2, low


def certify_partials_reference(planes, w_int8, w_scale, err, mag, qn, *, config=None, block_v: int = 128):
    """``certify_partials``' twin: exact integer sums (``int_matmul``), then the kernel's float32
    operations in its order, in tiles of ``block_v`` vocabulary rows (``config.block_v`` when
    given): the same bits as the kernel."""
    _check(w_int8, w_scale, err, mag, qn)
    g1, g2, a, n1, n2 = planes
    m, hdim = g1.shape
    v = w_int8.shape[0]
    block_v = config.block_v if config is not None else block_v
    acc1, acc2 = int_matmul(g1, w_int8), int_matmul(g2, w_int8)  # [M, V] int32
    logit = (acc1.float() * 128.0 + acc2.float()) * a[:, None] * w_scale[None, :]
    bound = (err[None, :] * n2[:, None] + rounding_gamma(hdim) * mag[None, :] * n1[:, None]
             + PLANE_HALF * w_scale[None, :] * a[:, None] * qn[None, :])
    bound = bound + (logit.abs() + bound) * COMPARISON_SLACK
    parts = -(-v // block_v)
    pad = parts * block_v - v
    up = torch.nn.functional.pad(logit + bound, (0, pad), value=float("-inf")).view(m, parts, block_v)
    low = torch.nn.functional.pad(logit - bound, (0, pad), value=float("-inf")).view(m, parts, block_v)
    u1, j = up.max(dim=2)  # torch.max: the first index of the maximum
    rest = up.scatter(2, j[..., None], float("-inf"))
    u2 = rest.amax(dim=2)
    low1 = low.gather(2, j[..., None])[..., 0]
    i1 = (j + torch.arange(parts, device=g1.device)[None, :] * block_v).to(torch.int32)
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


def decisive_rows_certified(token: torch.Tensor, ok: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """[1] int32: 1 when the verify's accepted prefix and verifier token follow from certified
    rows alone. ``token``, ``ok`` [D + 1]: the rows' certified tokens and flags; ``drafts`` [D]:
    row i < D is decisive where it is not certified or rejects ``drafts[i]``, row D always; the
    first decisive row must be certified (the rows before it are, and accept their drafts)."""
    if drafts.shape != (token.shape[0] - 1,):
        raise ValueError(f"certified head: drafts must be [M - 1]={token.shape[0] - 1}, got {tuple(drafts.shape)}")
    rejects = torch.cat([token[:-1] != drafts, torch.ones_like(ok[:1])])
    first = torch.argmax((rejects | ~ok).to(torch.int32)).reshape(1)  # the first decisive row
    return ok.gather(0, first).to(torch.int32)


def certified_head_argmax(h, w16, w_int8, w_scale, err, mag, qn, *, partials, f16_head, drafts=None):
    """-> (top1 [M] int64: the 16-bit head's argmax, check [M] float32, certified [1] int32).

    ``partials``: ``certify_partials`` or its twin; ``f16_head``: ``f16_head_argmax`` (or its
    twin), called with ``skip`` = 1 when every row that matters was certified (the kernel then
    reads no weights; the twin computes anyway). ``check`` is the 16-bit head's confidence where
    it ran and 1 where it did not: a value to test for NaN (a non-finite h never certifies), not
    a confidence to act on.

    ``drafts`` [M - 1] (a verify step's d_1..d_D): row i's token only matters up to the first
    row whose token rejects its draft (``accept_on_device`` reads rows 0..a), so the call needs
    the 16-bit head only if the first row that is uncertified *or* certified to reject comes
    out uncertified; the rows after it may then hold any token."""
    check_dtype(h, (torch.float16, torch.bfloat16), "certified head: h")
    token, ok = certify(*partials(activation_planes(h), w_int8, w_scale, err, mag, qn))
    skip = ok.all().to(torch.int32).reshape(1) if drafts is None else decisive_rows_certified(token, ok, drafts)
    top16, conf16 = f16_head(h, w16, skip=skip)
    every = skip.bool()
    return torch.where(every, token, top16), torch.where(every, torch.ones_like(conf16), conf16), skip
