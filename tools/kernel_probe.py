"""Where the W2A8 time goes: per-launch floor versus instruction throughput (``bench_kernels``).

A BitNet-2B linear at M = 1 moves 1.6-8.8 MB, 0.5-2.5 µs of an H200's DRAM time, yet costs
~5 µs in the stack: the stack rate mixes per-kernel fixed cost (graph node, launch, DRAM
latency ramp, the last wave's tail) with the integer work per weight. Two sections separate
them, in the same run as the stack:

* ``floor``: a chain of empty kernels (one program, or as many as the GPU holds at once) and
  of the smallest real W2A8 launch, replayed from one CUDA graph, with and without
  programmatic dependent launch: µs per launch that no kernel body can avoid;
* ``large``: single very large matrices (N = 8 x 13824, K = 2560; N = 8 x 2560, K = 6912;
  70 and 35 MB packed, rotating over copies so the L2 never holds them) at every width, for
  each kernel family's candidates: many waves, so fixed cost is amortised and weights per
  SM-clock is the kernels' sustained throughput. ``fixed_cost`` then reads the stack: per
  linear, ``(stack µs - sum of bytes / large-shape rate) / linears``.

The Orin projection (``kernel_stack.project``) uses the large-shape rate plus a stated
per-launch cost, not the stack rate, whose fixed cost belongs to the H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_ampere import tuning
from kernels_ampere.autotune import GraphTimer, LinearBench
from kernels_ampere.common import gdc_prologue, pdl_options, programmatic_launch
from kernels_ampere.tuning import DOT, GEMV, LANES, MMA, LinearConfig

LARGE_SHAPES = (("8 x w13 (K 2560)", 8 * 13824, 2560), ("8 x w2 (K 6912)", 8 * 2560, 6912))
FLOOR_CHAIN = 256  # launches per captured graph


@triton.jit
def _empty_kernel(x_ptr, USE_GDC: tl.constexpr = False):
    gdc_prologue(USE_GDC)
    if tl.program_id(0) == 1 << 30:  # never true: a body the compiler cannot drop the pointer of
        tl.store(x_ptr, 0)


def _empty_launch(x: torch.Tensor, programs: int, pdl: bool):
    opts = pdl_options(_empty_kernel) if pdl else {"USE_GDC": False}
    return lambda: _empty_kernel[(programs,)](x, num_warps=4, **opts)


def floor_rows(timer: GraphTimer, sms: int) -> list[dict]:
    """µs per launch of empty kernels and of the smallest W2A8 launch, PDL off and on."""
    rows = []
    x = torch.zeros(1, device="cuda")
    pdl_was = programmatic_launch()
    try:
        for pdl in (False, True):
            programmatic_launch(pdl)
            for what, programs in (("empty kernel, 1 program", 1), (f"empty kernel, {8 * sms} programs", 8 * sms)):
                us = timer([_empty_launch(x, programs, pdl and pdl_was)], reps=FLOOR_CHAIN)
                rows.append({"section": "floor", "what": what, "pdl": pdl and pdl_was, "us": round(us, 3)})
            small = LinearBench("w2a8_linear", 64, 128, False, rotate_mb=0.0, min_copies=1)
            cfg = tuning.default_linear(1, False, n=64, k=128, sms=sms, generation="v1")
            small.check(cfg)
            us = timer([small.call(0, cfg)], reps=FLOOR_CHAIN)
            rows.append({"section": "floor", "what": "w2a8 gemv 64x128, M=1", "pdl": pdl and pdl_was,
                         "us": round(us, 3)})
    finally:
        programmatic_launch(pdl_was)
    return rows


def large_candidates(m: int) -> list[tuple[str, LinearConfig]]:
    """(family, config) timed on the large shapes: each family's tiles that won somewhere in a
    wider first sweep (2026-11-30; ``lanes`` and unpipelined ``mma`` lost at every width), and
    gemv with the L2 prefetch before the programmatic-launch wait."""
    out = []
    if m <= 2:
        out += [("gemv", LinearConfig(GEMV, 8, 1024)), ("gemv", LinearConfig(GEMV, 16, 1024)),
                ("gemv+pf", LinearConfig(GEMV, 8, 1024, prefetch=True)), ("lanes", LinearConfig(LANES, 16, 256))]
    if m <= 48:
        out += [("mma", LinearConfig(MMA, 64, 64, 4, 3)), ("mma", LinearConfig(MMA, 64, 128, 4, 2))]
    if m >= 2:
        out += [("dot", LinearConfig(DOT, 64, 64, num_stages=3)), ("dot", LinearConfig(DOT, 128, 64, 8, 3))]
    return out


def large_rows(widths, timer: GraphTimer, sms: int, mhz: float, log) -> list[dict]:
    """Every candidate of ``large_candidates`` on each large shape and width (twin-checked)."""
    rows = []
    for label, n, k in LARGE_SHAPES:
        case = LinearBench("w2a8_linear", n, k, False, rotate_mb=160.0, min_copies=4)
        nbytes = n * (-(-k // 128) * 32)
        for m in widths:
            case.set_width(m)
            for family, cfg in large_candidates(m):
                row = {"section": "large", "shape": label, "N": n, "K": k, "M": m, "family": family,
                       "config": cfg.__dict__}
                try:
                    case.check(cfg)
                    us = case.time(timer, cfg)
                    row.update(us=round(us, 2), packed_gbps=round(nbytes / us / 1e3, 1),
                               weights_per_sm_clock=round(n * k / (us * sms * mhz), 2) if mhz else None)
                except Exception as e:  # a candidate that fails to compile or to match is a finding
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                log(f"large {label} M={m:<3} {family:<9} {cfg.kernel} bn={cfg.block_n} kb={cfg.block_kb} "
                    f"w={cfg.num_warps} s={cfg.num_stages} pf={int(cfg.prefetch)}: "
                    + (f"{row['us']:8.2f} us {row['packed_gbps']:7.0f} GB/s {row['weights_per_sm_clock']} w/clk"
                       if "us" in row else row["error"][:120]))
        del case
        torch.cuda.empty_cache()
    return rows


def best_large(rows: list[dict]) -> dict:
    """(K, M) -> the fastest large-shape row; (K, M, family) -> that family's fastest."""
    best = {}
    for r in rows:
        if r.get("section") != "large" or not r.get("us"):
            continue
        for key in ((r["K"], r["M"]), (r["K"], r["M"], r["family"])):
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    return best


def fixed_cost(stack_us: float, shapes, layers: int, m: int, best: dict) -> float | None:
    """µs per linear the stack pays beyond its bytes at the large-shape rate of the same K and M."""
    stream = 0.0
    for _, n, k, _ in shapes:
        big = best.get((2560 if k <= 4096 else 6912, m))
        if not big:
            return None
        stream += n * (-(-k // 128) * 32) / (big["packed_gbps"] * 1e3)  # µs
    return (stack_us - layers * stream) / (layers * len(shapes))
