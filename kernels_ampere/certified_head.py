"""The 16-bit head's greedy token, read from the int8 head wherever a bound certifies it.

An AR or verify step takes the argmax of the 16-bit head: on a Jetson, where a step streams
its weights from DRAM, that head is as many bytes as the whole ternary stack of a 2B model
(656 MB against 521). The int8 head (the artifact's draft head: per-row scales ``s``, codes
``q``) is half of it, but its argmax differs at near-ties. Here the int8 rows find the few
rows that can be the 16-bit head's argmax, and the 16-bit head then reads only those:

    h ~ a · g                                          the 16-bit h the 16-bit head reads, as one
                                                       int8 plane (a = max|h| / 127, g = round(h / a))
    l[v] = s[v] · a · (q[v] · g)                       one exact int8 tensor-core sum per weight, as
                                                       the int8 head's (the same bytes and work)
    |head16[v] - l[v]| <= B[v] = ||w[v] - s[v]q[v]||_2 · ||h||_2       (Cauchy-Schwarz, exact e)
                               + gamma · (max|w[v]| + s[v]) · ||h||_1   (float32 sums, both heads)
                               + s[v] · ||q[v]||_2 · ||h - a g||_2      (Cauchy-Schwarz, the plane)

with ``head16[v]`` the logit the 16-bit head *computes* (its own float32 rounding included).
With ``L = max_v (l[v] - B[v])``, no row whose upper bound ``l + B`` is below ``L`` can be the
argmax: the **candidates** are the rows with ``l + B >= L`` — usually one to a few dozen of the
vocabulary. Their 16-bit rows are read and their logits ``e`` summed in float32 from the exact
products, and the row with the largest ``e`` is the 16-bit head's argmax as soon as ``e - eps``
there is strictly above ``e + eps`` of every other candidate, ``eps`` bounding both float32
sums' rounding: no tie and no rounding can reorder them.

Three launches: the int8 pass writes every row's upper bound and each vocabulary tile's largest
lower bound; the selection appends the rows at or above ``L`` to at most ``CANDIDATES`` slots
per activation row; the resolution reads those 16-bit rows. A row is certified when its
candidates all fit and their margin holds. Where a deciding row of a call is not certified, the
16-bit head runs after all (``f16_head_argmax(..., skip=...)``: inside a CUDA graph both
launches are captured, and the 16-bit one returns at once when every row was certified), so
the tokens are the 16-bit head's in every case. The per-row constants ``||e_v||_2``,
``max|w_v| + s_v`` and ``||q_v||_2`` are computed once at load (``head_error_bounds``), rounded up.

On the embedded models' held-out text (27M, H = 512, V = 8192; 1368 rows each of d8 / sft-27m:
``tools/certified_candidates.py``), the candidates numbered 2 at the median and at most 153 / 106;
99.0% / 99.9% of rows fit the 64 slots, and 98.0% / 99.0% were certified. The earlier form (two
int8 planes for a 15-bit h, two tensor-core sums per weight, and the whole 16-bit head whenever
one row was not alone above the rest) answered 89.5% of the d8 model's greedy AR head calls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_dtype, check_launchable, gdc_prologue, next_pow2, pdl_options
from .heads import _argmax_confidence, _head_combine_kernel, _row_tile_partials
from .numerics import int_matmul, quantize_rows_int8
from .tuning import HeadConfig

# Activation rows per program: every row of a call in one tile up to 64 (a fused step's head rows
# at c = 3 are 29), so the int8 rows are read once; the sums are exact integers, so the tile's
# height changes no bit. 16 is tl.dot's least; the warps grow with the tile (registers).
CERT_MAX_ROW_TILE = 64


def row_tile(m: int) -> int:
    """The activation rows of one program of the int8 pass for a call of ``m`` rows."""
    return min(max(16, next_pow2(m)), CERT_MAX_ROW_TILE)
# 256 vocabulary rows x 128 features per step, 4 warps, 3 stages: the fastest of 24 tilings on
# 8 SMs of the H200 for the two-plane pass this one replaced (board proxy;
# tools/results/session19/certify_configs.py)
CERTIFY_CONFIG = HeadConfig(block_v=256, block_h=128, num_warps=4, num_stages=3)
# Candidate slots per activation row: on the embedded models' held-out text 99.0% / 99.9% of rows
# had at most 64 candidates (median 2); a row with more is not certified (the 16-bit head runs).
CANDIDATES = 64
SELECT_BLOCK = 1024  # vocabulary rows per program of the selection
# The float32 sums of either head: |computed - exact| <= H u / (1 - H u) sum|w h| with u = 2**-24
# for sequential round-to-nearest; 2**-22 leaves room for any accumulation order and mode.
ROUNDING_UNIT = 2.0**-22
# The bounds themselves and the comparisons of the certificate run in float32: each side
# widened by this share of |l| + B (a few float32 roundings are < 2**-22 of it).
COMPARISON_SLACK = 2.0**-18
_SLACK = tl.constexpr(COMPARISON_SLACK)
UP = 1 + 2.0**-20  # norms computed in float64, rounded up by this factor
_UP = tl.constexpr(UP)


def rounding_gamma(hidden: int) -> float:
    """The share of ``sum |w h|`` one float32 sum over ``hidden`` terms can be off by, twice
    (the 16-bit head's own sum and ``l``'s), with a 4x margin on the unit roundoff."""
    nu = hidden * ROUNDING_UNIT
    if nu >= 0.5:
        raise ValueError(f"certified head: H={hidden} is too wide for the float32 rounding bound")
    return 2 * nu / (1 - nu)


def resolution_eps(hidden: int) -> float:
    """The share of ``sum |w h|`` by which a candidate's logit ``e`` (a float32 sum of the exact
    products) can be off the logit the 16-bit head computes (another float32 sum): both sums'
    rounding, ``rounding_gamma``, times ``1 + gamma`` for ``sum |w h|`` itself summed in float32."""
    gamma = rounding_gamma(hidden)
    return gamma * (1 + gamma)


def head_error_bounds(w16: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor,
                      chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-row constants of the bound, on ``w16``'s device -> (``||w_v - s_v q_v||_2``,
    ``max|w_v| + s_v``, ``||q_v||_2``), float32, rounded up (float64 sums, times 1 + 2**-20)."""
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
        qn.append(q.norm(dim=1))
    return tuple((torch.cat(x) * UP).float() for x in (err, mag, qn))


