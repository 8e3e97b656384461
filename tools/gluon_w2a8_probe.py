"""Probe: what a W2A8 tensor-core kernel costs when its layouts are explicit (Gluon, mma.sync).

The shipped ``mma`` kernel (``kernels_ampere/w2a8.py``) is plain Triton: the compiler picks
every tensor's layout, and Nsight Compute shows its wide launches waiting on the CTA barriers
of the layout conversions it inserts (``tools/results/kernels.md``, "Where a W2A8 launch's time
goes"). This probe asks how much of a launch those conversions cost, with a kernel in which no
tensor changes layout: Gluon (``triton.experimental.gluon``) lets a kernel *load* straight into
the operand layouts of Ampere's ``mma.sync`` (``IMMA.16832``, what an Orin runs), so

* the packed weight bytes ``[BLOCK_N, 32 * CHUNKS]`` of a step are loaded in the A-operand
  layout and each lane is decoded there, one AND (XOR for lane 3) per four weights, exactly as
  the shipped kernel's ``_mma_lane``; the next step's bytes are in flight (registers) meanwhile;
* the activations of lane i (inputs ``32i .. 32i + 31`` of each chunk) are loaded in the
  B-operand layout, straight from the row-major ``[M, K]`` activations, and asked of the L1 one
  step ahead;
* ``k_width`` (``KW``): K elements a thread holds contiguously in both operand layouts. The
  order of K inside a dot is free (A and B agree), so at ``KW = 16`` each thread's operand bytes
  are 16 contiguous bytes in memory, one 128-bit load, where ``KW = 4`` takes four 32-bit loads;
  every warp loads its own B (no shared memory to share it through), so this decides the
  load/store unit's work;
* the four lanes share one int32 accumulator by Horner over their scales (``<< 2`` between
  lanes, ``>> 6`` per step), and the offset correction ``sum_k a`` is a second ``mma`` per lane
  against a constant tile (``-4^i``; ``+64`` for lane 3), into the same accumulator: the tensor
  cores are idle in these launches, the integer pipes are not;
* ``CHAINS = 2``: alternate steps go to two accumulators (two independent chains of dependent
  MMAs per program, summed at the end), so a warp has an MMA to issue while the other chain
  waits (session 12: compiled, 101 registers at M = 16 and 176 at 32 on sm_87; not yet run);
* K is sliced over programs whose int32 sums meet by ``atomic_add`` in a zeroed ``[M, N]``
  int32 buffer (integer addition: the same bits in any order); no scales. Optionally launched
  with programmatic dependent launch (sm_90; the first step's weights load before the wait).

So it computes ``sum_k a[m, k] * W[n, k]`` exactly (checked against ``torch`` on every shape
before timing) and nothing more: it is a probe of the main loop, not a drop-in linear (no
scales, residual or group-128 scales; K a multiple of 128; M <= BLOCK_M). The shipped launch it
is compared with does the whole linear (scales, split-K sums), which is stated beside every
number. Timing: the BitNet-2B stack (30 layers x 4 projections, distinct weights, 521 MB: cold
L2) in one CUDA graph, replayed; the probe's graph starts with one memset of all 120 outputs.

Answer so far (H200, session 12; ``tools/results/kernels.md``, "Explicit layouts"): at
``KW = 16`` it costs what the shipped launches cost (0.98-1.10x at M = 1-32), so the barriers
are not where the wide launches' time goes; at ``KW = 4`` it was 1.5-2x slower.

    python tools/gluon_w2a8_probe.py --widths 1,16,32 --out tools/results/gluon_probe
    python tools/gluon_w2a8_probe.py --sass 87 --widths 16      # no GPU: the compiled loop, per variant
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402

from kernels_ampere.autotune import MODEL_LAYERS, MODEL_SHAPES  # noqa: E402
from kernels_ampere.packing import pack_ternary  # noqa: E402
from kernels_ampere.w2a8 import w2a8_linear  # noqa: E402


def mma_layout(warps: int):
    """``mma.sync`` v2 accumulator layout, warps stacked along N (the weight rows)."""
    fields = {f.name for f in dataclasses.fields(gl.NVMMADistributedLayout)}
    extra = {}
    if "ctas_per_cga" in fields:  # older Gluon spells the CTA tiling out
        extra = dict(ctas_per_cga=[1, 1], cta_split_num=[1, 1], cta_order=[1, 0])
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8], **extra)


@gluon.jit
def _prefetch_l1(ptrs, mask):
    """``prefetch.global.L1`` of the line of every address where ``mask`` (no register written)."""
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L1 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_prologue(anchor):
    """Programmatic dependent launch (sm_90): wait for the previous kernel, then let the next one
    start (``griddepcontrol``; Gluon has no wrapper, so inline PTX, kept as a side effect)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; griddepcontrol.launch_dependents; mov.b32 $0, $1;", "=r,r",
                              [anchor], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _probe_step(wb, a_step, a_ok, acc, corr0, corr1, corr2, corr3):
    """One K step into ``acc``: the four lanes of the packed tile ``wb`` (A layout) against their
    activations at ``a_step`` (B layout), Horner-folded, each lane's offset correction a second MMA."""
    a0 = gl.load(a_step, mask=a_ok, other=0)
    a1 = gl.load(a_step + 32, mask=a_ok, other=0)
    a2 = gl.load(a_step + 64, mask=a_ok, other=0)
    a3 = gl.load(a_step + 96, mask=a_ok, other=0)
    acc = mma_v2((wb & 0x03).to(gl.int8, bitcast=True), a0, acc)
    acc = mma_v2(corr0, a0, acc)
    acc = acc << 2
    acc = mma_v2((wb & 0x0C).to(gl.int8, bitcast=True), a1, acc)
    acc = mma_v2(corr1, a1, acc)
    acc = acc << 2
    acc = mma_v2((wb & 0x30).to(gl.int8, bitcast=True), a2, acc)
    acc = mma_v2(corr2, a2, acc)
    acc = acc << 2
    acc = mma_v2(((wb & 0xC0) ^ 0x80).to(gl.int8, bitcast=True), a3, acc)
    acc = mma_v2(corr3, a3, acc)
    return acc >> 6


