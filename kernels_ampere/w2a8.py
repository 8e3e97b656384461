"""Packed ternary weights x per-token int8 activations ("W2A8"), exact int32 accumulation.

    out[m, n] = (sum_k a[m, k] * W[n, k]) * a_scale[m] * w_scale[n]                (per row)
    out[m, n] = (sum_g float(sum_{k in g} a[m, k] * W[n, k]) * w_scale[n, g]) * a_scale[m]
                                                                          (group-128, Bonsai)

``W`` in {-1, 0, 1} arrives packed as layout ``ternary-2bit-k128x4-v1`` (``packing.py``):
byte ``32*g + j`` of a row holds, in bits ``2i..2i+1``, the code ``c = W + 1`` of input
``128*g + 32*i + j``. All kernels keep the codes unsigned and correct once per row:
``sum_k a*(c - 1) = sum_k a*c - sum_k a`` (the offset trick of llama.cpp's TQ2_0), so
decoding is a shift and a mask, nothing more.

Five kernels, picked per (N, K, M) by the tuned table (``tuning.py``) or, without one, by
``tuning.default_linear`` from the shape and the SM count. The untuned default (generation
"v10", ``BITMTP_W2A8_KERNELS``; what each generation changed: ``default_linear``) is what the
H200 measured fastest per width on the whole 2B stack and in the 2B-shape replays
(tools/results/kernels.md); in outline: ``gemv`` at M <= 2 (with the L2
prefetch below at M = 1), ``mma`` with three software-pipeline stages and folded lanes
(below) from M = 3: v3's 64-row weight tiles to M = 16, the whole width in 128-row weight
tiles over 8 warps at M = 17..64, 32-row tiles of the width beyond. On a GPU of few SMs (a
Jetson Orin's 4-16) M = 1 and 2 take the M = 3 launch as well: measured on 8 of the H200's
SMs, gemv sustains 32 ternary weights per SM-clock at M = 1 and half that at M = 2 (it
decodes each weight once per row), the folded ``mma`` 38 at either.

v1:

* ``gemv`` (M = 1, 2): one activation row per program, a ``[BLOCK_N, CHUNKS, 8]`` tile of
  int32 words per K step. Word ``j`` of chunk ``c`` holds, in lane ``i``, the codes of the
  four *consecutive* inputs ``128c + 32i + 4j .. +3`` -- exactly activation word
  ``32c + 8i + j`` -- so ``(word >> 2i) & 0x03030303`` and one ``dp4a`` do four
  multiply-adds, all in registers, and the activation words of a lane are contiguous.
* ``rows`` (M = 3 .. 2D+1): the gemv kernel with up to 16 activation rows per program, so
  each weight word is loaded and decoded once for every row.
* ``dot`` (M >= 3): per 128-chunk, the ``[BLOCK_N, 32]`` byte tile is shifted/masked per
  lane into int8 codes (one shift, mask and convert per weight) that multiply (``tl.dot``,
  int8 tensor cores) the activations of inputs ``128c + 32i + 0..31``. The weights are the
  dot's first operand ("swap AB"): N fills the tensor-core M side, the width pads to 16;
  rows beyond 64 take a second tile (the weights decoded again).

v2 (issue 15: fewer integer instructions per weight, every width decoded once):

* ``lanes`` (M <= 8): dp4a with each lane *masked in place* (``word & (3 << 2i)·0x01010101``,
  no shift; lane i sums into its own accumulator, divided by ``4^i`` once at the end), all
  rows of the width in one program, the offset correction ``sum_k a`` in a separate pass
  over the activations: one mask per four weights, then one dp4a per row.
* ``mma`` (any M): int8 tensor cores over up to 128 rows per tile (each weight tile
  decoded once for every width <= 128). Per chunk the *packed* tile goes to the operand
  layout once and each lane is decoded there with one 32-bit AND per four weights (lanes
  masked in place; lane 3 as ``64·(c - 2)`` with an XOR), into its own accumulator; the
  offset correction is a dp4a over each step's activation words, loaded before the step's dots
  and summed after them (until session 9 a serial pass after the loop: an L2 round trip per
  few chunks at the end of every program). Decoding before the layout change (as
  ``dot`` does, or through inline PTX, which the compiler cannot move) converts four
  decoded tiles instead of one packed tile: ``tools/kernel_sass.py`` counts 597 against 166
  instructions per loop iteration on sm_87.

v5 (issue 15, the wide widths): ``mma`` with folded lanes (``LinearConfig.fold_lanes``): the
four lanes accumulate into one int32 tile by Horner over their scales (``<< 2`` between lanes,
``>> 6`` after the fourth, exact: every partial sum is a multiple of the next lane's scale),
and each lane is one dot over the whole K step (its chunks gathered in one tile). A quarter
of the accumulator registers (71 against 126 per thread at 64 x 32, sm_90) and half the
tensor-core waits at two chunks per step, for four shifts of the tile per step: a program
can take the whole width up to 64 rows (128 weight rows over 8 warps) with each weight
tile decoded once, where four accumulators of that size would spill.

Both v2 kernels load their first weight step *before* waiting for the previous kernel
(``gdc_prologue``): the weights are constants, so under programmatic dependent launch
(sm_90+) their DRAM latency overlaps the previous kernel's tail. ``mma`` needs
``num_stages=3`` (Triton's software pipeline over the chunk loop): unpipelined it waits on
every chunk's load and ran at a third of the speed on the H200.

``LinearConfig.prefetch`` (every kernel; acted on only under programmatic launch): before the
wait, each program asks the L2 for its whole weight slice (``common.prefetch_rows_l2``, one
``prefetch.global.L2`` per 128-byte line, no registers), so all of its DRAM traffic can start
during the previous kernel. Measured: -5% on the 2B stack at M = 1, slower at M = 2 and on
large matrices; only the M = 1 default uses it.

K need not be a multiple of 128: packed rows end in zero-weight padding (``packing.py``),
and every kernel reads the activations beyond K as 0.

Group-128 scales are applied per chunk after its exact int32 sum, one chunk at a time in K
order in every kernel (a step of several chunks adds them one by one, not as a tree), and
the K slices of a grouped call come from K alone (``tuning.group_k_slices``), not from the
launch configuration: the float32 sum over the groups then has one order at every width,
so a row's bits do not depend on how many rows share its call, and the twin (which sums in
the same order) is matched bit for bit. ``split_k > 1`` gives each program a slice of the
chunks; slices write int32 (per-row scales: still exact) or float32 (group scales applied)
partials that the last of a tile's slices to finish adds in slice order (``common.last_slice``:
an atomic arrival count per tile, which that program puts back to zero; ``common.split_k_reduce``,
a launch of its own, where the counts cannot be had) -- deterministic, the same bits either way.

``mma`` takes the width in tiles of ``LinearConfig.block_m`` rows (default: the whole width,
up to 128); the row tiles of one weight tile are neighbours in the grid, so they run at the
same time and read the tile from DRAM about once. Measured on the 2B stack
(tools/results/kernels.md, wide steps): 32-row tiles win at M = 80 (three of four
projections); 16-row tiles lost to one 32-row tile at M = 27 and to ``dot`` at M = 33-40.
In the model's replays (the linears between its norms, attention and heads) two 32-row tiles
beat ``dot`` at M = 33 and 40 by 12% of the whole step, and 16-row tiles beat it by 5%.
Folded (session 8): 32-row tiles fastest on the stack at M = 33-80, the whole width in
128-row weight tiles fastest in the replays at widths 32-40 (tools/results/kernels.md).
The folded loop may add a tail tile (``LinearConfig.tail_m``, ``tuning.tail_config``): a
program takes ``block_m + tail_m`` rows, each weight tile decoded once for both, so a width
just past a power of two stops paying for the padding to the next one (on 8 of the H200's
SMs the 2B stack took 6861 µs at M = 32 and 11614 at M = 33, padded to 64 rows).

``LinearConfig.chains = 2`` (folded, no tail; ``_mma_folded_pair``): two K steps per iteration
into two accumulators, so a warp has two independent chains of tensor-core ops. On the 2B stack
8% faster at M = 9 with ``mma.sync`` on 132 SMs, slower with ``wgmma`` and on 8 SMs
(tools/results/kernels.md, "Two chains"): a candidate the tuner times, in no default.

The epilogue multiplies in the same order as the twin, ``(float(acc) * a_scale) * w_scale``
(group scales: ``(sum of float(chunk) * w_scale[g]) * a_scale``), so results in float32 are
bit-identical to ``w2a8_linear_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .numerics import int_matmul

from .common import (apply_carveout, check_dtype, check_launchable, check_packed_weight, check_residual, dp4a,
                     dp4a_unsigned, gdc_prologue, is_interpreted, last_slice, next_pow2, pdl_options,
                     next_weights_l2, prefetch_rows_l2, prefetch_share_l2, scale_strides, split_counters, split_k_chunks,
                     split_k_reduce, sum_slices)
from .packing import BYTES_PER_CHUNK, CHUNK_K, unpack_ternary
from .tuning import (DOT, GEMV, LANES, MMA, ROWS, LinearConfig, default_linear, group_k_slices, linear_key, lookup,
                     sm_count)

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROWS_MAX_BLOCK_M = 16  # activation rows one ``rows`` program multiplies (registers: BLOCK_N·BLOCK_M·words)
LANES_MAX_BLOCK_M = 8  # the same for ``lanes`` (four accumulators per word)
MMA_MAX_BLOCK_M = 128  # ``mma``: every width up to 128 rows decodes each weight tile once
FOLD_MAX_K = 131072  # ``mma`` with folded lanes: 64 x the running sum stays below 2**31 (and a margin)
WORD_KERNELS = (GEMV, ROWS, LANES)  # read activations and weights as 4-byte words
# Split-K partials the last program of a tile adds itself (``common.last_slice``), at most: it
# reads every slice's tile alone, after the others have finished, where a reduction launch
# spreads the sum over the GPU. H200, 2B shape (tools/results/kernels.md, "Split-K sums in the
# kernel"): 64 x 16 tiles (M <= 16) -7% on the stack at M = 9 and 16, the width-16 replay
# unchanged; 128 x 64 tiles (widths 32-33) +2-3% on the replays, 64 x 32 (M = 80) +5% on the stack.
SLICE_SUM_MAX_TILE = 64 * 16
# ``next_weights`` is acted on from this width: H200, 2B shape, one run (tools/results/kernels.md,
# "The next launch's weights"): the decode replays of widths 9, 16 and 32 1-2% faster with it,
# the AR replay (M = 1, gemv) 4.6% slower, the stack at M = 2 2% slower.
NEXT_WEIGHTS_MIN_M = 3


@triton.jit
def _w2a8_gemv_kernel(
    a_ptr,  # [M, K/4] int32: four int8 activations per word
    a_scale_ptr,  # [M] float32
    w_ptr,  # [N, K/16] int32: sixteen 2-bit codes per word, 8 words per 128-chunk
    w_scale_ptr,  # [N] or [N, K/128] float32
    out_ptr,  # [M, N]
    part_ptr,  # SPLIT: [S, M, N] int32 or float32 partial sums
    count_ptr,  # SUM_SLICES: [tiles] int32 arrival counts, zero between launches
    res_ptr,  # [M, N] float32 residual added in the epilogue (read only when RESIDUAL)
    next_ptr, next_bytes,  # PREFETCH_NEXT: the next launch's packed weights (uint8), asked of the L2
    M, N, chunks_per_split,
    stride_am, stride_wn, stride_sn, stride_sg, stride_om, stride_rm,
    K: tl.constexpr,
    GROUPED: tl.constexpr, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr,
    SUM_SLICES: tl.constexpr,  # SPLIT: the slices the last of a tile's programs adds (0: common.split_k_reduce)
    BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,  # rows per program, 128-chunks per K step
    USE_ASM: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
    PREFETCH: tl.constexpr = False,  # the program's weights asked of the L2 before the wait
    PREFETCH_NEXT: tl.constexpr = False,  # common.next_weights_l2: the next launch's weights asked too
    NEXT_LINES: tl.constexpr = 128,  # lines asked per step: one per thread
):
    N_CHUNKS: tl.constexpr = (K + 127) // 128  # the last chunk may end in zero-weight padding
    m = tl.program_id(0)  # one activation row per program; rows of one N tile run side by side
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_lo = tl.program_id(2) * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, N_CHUNKS)
    if PREFETCH:  # weights are constants: their DRAM traffic may start before the previous kernel ends
        prefetch_rows_l2(w_ptr.to(tl.pointer_type(tl.uint8)) + rn * (stride_wn * 4) + c_lo * 32, rn < N,
                         (c_hi - c_lo) * 32, 8, USE_ASM)
    if PREFETCH_NEXT:  # after its own: the next launch's weights, a whole launch ahead
        prefetch_share_l2(next_ptr.to(tl.pointer_type(tl.uint8)), next_bytes, NEXT_LINES, USE_ASM)
    mask_n = rn < N
    ws = _row_scales(w_scale_ptr, rn, N, stride_sn, GROUPED, SPLIT)
    gdc_prologue(USE_GDC)
    # the epilogue's other inputs too, before the loop: a read after it is a round trip at the
    # end of every program, on the kernel's critical path (split-K: only the last slice reads them)
    if SPLIT:
        a_s = 0.0
    else:
        a_s = tl.load(a_scale_ptr + m)
    res = 0.0
    if RESIDUAL and not SPLIT:
        res = tl.load(res_ptr + m * stride_rm + rn, mask=mask_n, other=0.0)
    rc = tl.arange(0, CHUNKS)
    rj = tl.arange(0, 8)  # word j of a chunk holds inputs 4j..4j+3 of each 32-wide lane
    ones = tl.full((CHUNKS, 8), 0x01010101, tl.int32)

    acc = tl.zeros((BLOCK_N, CHUNKS, 8), tl.int32)
    asum = tl.zeros((CHUNKS, 8), tl.int32)
    facc = tl.zeros((BLOCK_N,), tl.float32)
    for c0 in range(c_lo, c_hi, CHUNKS):
        c = c0 + rc
        mask_c = c < c_hi
        # padding words read as 0 and meet activation 0: they add nothing to acc or asum
        wt = tl.load(w_ptr + rn[:, None, None] * stride_wn + c[None, :, None] * 8 + rj[None, None, :],
                     mask=mask_n[:, None, None] & mask_c[None, :, None], other=0)  # [BLOCK_N, CHUNKS, 8]
        if GROUPED:
            acc = tl.zeros((BLOCK_N, CHUNKS, 8), tl.int32)
            asum = tl.zeros((CHUNKS, 8), tl.int32)
        for i in tl.static_range(4):
            # lane i of word j = inputs 128c + 32i + 4j .. +3 = activation word 32c + 8i + j
            aw = c[:, None] * 32 + 8 * i + rj[None, :]  # activation word; K % 4 == 0 here
            a = tl.load(a_ptr + m * stride_am + aw, mask=mask_c[:, None] & (aw < K // 4), other=0)  # [CHUNKS, 8]
            codes = (wt >> (2 * i)) & 0x03030303
            acc = dp4a(codes, a[None, :, :], acc, USE_ASM)
            asum = dp4a(a, ones, asum, USE_ASM)
        if GROUPED:
            s = tl.load(w_scale_ptr + rn[:, None] * stride_sn + c[None, :] * stride_sg,
                        mask=mask_n[:, None] & mask_c[None, :], other=0.0)  # [BLOCK_N, CHUNKS]
            part = (tl.sum(acc, axis=2) - tl.sum(asum, axis=1)[None, :]).to(tl.float32) * s  # [BLOCK_N, CHUNKS]
            for cc in tl.static_range(CHUNKS):  # one chunk at a time, in K order: the sum's order is the width's
                facc += tl.sum(tl.where(rc[None, :] == cc, part, 0.0), axis=1)

    if GROUPED:
        y = facc
    else:
        y = tl.sum(tl.sum(acc, axis=2), axis=1) - tl.sum(tl.sum(asum, axis=1), axis=0)  # int32
    if SPLIT:
        tl.store(part_ptr + (tl.program_id(2) * M + m) * N + rn, y, mask=mask_n)
        if SUM_SLICES > 0:
            if last_slice(count_ptr, SUM_SLICES):  # fresh names: nothing flows out of the branch
                total = sum_slices(part_ptr, m * N + rn, mask_n, M * N, SUM_SLICES)
                row_scales = ws
                if not GROUPED:
                    row_scales = tl.load(w_scale_ptr + rn * stride_sn, mask=mask_n, other=0.0)
                row_res = res
                if RESIDUAL:
                    row_res = tl.load(res_ptr + m * stride_rm + rn, mask=mask_n, other=0.0)
                _finish_row(total, tl.load(a_scale_ptr + m), row_scales, row_res, out_ptr + m * stride_om + rn,
                            mask_n, GROUPED, RESIDUAL)
    else:
        _finish_row(y, a_s, ws, res, out_ptr + m * stride_om + rn, mask_n, GROUPED, RESIDUAL)


@triton.jit
def _finish_row(y, a_s, ws, res, out_ptrs, mask, GROUPED: tl.constexpr, RESIDUAL: tl.constexpr):
    """gemv's ``_finish_tile``: one activation row."""
    if GROUPED:
        y = y * a_s
    else:
        y = y.to(tl.float32) * a_s * ws
    if RESIDUAL:
        y = res + y
    tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _row_scales(w_scale_ptr, rn, N, stride_sn, GROUPED: tl.constexpr, SPLIT: tl.constexpr):
    """The per-row weight scales an epilogue multiplies by (zeros where it applies none: split-K
    partials, group scales). Constants: a kernel reads them before the programmatic-launch wait,
    so their DRAM latency overlaps the previous kernel instead of ending every program."""
    if SPLIT or GROUPED:
        ws = tl.zeros(rn.shape, tl.float32)
    else:
        ws = tl.load(w_scale_ptr + rn * stride_sn, mask=rn < N, other=0.0)
    return ws