def int8_rows(w16: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """``numerics.quantize_rows_int8`` of ``w16`` [V, H] on its own device, ``chunk`` rows at a
    time (a 2B head is 1.3 GB as float32): the int8 head of a checkpoint that ships none."""
    parts = [quantize_rows_int8(w16[v0:v0 + chunk]) for v0 in range(0, w16.shape[0], chunk)]
    return torch.cat([q for q, _ in parts]).contiguous(), torch.cat([s for _, s in parts]).contiguous()


def activation_plane(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[M, H] 16-bit -> (g [M, H] int8, a, ||h||_1, ||h||_2, ||h - a g||_2 [M] float32): per row
    ``h ~ a · g`` with ``a = max|h| / 127`` (a float32 step) and ``g = round(h / a)``; the norms
    in float64, rounded up. A row with a non-finite element gets NaN norms (it never certifies).
    Torch ops on the rows (a few kB): the same function for the kernels and their twins."""
    h64 = h.double()
    a = (h64.abs().amax(dim=1) / 127).float().clamp(min=2.0**-126)
    a64 = a.double()[:, None]
    g = torch.round(h64 / a64).clamp(-127, 127).nan_to_num(0.0)
    finite = torch.where(torch.isfinite(h64).all(dim=1), 1.0, float("nan"))
    n1, n2, r = (x * UP * finite for x in (h64.abs().sum(dim=1), h64.norm(dim=1), (h64 - a64 * g).norm(dim=1)))
    return g.to(torch.int8), a, n1.float(), n2.float(), r.float()


@triton.jit
def _activation_plane_kernel(
    h_ptr,  # [M, H] 16-bit
    g_ptr,  # [M, H] int8
    a_ptr, n1_ptr, n2_ptr, r_ptr,  # [M] float32
    H, stride_hm,
    BLOCK_H: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    """``activation_plane`` for one row per program, in float64 as the twin: ``a`` and ``g``
    bit for bit (round half to even), the norms as upper bounds like the twin's (their sums in
    another order: within a float32 ulp of them)."""
    gdc_prologue(USE_GDC)
    m = tl.program_id(0)
    rh = tl.arange(0, BLOCK_H)
    mask = rh < H
    x = tl.load(h_ptr + m * stride_hm + rh, mask=mask, other=0.0).to(tl.float64)
    a = tl.maximum((tl.max(tl.abs(x), axis=0) / 127).to(tl.float32), 2.0**-126)
    a = tl.where(tl.sum(tl.where(x != x, 1, 0), axis=0) == 0, a, float("nan"))  # torch's amax keeps a NaN
    y = x / a.to(tl.float64)
    g = tl.floor(y + 0.5)
    g = tl.where((g - y == 0.5) & (g - 2 * tl.floor(g * 0.5) != 0), g - 1, g)  # ties to even, as torch.round
    g = tl.where(g == g, g, 0.0)  # NaN (a non-finite row) -> 0, as nan_to_num
    g = tl.minimum(tl.maximum(g, -127.0), 127.0)
    finite = tl.sum(tl.where(mask & ((x - x) != 0), 1, 0), axis=0) == 0  # inf - inf and NaN are NaN
    r = x - a.to(tl.float64) * g
    up = tl.where(finite, _UP, float("nan"))
    tl.store(g_ptr + m * H + rh, g.to(tl.int8), mask=mask)
    tl.store(a_ptr + m, a)
    tl.store(n1_ptr + m, (tl.sum(tl.abs(x), axis=0) * up).to(tl.float32))
    tl.store(n2_ptr + m, (tl.sqrt(tl.sum(x * x, axis=0)) * up).to(tl.float32))
    tl.store(r_ptr + m, (tl.sqrt(tl.sum(r * r, axis=0)) * up).to(tl.float32))


def activation_plane_kernel(h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``activation_plane`` in one launch (a decode step pays ~30 torch launches for the twin)."""
    m, hdim = h.shape
    if h.stride(1) != 1:
        raise ValueError(f"certified head: h must have contiguous rows, got strides {h.stride()}")
    g = torch.empty((m, hdim), dtype=torch.int8, device=h.device)
    a, n1, n2, r = (torch.empty((m,), dtype=torch.float32, device=h.device) for _ in range(4))
    if m:
        _activation_plane_kernel[(m,)](h, g, a, n1, n2, r, hdim, h.stride(0), BLOCK_H=next_pow2(hdim),
                                       num_warps=8, **pdl_options(_activation_plane_kernel))
    return g, a, n1, n2, r


@triton.jit
def _certify_bounds_kernel(
    g_ptr,  # [M, H] int8: the activation plane (activation_plane)
    a_ptr, n1_ptr, n2_ptr, r_ptr,  # [M] float32: plane step, ||h||_1, ||h||_2, ||h - a g||_2
    q_ptr,  # [V, H] int8 codes
    s_ptr, err_ptr, mag_ptr, qn_ptr,  # [V] float32: row scale, ||e_v||_2, max|w_v| + s_v, ||q_v||_2
    up_ptr,  # [M, V] float32: every row's upper bound
    low_ptr,  # [P, M] float32: per vocabulary tile, the largest lower bound
    count_ptr,  # [M] int32: zeroed here for the selection that follows
    M, V, H, stride_gm, stride_qv, gamma,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
    pmax_ptr=None, pidx_ptr=None, psum_ptr=None,  # DRAFTS: [P, M], the int8 head's partials of l
    DRAFTS: tl.constexpr = False,
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
    if pid == 0:
        tl.store(count_ptr + rm, tl.zeros((BLOCK_M,), tl.int32), mask=mask_m)
    acc = tl.zeros((BLOCK_V, BLOCK_M), tl.int32)
    for h0 in range(0, H, BLOCK_H):
        mask_h = (h0 + rh) < H
        q = tl.load(q_ptr + rv[:, None] * stride_qv + (h0 + rh)[None, :],
                    mask=mask_v[:, None] & mask_h[None, :], other=0)  # [BLOCK_V, BLOCK_H]
        g = tl.load(g_ptr + rm[None, :] * stride_gm + (h0 + rh)[:, None],
                    mask=mask_m[None, :] & mask_h[:, None], other=0)  # [BLOCK_H, BLOCK_M]
        acc = tl.dot(q, g, acc, out_dtype=tl.int32)  # exact
    a = tl.load(a_ptr + rm, mask=mask_m, other=0.0)
    n1 = tl.load(n1_ptr + rm, mask=mask_m, other=0.0)
    n2 = tl.load(n2_ptr + rm, mask=mask_m, other=0.0)
    r = tl.load(r_ptr + rm, mask=mask_m, other=0.0)
    # the twin's order, operation for operation (launched without FMA contraction): equal bits
    logit = acc.to(tl.float32) * a[None, :] * s[:, None]
    bound = err[:, None] * n2[None, :] + gamma * mag[:, None] * n1[None, :] + s[:, None] * qn[:, None] * r[None, :]
    bound = bound + (tl.abs(logit) + bound) * _SLACK
    up = logit + bound
    tl.store(up_ptr + rm[None, :] * V + rv[:, None], up, mask=mask_m[None, :] & mask_v[:, None])
    low = tl.max(tl.where(mask_v[:, None], logit - bound, float("-inf")), axis=0)
    tl.store(low_ptr + pid * M + rm, low, mask=mask_m)
    if DRAFTS:  # l is an int8 head's logit (W8A8, h's plane): its argmax and confidence, as heads.py
        _row_tile_partials(acc, rm, M, pid, rv, mask_v, s, a, pmax_ptr, pidx_ptr, psum_ptr, True, BLOCK_V)


@triton.jit
def _select_candidates_kernel(
    up_ptr,  # [M, V] float32
    low_ptr,  # [P, M] float32
    cand_ptr,  # [M, K] int32: the rows with up >= max(low), in any order
    count_ptr,  # [M] int32: how many there were (zeroed by the bounds kernel; may exceed K)
    M, V, P,
    K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    gdc_prologue(USE_GDC)
    m = tl.program_id(0)
    rp = tl.arange(0, BLOCK_P)
    best = tl.full((BLOCK_P,), float("-inf"), tl.float32)
    for p0 in range(0, P, BLOCK_P):
        best = tl.maximum(best, tl.load(low_ptr + (p0 + rp) * M + m, mask=(p0 + rp) < P, other=float("-inf")))
    # a non-finite row's bounds are NaN: its floor comes out -inf or NaN, and selects nothing
    floor = tl.max(best, axis=0)
    floor = tl.where(floor > float("-inf"), floor, float("nan"))
    rv = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    up = tl.load(up_ptr + m * V + rv, mask=rv < V, other=float("-inf"))
    hit = ((up >= floor) & (rv < V)).to(tl.int32)
    n = tl.sum(hit, axis=0)
    if n > 0:
        slot = tl.atomic_add(count_ptr + m, n) + tl.cumsum(hit, axis=0) - 1
        tl.store(cand_ptr + m * K + slot, rv, mask=(hit != 0) & (slot < K))


@triton.jit
def _resolve_candidates_kernel(
    h_ptr,  # [M, H] 16-bit
    w_ptr,  # [V, H] 16-bit
    cand_ptr,  # [M, K] int32
    count_ptr,  # [M] int32
    token_ptr,  # [M] int64
    ok_ptr,  # [M] int32
    H, stride_hm, stride_wv, eps_share,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    """One program per activation row: the candidates' logits ``BLOCK_K`` at a time
    (most rows have a handful: one chunk), folded into the leader and the largest ``e + eps``
    of the rest."""
    gdc_prologue(USE_GDC)
    m = tl.program_id(0)
    rk = tl.arange(0, BLOCK_K)
    rh = tl.arange(0, BLOCK_H)
    count = tl.load(count_ptr + m)
    n = tl.minimum(count, K)
    lead_e = tl.full((), float("-inf"), tl.float32)
    lead_up = tl.full((), float("-inf"), tl.float32)
    lead_low = tl.full((), float("-inf"), tl.float32)
    lead_row = tl.full((), 0, tl.int32)
    rest = tl.full((), float("-inf"), tl.float32)  # the largest e + eps of the others
    for k0 in range(0, n, BLOCK_K):
        live = (k0 + rk) < n
        rows = tl.load(cand_ptr + m * K + k0 + rk, mask=live, other=0)
        e = tl.zeros((BLOCK_K,), tl.float32)
        ab = tl.zeros((BLOCK_K,), tl.float32)
        for h0 in range(0, H, BLOCK_H):
            mask_h = (h0 + rh) < H
            x = tl.load(h_ptr + m * stride_hm + h0 + rh, mask=mask_h, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * stride_wv + (h0 + rh)[None, :],
                        mask=live[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
            wx = w * x[None, :]  # exact in float32: the product of two 16-bit values
            e += tl.sum(wx, axis=1)
            ab += tl.sum(tl.abs(wx), axis=1)
        eps = ab * eps_share
        e = tl.where(live, e, float("-inf"))
        first = rk == tl.argmax(e, axis=0, tie_break_left=True)
        e_j = tl.max(tl.where(first, e, float("-inf")), axis=0)
        eps_j = tl.sum(tl.where(first, eps, 0.0), axis=0)
        others = tl.max(tl.where(first | ~live, float("-inf"), e + eps), axis=0)
        takes = e_j > lead_e  # an equal later row stays behind (and then fails the margin)
        rest = tl.maximum(rest, tl.maximum(others, tl.where(takes, lead_up, e_j + eps_j)))
        lead_up = tl.where(takes, e_j + eps_j, lead_up)
        lead_low = tl.where(takes, e_j - eps_j, lead_low)
        lead_row = tl.where(takes, tl.sum(tl.where(first, rows, 0), axis=0), lead_row)
        lead_e = tl.where(takes, e_j, lead_e)
    widen = (tl.abs(lead_low) + tl.where(rest == float("-inf"), 0.0, tl.abs(rest))) * _SLACK
    ok = (count >= 1) & (count <= K) & (lead_low - widen > rest + widen)  # false on NaN
    tl.store(token_ptr + m, lead_row.to(tl.int64))
    tl.store(ok_ptr + m, ok.to(tl.int32))


def _check(w_int8, w_scale, err, mag, qn):
    check_dtype(w_int8, (torch.int8,), "certified head: w_int8")
    if w_int8.dim() != 2 or w_int8.stride(1) != 1:
        raise ValueError(f"certified head: w_int8 must be [V, H] with contiguous rows, got {tuple(w_int8.shape)}")
    for t, name in ((w_scale, "w_scale"), (err, "err_norm"), (mag, "magnitude"), (qn, "code_norm")):
        check_dtype(t, (torch.float32,), f"certified head: {name}")
        if t.shape != (w_int8.shape[0],):
            raise ValueError(f"certified head: {name} must be [V]={w_int8.shape[0]}, got {tuple(t.shape)}")


def _plane_shape(plane, w_int8) -> tuple[int, int, int]:
    m, hdim = plane[0].shape
    if hdim != w_int8.shape[1]:
        raise ValueError(f"certified head: h has H={hdim}, the head {w_int8.shape[1]}")
    return m, hdim, w_int8.shape[0]


def certify_bounds(plane, w_int8, w_scale, err, mag, qn, *, config=None, drafts: bool = False):
    """The int8 pass -> (``up`` [M, V] float32: every row's upper bound ``l + B``; ``low``
    [P, M] float32: per vocabulary tile its largest lower bound; ``count`` [M] int32 zeros for
    ``select_candidates``), and with ``drafts`` the argmax of ``l`` and its confidence per row
    ((top1 [M] int64, confidence [M] float32): ``l`` is an int8 head's logit, the W8A8 product
    with h's plane, so the same pass answers draft rows). ``plane``: ``activation_plane(h)``.
    The Triton kernel."""
    _check(w_int8, w_scale, err, mag, qn)
    m, hdim, v = _plane_shape(plane, w_int8)
    g, a, n1, n2, r = plane
    check_launchable(_certify_bounds_kernel, g, a, w_int8, w_scale, err, mag, qn)
    config = config or CERTIFY_CONFIG
    parts = triton.cdiv(v, config.block_v)
    up = torch.empty((m, v), dtype=torch.float32, device=g.device)
    low = torch.empty((parts, m), dtype=torch.float32, device=g.device)
    count = torch.empty((m,), dtype=torch.int32, device=g.device)
    if drafts:
        partials = [torch.empty((parts, m), dtype=dt, device=g.device)
                    for dt in (torch.float32, torch.int32, torch.float32)]
        top1 = torch.empty((m,), dtype=torch.int64, device=g.device)
        conf = torch.empty((m,), dtype=torch.float32, device=g.device)
    if m:
        block_m = row_tile(m)
        _certify_bounds_kernel[(triton.cdiv(m, block_m), parts)](
            g, a, n1, n2, r, w_int8, w_scale, err, mag, qn, up, low, count, m, v, hdim, g.stride(0),
            w_int8.stride(0), rounding_gamma(hdim), BLOCK_M=block_m, BLOCK_V=config.block_v,
            BLOCK_H=config.block_h, num_warps=config.num_warps * max(1, block_m // 32), num_stages=config.num_stages,
            enable_fp_fusion=False, **pdl_options(_certify_bounds_kernel),
            **({"pmax_ptr": partials[0], "pidx_ptr": partials[1], "psum_ptr": partials[2], "DRAFTS": True}
               if drafts else {}),
        )
        if drafts:
            _head_combine_kernel[(m,)](*partials, top1, conf, parts, m, BLOCK_P=min(next_pow2(parts), 1024),
                                       num_warps=4, **pdl_options(_head_combine_kernel))
    return (up, low, count, top1, conf) if drafts else (up, low, count)


def certify_bounds_reference(plane, w_int8, w_scale, err, mag, qn, *, config=None, block_v: int = 128,
                             drafts: bool = False):
    """``certify_bounds``' twin: the exact integer sums (``int_matmul``), then the kernel's
    float32 operations in its order, tiles of ``block_v`` rows (``config.block_v`` when given):
    the same bits as the kernel (the drafts' tokens too; their confidences to float32 rounding)."""
    _check(w_int8, w_scale, err, mag, qn)
    m, hdim, v = _plane_shape(plane, w_int8)
    g, a, n1, n2, r = plane
    block_v = config.block_v if config is not None else block_v
    logit = int_matmul(g, w_int8).float() * a[:, None] * w_scale[None, :]  # [M, V]
    bound = (err[None, :] * n2[:, None] + rounding_gamma(hdim) * mag[None, :] * n1[:, None]
             + w_scale[None, :] * qn[None, :] * r[:, None])
    bound = bound + (logit.abs() + bound) * COMPARISON_SLACK
    parts = -(-v // block_v)
    low = torch.nn.functional.pad(logit - bound, (0, parts * block_v - v), value=float("-inf"))
    low = low.view(m, parts, block_v).amax(dim=2).t().contiguous()
    out = (logit + bound, low, torch.zeros((m,), dtype=torch.int32, device=g.device))
    return (*out, *_argmax_confidence(logit)) if drafts else out


def select_candidates(up, low, count, *, k: int = CANDIDATES, rows: int | None = None):
    """-> (``cand`` [R, k] int32, ``count`` [R] int32) for the first ``rows`` rows (R; default
    all): per row the vocabulary rows whose upper bound reaches the largest lower bound, in
    slots ``0 .. min(count, k)`` in any order (``count`` may exceed ``k``: that row is then not
    certified). The Triton kernel; ``count`` must hold zeros (``certify_bounds`` leaves them)."""
    m, v = up.shape
    rows = m if rows is None else rows
    cand = torch.empty((rows, k), dtype=torch.int32, device=up.device)
    if rows:
        _select_candidates_kernel[(rows, triton.cdiv(v, SELECT_BLOCK))](
            up, low, cand, count, m, v, low.shape[0], K=k, BLOCK=SELECT_BLOCK,
            BLOCK_P=min(next_pow2(low.shape[0]), 1024), num_warps=4, **pdl_options(_select_candidates_kernel),
        )
    return cand, count[:rows]


def select_candidates_reference(up, low, count, *, k: int = CANDIDATES, rows: int | None = None):
    """``select_candidates``' twin: the same rows, ascending, zeros in the unused slots."""
    up, low = up[:rows], low[:, :rows]
    floor = low.amax(dim=0)[:, None]
    hit = (up >= floor) & (floor > float("-inf"))  # [M, V]; NaN bounds (a non-finite row): none
    count = hit.sum(dim=1).to(torch.int32)
    order = torch.where(hit, torch.arange(up.shape[1], device=up.device), up.shape[1])
    cand = order.sort(dim=1).values[:, :k]
    cand = torch.where(cand < up.shape[1], cand, 0).to(torch.int32)
    return torch.nn.functional.pad(cand, (0, k - cand.shape[1])), count


def resolve_candidates(h, w16, cand, count):
    """-> (token [M] int64, ok [M] bool): per row the candidate with the largest logit,
    certified where its margin holds over every other candidate (and all candidates fitted).
    The Triton kernel."""
    m, hdim = h.shape
    if h.stride(1) != 1 or w16.stride(1) != 1 or cand.shape[0] != m or not cand.is_contiguous():
        raise ValueError(f"certified head: h [M, H] and w16 [V, H] need contiguous rows and cand [M={m}, K] "
                         f"contiguous; got h {tuple(h.shape)}, w16 {tuple(w16.shape)}, cand {tuple(cand.shape)}")
    token = torch.empty((m,), dtype=torch.int64, device=h.device)
    ok = torch.empty((m,), dtype=torch.int32, device=h.device)
    if m:
        _resolve_candidates_kernel[(m,)](
            h, w16, cand, count, token, ok, hdim, h.stride(0), w16.stride(0), resolution_eps(hdim),
            K=cand.shape[1], BLOCK_K=16, BLOCK_H=256, num_warps=4, **pdl_options(_resolve_candidates_kernel),
        )
    return token, ok.bool()


def resolve_candidates_reference(h, w16, cand, count):
    """``resolve_candidates``' twin (float32 sums in torch's order: the same tokens, and the
    same verdicts except within a float32 rounding of a margin)."""
    k = cand.shape[1]
    n = count.clamp(max=k)
    live = torch.arange(k, device=h.device)[None, :] < n[:, None]  # [M, k]
    w = w16[cand.long()].float()  # [M, k, H]
    wx = w * h.float()[:, None, :]
    e = torch.where(live, wx.sum(dim=2), float("-inf"))
    eps = wx.abs().sum(dim=2) * resolution_eps(h.shape[1])
    j = e.argmax(dim=1, keepdim=True)
    first = torch.zeros_like(live).scatter(1, j, True)
    lead_low = (e - eps).gather(1, j)[:, 0]
    rest = torch.where(first | ~live, float("-inf"), e + eps).amax(dim=1)
    widen = (lead_low.abs() + torch.where(rest == float("-inf"), 0.0, rest.abs())) * COMPARISON_SLACK
    ok = (count >= 1) & (count <= k) & (lead_low - widen > rest + widen)
    return cand.long().gather(1, j)[:, 0], ok


def certify_tokens(h, w16, w_int8, w_scale, err, mag, qn, *, config=None, k: int = CANDIDATES):
    """[M, H] 16-bit h -> (token [M] int64, certified [M] bool): the three launches."""
    up, low, count = certify_bounds(activation_plane_kernel(h), w_int8, w_scale, err, mag, qn, config=config)
    return resolve_candidates(h, w16, *select_candidates(up, low, count, k=k))


def certify_tokens_reference(h, w16, w_int8, w_scale, err, mag, qn, *, config=None, k: int = CANDIDATES):
    """``certify_tokens`` with the twins."""
    up, low, count = certify_bounds_reference(activation_plane(h), w_int8, w_scale, err, mag, qn, config=config)
    return resolve_candidates_reference(h, w16, *select_candidates_reference(up, low, count, k=k))


def certify_fused_rows(h, w16, w_int8, w_scale, err, mag, qn, *, n: int, config=None, k: int = CANDIDATES):
    """A fused step's head rows in one int8 pass: [R, H] 16-bit h, the first ``n`` the verify
    rows -> (token, certified [n]: as ``certify_tokens``; top1 [R] int64, confidence [R]
    float32: the int8 logits' argmax and confidence, the draft rows' next drafts)."""
    up, low, count, top1, conf = certify_bounds(activation_plane_kernel(h), w_int8, w_scale, err, mag, qn,
                                                config=config, drafts=True)
    return (*resolve_candidates(h[:n], w16, *select_candidates(up, low, count, k=k, rows=n)), top1, conf)


def certify_fused_rows_reference(h, w16, w_int8, w_scale, err, mag, qn, *, n: int, config=None,
                                 k: int = CANDIDATES):
    """``certify_fused_rows`` with the twins."""
    up, low, count, top1, conf = certify_bounds_reference(activation_plane(h), w_int8, w_scale, err, mag, qn,
                                                          config=config, drafts=True)
    return (*resolve_candidates_reference(h[:n], w16, *select_candidates_reference(up, low, count, k=k, rows=n)),
            top1, conf)


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


def certified_head_argmax(h, w16, w_int8, w_scale, err, mag, qn, *, certify, f16_head, drafts=None):
    """-> (top1 [M] int64: the 16-bit head's argmax, check [M] float32, certified [1] int32).

    ``certify``: ``certify_tokens`` or its twin; ``f16_head``: ``f16_head_argmax`` (or its
    twin), called with ``skip`` = 1 when every row that matters was certified (the kernel then
    reads no weights; the twin computes anyway). ``check`` is the 16-bit head's confidence where
    it ran and 1 where it did not: a value to test for NaN (a non-finite h never certifies), not
    a confidence to act on.

    ``drafts`` [M - 1] (a verify step's d_1..d_D): row i's token only matters up to the first
    row whose token rejects its draft (``accept_on_device`` reads rows 0..a), so the call needs
    the 16-bit head only if the first row that is uncertified *or* certified to reject comes
    out uncertified; the rows after it may then hold any token."""
    _check_heads(h, w16)
    return _16bit_where_needed(h, w16, *certify(h, w16, w_int8, w_scale, err, mag, qn), drafts, f16_head)


def _check_heads(h, w16):
    check_dtype(h, (torch.float16, torch.bfloat16), "certified head: h")
    if w16.dtype != h.dtype or w16.dim() != 2 or w16.shape[1] != h.shape[1] or w16.stride(1) != 1:
        raise ValueError(f"certified head: w16 must be [V, H={h.shape[1]}] {h.dtype} with contiguous rows, got "
                         f"{w16.dtype} {tuple(w16.shape)}")


def _16bit_where_needed(h, w16, token, ok, drafts, f16_head, top=None, check=None):
    """The certified rows' tokens, or the 16-bit head's on ``h`` where a deciding row is not
    certified -> (top1, check, certified [1] int32), written into ``top`` / ``check`` if given."""
    skip = ok.all().to(torch.int32).reshape(1) if drafts is None else decisive_rows_certified(token, ok, drafts)
    top16, conf16 = f16_head(h, w16, skip=skip)
    every = skip.bool()
    top = torch.where(every, token, top16, out=top)
    check = torch.where(every, torch.ones_like(conf16), conf16, out=check)
    return top, check, skip


def certified_fused_head(h, w16, w_int8, w_scale, err, mag, qn, *, n: int, drafts, certify_rows, f16_head):
    """A fused step's one head pass with the certified head -> (top1 [R] int64, confidence [R]
    float32, certified [1] int32). Rows ``:n`` (the verify rows ``[anchor, d_1..d_m]``,
    ``drafts`` = d_1..d_m): the 16-bit head's greedy tokens as ``certified_head_argmax`` gives
    them (the 16-bit head on these rows only where a deciding row is not certified; confidence
    1 where it did not run). Rows ``n:`` (the candidate blocks' draft rows): the argmax and
    confidence of the int8 logits the same pass computed — the drafts of an int8 head, where the
    16-bit head's one pass (``FastModel.verify_top1``) gives the 16-bit head's. ``certify_rows``:
    ``certify_fused_rows`` or its twin."""
    _check_heads(h, w16)
    token, ok, top1, conf = certify_rows(h, w16, w_int8, w_scale, err, mag, qn, n=n)
    _, _, skip = _16bit_where_needed(h[:n], w16, token, ok, drafts, f16_head, top=top1[:n], check=conf[:n])
    return top1, conf, skip