@gluon.jit
def _probe_kernel(a_ptr, w_ptr, out_ptr, M, N, stride_am, stride_wn, stride_om, chunks_per_split,
                  K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, CHUNKS: gl.constexpr, KW: gl.constexpr,
                  MMA: gl.constexpr, USE_GDC: gl.constexpr, CHAINS: gl.constexpr = 1):
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=KW)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=KW)
    N_CHUNKS: gl.constexpr = K // 128
    c_lo = gl.program_id(1) * chunks_per_split
    c_hi = gl.minimum(c_lo + chunks_per_split, N_CHUNKS)
    rn = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, A_OP))
    KS: gl.constexpr = 32 * CHUNKS  # the bytes of a step: CHUNKS chunks, 32 per row each
    rj = gl.arange(0, KS, layout=gl.SliceLayout(0, A_OP))
    w_rows = w_ptr + rn[:, None] * stride_wn + rj[None, :]  # [BLOCK_N, KS] packed bytes of a step, A layout
    rk = gl.arange(0, KS, layout=gl.SliceLayout(1, B_OP))
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, B_OP))
    # column q of a step, lane i: input 128 (step chunk q // 32) + 32 i + q % 32
    a_cols = a_ptr + rm[None, :] * stride_am + ((rk // 32) * 128 + rk % 32)[:, None]  # [KS, BLOCK_M], B layout
    corr0 = gl.full([BLOCK_N, KS], -1, gl.int8, layout=A_OP)
    corr1 = gl.full([BLOCK_N, KS], -4, gl.int8, layout=A_OP)
    corr2 = gl.full([BLOCK_N, KS], -16, gl.int8, layout=A_OP)
    corr3 = gl.full([BLOCK_N, KS], 64, gl.int8, layout=A_OP)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, layout=MMA)
    acc2 = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, layout=MMA)  # CHAINS = 2: the odd steps' chain
    STEP: gl.constexpr = CHUNKS * CHAINS  # chunks per loop iteration
    w_next = w_rows + c_lo * 32
    a_step = a_cols + c_lo * 128
    # constants: the first iteration's weights in flight before the wait
    wb = gl.load(w_next, mask=(rn < N)[:, None] & (c_lo + rj // 32 < c_hi)[None, :], other=0)
    wb2 = wb
    if CHAINS == 2:
        wb2 = gl.load(w_next + KS, mask=(rn < N)[:, None] & (c_lo + CHUNKS + rj // 32 < c_hi)[None, :], other=0)
    if USE_GDC:
        _gdc_prologue(gl.program_id(0) + gl.arange(0, 1, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0])))
    # each step's activation lines asked of the L1 one iteration ahead (no registers: int8 tiles
    # carried through the loop would be repacked byte by byte), so the loads hit the L1, not the L2
    lines = gl.arange(0, 2 * BLOCK_M * STEP, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    line_ptrs = a_ptr + (lines // (2 * STEP)) * stride_am + (lines % (2 * STEP)) * 64
    line_ok = lines // (2 * STEP) < M
    _prefetch_l1(line_ptrs + c_lo * 128, line_ok)
    for c in range(c_lo, c_hi, STEP):
        # the next iteration's weights in flight while this one is multiplied (registers, no shared
        # memory); pointers advance by a constant (each load's address: one add)
        w_next += KS * CHAINS
        wn = gl.load(w_next, mask=(rn < N)[:, None] & (c + STEP + rj // 32 < c_hi)[None, :], other=0)
        if CHAINS == 2:
            wn2 = gl.load(w_next + KS, mask=(rn < N)[:, None] & (c + STEP + CHUNKS + rj // 32 < c_hi)[None, :],
                          other=0)
        _prefetch_l1(line_ptrs + (c + STEP) * 128, line_ok & (c + STEP < c_hi))
        acc = _probe_step(wb, a_step, (c + rk // 32 < c_hi)[:, None] & (rm < M)[None, :], acc,
                          corr0, corr1, corr2, corr3)
        if CHAINS == 2:  # an independent chain of MMAs beside the first: the warp issues one while the other waits
            acc2 = _probe_step(wb2, a_step + 128 * CHUNKS, (c + CHUNKS + rk // 32 < c_hi)[:, None] & (rm < M)[None, :],
                               acc2, corr0, corr1, corr2, corr3)
            wb2 = wn2
        a_step += 128 * STEP
        wb = wn
    acc = acc + acc2
    on = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    out_ok = (on < N)[:, None] & (om < M)[None, :]
    gl.atomic_add(out_ptr + om[None, :] * stride_om + on[:, None], acc, mask=out_ok, sem="relaxed")


def probe_launch(a, packed, out, block_n: int, block_m: int, split: int, chunks_per_step: int = 1,
                 k_width: int = 16, pdl: bool = False, chains: int = 1):
    """One launch: ``out`` (int32 [M, N], zeroed) += the exact int32 product."""
    m, k = a.shape
    n = packed.shape[0]
    chunks = k // 128
    per = triton.cdiv(triton.cdiv(chunks, split), chunks_per_step) * chunks_per_step  # whole steps per slice
    warps = block_n // 16
    grid = (triton.cdiv(n, block_n), triton.cdiv(chunks, per))
    _probe_kernel[grid](a, packed, out, m, n, a.stride(0), packed.stride(0), out.stride(0), per, K=k, BLOCK_N=block_n,
                        BLOCK_M=block_m, CHUNKS=chunks_per_step, KW=k_width, MMA=mma_layout(warps),
                        USE_GDC=pdl, CHAINS=chains, num_warps=warps, **({"launch_pdl": True} if pdl else {}))


def static_profile(arch: int, k: int, block_n: int, block_m: int, chunks: int, k_width: int, pdl: bool,
                   chains: int = 1) -> dict:
    """Compile one probe launch for ``arch`` with no GPU (as ``tools/kernel_sass.py`` does the
    shipped kernels) and count its SASS: registers, shared memory, CTA barriers and
    shared-memory traffic in the whole kernel, and the main loop's loads by width."""
    import collections
    import re
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import GluonASTSource

    from tools import kernel_sass

    fn = _probe_kernel
    sig = {"a_ptr": "*i8", "w_ptr": "*u8", "out_ptr": "*i32", "M": "i32", "N": "i32", "stride_am": "i32",
           "stride_wn": "i32", "stride_om": "i32", "chunks_per_split": "i32"}
    const = dict(K=k, BLOCK_N=block_n, BLOCK_M=block_m, CHUNKS=chunks, KW=k_width, MMA=mma_layout(block_n // 16),
                 USE_GDC=pdl, CHAINS=chains)
    sig.update({name: "constexpr" for name in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}  # torch allocations: 16-byte aligned
    for name in ("N", "stride_am", "stride_wn", "stride_om"):
        attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    kern = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": block_n // 16})
    with tempfile.TemporaryDirectory() as tmp:
        sass, res = kernel_sass.disassemble(kern.asm["cubin"], Path(tmp) / "probe.cubin")
    loop = kernel_sass.main_loop(sass)
    ops = collections.Counter(mt.group(3) for mt in map(kernel_sass.LINE.search, sass.splitlines()) if mt)
    loads = collections.Counter(re.search(r"LDG(\.[A-Z0-9_]+)*", line).group(0) for line in sass.splitlines()
                                if re.search(r"\bLDG\b|LDG\.", line))
    return {"arch": arch, "K": k, "block_n": block_n, "block_m": block_m, "chunks": chunks, "k_width": k_width,
            "pdl": pdl, "chains": chains, "regs": res.get("reg"), "shared_bytes": res.get("shared", 0),
            "barriers": ops["BAR"], "shared_ops": ops["STS"] + ops["LDS"] + ops["LDSM"],
            "loop_instructions": sum(loop.values()), "loop_loads": loop["LDG"], "loads_by_width": dict(loads),
            "loop_imma": loop["IMMA"]}


def graph_us(fn, replays: int = 20) -> float:
    """Best of ``replays`` timed replays of one CUDA graph of ``fn`` (µs)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        g.replay()
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) * 1000)
    return best


def variant_name(block_n: int, chunks: int, k_width: int, pdl: bool, chains: int) -> str:
    """A variant's column in the report (the names of session 12's reports)."""
    return f"probe {block_n}x{chunks} kw{k_width}{' pdl' if pdl else ''}{' 2 chains' if chains == 2 else ''}"


def probe_block_m(m: int) -> int:
    """The probe's width tile: the width rounded up to a power of two, at least the MMA's 16."""
    return max(16, 1 << (m - 1).bit_length())


def split_for(n: int, k: int, block_n: int, sms: int) -> int:
    """K slices so that the launch has about two programs per SM (and slices of >= 2 chunks)."""
    tiles = triton.cdiv(n, block_n)
    return max(1, min(k // 128 // 2, round(2 * sms / tiles)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="1,9,16,32")
    ap.add_argument("--variants", default="128:2:16,128:2:16:1,128:2:16:0:2,128:2:16:1:2",
                    help="probe launches, comma list of block_n:chunks:k_width[:pdl[:chains]] (weight rows per "
                         "program, 16 per warp; 128-chunks per step; consecutive K elements per thread in the "
                         "operand layouts; 1: programmatic dependent launch; 2: two independent MMA chains, "
                         "alternate steps)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--sass", type=int, default=None, metavar="ARCH",
                    help="no GPU: compile each variant for sm_ARCH (87: Orin) and print its SASS counts (JSON)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = []  # (block_n, chunks, k_width, programmatic launch, chains)
    for v in args.variants.split(","):
        try:
            f = [int(x) for x in v.split(":")]
        except ValueError:
            f = []
        f += [0, 1][len(f) - 3:] if 3 <= len(f) <= 5 else []
        if len(f) != 5 or f[0] % 16 or f[1] < 1 or f[2] not in (4, 8, 16) or f[3] not in (0, 1) or f[4] not in (1, 2):
            raise SystemExit(f"gluon_w2a8_probe: --variants item {v!r}: expected block_n:chunks:k_width[:pdl[:chains]] "
                             f"with block_n a multiple of 16, k_width 4, 8 or 16, pdl 0 or 1, chains 1 or 2")
        variants.append((f[0], f[1], f[2], bool(f[3]), f[4]))
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        raise SystemExit(f"gluon_w2a8_probe: --widths {args.widths!r}: expected a comma list of integers") from None
    if any(w < 1 for w in widths):
        raise SystemExit(f"gluon_w2a8_probe: --widths {args.widths!r}: every width must be at least 1")
    if args.sass is not None:
        if args.sass < 90 and any(v[3] for v in variants):
            raise SystemExit(f"gluon_w2a8_probe: programmatic launch (a :1 variant) needs sm_90 or newer, not sm_{args.sass}")
        for m in widths:
            for block_n, cps, kw, pdl, chains in variants:
                print(json.dumps({"M": m, **static_profile(args.sass, 2560, block_n, probe_block_m(m), cps, kw,
                                                           pdl, chains)}), flush=True)
        return 0
    if args.out is None:
        raise SystemExit("gluon_w2a8_probe: --out is required (where the report goes)")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = [(n, k) for _, n, k, _ in MODEL_SHAPES["bitnet-2b"]]
    layers = MODEL_LAYERS["bitnet-2b"]
    weights = []  # [layer][shape] -> packed codes; layer 0's codes kept for the exactness checks
    for layer in range(layers):
        row = []
        for n, k in shapes:
            codes = torch.randint(-1, 2, (n, k), generator=gen, device=dev, dtype=torch.int8)
            row.append((codes if layer == 0 else None, pack_ternary(codes)))
        weights.append(row)
    if any(v[3] for v in variants) and torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("gluon_w2a8_probe: programmatic launch (a :1 variant) needs an sm_90 or newer GPU")
    rows = []
    for m in widths:
        acts = [torch.randint(-127, 128, (m, k), generator=gen, device=dev, dtype=torch.int8) for _, k in shapes]
        a_scale = torch.full((m,), 1.0, device=dev)
        w_scale = [torch.ones(n, device=dev) for n, _ in shapes]
        block_m = probe_block_m(m)
        # exactness first: every shape, layer 0, against torch's integer product
        refs = []
        for s, (n, k) in enumerate(shapes):
            refs.append((acts[s].double() @ weights[0][s][0].double().T).to(torch.int32))
        for s, (n, k) in enumerate(shapes):
            shipped = w2a8_linear(acts[s], a_scale, weights[0][s][1], w_scale[s], out_dtype=torch.float32)
            if not torch.equal(shipped, refs[s].float()):
                raise SystemExit(f"shipped M={m} {n}x{k}: differs from the integer product")
        inexact = {}  # a variant that misses a bit is reported, not timed
        for block_n, cps, kw, pdl, chains in variants:
            for s, (n, k) in enumerate(shapes):
                out = torch.zeros((m, n), dtype=torch.int32, device=dev)
                probe_launch(acts[s], weights[0][s][1], out, block_n, block_m, split_for(n, k, block_n, sms), cps,
                             kw, pdl, chains)
                bad = (out != refs[s]).sum().item()
                if bad:
                    inexact[variant_name(block_n, cps, kw, pdl, chains)] = f"{n}x{k}: {bad} of {out.numel()} differ"
                    print(f"probe M={m} {variant_name(block_n, cps, kw, pdl, chains)}: inexact ({n}x{k}: {bad} of "
                          f"{out.numel()} differ), not timed", flush=True)
                    break
        outs = torch.zeros((layers * len(shapes), m, max(n for n, _ in shapes)), dtype=torch.int32, device=dev)

        def shipped_stack():
            for layer in weights:
                for s, (_, packed) in enumerate(layer):
                    w2a8_linear(acts[s], a_scale, packed, w_scale[s], out_dtype=torch.float32)

        row = {"M": m, "shipped_us": graph_us(shipped_stack, args.replays)}
        for block_n, cps, kw, pdl, chains in variants:
            name = variant_name(block_n, cps, kw, pdl, chains)
            if name in inexact:
                row[f"{name}_us"] = None
                row.setdefault("inexact", {})[name] = inexact[name]
                continue

            def probe_stack(block_n=block_n, cps=cps, kw=kw, pdl=pdl, chains=chains):
                outs.zero_()
                i = 0
                for layer in weights:
                    for s, (_, packed) in enumerate(layer):
                        n, k = shapes[s]
                        probe_launch(acts[s], packed, outs[i, :, :n], block_n, block_m, split_for(n, k, block_n, sms),
                                     cps, kw, pdl, chains)
                        i += 1
            row[f"{name}_us"] = graph_us(probe_stack, args.replays)
            for s, ref in enumerate(refs):  # the graph's last replay, layer 0: still exact
                if not torch.equal(outs[s, :, :shapes[s][0]], ref):
                    raise SystemExit(f"{name} M={m}: the replayed stack's layer 0, shape {s}, differs")
        rows.append(row)
        print(json.dumps(row), flush=True)
    commit = os.environ.get("BITMTP_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                               capture_output=True, text=True).stdout.strip()
    report = {"device": torch.cuda.get_device_name(dev), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "commit": commit, "triton": triton.__version__,
        "command": "python tools/gluon_w2a8_probe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gluon_probe.json").write_text(json.dumps(report, indent=1) + "\n")
    keys = [k for k in rows[0] if k.endswith("_us")]
    lines = [f"# Explicit-layout W2A8 probe (Gluon, mma.sync) vs the shipped launches", "",
             f"- device: {report['device']}, triton {report['triton']}", f"- date: {report['date']}",
             f"- commit: {commit}", f"- command: `{report['command']}`",
             "- BitNet-2B stack, 120 ternary linears in one CUDA graph, cold L2, best of the replays (µs); "
             "shipped = `w2a8_linear` (tuned table, scales, split-K sums); probe = the exact int32 product "
             "only (no scales), plus one memset of its outputs", "",
             "| M | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    lines += [f"| {r['M']} | " + " | ".join("inexact" if r[k] is None else f"{r[k]:.1f}" for k in keys) + " |"
              for r in rows]
    (out / "gluon_probe.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
