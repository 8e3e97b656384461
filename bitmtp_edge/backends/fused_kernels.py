"""The fused step's bookkeeping in three launches instead of about a hundred small torch ops.

Inside a captured graph every torch op is a kernel node (~1.5-3 µs each on an H200), and at
batch 1 the fused step's bookkeeping (candidate choice, rows, positions, slots, spans,
accept, readback, next inputs) cost as much as a third of the model's forward. Here:

* ``fused_prepare``: the candidate set C (``decoding_rules.candidate_lengths``), and the
  step's tokens, positions, KV slots, attention row spans and attention row limit;
* ``fused_accept`` (after the head): the greedy tokens flagged where a row is not finite,
  the accepted count a, the verifier token v, whether a ∈ C and its block, which of the
  head's draft rows hold the next drafts, L += pending + a, and the readback's first part;
* ``fused_chain``: those next drafts, flagged, into the readback and the next fused step's
  inputs.

Each is one program over at most ~80 rows, so the launches cost their latency only: accept
and chain issue every load before their first store and check finiteness in unrolled column
steps with one reduction, and launch under PDL (27 → 10 µs a fused step on the H200). The
pure-PyTorch twins are the ``*_reference`` functions in ``fused_graph.py`` (the graph
bodies' torch code); tests/test_fused_kernels.py compares them exactly on random inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ampere.common import gdc_prologue, next_pow2, pdl_options

# columns of the hidden rows per unrolled step of the finiteness check (registers: 8 warps hold a
# [16, ROW_STEP] tile in 16 per thread, so several steps' loads fit in flight together)
ROW_STEP = 256


@triton.jit
def _fused_prepare_kernel(
    hist_ptr,  # [1] int64: L
    tokens_ptr,  # [N] int64: the causal rows' tokens
    conf_ptr,  # [N - 1] float32 or float64: the drafts' confidences
    chosen_ptr,  # [C] int64 out: C ascending
    step_tokens_ptr, positions_ptr, slots_ptr,  # [N + C·D] int64 out
    spans_ptr,  # [N + C·D, 3] int32 out
    attn_rows_ptr,  # [1] int32 out
    mask_id, capacity,
    N: tl.constexpr, C: tl.constexpr, D: tl.constexpr, PENDING: tl.constexpr,
    BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
):
    # P(a = j) = c_1…c_j · (1 − c_{j+1}), the product rounded to float32 after each factor
    j = tl.arange(0, BLOCK_J)
    p = tl.zeros([BLOCK_J], dtype=tl.float32)
    reach = tl.full([], 1.0, tl.float32)
    for i in tl.static_range(N):
        if i < N - 1:
            c = tl.load(conf_ptr + i).to(tl.float32)
            p = tl.where(j == i, reach * (1.0 - c), p)
            reach = reach * c
        else:
            p = tl.where(j == i, reach, p)
    p = tl.where(p != p, 2.0, p)  # NaN first, as a descending sort puts it
    # C: the C largest (ties: the shorter length), as ranks
    pi = p[:, None]
    pj = p[None, :]
    ii = j[:, None]
    jj = j[None, :]
    beats = ((pi > pj) | ((pi == pj) & (ii < jj))) & (ii < N)
    rank = tl.sum(beats.to(tl.int32), axis=0)
    chosen = (rank < C) & (j < N)
    order = tl.sum(((chosen[:, None]) & (ii < jj)).to(tl.int32), axis=0)  # place among the chosen, ascending
    k = tl.arange(0, BLOCK_C)
    ch = tl.sum(tl.where((chosen[None, :]) & (order[None, :] == k[:, None]), j[None, :], 0), axis=1)  # [BLOCK_C]
    tl.store(chosen_ptr + k, ch.to(tl.int64), mask=k < C)

    first = tl.load(hist_ptr) - 1 + PENDING  # the first causal row's slot
    w = tl.arange(0, BLOCK_W)
    causal = w < N
    live = w < N + C * D
    wb = tl.where(causal, 0, w - N)
    b = wb // D  # block of a block row
    r = wb % D  # its row in the block
    jb = tl.sum(tl.where(k[None, :] == b[:, None], ch[None, :], 0), axis=1).to(tl.int64)  # its length j
    tok_causal = tl.load(tokens_ptr + w, mask=causal, other=0)
    tok_head = tl.load(tokens_ptr + jb, mask=(~causal) & live & (r == 0), other=0)  # d_j (the anchor at j = 0)
    step_tok = tl.where(causal, tok_causal, tl.where(r == 0, tok_head, mask_id))
    pos = tl.where(causal, first + w, first + jb + r)
    slot = tl.where(causal, first + w, capacity + wb)
    hist_end = tl.where(causal, first + w + 1, first + jb)
    ws_begin = tl.where(causal, 0, b * D)
    ws_end = tl.where(causal, 0, (b + 1) * D)
    tl.store(step_tokens_ptr + w, step_tok, mask=live)
    tl.store(positions_ptr + w, pos, mask=live)
    tl.store(slots_ptr + w, slot, mask=live)
    tl.store(spans_ptr + 3 * w, hist_end.to(tl.int32), mask=live)
    tl.store(spans_ptr + 3 * w + 1, ws_begin.to(tl.int32), mask=live)
    tl.store(spans_ptr + 3 * w + 2, ws_end.to(tl.int32), mask=live)
    tl.store(attn_rows_ptr, (first + N).to(tl.int32))


def fused_prepare(history_len: torch.Tensor, tokens: torch.Tensor, confidences: torch.Tensor, mask_id: int,
                  capacity: int, count: int, block: int, pending: int):
    """-> (chosen [c], step tokens, positions, slots [W] int64, spans [W, 3] int32, attention
    row limit [1] int32); see ``fused_graph.fused_prepare_reference`` for the meaning."""
    n = tokens.shape[0]
    c = min(count, n)
    width = n + c * block
    dev = tokens.device
    chosen = torch.empty(c, dtype=torch.long, device=dev)
    step_tokens = torch.empty(width, dtype=torch.long, device=dev)
    positions = torch.empty(width, dtype=torch.long, device=dev)
    slots = torch.empty(width, dtype=torch.long, device=dev)
    spans = torch.empty((width, 3), dtype=torch.int32, device=dev)
    attn_rows = torch.empty(1, dtype=torch.int32, device=dev)
    _fused_prepare_kernel[(1,)](
        history_len, tokens, confidences, chosen, step_tokens, positions, slots, spans, attn_rows,
        int(mask_id), int(capacity), N=n, C=c, D=block, PENDING=pending,
        BLOCK_J=next_pow2(n), BLOCK_C=next_pow2(c), BLOCK_W=next_pow2(width), num_warps=4,
        enable_fp_fusion=False,  # each product rounds to float32, as in the twin
    )
    return chosen, step_tokens, positions, slots, spans, attn_rows


@triton.jit
def _row_finite(x_ptr, stride_x, rows, ok_rows, H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """[BLOCK_R] bool: every value of row ``rows[i]`` of x is finite. The column steps are
    unrolled and flag elements without a reduction between them, so all of their loads are
    in flight at once (one memory round trip, not one per step behind a block barrier)."""
    h = tl.arange(0, BLOCK_H)
    bad = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.int32)
    for h0 in tl.static_range(0, H, BLOCK_H):
        m = ok_rows[:, None] & ((h0 + h)[None, :] < H)
        x = tl.load(x_ptr + rows[:, None] * stride_x + (h0 + h)[None, :], mask=m, other=0.0)
        bad = bad | ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
    return tl.max(bad, axis=1) == 0


@triton.jit
def _fused_accept_kernel(
    x_ptr, stride_x,  # [W, H] float32: the step's hidden rows (the causal ones are checked)
    greedy_ptr, gconf_ptr,  # [N] int64 / float32: the verify head on the causal rows
    tokens_ptr,  # [N] int64: the causal rows' tokens
    chosen_ptr,  # [C] int64
    drafts_ptr, conf_ptr,  # [N - 1]: the drafts as the host reads them (int64 or float64), confidences
    hist_ptr,  # [1] int64: L, advanced in place
    rb_ptr,  # float64 readback (FusedInputs.slices)
    wanted_ptr,  # [D - 1] int64 out: a's block among the head's draft rows (rows 1..D-1 of each block)
    causal_ptr, pending_ptr,  # [D] int64 (the next fused step's [v, ...]), [1] int64 (a draft step's v)
    H: tl.constexpr, N: tl.constexpr, C: tl.constexpr, D: tl.constexpr, PENDING: tl.constexpr,
    RB_ACCEPTED: tl.constexpr, RB_VERIFIER: tl.constexpr, RB_HIT: tl.constexpr, RB_CANDIDATES: tl.constexpr,
    RB_HELD_TOKENS: tl.constexpr, RB_HELD_CONF: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (kernels_ampere.common)
):
    gdc_prologue(USE_GDC)
    # every load first: a load after a store to a pointer that may alias it waits in program
    # order, and one program has nothing else to hide that latency with
    i = tl.arange(0, BLOCK_N)
    rows_ok = i < N
    gconf = tl.load(gconf_ptr + i, mask=rows_ok, other=0.0)
    greedy = tl.load(greedy_ptr + i, mask=rows_ok, other=0)
    nxt = tl.load(tokens_ptr + i + 1, mask=i < N - 1, other=0)
    k = tl.arange(0, BLOCK_C)
    ch = tl.load(chosen_ptr + k, mask=k < C, other=-1)
    cand = tl.arange(0, BLOCK_D * 2)
    ch_all = tl.load(chosen_ptr + cand, mask=cand < C, other=-1)
    held = tl.load(drafts_ptr + i, mask=i < N - 1, other=0)
    conf = tl.load(conf_ptr + i, mask=i < N - 1, other=0.0).to(tl.float32)
    hist = tl.load(hist_ptr)
    finite = _row_finite(x_ptr, stride_x, i, rows_ok, H, BLOCK_N, BLOCK_H)
    finite = finite & (gconf == gconf) & (tl.abs(gconf) != float("inf"))
    greedy = tl.where(finite, greedy, -1)
    # a: the leading drafts equal to the greedy token of the row before them
    mismatch = (nxt != greedy) & (i < N - 1)
    accepted = tl.min(tl.where(mismatch, i, N - 1), axis=0)
    verifier = tl.sum(tl.where(i == accepted, greedy, 0), axis=0)
    at = (ch == accepted) & (k < C)
    hit = tl.sum(at.to(tl.int32), axis=0) > 0
    block = tl.where(hit, tl.min(tl.where(at, k, BLOCK_C), axis=0), 0)  # block 0 on a miss: never read
    r = tl.arange(0, BLOCK_D)
    tl.store(wanted_ptr + r, (block * (D - 1) + r).to(tl.int64), mask=r < D - 1)
    tl.store(hist_ptr, hist + PENDING + accepted)
    tl.store(rb_ptr + RB_ACCEPTED, accepted.to(tl.float64))
    tl.store(rb_ptr + RB_VERIFIER, verifier.to(tl.float64))
    tl.store(rb_ptr + RB_HIT, hit.to(tl.float64))
    tl.store(rb_ptr + RB_CANDIDATES + cand, ch_all.to(tl.float64), mask=cand < D + 1)
    tl.store(rb_ptr + RB_HELD_TOKENS + i, held.to(tl.float64), mask=i < N - 1)
    tl.store(rb_ptr + RB_HELD_CONF + i, conf.to(tl.float64), mask=i < N - 1)
    v0 = tl.maximum(verifier, 0)  # a flagged row must not index the embedding
    tl.store(causal_ptr, v0)
    tl.store(pending_ptr, v0)


def fused_accept(x, greedy, gconf, tokens, chosen, drafts, confidences, history_len, readback, wanted, causal,
                 pending_out, block: int, pending: int, slices: dict) -> None:
    n, c, d = tokens.shape[0], chosen.shape[0], block
    h = x.shape[1]
    _fused_accept_kernel[(1,)](
        x, x.stride(0), greedy, gconf, tokens, chosen, drafts, confidences, history_len, readback, wanted,
        causal, pending_out, H=h, N=n, C=c, D=d, PENDING=pending,
        RB_ACCEPTED=slices["accepted"].start, RB_VERIFIER=slices["verifier"].start, RB_HIT=slices["hit"].start,
        RB_CANDIDATES=slices["candidates"].start, RB_HELD_TOKENS=slices["held_tokens"].start,
        RB_HELD_CONF=slices["held_conf"].start,
        BLOCK_N=next_pow2(n), BLOCK_C=next_pow2(c), BLOCK_D=next_pow2(d + 1), BLOCK_H=min(next_pow2(h), ROW_STEP),
        num_warps=8, **pdl_options(_fused_accept_kernel),
    )


@triton.jit
def _fused_chain_kernel(
    rows_ptr, stride_x,  # [C·(D - 1), H] float32: the hidden rows 1..D-1 of every candidate block
    top_ptr, conf_ptr,  # [C·(D - 1)] int64 / float32: the head on them
    wanted_ptr,  # [D - 1] int64: a's block among them (fused_accept)
    rb_ptr, causal_ptr, next_conf_ptr,  # readback; [D] int64 (rows 1..); [D - 1] float32
    H: tl.constexpr, RB_NEXT_TOKENS: tl.constexpr, RB_NEXT_CONF: tl.constexpr, R: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (kernels_ampere.common)
):
    gdc_prologue(USE_GDC)
    i = tl.arange(0, BLOCK_R)
    ok = i < R
    row = tl.load(wanted_ptr + i, mask=ok, other=0)
    conf = tl.load(conf_ptr + row, mask=ok, other=0.0)
    top = tl.load(top_ptr + row, mask=ok, other=0)
    finite = _row_finite(rows_ptr, stride_x, row, ok, H, BLOCK_R, BLOCK_H)
    finite = finite & (conf == conf) & (tl.abs(conf) != float("inf"))
    top = tl.where(finite, top, -1)
    tl.store(rb_ptr + RB_NEXT_TOKENS + i, top.to(tl.float64), mask=ok)
    tl.store(rb_ptr + RB_NEXT_CONF + i, conf.to(tl.float64), mask=ok)
    tl.store(causal_ptr + 1 + i, tl.maximum(top, 0), mask=ok)
    tl.store(next_conf_ptr + i, conf, mask=ok)


def fused_chain(rows, top, conf, wanted, readback, causal, next_conf, slices: dict) -> None:
    """The next drafts: rows ``wanted`` of the candidate blocks' draft rows ``rows`` and of the
    head's ``top`` / ``conf`` on them."""
    r, h = wanted.shape[0], rows.shape[1]
    if r == 0:
        return
    _fused_chain_kernel[(1,)](
        rows, rows.stride(0), top, conf, wanted, readback, causal, next_conf,
        H=h, RB_NEXT_TOKENS=slices["next_tokens"].start, RB_NEXT_CONF=slices["next_conf"].start, R=r,
        BLOCK_R=next_pow2(r), BLOCK_H=min(next_pow2(h), ROW_STEP), num_warps=8, **pdl_options(_fused_chain_kernel),
    )
