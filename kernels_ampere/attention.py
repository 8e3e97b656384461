"""Small-width attention: M query rows (M <= ~17) against one shared KV buffer.

Buffer layout (the runtime's KV segment)::

    k_buf, v_buf: [Hkv, S, hd],  S = capacity + W
    slots [0, capacity)      history: slot s holds position s; only s < history_len is live
    slots [capacity, S)      workspace: the rows of the current step (pending / draft / verify)

``allowed_mask[m, s]`` says which slots query row ``m`` may see (causal pending rows, the
bidirectional draft block, the masked-out repeated anchor...). A history slot counts only
when ``s < history_len`` *and* the mask allows it; ``history_len`` is read on the device
(``[1]`` int32), so a CUDA graph captured once replays any length without re-capture.

Instead of the mask, ``row_spans[m] = (history_end, workspace_begin, workspace_end)`` ([M, 3]
int32) may say the same thing in three integers per row: row m sees history slots
``s < history_end`` and workspace rows ``[workspace_begin, workspace_end)``. Every decode
step has that shape (AR, verify, draft, and the fused verify + draft blocks), and the kernel
then computes the visibility in registers instead of reading an [M, S] mask: nothing per
step grows with M x S. Both forms give the same visible set, but they compile to different
kernels, and on an H200 (hd 64, 256-512 history slots) some rows came out different in
the last bits: a runtime whose steps must agree row for row uses one form for all of them
(the graph backend: spans). Slots a row cannot see cost no bits: a wider workspace, or a
longer history loop, leaves a row's result unchanged (a key tile no row sees adds exactly
zero: alpha = 1, p = 0). So with spans a tile stops its workspace loop at its rows' largest
``workspace_end``: an AR step or a verify reads no workspace slot, whatever the view's width.

GQA: the ``G = Hq / Hkv`` query heads of one KV head, times the M rows, form the query rows
of that KV head, cut into tiles of 16 (the same tile at every width, so a row computes the
same bits in an AR step and in a verify: see ``QUERY_TILE``).

Flash-decoding split over the history: program ``(tile, p)`` owns history slots
``[p*split_slots, (p+1)*split_slots)`` and the last split also the workspace. Splits past
``history_len`` find an empty range and only write an empty partial. Pass two merges the
partials ``(max, sum, acc)`` by log-sum-exp. With one split the first pass normalises and
writes the output itself (one launch). Scores use base-2 exponentials (log2(e) folded into
the scale). A row that sees no slot at all gets zeros (the twin matches).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (alignment_blind, bf16_dot_upcast, check_dtype, check_launchable, gdc_prologue, next_pow2,
                     pdl_options, prefetch_rows_l2)
from .tuning import AttentionConfig, default_attention, lookup, sm_count

LOG2E = 1.4426950408889634
QUERY_TILE = 16  # query rows (m, g) per program, whatever the width
QKV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, k_ptr, v_ptr, mask_ptr, row_m, row_ok,
                  lo, hi, n_hist, ws_hi, n_tiles, stride_ks, stride_vs, stride_mm, qk_scale, HD,
                  hist_end, ws_begin, ws_end, capacity,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPANS: tl.constexpr):
    """Online softmax over ``n_tiles`` key tiles: ``n_hist`` history tiles from slot ``lo``
    (live below ``hi``), then the workspace tiles from slot ``capacity`` (below ``ws_hi``).
    One loop for both ranges, so the software pipeline loads the first workspace tile while
    the last history tile computes; each tile is the same computation, in the same order, as
    in two loops one after the other."""
    rs = tl.arange(0, BLOCK_S)
    rd = tl.arange(0, BLOCK_D)
    mask_d = rd < HD
    for t in range(0, n_tiles):
        in_hist = t < n_hist
        s0 = tl.where(in_hist, lo + t * BLOCK_S, capacity + (t - n_hist) * BLOCK_S)
        s = s0 + rs
        mask_s = s < tl.where(in_hist, hi, ws_hi)
        k = tl.load(k_ptr + s[:, None] * stride_ks + rd[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
        v = tl.load(v_ptr + s[:, None] * stride_vs + rd[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        if SPANS:  # history below the row's end, or inside its run of workspace rows
            w = s[None, :] - capacity
            visible = ((s[None, :] < capacity) & (s[None, :] < hist_end[:, None])) | \
                ((w >= ws_begin[:, None]) & (w < ws_end[:, None]))
            visible = visible & row_ok[:, None] & mask_s[None, :]
        else:
            allowed = tl.load(mask_ptr + row_m[:, None] * stride_mm + s[None, :],
                              mask=row_ok[:, None] & mask_s[None, :], other=0)  # [BLOCK_Q, BLOCK_S]
            visible = allowed != 0
        if UPCAST:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # rows that have seen nothing yet keep m = -inf; shift by 0 there to avoid inf - inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefetch_history_tile(k_head, v_head, hist_ptr, lo, capacity, stride_ks, stride_vs, HD,
                           BLOCK_S: tl.constexpr):
    """Ask the L2 for the key and value rows of history slots ``lo .. lo + BLOCK_S`` below the
    history length (compiled only: inline PTX). Read before the wait, the length may be
    another step's: that can only ask for other lines, never change a result (a prefetch
    writes no register)."""
    elem = k_head.dtype.element_ty.primitive_bitwidth // 8
    s = lo + tl.arange(0, BLOCK_S)
    live = s < tl.minimum(tl.load(hist_ptr), capacity)
    prefetch_rows_l2(k_head.to(tl.pointer_type(tl.uint8)) + s * (stride_ks * elem), live, HD * elem, 2, True)
    prefetch_rows_l2(v_head.to(tl.pointer_type(tl.uint8)) + s * (stride_vs * elem), live, HD * elem, 2, True)


@triton.jit(**alignment_blind("M"))  # M bounds and indexes rows only (no extra variant at width 16)
def _attention_split_kernel(
    q_ptr,  # [M, Hq, hd]
    k_ptr, v_ptr,  # [Hkv, S, hd]
    mask_ptr,  # [M, S] uint8 (bool), or [M, 3] int32 row spans (SPANS)
    hist_ptr,  # [1] int32 history length
    out_ptr,  # [M, Hq, hd] (DIRECT) -- else the partials below
    pacc_ptr,  # [splits, M, Hq, hd] float32
    pm_ptr, pl_ptr,  # [splits, M, Hq] float32: running max (log2 domain) and sum
    M, G, capacity, S, HD,
    stride_qm, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_mm,
    stride_om, stride_oh,
    qk_scale,
    SPLIT_SLOTS: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPANS: tl.constexpr = False,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
    PREFETCH: tl.constexpr = False,  # the first history tile's keys and values asked of the L2 before the wait
):
    kvh = tl.program_id(0)
    q_tile = tl.program_id(1)
    split = tl.program_id(2)
    if PREFETCH:  # history K/V are earlier steps' (constant during this one): their DRAM latency off the path
        _prefetch_history_tile(k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, hist_ptr, split * SPLIT_SLOTS,
                               capacity, stride_ks, stride_vs, HD, BLOCK_S)
    gdc_prologue(USE_GDC)
    n_splits = tl.num_programs(2)
    Hq = tl.num_programs(0) * G

    r = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)  # query tile row = (m, g) flattened
    row_m = r // G
    head = kvh * G + r % G
    row_ok = row_m < M
    rd = tl.arange(0, BLOCK_D)
    mask_d = rd < HD
    q = tl.load(q_ptr + row_m[:, None] * stride_qm + head[:, None] * stride_qh + rd[None, :],
                mask=row_ok[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_Q, BLOCK_D]

    if SPANS:
        hist_end = tl.load(mask_ptr + row_m * 3, mask=row_ok, other=0)
        ws_begin = tl.load(mask_ptr + row_m * 3 + 1, mask=row_ok, other=0)
        ws_end = tl.load(mask_ptr + row_m * 3 + 2, mask=row_ok, other=0)
    else:
        hist_end = row_m  # unused without spans
        ws_begin = row_m
        ws_end = row_m
    hist = tl.minimum(tl.load(hist_ptr), capacity)
    lo = split * SPLIT_SLOTS
    hi = tl.minimum(lo + SPLIT_SLOTS, hist)
    n_hist = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_S)
    # the workspace rides with the last split
    ws_hi = S
    if SPANS:  # only as far as the tile's rows look: an AR tile reads no workspace at all
        ws_hi = tl.minimum(capacity + tl.max(tl.where(row_ok, ws_end, 0), axis=0), S)
    n_ws = tl.where(split == n_splits - 1, tl.cdiv(tl.maximum(ws_hi - capacity, 0), BLOCK_S), 0)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    m_i = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, mask_ptr,
                                  row_m, row_ok, lo, hi, n_hist, ws_hi, n_hist + n_ws,
                                  stride_ks, stride_vs, stride_mm, qk_scale, HD,
                                  hist_end, ws_begin, ws_end, capacity,
                                  BLOCK_S, BLOCK_D, PRECISION, UPCAST, SPANS)

    if DIRECT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + row_m[:, None] * stride_om + head[:, None] * stride_oh + rd[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])
    else:
        part = (split * M + row_m) * Hq + head  # index into [splits, M, Hq]
        tl.store(pacc_ptr + part[:, None] * HD + rd[None, :], acc, mask=row_ok[:, None] & mask_d[None, :])
        tl.store(pm_ptr + part, m_i, mask=row_ok)
        tl.store(pl_ptr + part, l_i, mask=row_ok)


@triton.jit(**alignment_blind("MH"))  # MH = M * Hq strides the splits (no extra variant at widths 16 | MH)
def _attention_combine_kernel(
    pacc_ptr, pm_ptr, pl_ptr,  # partials, as above
    out_ptr,  # [M, Hq, hd]
    n_splits, MH, Hq, HD, stride_om, stride_oh,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
):
    gdc_prologue(USE_GDC)
    row = tl.program_id(0)  # = m * Hq + head
    rp = tl.arange(0, BLOCK_P)
    rd = tl.arange(0, BLOCK_D)
    mask_p = rp < n_splits
    mask_d = rd < HD
    m_p = tl.load(pm_ptr + rp * MH + row, mask=mask_p, other=float("-inf"))
    l_p = tl.load(pl_ptr + rp * MH + row, mask=mask_p, other=0.0)
    m_max = tl.max(m_p, axis=0)
    w = tl.exp2(m_p - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits weigh 0
    acc = tl.load(pacc_ptr + (rp * MH + row)[:, None] * HD + rd[None, :],
                  mask=mask_p[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(w * l_p, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + (row // Hq) * stride_om + (row % Hq) * stride_oh + rd,
             out.to(out_ptr.dtype.element_ty), mask=mask_d)


def small_width_attention(
    q: torch.Tensor,  # [M, Hq, hd]
    k_buf: torch.Tensor,  # [Hkv, S, hd], S = capacity + W
    v_buf: torch.Tensor,  # [Hkv, S, hd]
    allowed_mask: torch.Tensor | None,  # [M, S] bool, or None with row_spans
    history_len: torch.Tensor,  # [1] int32, on the device
    *,
    capacity: int,
    sm_scale: float | None = None,  # default 1/sqrt(hd)
    config: AttentionConfig | None = None,
    row_spans: torch.Tensor | None = None,  # [M, 3] int32 instead of the mask
) -> torch.Tensor:  # [M, Hq, hd], q.dtype
    """Masked softmax attention of M rows over history[:history_len] + workspace, GQA."""
    for name, t in (("q", q), ("k_buf", k_buf), ("v_buf", v_buf)):
        check_dtype(t, QKV_DTYPES, f"small_width_attention: {name}")
        if t.dim() != 3 or t.stride(-1) != 1:
            raise ValueError(f"small_width_attention: {name} must be 3-D with a contiguous last dim, "
                             f"got {tuple(t.shape)} strides {t.stride()}")
    if not (q.dtype == k_buf.dtype == v_buf.dtype):
        raise TypeError(f"small_width_attention: q/k/v dtypes differ: {q.dtype}, {k_buf.dtype}, {v_buf.dtype}")
    m, hq, hd = q.shape
    hkv, s_total, hd_k = k_buf.shape
    if v_buf.shape != k_buf.shape or hd_k != hd:
        raise ValueError(f"small_width_attention: k_buf {tuple(k_buf.shape)} / v_buf {tuple(v_buf.shape)} "
                         f"must both be [Hkv, S, hd={hd}]")
    if hq % hkv:
        raise ValueError(f"small_width_attention: Hq={hq} is not a multiple of Hkv={hkv}")
    if not 0 <= capacity <= s_total:
        raise ValueError(f"small_width_attention: capacity={capacity} outside [0, S={s_total}]")
    visibility = _check_visibility("small_width_attention", allowed_mask, row_spans, m, s_total)
    if history_len.dtype != torch.int32 or history_len.numel() != 1:
        raise ValueError(f"small_width_attention: history_len must be a [1] int32 tensor, got "
                         f"{history_len.dtype} {tuple(history_len.shape)}")
    check_launchable(_attention_split_kernel, q, k_buf, v_buf, visibility, history_len)
    g = hq // hkv
    if config is None:
        config = lookup("small_width_attention", {"hd": hd, "G": g, "M": m, "capacity": capacity},
                        q.device) or default_attention(hd, QUERY_TILE, capacity, hkv, sm_count(q.device))
    if config.split_slots % config.block_s:
        raise ValueError(f"small_width_attention: split_slots={config.split_slots} must be a multiple "
                         f"of block_s={config.block_s}")
    scale = (1.0 / math.sqrt(hd) if sm_scale is None else sm_scale) * LOG2E

    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if m == 0:
        return out
    n_splits = max(1, triton.cdiv(capacity, config.split_slots))
    # 16-row query tiles at every width: a row's result must not depend on how many rows
    # share its tile (an AR row and the same row inside a verify must agree bit for bit),
    # and on Hopper a 64-row tile switches tl.dot to wgmma, which rounds differently.
    block_q = QUERY_TILE
    block_d = max(16, next_pow2(hd))
    direct = n_splits == 1
    if direct:  # the partial pointers are never touched
        pacc = pm = pl = out
    else:
        pacc = torch.empty((n_splits, m, hq, hd), dtype=torch.float32, device=q.device)
        pm = torch.empty((n_splits, m, hq), dtype=torch.float32, device=q.device)
        pl = torch.empty((n_splits, m, hq), dtype=torch.float32, device=q.device)
    grid = (hkv, triton.cdiv(m * g, block_q), n_splits)
    pdl = pdl_options(_attention_split_kernel)
    _attention_split_kernel[grid](
        q, k_buf, v_buf, visibility if row_spans is not None else visibility.view(torch.uint8), history_len,
        out, pacc, pm, pl,
        m, g, capacity, s_total, hd,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        visibility.stride(0), out.stride(0), out.stride(1),
        scale,
        SPLIT_SLOTS=config.split_slots, DIRECT=direct,
        BLOCK_Q=block_q, BLOCK_S=config.block_s, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=bf16_dot_upcast(_attention_split_kernel, q), SPANS=row_spans is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl,
        PREFETCH=pdl["USE_GDC"],  # the prefetch overlaps the previous kernel: only under programmatic launch
    )
    if not direct:
        _attention_combine_kernel[(m * hq,)](
            pacc, pm, pl, out, n_splits, m * hq, hq, hd, out.stride(0), out.stride(1),
            BLOCK_P=next_pow2(n_splits), BLOCK_D=block_d, num_warps=4, **pdl_options(_attention_combine_kernel),
        )
    return out


def _check_visibility(op: str, allowed_mask, row_spans, m: int, s_total: int) -> torch.Tensor:
    """The one visibility argument given: a bool [M, S] mask or int32 [M, 3] row spans."""
    if (allowed_mask is None) == (row_spans is None):
        raise ValueError(f"{op}: give exactly one of allowed_mask ([M, S] bool) and row_spans ([M, 3] int32)")
    if row_spans is not None:
        if row_spans.dtype != torch.int32 or row_spans.shape != (m, 3) or not row_spans.is_contiguous():
            raise ValueError(f"{op}: row_spans must be a contiguous int32 [M, 3] = [{m}, 3] tensor, got "
                             f"{row_spans.dtype} {tuple(row_spans.shape)}")
        return row_spans
    if allowed_mask.dtype != torch.bool or allowed_mask.shape != (m, s_total) or allowed_mask.stride(1) != 1:
        raise ValueError(f"{op}: allowed_mask must be bool [M, S] = [{m}, {s_total}] with "
                         f"contiguous rows, got {allowed_mask.dtype} {tuple(allowed_mask.shape)}")
    return allowed_mask


def row_spans_mask(row_spans: torch.Tensor, capacity: int, slots: int) -> torch.Tensor:
    """[M, 3] (history_end, workspace_begin, workspace_end) -> the [M, slots] bool mask it means."""
    s = torch.arange(slots, device=row_spans.device)
    w = s - capacity
    hist_end, ws_begin, ws_end = (row_spans[:, i:i + 1].long() for i in range(3))
    return ((s < capacity) & (s < hist_end)) | ((s >= capacity) & (w >= ws_begin) & (w < ws_end))


def small_width_attention_reference(
    q: torch.Tensor,  # [M, Hq, hd]
    k_buf: torch.Tensor,  # [Hkv, S, hd]
    v_buf: torch.Tensor,  # [Hkv, S, hd]
    allowed_mask: torch.Tensor | None,  # [M, S] bool, or None with row_spans
    history_len: torch.Tensor,  # [1] int32
    *,
    capacity: int,
    sm_scale: float | None = None,
    row_spans: torch.Tensor | None = None,  # [M, 3] int32 instead of the mask
) -> torch.Tensor:  # [M, Hq, hd], q.dtype
    """The pure-PyTorch twin: masked softmax attention in float32 (reads history_len on the host)."""
    m, hq, hd = q.shape
    hkv, s_total, _ = k_buf.shape
    g = hq // hkv
    hist = min(int(history_len.reshape(-1)[0]), capacity)
    if row_spans is not None:
        allowed_mask = row_spans_mask(_check_visibility("small_width_attention_reference", None, row_spans, m,
                                                        s_total), capacity, s_total)
    visible = allowed_mask.clone()
    visible[:, hist:capacity] = False  # dead history slots
    scale = 1.0 / math.sqrt(hd) if sm_scale is None else sm_scale
    qf = q.float().view(m, hkv, g, hd)
    scores = torch.einsum("mhgd,hsd->mhgs", qf, k_buf.float()) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing -> zeros
    out = torch.einsum("mhgs,hsd->mhgd", p, v_buf.float())
    return out.reshape(m, hq, hd).to(q.dtype)
