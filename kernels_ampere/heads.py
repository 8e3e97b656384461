"""Output heads fused with argmax and max-softmax: top-1 and confidence, no [M, V] logits.

    logits[m, v] = float(sum_h h[m, h] * W[v, h]) * h_scale[m] * w_row_scale[v]   (int8 / int4 draft head)
    logits[m, v] = float32 sum_h h[m, h] * W[v, h]                                 (16-bit verify head)
    top1[m]       = argmax_v logits[m, v]            (ties: the lowest index, as torch.argmax)
    confidence[m] = max_v softmax(logits[m])[v] = 1 / sum_v exp(logits[m, v] - max)

Pass one: each program owns ``BLOCK_V`` vocabulary rows, computes their logits tile
(``tl.dot``, weights as the first operand so the vocabulary fills the tensor-core M side),
and writes per column ``m`` its local max, the lowest index reaching it, and
``sum exp(logit - local max)``. Pass two, one program per row, folds the partials in
vocabulary order with an online log-sum-exp; a later partial replaces the running argmax
only when strictly larger, so ties keep the lowest index.

The int8 head accumulates exactly in int32 and scales in the twin's order
``(float(acc) * h_scale) * w_row_scale``, so its top-1 equals the twin's bit for bit. The int4
head (``numerics.pack_int4_rows``: half a row's columns in the low nibbles, half in the high
ones, each as code + 8) is the same computation over half the bytes: per step one packed byte
tile gives both halves' int8 operands by bitwise operations on whole bytes (``_int4_tile_sums``),
and the integer sum is exact. Its point is the board: a draft step of a 2B model streams the
head as well as the ternary stack, and int4 halves the head's share of those bytes. The
16-bit head accumulates in float32 in tile order, so a near-tie (two logits within float32
rounding of each other) may resolve differently from the twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .numerics import int_matmul, unpack_int4_rows

from .common import bf16_dot_upcast, check_dtype, check_launchable, gdc_prologue, next_pow2, pdl_options
from .tuning import HeadConfig, default_head, lookup

_LOG2E = tl.constexpr(1.4426950408889634)
_NO_INDEX = tl.constexpr(2**31 - 1)  # larger than any vocabulary index
F16_ROW_TILE = 16  # rows per tile of the 16-bit head, whatever the width (row invariance)
# Row tiles one program of the 16-bit head takes, each weight tile loaded once for all of them
# (a fused step's head reads its verify rows and every candidate block's draft rows: ~30 at
# D = 8, c = 3); separate programs would each read the weights (H200: a second 16-row tile in
# its own program cost the 2B-shape fused replay ~40 µs of the ~80 a one-pass head saves).
F16_MAX_ROW_TILES = 4


@triton.jit
def _head_partial_kernel(
    h_ptr,  # [M, H] int8, or float16 / bfloat16
    h_scale_ptr,  # [M] float32 (INT8 only)
    w_ptr,  # [V, H] int8, or float16 / bfloat16
    w_scale_ptr,  # [V] float32 (INT8 only)
    pmax_ptr, pidx_ptr, psum_ptr,  # [P, M] float32 / int32 / float32
    M, V, H,
    stride_hm, stride_wv,
    INT8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    ROW_TILES: tl.constexpr = 1,  # BLOCK_M-row tiles per program (1..4), each weight tile loaded once for all
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
    skip_ptr=None,  # SKIP: [1] int32, nonzero = return at once (certified_head.py answered every row)
    SKIP: tl.constexpr = False,
    INT4: tl.constexpr = False,  # w: [V, HP] packed int4 (numerics.pack_int4_rows), HP = ceil(H / 2)
    HP=0,
):
    # the row tiles of one vocabulary tile are neighbours in the grid (and up to ROW_TILES of
    # them in one program): they share its weights' DRAM traffic (a fused step's head reads ~30 rows)
    pid = tl.program_id(1)
    rv = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    rm = tl.program_id(0) * (BLOCK_M * ROW_TILES) + tl.arange(0, BLOCK_M)
    rh = tl.arange(0, BLOCK_H)
    mask_v = rv < V
    if INT8:  # the weights' row scales are constants: read before the wait, not after the loop
        ws = tl.load(w_scale_ptr + rv, mask=mask_v, other=0.0)
    else:
        ws = tl.zeros((BLOCK_V,), tl.float32)
    gdc_prologue(USE_GDC)
    if SKIP:  # the flag is the previous kernel's output: read after the wait
        if tl.load(skip_ptr) != 0:
            return
    # int8: the rows' scales asked for now, in flight during the loop (one tile holds every row)
    hs = _row_scales(h_scale_ptr, rm, M, INT8, BLOCK_M)
    acc0 = tl.zeros((BLOCK_V, BLOCK_M), tl.int32 if INT8 else tl.float32)
    acc1 = tl.zeros((BLOCK_V, BLOCK_M), tl.int32 if INT8 else tl.float32)
    acc2 = tl.zeros((BLOCK_V, BLOCK_M), tl.int32 if INT8 else tl.float32)
    acc3 = tl.zeros((BLOCK_V, BLOCK_M), tl.int32 if INT8 else tl.float32)
    if INT4:
        acc0 = _int4_tile_sums(w_ptr, h_ptr, rv, mask_v, rm, M, H, HP, stride_wv, stride_hm, BLOCK_V, BLOCK_M,
                               BLOCK_H)
    else:
        for h0 in range(0, H, BLOCK_H):
            mask_h = (h0 + rh) < H
            w = tl.load(w_ptr + rv[:, None] * stride_wv + (h0 + rh)[None, :],
                        mask=mask_v[:, None] & mask_h[None, :], other=0)  # [BLOCK_V, BLOCK_H]
            # each row tile is the same dot a one-tile program makes: a row's logits do not depend
            # on how many tiles share the program (row invariance of the 16-bit head)
            acc0 = _row_tile_dot(w, h_ptr, rm, M, h0 + rh, mask_h, stride_hm, acc0, INT8, UPCAST)
            if ROW_TILES > 1:
                acc1 = _row_tile_dot(w, h_ptr, rm + BLOCK_M, M, h0 + rh, mask_h, stride_hm, acc1, INT8, UPCAST)
            if ROW_TILES > 2:
                acc2 = _row_tile_dot(w, h_ptr, rm + 2 * BLOCK_M, M, h0 + rh, mask_h, stride_hm, acc2, INT8, UPCAST)
            if ROW_TILES > 3:
                acc3 = _row_tile_dot(w, h_ptr, rm + 3 * BLOCK_M, M, h0 + rh, mask_h, stride_hm, acc3, INT8, UPCAST)
    _row_tile_partials(acc0, rm, M, pid, rv, mask_v, ws, hs, pmax_ptr, pidx_ptr, psum_ptr, INT8, BLOCK_V)
    if ROW_TILES > 1:
        _row_tile_partials(acc1, rm + BLOCK_M, M, pid, rv, mask_v, ws, _row_scales(h_scale_ptr, rm + BLOCK_M, M, INT8,
                           BLOCK_M), pmax_ptr, pidx_ptr, psum_ptr, INT8, BLOCK_V)
    if ROW_TILES > 2:
        _row_tile_partials(acc2, rm + 2 * BLOCK_M, M, pid, rv, mask_v, ws, _row_scales(h_scale_ptr, rm + 2 * BLOCK_M,
                           M, INT8, BLOCK_M), pmax_ptr, pidx_ptr, psum_ptr, INT8, BLOCK_V)
    if ROW_TILES > 3:
        _row_tile_partials(acc3, rm + 3 * BLOCK_M, M, pid, rv, mask_v, ws, _row_scales(h_scale_ptr, rm + 3 * BLOCK_M,
                           M, INT8, BLOCK_M), pmax_ptr, pidx_ptr, psum_ptr, INT8, BLOCK_V)


@triton.jit
def _int4_tile_sums(w_ptr, h_ptr, rv, mask_v, rm, M, H, HP, stride_wv, stride_hm, BLOCK_V: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """``sum_h W[v, h] * x[m, h]`` (exact int32, [BLOCK_V, BLOCK_M]) over packed int4 rows: per
    step ``BLOCK_H / 2`` bytes of each row give the low half's operand ``byte & 0x0F`` (code + 8:
    its offset ``8 * sum x`` over the low half is taken off once, at the end) and the high
    half's ``(byte & 0xF0) ^ 0x80`` (16 x code). Both are bitwise operations on whole bytes,
    which the compiler does four to a register; a shift of each byte would go a byte at a time."""
    rb = tl.arange(0, BLOCK_H // 2)
    acc_lo = tl.zeros((BLOCK_V, BLOCK_M), tl.int32)
    acc_hi = tl.zeros((BLOCK_V, BLOCK_M), tl.int32)
    x_sum = tl.zeros((16, BLOCK_M), tl.int32)  # 16 equal rows: the low half's activation sums
    ones = tl.full((16, BLOCK_H // 2), 1, tl.int8)
    for j0 in range(0, HP, BLOCK_H // 2):
        mask_j = (j0 + rb) < HP
        wb = tl.load(w_ptr + rv[:, None] * stride_wv + (j0 + rb)[None, :],
                     mask=mask_v[:, None] & mask_j[None, :], other=0)  # [BLOCK_V, BLOCK_H / 2] uint8 (masked: x is 0 there)
        x_lo = tl.load(h_ptr + rm[None, :] * stride_hm + (j0 + rb)[:, None],
                       mask=(rm < M)[None, :] & mask_j[:, None], other=0)  # [BLOCK_H / 2, BLOCK_M]
        x_hi = tl.load(h_ptr + rm[None, :] * stride_hm + (HP + j0 + rb)[:, None],
                       mask=(rm < M)[None, :] & ((HP + j0 + rb) < H)[:, None], other=0)
        acc_lo = tl.dot((wb & 0x0F).to(tl.int8, bitcast=True), x_lo, acc_lo, out_dtype=tl.int32)
        acc_hi = tl.dot(((wb & 0xF0) ^ 0x80).to(tl.int8, bitcast=True), x_hi, acc_hi, out_dtype=tl.int32)
        x_sum = tl.dot(ones, x_lo, x_sum, out_dtype=tl.int32)
    return acc_lo - 8 * tl.max(x_sum, axis=0)[None, :] + (acc_hi >> 4)


@triton.jit
def _row_scales(h_scale_ptr, rm, M, INT8: tl.constexpr, BLOCK_M: tl.constexpr):
    """The int8 rows' activation scales (zeros for the 16-bit head, which has none)."""
    if INT8:
        return tl.load(h_scale_ptr + rm, mask=rm < M, other=0.0)
    return tl.zeros((BLOCK_M,), tl.float32)