@triton.jit
def _act_scales(a_scale_ptr, rm, M, SPLIT: tl.constexpr):
    """The activation rows' scales of an epilogue (zeros for split-K partials). The tile kernels
    read them after the K loop: they are the previous kernel's output (no earlier than the
    wait, an L2 hit), and a ``[BLOCK_M]`` vector held across the loop costs registers on
    Ampere (sm_87, the 2560 x 6912 default at width 40: 128 -> 174 per thread), where the
    weights' scales (``_row_scales``, from DRAM) cost none. gemv reads its one scale before."""
    if SPLIT:
        a_s = tl.zeros(rm.shape, tl.float32)
    else:
        a_s = tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)
    return a_s


@triton.jit
def _finish_tile(y, rn, rm, M, N, a_s, ws, out_ptr, stride_om, res_ptr, stride_rm,
                 GROUPED: tl.constexpr, RESIDUAL: tl.constexpr):
    """``(acc · a_scale) · w_scale`` (group scales: already applied) ``+ residual``, stored:
    the order of the twin and of ``common.split_k_reduce``."""
    mask = (rn < N)[:, None] & (rm < M)[None, :]
    if GROUPED:
        y = y * a_s[None, :]
    else:
        y = y.to(tl.float32) * a_s[None, :] * ws[:, None]
    if RESIDUAL:
        y = tl.load(res_ptr + rm[None, :] * stride_rm + rn[:, None], mask=mask, other=0.0) + y
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_tile(y, rn, rm, M, N, a_s, ws, out_ptr, stride_om, res_ptr, stride_rm, part_ptr, count_ptr,
                a_scale_ptr, w_scale_ptr, stride_sn,
                GROUPED: tl.constexpr, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr, SUM_SLICES: tl.constexpr):
    """Epilogue of a ``[BLOCK_N, BLOCK_M]`` tile (every kernel but gemv): ``_finish_tile``, or
    under split-K this slice's partial, and in the last of the tile's slices to arrive
    (``SUM_SLICES``) the sum of them all finished; the scales ``a_s`` [BLOCK_M]
    (``_act_scales``) and ``ws`` [BLOCK_N] (``_row_scales``, read before the
    programmatic-launch wait) come from the kernel."""
    if SPLIT:
        offs = rm[None, :] * N + rn[:, None]
        mask = (rn < N)[:, None] & (rm < M)[None, :]
        tl.store(part_ptr + tl.program_id(2) * M * N + offs, y, mask=mask)
        if SUM_SLICES > 0:
            if last_slice(count_ptr, SUM_SLICES):  # fresh names: nothing flows out of the branch
                total = sum_slices(part_ptr, offs, mask, M * N, SUM_SLICES)
                row_scales = ws
                if not GROUPED:
                    row_scales = tl.load(w_scale_ptr + rn * stride_sn, mask=rn < N, other=0.0)
                _finish_tile(total, rn, rm, M, N, tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0), row_scales,
                             out_ptr, stride_om, res_ptr, stride_rm, GROUPED, RESIDUAL)
    else:
        _finish_tile(y, rn, rm, M, N, a_s, ws, out_ptr, stride_om, res_ptr, stride_rm, GROUPED, RESIDUAL)