@triton.jit
def _row_tile_dot(w, h_ptr, rm, M, cols, mask_h, stride_hm, acc, INT8: tl.constexpr, UPCAST: tl.constexpr):
    """``acc += w @ h[rm, cols]^T`` for one tile of rows (rows past M read as 0)."""
    x = tl.load(h_ptr + rm[None, :] * stride_hm + cols[:, None],
                mask=(rm < M)[None, :] & mask_h[:, None], other=0)  # [BLOCK_H, BLOCK_M]
    if UPCAST:
        return tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w, x, acc, out_dtype=tl.int32 if INT8 else tl.float32)


@triton.jit
def _row_tile_partials(acc, rm, M, pid, rv, mask_v, ws, hs, pmax_ptr, pidx_ptr, psum_ptr,
                       INT8: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row tile's local max, its lowest index and ``sum exp(logit - max)`` over this
    program's vocabulary rows, stored per row (int8: ``hs`` the rows' scales)."""
    mask_m = rm < M
    if INT8:
        logits = acc.to(tl.float32) * hs[None, :] * ws[:, None]
    else:
        logits = acc
    logits = tl.where(mask_v[:, None], logits, float("-inf"))  # [BLOCK_V, BLOCK_M]
    lmax = tl.max(logits, axis=0)
    lidx = tl.argmax(logits, axis=0, tie_break_left=True)
    lsum = tl.sum(tl.exp2((logits - lmax[None, :]) * _LOG2E), axis=0)
    out = pid * M + rm
    tl.store(pmax_ptr + out, lmax, mask=mask_m)
    tl.store(pidx_ptr + out, pid * BLOCK_V + lidx, mask=mask_m)
    tl.store(psum_ptr + out, lsum, mask=mask_m)


@triton.jit
def _head_combine_kernel(
    pmax_ptr, pidx_ptr, psum_ptr,  # [P, M]
    top1_ptr,  # [M] int64
    conf_ptr,  # [M] float32
    P, M,
    BLOCK_P: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
    skip_ptr=None,  # as in _head_partial_kernel
    SKIP: tl.constexpr = False,
):
    gdc_prologue(USE_GDC)
    if SKIP:
        if tl.load(skip_ptr) != 0:
            return
    m = tl.program_id(0)
    rp = tl.arange(0, BLOCK_P)
    g_max = float("-inf")
    g_idx = 0
    g_sum = 0.0
    for p0 in range(0, P, BLOCK_P):
        mask = (p0 + rp) < P
        pm = tl.load(pmax_ptr + (p0 + rp) * M + m, mask=mask, other=float("-inf"))
        pi = tl.load(pidx_ptr + (p0 + rp) * M + m, mask=mask, other=_NO_INDEX)
        ps = tl.load(psum_ptr + (p0 + rp) * M + m, mask=mask, other=0.0)
        c_max = tl.max(pm, axis=0)
        c_idx = tl.min(tl.where(pm == c_max, pi, _NO_INDEX), axis=0)
        new_max = tl.maximum(g_max, c_max)
        g_sum = g_sum * tl.exp2((g_max - new_max) * _LOG2E) + \
            tl.sum(ps * tl.exp2((pm - new_max) * _LOG2E), axis=0)
        g_idx = tl.where(c_max > g_max, c_idx, g_idx)  # strict: earlier chunks win ties
        g_max = new_max
    tl.store(top1_ptr + m, g_idx.to(tl.int64))
    tl.store(conf_ptr + m, 1.0 / g_sum)


def _head_argmax(h, h_scale, w, w_scale, config, op, skip=None, int4=False):
    m, hdim = h.shape
    v = w.shape[0]
    w_cols, w_name = ((hdim + 1) // 2, "[V, ceil(H / 2)] (packed int4)") if int4 else (hdim, "[V, H]")
    if w.dim() != 2 or w.shape[1] != w_cols or w.stride(1) != 1 or h.stride(1) != 1:
        raise ValueError(f"{op}: h must be [M, H] and w {w_name} with contiguous rows; got h {tuple(h.shape)}, "
                         f"w {tuple(w.shape)}")
    int8 = h_scale is not None
    check_launchable(_head_partial_kernel, *(t for t in (h, h_scale, w, w_scale) if t is not None))
    if config is None:
        # The 16-bit verify head must give a row the same logits at every width (an AR step
        # and a verify row pick the same token), so it takes the M = 1 launch everywhere; the
        # int8 head's logits are exact integers whatever the tiling, so it may specialise.
        key_m = m if int8 else 1
        config = lookup(op, {"V": v, "H": hdim, "M": key_m}, h.device) or default_head(key_m, int4)
    top1 = torch.empty((m,), dtype=torch.int64, device=h.device)
    conf = torch.empty((m,), dtype=torch.float32, device=h.device)
    if m == 0:
        return top1, conf
    # The int8 head is exact, so all rows share one tile (each weight tile read once). The
    # 16-bit head accumulates floats: its rows go in tiles of a fixed height, so a row's
    # logits are the same tile computation at every width (a taller tile may switch the
    # tensor-core instruction, e.g. to wgmma on Hopper, and its rounding with it).
    block_m = max(16, next_pow2(m)) if int8 else F16_ROW_TILE
    n_parts = triton.cdiv(v, config.block_v)
    pmax = torch.empty((n_parts, m), dtype=torch.float32, device=h.device)
    pidx = torch.empty((n_parts, m), dtype=torch.int32, device=h.device)
    psum = torch.empty((n_parts, m), dtype=torch.float32, device=h.device)
    tiles = min(triton.cdiv(m, block_m), F16_MAX_ROW_TILES)  # int8: one tile holds every row
    skipping = {} if skip is None else {"skip_ptr": skip, "SKIP": True}
    _head_partial_kernel[(triton.cdiv(m, block_m * tiles), n_parts)](
        h, h if h_scale is None else h_scale, w, w if w_scale is None else w_scale,
        pmax, pidx, psum, m, v, hdim, h.stride(0), w.stride(0),
        INT8=int8, BLOCK_M=block_m, BLOCK_V=config.block_v, BLOCK_H=config.block_h,
        UPCAST=bf16_dot_upcast(_head_partial_kernel, h), ROW_TILES=tiles,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(_head_partial_kernel),
        **skipping, **({"INT4": True, "HP": w_cols} if int4 else {}),
    )
    _head_combine_kernel[(m,)](pmax, pidx, psum, top1, conf, n_parts, m,
                               BLOCK_P=min(next_pow2(n_parts), config.combine_block), num_warps=4,
                               **pdl_options(_head_combine_kernel), **skipping)
    return top1, conf


def int8_head_argmax(
    h_int8: torch.Tensor,  # [M, H] int8 (per-token quantised hidden state)
    h_scale: torch.Tensor,  # [M] float32 (1/q)
    w_int8: torch.Tensor,  # [V, H] int8 (quantize_rows_int8)
    w_row_scale: torch.Tensor,  # [V] float32
    *,
    config: HeadConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (top1 [M] int64, confidence [M] float32)
    """The int8 draft head: exact int32 logits, then argmax and max-softmax."""
    _check_integer_head("int8_head_argmax", h_int8, h_scale, w_int8, "w_int8", torch.int8, w_row_scale)
    return _head_argmax(h_int8, h_scale, w_int8, w_row_scale, config, "int8_head_argmax")


def int4_head_argmax(
    h_int8: torch.Tensor,  # [M, H] int8 (per-token quantised hidden state)
    h_scale: torch.Tensor,  # [M] float32 (1/q)
    w_packed: torch.Tensor,  # [V, ceil(H / 2)] uint8 (numerics.quantize_rows_int4)
    w_row_scale: torch.Tensor,  # [V] float32
    *,
    config: HeadConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (top1 [M] int64, confidence [M] float32)
    """The int4 draft head: exact int32 logits from packed int4 rows, then argmax and max-softmax."""
    _check_integer_head("int4_head_argmax", h_int8, h_scale, w_packed, "w_packed", torch.uint8, w_row_scale)
    return _head_argmax(h_int8, h_scale, w_packed, w_row_scale, config, "int4_head_argmax", int4=True)


def _check_integer_head(op, h_int8, h_scale, w, w_name, w_dtype, w_row_scale) -> None:
    """The dtypes and the scales' shapes of an int8 or int4 head call (``_head_argmax`` checks the rest)."""
    check_dtype(h_int8, (torch.int8,), f"{op}: h_int8")
    check_dtype(w, (w_dtype,), f"{op}: {w_name}")
    check_dtype(h_scale, (torch.float32,), f"{op}: h_scale")
    check_dtype(w_row_scale, (torch.float32,), f"{op}: w_row_scale")
    if h_scale.shape != (h_int8.shape[0],) or w_row_scale.shape != (w.shape[0],):
        raise ValueError(f"{op}: h_scale must be [M] and w_row_scale [V]; got "
                         f"{tuple(h_scale.shape)}, {tuple(w_row_scale.shape)}")


def f16_head_argmax(
    h: torch.Tensor,  # [M, H] float16 / bfloat16
    w: torch.Tensor,  # [V, H] same dtype
    *,
    config: HeadConfig | None = None,
    skip: torch.Tensor | None = None,  # [1] int32 on the device: nonzero = read nothing, write nothing
) -> tuple[torch.Tensor, torch.Tensor]:  # (top1 [M] int64, confidence [M] float32)
    """The 16-bit verify head: float32-accumulated logits, then argmax and max-softmax.

    ``skip`` (``certified_head.py``): a flag the device decides during a step; where it is
    nonzero both launches return at once and the outputs are left unwritten (a CUDA graph
    keeps both launches captured either way)."""
    check_dtype(h, (torch.float16, torch.bfloat16), "f16_head_argmax: h")
    if w.dtype != h.dtype:
        raise TypeError(f"f16_head_argmax: w is {w.dtype} but h is {h.dtype}; they must match")
    if skip is not None and (skip.dtype != torch.int32 or skip.shape != (1,) or skip.device != h.device):
        raise ValueError(f"f16_head_argmax: skip must be a [1] int32 tensor on {h.device}, got "
                         f"{skip.dtype} {tuple(skip.shape)} on {skip.device}")
    return _head_argmax(h, None, w, None, config, "f16_head_argmax", skip)