@triton.jit
def _w2a8_rows_kernel(
    a_ptr,  # [M, K/4] int32: four int8 activations per word
    a_scale_ptr,  # [M] float32
    w_ptr,  # [N, K/16] int32 packed words (as the gemv kernel reads them)
    w_scale_ptr,  # [N] or [N, K/128] float32
    out_ptr,  # [M, N]
    part_ptr,  # SPLIT: [S, M, N] int32 or float32 partial sums
    count_ptr,  # SUM_SLICES: [tiles] int32 arrival counts, zero between launches
    res_ptr,  # [M, N] float32 residual (RESIDUAL)
    next_ptr, next_bytes,  # PREFETCH_NEXT: the next launch's packed weights (uint8), asked of the L2
    M, N, chunks_per_split,
    stride_am, stride_wn, stride_sn, stride_sg, stride_om, stride_rm,
    K: tl.constexpr,
    GROUPED: tl.constexpr, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr,
    SUM_SLICES: tl.constexpr,  # SPLIT: the slices the last of a tile's programs adds (0: common.split_k_reduce)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    USE_ASM: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
    PREFETCH: tl.constexpr = False,  # the program's weights asked of the L2 before the wait
    PREFETCH_NEXT: tl.constexpr = False,  # common.next_weights_l2: the next launch's weights asked too
    NEXT_LINES: tl.constexpr = 128,  # lines asked per step: one per thread
):
    """The gemv kernel with BLOCK_M activation rows per program: each weight word is loaded
    and decoded once and multiplies every row (dp4a), instead of once per row."""
    N_CHUNKS: tl.constexpr = (K + 127) // 128
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    c_lo = tl.program_id(2) * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, N_CHUNKS)
    if PREFETCH:
        prefetch_rows_l2(w_ptr.to(tl.pointer_type(tl.uint8)) + rn * (stride_wn * 4) + c_lo * 32, rn < N,
                         (c_hi - c_lo) * 32, 8, USE_ASM)
    if PREFETCH_NEXT:  # after its own: the next launch's weights, a whole launch ahead
        prefetch_share_l2(next_ptr.to(tl.pointer_type(tl.uint8)), next_bytes, NEXT_LINES, USE_ASM)
    ws = _row_scales(w_scale_ptr, rn, N, stride_sn, GROUPED, SPLIT)
    gdc_prologue(USE_GDC)
    rc = tl.arange(0, CHUNKS)
    rj = tl.arange(0, 8)
    mask_n = rn < N
    mask_m = rm < M
    ones = tl.full((BLOCK_M, CHUNKS, 8), 0x01010101, tl.int32)

    acc = tl.zeros((BLOCK_N, BLOCK_M, CHUNKS, 8), tl.int32)
    asum = tl.zeros((BLOCK_M, CHUNKS, 8), tl.int32)
    facc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for c0 in range(c_lo, c_hi, CHUNKS):
        c = c0 + rc
        mask_c = c < c_hi
        wt = tl.load(w_ptr + rn[:, None, None] * stride_wn + c[None, :, None] * 8 + rj[None, None, :],
                     mask=mask_n[:, None, None] & mask_c[None, :, None], other=0)  # [BLOCK_N, CHUNKS, 8]
        if GROUPED:
            acc = tl.zeros((BLOCK_N, BLOCK_M, CHUNKS, 8), tl.int32)
            asum = tl.zeros((BLOCK_M, CHUNKS, 8), tl.int32)
        for i in tl.static_range(4):
            aw = c[:, None] * 32 + 8 * i + rj[None, :]  # [CHUNKS, 8] activation words
            a = tl.load(a_ptr + rm[:, None, None] * stride_am + aw[None, :, :],
                        mask=mask_m[:, None, None] & (mask_c[:, None] & (aw < K // 4))[None, :, :],
                        other=0)  # [BLOCK_M, CHUNKS, 8]
            codes = (wt >> (2 * i)) & 0x03030303
            acc = dp4a(codes[:, None, :, :], a[None, :, :, :], acc, USE_ASM)
            asum = dp4a(a, ones, asum, USE_ASM)
        if GROUPED:
            s = tl.load(w_scale_ptr + rn[:, None] * stride_sn + c[None, :] * stride_sg,
                        mask=mask_n[:, None] & mask_c[None, :], other=0.0)  # [BLOCK_N, CHUNKS]
            chunk = tl.sum(acc, axis=3) - tl.sum(asum, axis=2)[None, :, :]  # [BLOCK_N, BLOCK_M, CHUNKS]
            part = chunk.to(tl.float32) * s[:, None, :]
            for cc in tl.static_range(CHUNKS):  # one chunk at a time, in K order
                facc += tl.sum(tl.where(rc[None, None, :] == cc, part, 0.0), axis=2)

    if GROUPED:
        y = facc
    else:
        y = tl.sum(tl.sum(acc, axis=3), axis=2) - tl.sum(tl.sum(asum, axis=2), axis=1)[None, :]  # int32
    a_s = _act_scales(a_scale_ptr, rm, M, SPLIT)
    _store_tile(y, rn, rm, M, N, a_s, ws, out_ptr, stride_om, res_ptr, stride_rm, part_ptr, count_ptr,
                a_scale_ptr, w_scale_ptr, stride_sn, GROUPED, SPLIT, RESIDUAL, SUM_SLICES)


@triton.jit
def _w2a8_dot_kernel(
    a_ptr,  # [M, K] int8
    a_scale_ptr,  # [M] float32
    w_ptr,  # [N, K/4] uint8 packed codes
    w_scale_ptr,  # [N] or [N, K/128] float32
    out_ptr,  # [M, N]
    part_ptr,  # SPLIT: [S, M, N] int32 or float32 partial sums
    count_ptr,  # SUM_SLICES: [tiles] int32 arrival counts, zero between launches
    res_ptr,  # [M, N] float32 residual (RESIDUAL)
    next_ptr, next_bytes,  # PREFETCH_NEXT: the next launch's packed weights (uint8), asked of the L2
    M, N, chunks_per_split,
    stride_am, stride_wn, stride_sn, stride_sg, stride_om, stride_rm,
    K: tl.constexpr,
    GROUPED: tl.constexpr, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr,
    SUM_SLICES: tl.constexpr,  # SPLIT: the slices the last of a tile's programs adds (0: common.split_k_reduce)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    USE_ASM: tl.constexpr = False,  # only the L2 prefetch is inline assembly here
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
    PREFETCH: tl.constexpr = False,  # the program's weights asked of the L2 before the wait
    PREFETCH_NEXT: tl.constexpr = False,  # common.next_weights_l2: the next launch's weights asked too
    NEXT_LINES: tl.constexpr = 128,  # lines asked per step: one per thread
):
    N_CHUNKS: tl.constexpr = (K + 127) // 128
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    c_lo = tl.program_id(2) * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, N_CHUNKS)
    if PREFETCH:
        prefetch_rows_l2(w_ptr + rn * stride_wn + c_lo * 32, rn < N, (c_hi - c_lo) * 32, 8, USE_ASM)
    if PREFETCH_NEXT:  # after its own: the next launch's weights, a whole launch ahead
        prefetch_share_l2(next_ptr.to(tl.pointer_type(tl.uint8)), next_bytes, NEXT_LINES, USE_ASM)
    ws = _row_scales(w_scale_ptr, rn, N, stride_sn, GROUPED, SPLIT)
    gdc_prologue(USE_GDC)
    rb = tl.arange(0, 32)  # byte j of a chunk holds input 32i + j of lane i
    mask_m = rm < M
    mask_n = rn < N

    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
    asum = tl.zeros((BLOCK_M,), tl.int32)
    facc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for c0 in range(c_lo, c_hi, CHUNKS):
        for cc in tl.static_range(CHUNKS):  # one 32-byte column block per chunk: scales stay per chunk
            c = c0 + cc
            ok = (c * 32 + rb) < c_hi * 32  # [32]: the whole chunk is in this slice or not
            wb = tl.load(w_ptr + rn[:, None] * stride_wn + c * 32 + rb[None, :],
                         mask=mask_n[:, None] & ok[None, :], other=0)  # [BLOCK_N, 32] uint8
            if GROUPED:
                acc = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
                asum = tl.zeros((BLOCK_M,), tl.int32)
            for i in tl.static_range(4):
                ka = c * 128 + 32 * i + rb
                a = tl.load(a_ptr + rm[None, :] * stride_am + ka[:, None],
                            mask=mask_m[None, :] & (ok & (ka < K))[:, None], other=0)  # [32, BLOCK_M] int8
                codes = ((wb >> (2 * i)) & 3).to(tl.int8)
                acc = tl.dot(codes, a, acc, out_dtype=tl.int32)  # [BLOCK_N, BLOCK_M]
                asum += tl.sum(a.to(tl.int32), axis=0)
            if GROUPED:
                s = tl.load(w_scale_ptr + rn * stride_sn + c * stride_sg, mask=mask_n & (rn * 0 + c < c_hi), other=0.0)
                facc += (acc - asum[None, :]).to(tl.float32) * s[:, None]

    if GROUPED:
        y = facc
    else:
        y = acc - asum[None, :]  # int32
    a_s = _act_scales(a_scale_ptr, rm, M, SPLIT)
    _store_tile(y, rn, rm, M, N, a_s, ws, out_ptr, stride_om, res_ptr, stride_rm, part_ptr, count_ptr,
                a_scale_ptr, w_scale_ptr, stride_sn, GROUPED, SPLIT, RESIDUAL, SUM_SLICES)


@triton.jit
def _w2a8_lanes_kernel(
    a_ptr,  # [M, K/4] int32: four int8 activations per word
    a_scale_ptr,  # [M] float32
    w_ptr,  # [N, Kp/16] int32 packed words (as the gemv kernel reads them)
    w_scale_ptr,  # [N] or [N, ceil(K/128)] float32
    out_ptr,  # [M, N]
    part_ptr,  # SPLIT: [S, M, N] int32 or float32 partial sums
    count_ptr,  # SUM_SLICES: [tiles] int32 arrival counts, zero between launches
    res_ptr,  # [M, N] float32 residual (RESIDUAL)
    next_ptr, next_bytes,  # PREFETCH_NEXT: the next launch's packed weights (uint8), asked of the L2
    M, N, chunks_per_split,
    stride_am, stride_wn, stride_sn, stride_sg, stride_om, stride_rm,
    K: tl.constexpr,
    GROUPED: tl.constexpr, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr,
    SUM_SLICES: tl.constexpr,  # SPLIT: the slices the last of a tile's programs adds (0: common.split_k_reduce)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    USE_ASM: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
    PREFETCH: tl.constexpr = False,  # the program's weights asked of the L2 before the wait
    PREFETCH_NEXT: tl.constexpr = False,  # common.next_weights_l2: the next launch's weights asked too
    NEXT_LINES: tl.constexpr = 128,  # lines asked per step: one per thread
):
    """dp4a over all BLOCK_M rows of the width with each weight word loaded and decoded once.

    A lane is *masked in place* (``word & (0x03030303 << 2i)``), not shifted down: its codes
    read as ``4^i * c`` and lane i sums into its own accumulator, divided by ``4^i`` once at
    the end (exact: every product is a multiple of ``4^i``). Two integer instructions per
    four weights and row-independent decode: one mask, then one dp4a per row. The offset
    correction ``sum_k a`` is a separate pass over the activations after the main loop, not
    a dp4a per weight word. The first weight step is loaded before waiting for the previous
    kernel (weights are constants), so under programmatic launch it overlaps that kernel.
    int32 headroom: lane 3's sum is at most ``128 · 128 · K / 4``, below 2**31 for K < 524288."""
    N_CHUNKS: tl.constexpr = (K + 127) // 128
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    c_lo = tl.program_id(2) * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, N_CHUNKS)
    rc = tl.arange(0, CHUNKS)
    rj = tl.arange(0, 8)
    mask_n = rn < N
    mask_m = rm < M
    w_rows = w_ptr + rn[:, None, None] * stride_wn + rj[None, None, :]
    a_rows = a_ptr + rm[:, None, None] * stride_am

    if PREFETCH:
        prefetch_rows_l2(w_ptr.to(tl.pointer_type(tl.uint8)) + rn * (stride_wn * 4) + c_lo * 32, mask_n,
                         (c_hi - c_lo) * 32, 8, USE_ASM)
    if PREFETCH_NEXT:  # after its own: the next launch's weights, a whole launch ahead
        prefetch_share_l2(next_ptr.to(tl.pointer_type(tl.uint8)), next_bytes, NEXT_LINES, USE_ASM)
    c = c_lo + rc
    wt = tl.load(w_rows + c[None, :, None] * 8, mask=mask_n[:, None, None] & (c < c_hi)[None, :, None], other=0)
    ws = _row_scales(w_scale_ptr, rn, N, stride_sn, GROUPED, SPLIT)
    gdc_prologue(USE_GDC)  # from here on the previous kernel's output (the activations) is visible

    acc0 = tl.zeros((BLOCK_N, BLOCK_M, CHUNKS, 8), tl.int32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_M, CHUNKS, 8), tl.int32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_M, CHUNKS, 8), tl.int32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_M, CHUNKS, 8), tl.int32)
    ones = tl.full((BLOCK_M, CHUNKS, 8), 0x01010101, tl.int32)
    asum = tl.zeros((BLOCK_M, CHUNKS, 8), tl.int32)
    facc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for c0 in range(c_lo, c_hi, CHUNKS):
        c = c0 + rc
        mask_c = c < c_hi
        cn = c + CHUNKS  # the next step's weights: in flight while this step computes
        wt_next = tl.load(w_rows + cn[None, :, None] * 8, mask=mask_n[:, None, None] & (cn < c_hi)[None, :, None],
                          other=0)
        if GROUPED:
            acc0 = tl.zeros((BLOCK_N, BLOCK_M, CHUNKS, 8), tl.int32)
            acc1 = tl.zeros((BLOCK_N, BLOCK_M, CHUNKS, 8), tl.int32)
            acc2 = tl.zeros((BLOCK_N, BLOCK_M, CHUNKS, 8), tl.int32)
            acc3 = tl.zeros((BLOCK_N, BLOCK_M, CHUNKS, 8), tl.int32)
            asum = tl.zeros((BLOCK_M, CHUNKS, 8), tl.int32)
        w4 = wt[:, None, :, :]
        for i in tl.static_range(4):
            aw = c[:, None] * 32 + 8 * i + rj[None, :]  # lane i of word j = activation word 32c + 8i + j
            a3 = tl.load(a_rows + aw[None, :, :], mask=mask_m[:, None, None] & (mask_c[:, None] & (aw < K // 4))[None],
                         other=0)  # [BLOCK_M, CHUNKS, 8]
            a = a3[None, :, :, :]
            if i == 0:
                acc0 = dp4a_unsigned(w4 & 0x03030303, a, acc0, USE_ASM)
            elif i == 1:
                acc1 = dp4a_unsigned(w4 & 0x0C0C0C0C, a, acc1, USE_ASM)
            elif i == 2:
                acc2 = dp4a_unsigned(w4 & 0x30303030, a, acc2, USE_ASM)
            else:
                acc3 = dp4a_unsigned(w4 & -1061109568, a, acc3, USE_ASM)  # 0xC0C0C0C0 as int32
            if GROUPED:
                asum = dp4a(a3, ones, asum, USE_ASM)
        if GROUPED:
            s = tl.load(w_scale_ptr + rn[:, None] * stride_sn + c[None, :] * stride_sg,
                        mask=mask_n[:, None] & mask_c[None, :], other=0.0)  # [BLOCK_N, CHUNKS]
            words = acc0 + (acc1 >> 2) + (acc2 >> 4) + (acc3 >> 6)  # exact: lane i's sums are multiples of 4^i
            chunk = tl.sum(words, axis=3) - tl.sum(asum, axis=2)[None, :, :]  # [BLOCK_N, BLOCK_M, CHUNKS]
            part = chunk.to(tl.float32) * s[:, None, :]
            for cc in tl.static_range(CHUNKS):  # one chunk at a time, in K order
                facc += tl.sum(tl.where(rc[None, None, :] == cc, part, 0.0), axis=2)
        wt = wt_next

    if GROUPED:
        y = facc
    else:
        # sum_k a over this slice, once per row (a dp4a against ones per activation word)
        rw = tl.arange(0, CHUNKS * 32)
        arow = a_ptr + rm[:, None] * stride_am
        asum2 = tl.zeros((BLOCK_M, CHUNKS * 32), tl.int32)
        for w0 in range(c_lo * 32, c_hi * 32, CHUNKS * 32):
            aw = w0 + rw
            a = tl.load(arow + aw[None, :], mask=mask_m[:, None] & ((aw < c_hi * 32) & (aw < K // 4))[None, :], other=0)
            asum2 = dp4a(a, tl.full((BLOCK_M, CHUNKS * 32), 0x01010101, tl.int32), asum2, USE_ASM)
        y = (tl.sum(tl.sum(acc0, axis=3), axis=2) + (tl.sum(tl.sum(acc1, axis=3), axis=2) >> 2)
             + (tl.sum(tl.sum(acc2, axis=3), axis=2) >> 4) + (tl.sum(tl.sum(acc3, axis=3), axis=2) >> 6)
             - tl.sum(asum2, axis=1)[None, :])  # [BLOCK_N, BLOCK_M] int32
    a_s = _act_scales(a_scale_ptr, rm, M, SPLIT)
    _store_tile(y, rn, rm, M, N, a_s, ws, out_ptr, stride_om, res_ptr, stride_rm, part_ptr, count_ptr,
                a_scale_ptr, w_scale_ptr, stride_sn, GROUPED, SPLIT, RESIDUAL, SUM_SLICES)


@triton.jit
def _mma_chunk(wb, c, c_hi, a_cols, mask_m, rb, rn, N, w_scale_ptr, stride_sn, stride_sg, acc0, acc1, acc2, acc3, asum,
               facc, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUPED: tl.constexpr,
               ASUM_BY_DOT: tl.constexpr):
    """One 128-chunk of ``_w2a8_mma_kernel``: the four lanes of the packed tile ``wb``
    ([BLOCK_N, 32] uint8) against their activations; group scales applied per chunk."""
    live = rb * 0 + c < c_hi  # [32]: a step may overshoot the slice
    if GROUPED:
        acc0 = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
        acc1 = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
        asum = tl.zeros((16, BLOCK_M), tl.int32)
    for i in tl.static_range(4):
        ka = c * 128 + 32 * i + rb
        a = tl.load(a_cols + c * 128 + 32 * i, mask=mask_m & (live & (ka < K))[:, None], other=0)  # [32, BLOCK_M]
        if i == 0:
            acc0 = tl.dot(_mma_lane(wb, 0), a, acc0, out_dtype=tl.int32)
        elif i == 1:
            acc1 = tl.dot(_mma_lane(wb, 1), a, acc1, out_dtype=tl.int32)
        elif i == 2:
            acc2 = tl.dot(_mma_lane(wb, 2), a, acc2, out_dtype=tl.int32)
        else:
            acc3 = tl.dot(_mma_lane(wb, 3), a, acc3, out_dtype=tl.int32)
        if ASUM_BY_DOT:
            asum = _mma_asum(a, i, asum, 32)
    if GROUPED:
        s = tl.load(w_scale_ptr + rn * stride_sn + c * stride_sg, mask=(rn < N) & (rn * 0 + c < c_hi), other=0.0)
        chunk = acc0 + (acc1 >> 2) + (acc2 >> 4) + (acc3 >> 6) + tl.max(asum, axis=0)[None, :]
        facc += chunk.to(tl.float32) * s[:, None]
    return acc0, acc1, acc2, acc3, asum, facc


@triton.jit
def _mma_folded_step(wb, c0, c_hi, a_step, mask_m, a_tail, mask_t, rk, rn, N, w_scale_ptr, stride_sn, stride_sg,
                     acc, asum, facc, acc_t, asum_t, facc_t, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr, GROUPED: tl.constexpr, ASUM_BY_DOT: tl.constexpr,
                     CHUNKS: tl.constexpr):
    """One K step (CHUNKS 128-chunks from ``c0``) of ``_w2a8_mma_kernel`` with folded lanes.

    ``wb``: the step's packed bytes ([BLOCK_N, 32·CHUNKS], chunk after chunk); column ``32c + j``
    of lane i is input ``128(c0 + c) + 32i + j``, which ``a_step`` gathers, so each lane is one
    dot over the whole step. The lanes share ``acc`` by Horner over their scales: in at scale
    1, ``<< 2`` before lanes 1..3 (every partial sum is then a multiple of the next lane's
    scale), ``>> 6`` at the end: four exact shifts per step. Group scales: CHUNKS == 1.
    ``TAIL_M > 0``: each decoded lane also multiplies the tail rows (``a_tail``, ``mask_t``)
    into ``acc_t`` / ``asum_t`` / ``facc_t`` the same way; else those pass through untouched."""
    c = c0 + rk // 32  # [32·CHUNKS]: the chunk of each column
    live = c < c_hi  # a step may overshoot the slice
    if GROUPED:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
        asum = tl.zeros((16, BLOCK_M), tl.int32)
        if TAIL_M > 0:
            acc_t = tl.zeros((BLOCK_N, TAIL_M), tl.int32)
            asum_t = tl.zeros((16, TAIL_M), tl.int32)
    for i in tl.static_range(4):
        if i > 0:
            acc = acc << 2
            if TAIL_M > 0:
                acc_t = acc_t << 2
        ka = c * 128 + 32 * i + rk % 32
        a = tl.load(a_step + c0 * 128 + 32 * i, mask=mask_m & (live & (ka < K))[:, None], other=0)  # [32·CHUNKS, BLOCK_M]
        lane = _mma_lane(wb, i)  # decoded once for both row tiles
        acc = tl.dot(lane, a, acc, out_dtype=tl.int32)
        if ASUM_BY_DOT:
            asum = _mma_asum(a, i, asum, 32 * CHUNKS)
        if TAIL_M > 0:
            a_t = tl.load(a_tail + c0 * 128 + 32 * i, mask=mask_t & (live & (ka < K))[:, None], other=0)
            acc_t = tl.dot(lane, a_t, acc_t, out_dtype=tl.int32)
            if ASUM_BY_DOT:
                asum_t = _mma_asum(a_t, i, asum_t, 32 * CHUNKS)
    acc = acc >> 6
    if TAIL_M > 0:
        acc_t = acc_t >> 6
    if GROUPED:
        s = tl.load(w_scale_ptr + rn * stride_sn + c0 * stride_sg, mask=(rn < N) & (rn * 0 + c0 < c_hi), other=0.0)
        facc += (acc + tl.max(asum, axis=0)[None, :]).to(tl.float32) * s[:, None]
        if TAIL_M > 0:
            facc_t += (acc_t + tl.max(asum_t, axis=0)[None, :]).to(tl.float32) * s[:, None]
    return acc, asum, facc, acc_t, asum_t, facc_t


@triton.jit
def _mma_folded_pair(wa, wb, c0, c_hi, a_step, mask_m, rk, rn, N, w_scale_ptr, stride_sn, stride_sg, acc_a, acc_b,
                     asum, facc, a_words, rw, rows_ok, sign, asum2, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_M: tl.constexpr, GROUPED: tl.constexpr, ASUM_BY_DOT: tl.constexpr, CHUNKS: tl.constexpr,
                     WORD_SUMS: tl.constexpr, USE_ASM: tl.constexpr):
    """Two K steps of ``_w2a8_mma_kernel``'s folded loop at once (``CHAINS = 2``, no tail):
    ``wa`` from chunk ``c0`` into ``acc_a``, ``wb`` from ``c0 + CHUNKS`` into ``acc_b``, each as
    ``_mma_folded_step`` multiplies one, with lane i of both dotted before either shifts for
    lane i + 1: two independent chains of dependent tensor-core ops where one accumulator
    makes one. Group scales (CHUNKS == 1): each step's exact sum is scaled and added to
    ``facc`` in K order, ``a`` then ``b``, as one step after the other would. ``WORD_SUMS``:
    both steps' activation words loaded before the dots and summed into ``asum2`` after them."""
    tl.static_assert(not GROUPED or CHUNKS == 1, "group scales: one chunk per step, its own scale")
    if WORD_SUMS:
        aw_a = _step_words(a_words, c0, c_hi, rw, rows_ok, K)
        aw_b = _step_words(a_words, c0 + CHUNKS, c_hi, rw, rows_ok, K)
    ca = c0 + rk // 32  # [32·CHUNKS]: the chunk of each column of the first step
    cb = ca + CHUNKS
    live_a = ca < c_hi
    live_b = cb < c_hi  # either step may overshoot the slice
    if GROUPED:
        acc_a = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
        acc_b = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
        asum_a = tl.zeros((16, BLOCK_M), tl.int32)
        asum_b = tl.zeros((16, BLOCK_M), tl.int32)
    for i in tl.static_range(4):
        if i > 0:
            acc_a = acc_a << 2
            acc_b = acc_b << 2
        ka = ca * 128 + 32 * i + rk % 32
        x_a = tl.load(a_step + c0 * 128 + 32 * i, mask=mask_m & (live_a & (ka < K))[:, None], other=0)
        x_b = tl.load(a_step + (c0 + CHUNKS) * 128 + 32 * i, mask=mask_m & (live_b & (ka + CHUNKS * 128 < K))[:, None],
                      other=0)
        acc_a = tl.dot(_mma_lane(wa, i), x_a, acc_a, out_dtype=tl.int32)
        acc_b = tl.dot(_mma_lane(wb, i), x_b, acc_b, out_dtype=tl.int32)
        if ASUM_BY_DOT:
            if GROUPED:
                asum_a = _mma_asum(x_a, i, asum_a, 32 * CHUNKS)
                asum_b = _mma_asum(x_b, i, asum_b, 32 * CHUNKS)
            else:
                asum = _mma_asum(x_b, i, _mma_asum(x_a, i, asum, 32 * CHUNKS), 32 * CHUNKS)
    acc_a = acc_a >> 6
    acc_b = acc_b >> 6
    if GROUPED:
        s_a = tl.load(w_scale_ptr + rn * stride_sn + c0 * stride_sg, mask=(rn < N) & (rn * 0 + c0 < c_hi), other=0.0)
        facc += (acc_a + tl.max(asum_a, axis=0)[None, :]).to(tl.float32) * s_a[:, None]
        s_b = tl.load(w_scale_ptr + rn * stride_sn + (c0 + 1) * stride_sg, mask=(rn < N) & (rn * 0 + c0 + 1 < c_hi),
                      other=0.0)
        facc += (acc_b + tl.max(asum_b, axis=0)[None, :]).to(tl.float32) * s_b[:, None]
    if WORD_SUMS:
        asum2 = dp4a(aw_b, sign[None, :], dp4a(aw_a, sign[None, :], asum2, USE_ASM), USE_ASM)
    return acc_a, acc_b, asum, facc, asum2


@triton.jit
def _mma_asum(a, i: tl.constexpr, asum, KS: tl.constexpr):
    """``asum`` (16 equal rows) minus the activation sums of lanes 0..2, plus lane 3's, on the tensor cores."""
    if i < 3:
        return tl.dot(tl.full((16, KS), -1, tl.int8), a, asum, out_dtype=tl.int32)
    else:
        return tl.dot(tl.full((16, KS), 1, tl.int8), a, asum, out_dtype=tl.int32)


@triton.jit
def _mma_lane(wb, i: tl.constexpr):
    """Lane ``i`` of a packed tile as the tensor cores' int8 operand, masked in place (one
    bitwise op per four weights): ``4^i · c`` for lanes 0..2, ``64 · (c - 2)`` for lane 3."""
    if i == 0:
        lane = wb & 0x03
    elif i == 1:
        lane = wb & 0x0C
    elif i == 2:
        lane = wb & 0x30
    else:
        lane = (wb & 0xC0) ^ 0x80
    return lane.to(tl.int8, bitcast=True)


@triton.jit
def _step_words(a_words, c0, c_hi, rw, rows_ok, K: tl.constexpr):
    """The activation words of the chunks ``c0 ..`` of a step that lie below ``c_hi`` and K:
    ``[BLOCK_M, 32·CHUNKS]`` int32, four int8 inputs each, 0 beyond (adds nothing to a sum)."""
    w = c0 * 32 + rw
    return tl.load(a_words + c0 * 32, mask=rows_ok & ((w < c_hi * 32) & (w < K // 4))[None, :], other=0)


@triton.jit
def _w2a8_mma_kernel(
    a_ptr,  # [M, K] int8
    a_scale_ptr,  # [M] float32
    w_ptr,  # [N, Kp/4] uint8 packed codes
    w_scale_ptr,  # [N] or [N, ceil(K/128)] float32
    out_ptr,  # [M, N]
    part_ptr,  # SPLIT: [S, M, N] int32 or float32 partial sums
    count_ptr,  # SUM_SLICES: [tiles] int32 arrival counts, zero between launches
    res_ptr,  # [M, N] float32 residual (RESIDUAL)
    next_ptr, next_bytes,  # PREFETCH_NEXT: the next launch's packed weights (uint8), asked of the L2
    M, N, chunks_per_split,
    stride_am, stride_wn, stride_sn, stride_sg, stride_om, stride_rm,
    K: tl.constexpr,
    GROUPED: tl.constexpr, SPLIT: tl.constexpr, RESIDUAL: tl.constexpr,
    SUM_SLICES: tl.constexpr,  # SPLIT: the slices the last of a tile's programs adds (0: common.split_k_reduce)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    USE_ASM: tl.constexpr,
    ASUM_BY_DOT: tl.constexpr,  # group scales, rows that are not whole aligned int32 words, or asked (config)
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
    PREFETCH: tl.constexpr = False,  # the program's weights asked of the L2 before the wait
    PREFETCH_NEXT: tl.constexpr = False,  # common.next_weights_l2: the next launch's weights asked too
    NEXT_LINES: tl.constexpr = 128,  # lines asked per step: one per thread
    FOLD: tl.constexpr = False,  # LinearConfig.fold_lanes: one accumulator for the four lanes, one dot per step
    TAIL_M: tl.constexpr = 0,  # FOLD: LinearConfig.tail_m, a second row tile after BLOCK_M's (0: none)
    CHAINS: tl.constexpr = 1,  # FOLD, no tail: LinearConfig.chains, K steps multiplied at once (1 or 2)
):
    """int8 tensor cores over all BLOCK_M (<= 128) rows of the width: each weight tile is
    loaded and decoded once for every row.

    Per chunk the ``[BLOCK_N, 32]`` packed bytes go to the tensor cores' operand layout once
    (Triton converts the *packed* tile, then decodes in registers), and each lane is one
    bitwise instruction per four weights, with no shift: lane i < 3 is ``byte & (3 << 2i)``
    = ``4^i · c`` (its own accumulator, divided by ``4^i`` at the end), lane 3 is
    ``(byte & 0xC0) ^ 0x80`` = ``64 · (c - 2)`` as a signed byte. Bitwise and/xor act on four
    packed bytes at once, so the compiler keeps them 32-bit. With ``w = c - 1``:
    ``sum w·a = acc0 + acc1/4 + acc2/16 + acc3/64 - (a-sums of lanes 0..2) + (a-sum of lane 3)``,
    the a-sums (row scales, word-aligned activations) by dp4a over the activation words, loaded at the start
    of each K step and summed after its dots (their latency behind the tensor cores, not in a pass after the loop),
    else (group scales, K % 4 != 0, or ``LinearConfig.asum_by_dot``: no word loads, at the
    price of a 16-row MMA per lane) from the tensor cores (a -1 / +1 tile times
    the same activations). Exact: every lane sum is a multiple of its scale; |acc3| <= 128·128·K/4 < 2**31.
    The first weight chunk is loaded before waiting for the previous kernel (constants).

    ``FOLD`` (wide widths, ``_mma_folded_step``): the four lanes share one accumulator (Horner
    over their scales, four exact shifts per K step instead of three more accumulators), so a
    ``BLOCK_N x BLOCK_M`` tile holds a quarter of the registers and one program can take the
    whole width up to 128 rows, each weight tile decoded once for all of them; and each lane
    is one dot over the whole step (``CHUNKS`` chunks gathered in one tile), a quarter of the
    dependent tensor-core ops at four chunks per step. Exact while ``64 · 160 · K < 2**31``
    (``FOLD_MAX_K``).

    ``TAIL_M`` (``FOLD`` only, ``LinearConfig.tail_m``): a program takes ``BLOCK_M + TAIL_M``
    rows, a main tile of BLOCK_M and a smaller tail tile of the TAIL_M rows after it (both
    powers of two), so a width just past a power of two pads to ``BLOCK_M + TAIL_M`` rows
    instead of ``2 · BLOCK_M`` (M = 33..48: 32 + 16 rows, not 64): the tensor-core work follows
    the padded rows. Each decoded lane feeds two dots, one per tile (the weights are still
    loaded and decoded once per step); each tile has its own accumulator, offset correction,
    activation scales and epilogue (under split-K its own arrival counts, after the main
    tiles'). A row's result does not depend on the tile it lands in (integer sums, exact).
    Without a tail the tail's tiles are 16-row placeholders that the folded step passes
    through untouched, and the compiler drops them.

    ``CHAINS = 2`` (``FOLD`` without a tail, ``LinearConfig.chains``): the loop takes two K
    steps per iteration into two accumulators, their lanes' dots interleaved
    (``_mma_folded_pair``). Folded lanes make each step a chain of four dependent dots, and one
    accumulator chains the steps as well; two accumulators give each warp two independent
    chains to issue. The two are added once after the loop (integers: exact in any order)."""
    N_CHUNKS: tl.constexpr = (K + 127) // 128
    tl.static_assert(TAIL_M == 0 or FOLD, "only the folded loop multiplies a tail tile")
    tl.static_assert(CHAINS == 1 or (FOLD and TAIL_M == 0), "two chains: the folded loop without a tail")
    # the row tiles of one weight tile are neighbours in the grid: they run together and
    # share the tile's DRAM traffic through the L2
    rm = tl.program_id(0) * (BLOCK_M + TAIL_M) + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_lo = tl.program_id(2) * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, N_CHUNKS)
    mask_n = (rn < N)[:, None]
    mask_m = (rm < M)[None, :]
    if PREFETCH:
        prefetch_rows_l2(w_ptr + rn * stride_wn + c_lo * 32, rn < N, (c_hi - c_lo) * 32, 8, USE_ASM)
    if PREFETCH_NEXT:  # after its own: the next launch's weights, a whole launch ahead
        prefetch_share_l2(next_ptr.to(tl.pointer_type(tl.uint8)), next_bytes, NEXT_LINES, USE_ASM)
    acc0 = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)  # folded: the only accumulator (acc1..3 stay zero)
    acc1 = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
    asum = tl.zeros((16, BLOCK_M), tl.int32)  # 16 equal rows: -sum(lanes 0..2) + sum(lane 3)
    facc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    ws = _row_scales(w_scale_ptr, rn, N, stride_sn, GROUPED, SPLIT)  # before the wait (both paths below)
    # The offset correction -sum(lanes 0..2) + sum(lane 3) of the activations (row scales, word-aligned
    # rows): each step loads its words first and sums them after its dots, so their L2 latency
    # hides behind the tensor cores instead of a serial pass after the loop (a round trip per
    # few chunks). Input 32i + j of a chunk is byte j % 4 of its word 8i + j // 4: lane = word // 8.
    WORD_SUMS: tl.constexpr = not (GROUPED or ASUM_BY_DOT)
    rw = tl.arange(0, 32 * CHUNKS)  # the words of one step, chunk after chunk
    sign = tl.where((rw % 32) // 8 == 3, 0x01010101, -1)  # four bytes of +1 (lane 3) or of -1 (0xFFFFFFFF)
    a_words = a_ptr.to(tl.pointer_type(tl.int32)) + rm[:, None] * (stride_am // 4) + rw[None, :]
    rows_ok = (rm < M)[:, None]
    asum2 = tl.zeros((BLOCK_M, 32 * CHUNKS), tl.int32)
    if FOLD:
        rk = tl.arange(0, 32 * CHUNKS)  # byte 32c + j of a step: inputs 128c + 32i + j of lane i
        w_step = w_ptr + rn[:, None] * stride_wn + rk[None, :]
        a_step = a_ptr + rm[None, :] * stride_am + ((rk // 32) * 128 + rk % 32)[:, None]
        # the tail tile: the TAIL_M rows after the main tile's (without one, 16-row placeholders)
        TAIL_ROWS: tl.constexpr = TAIL_M if TAIL_M > 0 else 16
        rt = tl.program_id(0) * (BLOCK_M + TAIL_M) + BLOCK_M + tl.arange(0, TAIL_ROWS)
        a_tail = a_ptr + rt[None, :] * stride_am + ((rk // 32) * 128 + rk % 32)[:, None]
        mask_t = (rt < M)[None, :]
        acc_t = tl.zeros((BLOCK_N, TAIL_ROWS), tl.int32)
        asum_t = tl.zeros((16, TAIL_ROWS), tl.int32)
        facc_t = tl.zeros((BLOCK_N, TAIL_ROWS), tl.float32)
        if WORD_SUMS and TAIL_M > 0:
            t_words = a_ptr.to(tl.pointer_type(tl.int32)) + rt[:, None] * (stride_am // 4) + rw[None, :]
            rows_t = (rt < M)[:, None]
            asum2_t = tl.zeros((TAIL_M, 32 * CHUNKS), tl.int32)
        # the weights are constants: their first step is in flight before the wait
        wb = tl.load(w_step + c_lo * 32, mask=mask_n & (c_lo + rk // 32 < c_hi)[None, :], other=0)
        if CHAINS == 2:  # two steps per iteration, each into its own accumulator (acc_b: the second's)
            acc_b = tl.zeros((BLOCK_N, BLOCK_M), tl.int32)
            wb2 = tl.load(w_step + (c_lo + CHUNKS) * 32, mask=mask_n & (c_lo + CHUNKS + rk // 32 < c_hi)[None, :],
                          other=0)
            gdc_prologue(USE_GDC)
            acc0, acc_b, asum, facc, asum2 = _mma_folded_pair(
                wb, wb2, c_lo, c_hi, a_step, mask_m, rk, rn, N, w_scale_ptr, stride_sn, stride_sg, acc0, acc_b, asum,
                facc, a_words, rw, rows_ok, sign, asum2, K, BLOCK_N, BLOCK_M, GROUPED, ASUM_BY_DOT, CHUNKS, WORD_SUMS,
                USE_ASM)
            for c0 in range(c_lo + 2 * CHUNKS, c_hi, 2 * CHUNKS):
                wb = tl.load(w_step + c0 * 32, mask=mask_n & (c0 + rk // 32 < c_hi)[None, :], other=0)
                wb2 = tl.load(w_step + (c0 + CHUNKS) * 32, mask=mask_n & (c0 + CHUNKS + rk // 32 < c_hi)[None, :],
                              other=0)
                acc0, acc_b, asum, facc, asum2 = _mma_folded_pair(
                    wb, wb2, c0, c_hi, a_step, mask_m, rk, rn, N, w_scale_ptr, stride_sn, stride_sg, acc0, acc_b, asum,
                    facc, a_words, rw, rows_ok, sign, asum2, K, BLOCK_N, BLOCK_M, GROUPED, ASUM_BY_DOT, CHUNKS,
                    WORD_SUMS, USE_ASM)
            acc0 = acc0 + acc_b
        else:
            gdc_prologue(USE_GDC)
            if WORD_SUMS:
                aw = _step_words(a_words, c_lo, c_hi, rw, rows_ok, K)
                if TAIL_M > 0:
                    aw_t = _step_words(t_words, c_lo, c_hi, rw, rows_t, K)
            acc0, asum, facc, acc_t, asum_t, facc_t = _mma_folded_step(
                wb, c_lo, c_hi, a_step, mask_m, a_tail, mask_t, rk, rn, N, w_scale_ptr, stride_sn, stride_sg, acc0, asum,
                facc, acc_t, asum_t, facc_t, K, BLOCK_N, BLOCK_M, TAIL_M, GROUPED, ASUM_BY_DOT, CHUNKS)
            if WORD_SUMS:
                asum2 = dp4a(aw, sign[None, :], asum2, USE_ASM)
                if TAIL_M > 0:
                    asum2_t = dp4a(aw_t, sign[None, :], asum2_t, USE_ASM)
            for c0 in range(c_lo + CHUNKS, c_hi, CHUNKS):
                wb = tl.load(w_step + c0 * 32, mask=mask_n & (c0 + rk // 32 < c_hi)[None, :], other=0)
                if WORD_SUMS:
                    aw = _step_words(a_words, c0, c_hi, rw, rows_ok, K)
                    if TAIL_M > 0:
                        aw_t = _step_words(t_words, c0, c_hi, rw, rows_t, K)
                acc0, asum, facc, acc_t, asum_t, facc_t = _mma_folded_step(
                    wb, c0, c_hi, a_step, mask_m, a_tail, mask_t, rk, rn, N, w_scale_ptr, stride_sn, stride_sg, acc0,
                    asum, facc, acc_t, asum_t, facc_t, K, BLOCK_N, BLOCK_M, TAIL_M, GROUPED, ASUM_BY_DOT, CHUNKS)
                if WORD_SUMS:
                    asum2 = dp4a(aw, sign[None, :], asum2, USE_ASM)
                    if TAIL_M > 0:
                        asum2_t = dp4a(aw_t, sign[None, :], asum2_t, USE_ASM)
    else:
        rb = tl.arange(0, 32)  # byte j of a chunk: inputs 32i + j of lane i
        w_rows = w_ptr + rn[:, None] * stride_wn + rb[None, :]
        a_cols = a_ptr + rm[None, :] * stride_am + rb[:, None]
        # (rn * 0 + c): a scalar condition as a row vector, which the interpreter accepts in a mask too
        # the weights are constants: their first chunk is in flight before the wait
        wb = tl.load(w_rows + c_lo * 32, mask=mask_n & (rn * 0 + c_lo < c_hi)[:, None], other=0)
        gdc_prologue(USE_GDC)
        # The first chunk is peeled off the loop: every chunk's tile is then a fresh load, not a
        # loop-carried value, so the compiler converts the *packed* tile to the operand layout
        # once and decodes there (a loop-carried tile would be converted once per lane).
        if WORD_SUMS:  # one chunk's words here (the first 32 columns of the step tile)
            aw = _step_words(a_words, c_lo, tl.minimum(c_lo + 1, c_hi), rw, rows_ok, K)
        acc0, acc1, acc2, acc3, asum, facc = _mma_chunk(
            wb, c_lo, c_hi, a_cols, mask_m, rb, rn, N, w_scale_ptr, stride_sn, stride_sg, acc0, acc1, acc2, acc3,
            asum, facc, K, BLOCK_N, BLOCK_M, GROUPED, ASUM_BY_DOT)
        if WORD_SUMS:
            asum2 = dp4a(aw, sign[None, :], asum2, USE_ASM)
        for c0 in range(c_lo + 1, c_hi, CHUNKS):
            if WORD_SUMS:  # the step's CHUNKS chunks from c0 (the peeled chunk shifted the steps by one)
                aw = _step_words(a_words, c0, c_hi, rw, rows_ok, K)
            for cc in tl.static_range(CHUNKS):
                c = c0 + cc
                wb = tl.load(w_rows + c * 32, mask=mask_n & (rn * 0 + c < c_hi)[:, None], other=0)
                acc0, acc1, acc2, acc3, asum, facc = _mma_chunk(
                    wb, c, c_hi, a_cols, mask_m, rb, rn, N, w_scale_ptr, stride_sn, stride_sg, acc0, acc1, acc2,
                    acc3, asum, facc, K, BLOCK_N, BLOCK_M, GROUPED, ASUM_BY_DOT)
            if WORD_SUMS:
                asum2 = dp4a(aw, sign[None, :], asum2, USE_ASM)

    if GROUPED:
        y = facc
    elif ASUM_BY_DOT:
        y = acc0 + (acc1 >> 2) + (acc2 >> 4) + (acc3 >> 6) + tl.max(asum, axis=0)[None, :]  # int32
    else:
        y = acc0 + (acc1 >> 2) + (acc2 >> 4) + (acc3 >> 6) + tl.sum(asum2, axis=1)[None, :]  # int32
    a_s = _act_scales(a_scale_ptr, rm, M, SPLIT)
    _store_tile(y, rn, rm, M, N, a_s, ws, out_ptr, stride_om, res_ptr, stride_rm, part_ptr, count_ptr,
                a_scale_ptr, w_scale_ptr, stride_sn, GROUPED, SPLIT, RESIDUAL, SUM_SLICES)
    if TAIL_M > 0:  # the tail tile's own epilogue; split-K: its arrival counts follow the main tiles'
        if GROUPED:
            y_t = facc_t
        elif ASUM_BY_DOT:
            y_t = acc_t + tl.max(asum_t, axis=0)[None, :]
        else:
            y_t = acc_t + tl.sum(asum2_t, axis=1)[None, :]
        _store_tile(y_t, rn, rt, M, N, _act_scales(a_scale_ptr, rt, M, SPLIT), ws, out_ptr, stride_om, res_ptr,
                    stride_rm, part_ptr, count_ptr + tl.num_programs(0) * tl.num_programs(1), a_scale_ptr,
                    w_scale_ptr, stride_sn, GROUPED, SPLIT, RESIDUAL, SUM_SLICES)


def mma_rows(config: LinearConfig, m: int, k: int) -> tuple[int, int]:
    """(BLOCK_M, TAIL_M) of an ``mma`` launch at width ``m``: the main tile is the width's power
    of two up to ``config.block_m`` (0: up to 128), 16 at least; a tail (``config.tail_m``) only
    on the folded loop and where the width outgrows the main tile. A program takes both."""
    block_m = max(16, min(next_pow2(m), config.block_m or MMA_MAX_BLOCK_M))
    fold = config.fold_lanes and k <= FOLD_MAX_K
    return block_m, (config.tail_m if fold and m > block_m else 0)


def w2a8_linear(
    a_int8: torch.Tensor,  # [M, K] int8
    a_scale: torch.Tensor,  # [M] float32 (absmax / 127, i.e. 1/q)
    packed: torch.Tensor,  # [N, ceil(K/128)*32] uint8, layout ternary-2bit-k128x4-v1
    w_scale: torch.Tensor,  # [N] float32 per row, [1] or 0-d per tensor, or [N, ceil(K/128)] per 128-group
    *,
    out_dtype: torch.dtype = torch.float16,
    residual: torch.Tensor | None = None,  # [M, N] float32, added in the epilogue
    config: LinearConfig | None = None,
    next_weights: torch.Tensor | None = None,  # the packed weights of the launch after this one
) -> torch.Tensor:  # [M, N] out_dtype
    """``(a_int8 @ W^T) * a_scale[:, None] * w_scale`` (``+ residual``), exact int32 accumulation.

    ``residual`` (float32 output only) fuses the transformer's ``x + f(x)``: the product is
    rounded to float32 first and then added, so the result equals the unfused sum bit for bit.
    ``config`` overrides the tuned table (the tuner uses it); leave it None. K need not be a
    multiple of 128 (the packed rows end in zero-weight padding); where the activations cannot
    be read as 4-byte words (K % 4 != 0, or unaligned rows) the word-reading kernels give way
    to the tensor-core kernel. ``next_weights``: from ``NEXT_WEIGHTS_MIN_M`` rows the programs
    also ask the L2 for these bytes (``common.next_weights_l2``), a hint that never changes a result.
    """
    if a_int8.dtype != torch.int8 or a_int8.dim() != 2 or a_int8.stride(1) != 1:
        raise TypeError(f"w2a8_linear: a_int8 must be a 2-D int8 [M, K] tensor with contiguous rows, "
                        f"got {a_int8.dtype} {tuple(a_int8.shape)}")
    m, k = a_int8.shape
    n, grouped = check_packed_weight(packed, w_scale, k, "w2a8_linear")
    if w_scale.dim() == 0:
        w_scale = w_scale.reshape(1)
    check_dtype(a_scale, (torch.float32,), "w2a8_linear: a_scale")
    if a_scale.shape != (m,):
        raise ValueError(f"w2a8_linear: a_scale must be [M]={m}, got {tuple(a_scale.shape)}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"w2a8_linear: out_dtype {out_dtype} not supported, expected one of {OUT_DTYPES}")
    check_residual(residual, m, n, out_dtype, "w2a8_linear")
    if config is None:
        config = (lookup("w2a8_linear", linear_key(n, k, m, grouped), packed.device)
                  or default_linear(m, grouped, n=n, k=k, sms=sm_count(packed.device)))
    words = (k % 4 == 0 and a_int8.stride(0) % 4 == 0 and a_int8.data_ptr() % 4 == 0
             and packed.stride(0) % 4 == 0 and packed.data_ptr() % 4 == 0)
    if config.kernel in WORD_KERNELS and not words:  # the byte-reading kernels take any K
        config = LinearConfig(MMA if config.kernel == LANES else DOT, block_n=64, block_kb=64, num_warps=4,
                              num_stages=1 if config.kernel == LANES else 3, split_k=config.split_k,
                              prefetch=config.prefetch)

    out = torch.empty((m, n), dtype=out_dtype, device=a_int8.device)
    if m == 0 or n == 0:
        return out
    stride_sn, stride_sg = scale_strides(w_scale, grouped)
    chunks = 1 if (grouped and config.kernel == MMA) else config.block_kb // BYTES_PER_CHUNK
    if grouped:  # the slices from K alone: one order of the float sum over the groups at every width
        per_split, n_split = split_k_chunks(triton.cdiv(k, CHUNK_K), group_k_slices(k), 1)
    else:
        per_split, n_split = split_k_chunks(triton.cdiv(k, CHUNK_K), config.split_k, chunks)
    split = n_split > 1
    # split-K slices write int32 (per-row: still exact) or float32 (group scales applied) partials
    parts = torch.empty((n_split, m, n), dtype=torch.float32 if grouped else torch.int32,
                        device=out.device) if split else out
    res = residual if residual is not None else out
    if config.kernel in WORD_KERNELS:
        kernel = {GEMV: _w2a8_gemv_kernel, ROWS: _w2a8_rows_kernel, LANES: _w2a8_lanes_kernel}[config.kernel]
        a_in, w_in = a_int8.view(torch.int32), packed.view(torch.int32)  # [M, K/4], [N, Kp/16]
        if config.kernel == GEMV:
            rows, grid = {}, (m, triton.cdiv(n, config.block_n), n_split)
        else:
            cap = ROWS_MAX_BLOCK_M if config.kernel == ROWS else LANES_MAX_BLOCK_M
            rows = {"BLOCK_M": min(next_pow2(m), cap)}
            grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, rows["BLOCK_M"]), n_split)
    elif config.kernel == DOT:
        kernel, a_in, w_in = _w2a8_dot_kernel, a_int8, packed
        rows = {"BLOCK_M": max(16, min(next_pow2(m), 64))}  # tl.dot needs 16 rows at least
        grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, rows["BLOCK_M"]), n_split)
    else:  # mma: the row tiles of one weight tile first in the grid (neighbours share it through the L2)
        kernel, a_in, w_in = _w2a8_mma_kernel, a_int8, packed
        rows = dict(zip(("BLOCK_M", "TAIL_M"), mma_rows(config, m, k)))
        grid = (triton.cdiv(m, rows["BLOCK_M"] + rows["TAIL_M"]), triton.cdiv(n, config.block_n), n_split)
    check_launchable(kernel, a_int8, a_scale, packed, w_scale)
    # the last program of each output tile adds the slices (common.last_slice) where the tile is small,
    # and where the counts can be had; else a reduction launch. A tail tile has counts of its own.
    tile = config.block_n * (rows.get("BLOCK_M", 1) + rows.get("TAIL_M", 0))
    tiles = grid[0] * grid[1] * (2 if rows.get("TAIL_M") else 1)
    counts = split_counters(out.device, tiles) if split and tile <= SLICE_SUM_MAX_TILE else None
    in_kernel = n_split if counts is not None else 0
    # No FMA contraction: the epilogue's ``residual + (acc·a_s)·w_s`` must round the product
    # first, as the twin (and the unfused sum) does; the main loops are integer anyway.
    common = dict(K=k, GROUPED=grouped, SPLIT=split, RESIDUAL=residual is not None and (not split or in_kernel > 0),
                  SUM_SLICES=in_kernel, BLOCK_N=config.block_n, CHUNKS=chunks, num_warps=config.num_warps,
                  num_stages=config.num_stages, enable_fp_fusion=False)
    pdl = pdl_options(kernel)
    # the prefetch overlaps the previous kernel: only worth its instructions under programmatic launch
    asm = {"USE_ASM": not is_interpreted(kernel), "PREFETCH": config.prefetch and pdl["USE_GDC"]}
    if kernel is _w2a8_mma_kernel:
        asm["ASUM_BY_DOT"] = grouped or not words or config.asum_by_dot
        asm["FOLD"] = config.fold_lanes and k <= FOLD_MAX_K  # longer rows keep four accumulators
        asm["CHAINS"] = config.chains if asm["FOLD"] else 1  # (a config with two chains has no tail)
    ahead = next_weights_l2(kernel, next_weights if m >= NEXT_WEIGHTS_MIN_M else None, config.num_warps,
                            unused=packed)
    compiled = kernel[grid](
        a_in, a_scale, w_in, w_scale, out, parts, out if counts is None else counts, res, ahead.pop("next_ptr"),
        ahead.pop("next_bytes"), m, n, per_split, a_in.stride(0), w_in.stride(0), stride_sn, stride_sg, out.stride(0),
        res.stride(0), **asm, **rows, **common, **pdl, **ahead,
    )
    apply_carveout(compiled)
    if split and not in_kernel:
        split_k_reduce(parts, out, a_scale, None if grouped else w_scale, stride_sn, residual)
    return out


def w2a8_linear_reference(
    a_int8: torch.Tensor,  # [M, K] int8
    a_scale: torch.Tensor,  # [M] float32
    packed: torch.Tensor,  # [N, ceil(K/128)*32] uint8
    w_scale: torch.Tensor,  # [N] / [1] / [] / [N, ceil(K/128)] float32
    *,
    out_dtype: torch.dtype = torch.float16,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N]
    """The pure-PyTorch twin: exact integer products (float64), float32 epilogue."""
    check_residual(residual, a_int8.shape[0], packed.shape[0], out_dtype, "w2a8_linear_reference")
    m, k = a_int8.shape
    codes = unpack_ternary(packed, k)  # [N, K] int8 (the zero-weight padding checked and dropped)
    n = codes.shape[0]
    if w_scale.dim() == 2:
        g = packed.shape[1] // BYTES_PER_CHUNK
        kp = g * CHUNK_K
        a_int8 = torch.nn.functional.pad(a_int8, (0, kp - k))  # whole groups: the padding adds zeros
        codes = torch.nn.functional.pad(codes, (0, kp - k))
        acc = torch.einsum("mgk,ngk->mng", a_int8.double().view(m, g, CHUNK_K),
                           codes.double().view(n, g, CHUNK_K))  # [M, N, G], exact integers
        part = acc.float() * w_scale[None]  # each group's product rounded once to float32
        # the kernels' order: one group at a time in K order within each K slice, then the
        # slices in order (tuning.group_k_slices: from K alone, whatever the launch)
        per, slices = split_k_chunks(g, group_k_slices(k), 1)
        y = None
        for s in range(slices):
            total = torch.zeros(m, n, dtype=torch.float32, device=part.device)
            for j in range(s * per, min((s + 1) * per, g)):
                total = total + part[:, :, j]
            y = total if y is None else y + total
        y = y * a_scale[:, None]
    else:
        acc = int_matmul(a_int8, codes).float()  # [M, N]
        y = acc * a_scale[:, None] * w_scale.expand(n)[None, :]
    return y.to(out_dtype) if residual is None else residual + y