# --- pure-PyTorch twins (they do write the [M, V] logits) ------------------------------------

def _argmax_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.argmax(logits, dim=-1), torch.softmax(logits, dim=-1).amax(dim=-1)


def int8_head_logits_reference(h_int8, h_scale, w_int8, w_row_scale) -> torch.Tensor:
    return int_matmul(h_int8, w_int8).float() * h_scale[:, None] * w_row_scale[None, :]


def int8_head_argmax_reference(h_int8, h_scale, w_int8, w_row_scale):
    return _argmax_confidence(int8_head_logits_reference(h_int8, h_scale, w_int8, w_row_scale))


def int4_head_logits_reference(h_int8, h_scale, w_packed, w_row_scale) -> torch.Tensor:
    return int8_head_logits_reference(h_int8, h_scale, unpack_int4_rows(w_packed, h_int8.shape[1]), w_row_scale)


def int4_head_argmax_reference(h_int8, h_scale, w_packed, w_row_scale):
    return _argmax_confidence(int4_head_logits_reference(h_int8, h_scale, w_packed, w_row_scale))


def f16_head_logits_reference(h, w) -> torch.Tensor:
    return h.float() @ w.float().t()


def f16_head_argmax_reference(h, w, skip=None):
    """``skip`` is taken and ignored: the twin always computes (its outputs where the kernel
    skipped are never read)."""
    return _argmax_confidence(f16_head_logits_reference(h, w))
