"""Static Orin proxy for the W2A8 kernels: instructions per weight in the compiled main loop.

No GPU needed: each kernel configuration is compiled by Triton for a chosen architecture
(default sm_87, the Jetson Orin's GA10B; sm_90 for the H200), disassembled with the
``cuobjdump`` Triton ships, and its main loop (the longest backward branch) is counted by
instruction class. From the weights one loop iteration covers (``BLOCK_N x CHUNKS x 128``
per program, spread over its warps) follow two upper bounds on the weights an SM can
decode and multiply per clock:

* issue: an SM issues at most 4 warp-instructions per clock (4 schedulers);
* pipes (Ampere GA10x per-SM rates, warp-instructions per clock): integer ALU (LOP3, SHF,
  IADD3, ISETP, PRMT, ...) 2; IMAD / IDP (dp4a) 2; memory (LDG, STS, LDS, LDSM, SHFL, BAR)
  1; int8 tensor core ``IMMA.16832`` 0.5 (2048 int8 MACs per SM-clock on sm_80 / sm_87).

``bound = weights per warp-iteration / max(total / 4, ALU / 2, IMAD+IDP / 2, MEM / 1, IMMA / 0.5)``.
It ignores latency, occupancy and DRAM: a kernel can only be slower than this, never
faster. A kernel is bandwidth-bound on a board when the bound is well above the board's
weights per SM-clock (4 x DRAM bytes / (SMs x clock)): Orin NX 16GB ~56, AGX Orin 64GB ~39,
Orin Nano 8GB ~54. Registers and local-memory spills come from the cubin.

    python tools/kernel_sass.py                        # the W2A8 defaults, sm_87, M in 1..80
    python tools/kernel_sass.py --arch 90 --out tools/results/kernel_sass_sm90.md
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.pop("TRITON_INTERPRET", None)  # compile for real (no GPU is needed to compile)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels_ampere import tuning, w2a8  # noqa: E402
from kernels_ampere.common import split_k_chunks  # noqa: E402
from kernels_ampere.tuning import DOT, GEMV, LANES, MMA, ROWS, LinearConfig  # noqa: E402

ALU = {"LOP3", "SHF", "IADD3", "ISETP", "PRMT", "SEL", "LEA", "SGXT", "MOV", "CS2R", "PLOP3", "IABS", "IMNMX",
       "BMSK", "FLO", "POPC", "BREV", "LEA.HI", "VIADD", "I2F", "F2I", "FSEL", "FSETP", "FADD", "FMUL", "FFMA"}
FMA = {"IMAD", "IDP", "IMUL", "IDP4A"}
MEM = {"LDG", "STG", "STS", "LDS", "LDSM", "SHFL", "BAR", "LDL", "STL", "LDGSTS", "LDGDEPBAR", "DEPBAR", "REDUX"}
MMA_OPS = {"IMMA", "HMMA"}
RATES = {"issue": 4.0, "alu": 2.0, "fma": 2.0, "mem": 1.0, "mma": 0.5}
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?\s*([^;]*);")
WORD_KERNELS = (GEMV, ROWS, LANES)
KERNELS = {GEMV: "_w2a8_gemv_kernel", ROWS: "_w2a8_rows_kernel", DOT: "_w2a8_dot_kernel",
           LANES: "_w2a8_lanes_kernel", MMA: "_w2a8_mma_kernel"}


def nv_bin(tool: str) -> str:
    import triton.backends.nvidia as nv

    return os.path.join(os.path.dirname(nv.__file__), "bin", tool)


def block_m(cfg: LinearConfig, m: int, k: int) -> int:
    """Activation rows one program multiplies (``mma``: its main tile and its tail tile)."""
    p2 = 1 << max(m - 1, 0).bit_length()
    if cfg.kernel == GEMV:
        return 1
    if cfg.kernel == ROWS:
        return min(p2, w2a8.ROWS_MAX_BLOCK_M)
    if cfg.kernel == LANES:
        return min(p2, w2a8.LANES_MAX_BLOCK_M)
    if cfg.kernel == MMA:
        return sum(w2a8.mma_rows(cfg, m, k))
    return max(16, min(p2, 64))


def compile_config(cfg: LinearConfig, m: int, k: int, arch: int, grouped: bool = False, n: int = 2560):
    """Compile one launch as ``w2a8_linear`` would specialise it (integer arguments equal to 1
    become constants, multiples of 16 get Triton's divisibility hint, pointers are aligned)."""
    word = cfg.kernel in WORD_KERNELS
    sig = {"a_ptr": "*i32" if word else "*i8", "a_scale_ptr": "*fp32", "w_ptr": "*i32" if word else "*u8",
           "w_scale_ptr": "*fp32", "out_ptr": "*fp32", "part_ptr": "*fp32" if grouped else "*i32",
           "count_ptr": "*i32", "res_ptr": "*fp32", "M": "i32", "N": "i32",
           "chunks_per_split": "i32", "stride_am": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_sg": "i32",
           "stride_om": "i32", "stride_rm": "i32"}
    chunks = 1 if (grouped and cfg.kernel == MMA) else cfg.block_kb // 32
    # no programmatic launch (an Orin has none), so no L2 prefetch either: w2a8_linear gates it on the launch
    chunks_total = -(-k // 128)
    per_split, n_split = split_k_chunks(chunks_total, cfg.split_k, chunks)  # as w2a8_linear slices K
    const = dict(K=k, GROUPED=grouped, SPLIT=n_split > 1, RESIDUAL=False, SUM_SLICES=n_split if n_split > 1 else 0,
                 BLOCK_N=cfg.block_n, CHUNKS=chunks, USE_GDC=False, PREFETCH=False, USE_ASM=True)
    if cfg.kernel == MMA:
        const["ASUM_BY_DOT"] = grouped or k % 4 != 0 or cfg.asum_by_dot
        const["FOLD"] = cfg.fold_lanes and k <= w2a8.FOLD_MAX_K
        const["BLOCK_M"], const["TAIL_M"] = w2a8.mma_rows(cfg, m, k)
    elif cfg.kernel != GEMV:
        const["BLOCK_M"] = block_m(cfg, m, k)
    kw = k // 4 if word else k  # activation row stride in elements
    pw = (chunks_total * 32) // (4 if word else 1)
    values = {"M": m, "N": n, "chunks_per_split": per_split, "stride_am": kw, "stride_wn": pw, "stride_sn": 1,
              "stride_sg": 0, "stride_om": n, "stride_rm": n}
    fn = getattr(w2a8, KERNELS[cfg.kernel])
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(8)}  # the pointers: torch allocations are 16-byte aligned
    for name, v in values.items():
        if v == 1:
            const[name] = 1
        elif v % 16 == 0:
            attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    sig.update({name: "constexpr" for name in const})
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": False})


def disassemble(cubin: bytes, tmp: Path) -> tuple[str, dict]:
    """(SASS text, resource usage: reg / stack / shared / local) of a cubin, written to ``tmp``."""
    tmp.write_bytes(cubin)
    sass = subprocess.run([nv_bin("cuobjdump"), "-sass", str(tmp)], capture_output=True, text=True).stdout
    usage = subprocess.run([nv_bin("cuobjdump"), "-res-usage", str(tmp)], capture_output=True, text=True).stdout
    return sass, {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}


def loop_profile(cubin: bytes, tmp: Path) -> tuple[collections.Counter, dict]:
    sass, res = disassemble(cubin, tmp)
    return main_loop(sass), res


def main_loop(sass: str) -> collections.Counter:
    """Instruction counts of the main loop: the longest backward branch of the SASS."""
    ins = [(int(mt.group(1), 16), mt.group(3), mt.group(5)) for mt in map(LINE.search, sass.splitlines()) if mt]
    best = []
    for addr, op, args in ins:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return collections.Counter(best)


def bound(counts: collections.Counter, weights_per_warp: float) -> tuple[float, str]:
    load = {"issue": sum(counts.values()) / RATES["issue"],
            "alu": sum(v for k, v in counts.items() if k in ALU) / RATES["alu"],
            "fma": sum(v for k, v in counts.items() if k in FMA) / RATES["fma"],
            "mem": sum(v for k, v in counts.items() if k in MEM) / RATES["mem"],
            "mma": sum(v for k, v in counts.items() if k in MMA_OPS) / RATES["mma"]}
    limiter = max(load, key=load.get)
    return (weights_per_warp / load[limiter] if load[limiter] else float("inf")), limiter


def profile(cfg: LinearConfig, m: int, k: int, arch: int, tmp: Path) -> dict:
    kern = compile_config(cfg, m, k, arch)
    counts, res = loop_profile(kern.asm["cubin"], tmp)
    chunks = cfg.block_kb // 32
    # weights one loop iteration covers per program; gemv / rows / lanes / dot / mma all step CHUNKS chunks
    weights = cfg.block_n * chunks * 128
    rows_per_program = 1 if cfg.kernel == GEMV else min(block_m(cfg, m, k), m) if m else 1
    programs_per_tile = -(-m // rows_per_program)  # programs that decode the same weights again
    per_warp = weights / cfg.num_warps / programs_per_tile
    b, limiter = bound(counts, per_warp)
    return {"kernel": cfg.kernel, "fold": cfg.fold_lanes, "M": m, "BLOCK_N": cfg.block_n, "CHUNKS": chunks, "warps": cfg.num_warps,
            "stages": cfg.num_stages,
            "rows_per_program": rows_per_program, "loop_instructions": sum(counts.values()),
            "weights_per_warp_instruction": round(per_warp / max(sum(counts.values()), 1), 2),
            "bound_weights_per_sm_clock": round(b, 1), "limiter": limiter, "regs": res.get("reg"),
            "spill_bytes": res.get("stack", 0), "top": dict(counts.most_common(8))}


def project(rows: list[dict], model: str = "bitnet-2b") -> list[str]:
    """Markdown: the model's ternary-linear step on each Jetson board from these static bounds
    (``tools/kernel_stack.py``'s formula with r = the bound: an optimistic compute term)."""
    from kernels_ampere.autotune import MODEL_LAYERS, MODEL_SHAPES
    from tools.kernel_stack import BOARDS, DRAM_EFFICIENCY, ORIN_LAUNCH_US

    shapes, layers = MODEL_SHAPES[model], MODEL_LAYERS[model]
    lines = ["", f"## Projected {model} ternary-linear step from these bounds (ms; steps/s)", "",
             f"Per call `max(bytes / ({DRAM_EFFICIENCY} · BW), weights / (r · SMs · f)) + {ORIN_LAUNCH_US:g} µs`, "
             f"summed over {layers} layers x {len(shapes)} projections, r = the bound above for the default kernel of "
             "each generation at that width (v1: gemv / dot, v2: lanes / mma, v5: gemv / folded mma, v6: folded mma "
             "from M = 1, v7: v6 with a tail tile at M = 33..48). An upper "
             "bound on speed: the "
             "bound ignores latency and occupancy.", "",
             "| M | generation | r | " + " | ".join(BOARDS) + " |", "|---|---|---|" + "---|" * len(BOARDS)]
    for m in sorted({r["M"] for r in rows if "error" not in r}):
        for name in GENERATIONS:
            got = [r for r in rows if r["M"] == m and name in r.get("generations", ()) and "error" not in r]
            if not got:
                continue
            rate = got[0]["bound_weights_per_sm_clock"]
            cells = []
            for sms, mhz, bw in BOARDS.values():
                t = sum(layers * (max(n * (-(-k // 128) * 32) / (DRAM_EFFICIENCY * bw * 1e9),
                                      n * k / (rate * sms * mhz * 1e6)) + ORIN_LAUNCH_US * 1e-6)
                        for _, n, k, _ in shapes)
                cells.append(f"{t * 1e3:.2f} ({1 / t:.0f})")
            lines.append(f"| {m} | {name} | {rate} | " + " | ".join(cells) + " |")
    return lines


GENERATIONS = ("v1", "v2", "v5", "v6", "v7", "v8")  # v1: gemv / dot, v2: lanes / mma, v5: gemv / folded mma,
# v6: v5 with folded mma at M <= 2 on a GPU of few SMs; v7: v6 with a tail tile at M = 33..48;
# v8 (the default): v7 with 4 warps of 128 / 256 weight rows (and K slices by wave fill) on a GPU of few SMs


def default_configs(m: int, n: int, k: int, sms: int) -> list[tuple[str, LinearConfig]]:
    return [(g, tuning.default_linear(m, False, n=n, k=k, sms=sms, generation=g)) for g in GENERATIONS]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=87, help="compute capability x 10 (87 Orin, 90 H200, 86 RTX 30)")
    ap.add_argument("--sms", type=int, default=8, help="SM count the defaults are sized for (8: Orin NX / Nano)")
    ap.add_argument("--widths", default="1,2,9,16,27,40,80")
    ap.add_argument("--shape", default="2560x6912", help="NxK of the projection (the defaults depend on it)")
    ap.add_argument("--extra", default="",
                    help="more configs: kernel:block_n:block_kb:warps[:split[:stages]], comma list")
    ap.add_argument("--out", type=Path, default=None, help="write a Markdown table here")
    args = ap.parse_args(argv)
    n, k = (int(v) for v in args.shape.split("x"))
    extra = []
    for item in filter(None, args.extra.split(",")):
        kind, bn, kb, warps, *rest = item.split(":")
        extra.append(LinearConfig(kind, int(bn), int(kb), num_warps=int(warps), split_k=int(rest[0]) if rest else 1,
                                  num_stages=int(rest[1]) if len(rest) > 1 else 1))
    tmp = Path(f"/tmp/kernel_sass_{os.getpid()}.cubin")
    rows = []
    for m in (int(w) for w in args.widths.split(",")):
        seen = {}  # config -> its row (a launch two generations share is compiled once)
        for gen, cfg in default_configs(m, n, k, args.sms) + [("", c) for c in extra]:
            if cfg in seen or (cfg.kernel == LANES and m > w2a8.LANES_MAX_BLOCK_M):
                if cfg in seen and gen:
                    seen[cfg]["generations"].append(gen)
                continue
            try:
                rows.append(profile(cfg, m, k, args.arch, tmp))
            except Exception as e:  # a configuration that does not compile is a finding too
                rows.append({"kernel": cfg.kernel, "M": m, "error": f"{type(e).__name__}: {e}"[:200]})
            r = seen[cfg] = rows[-1]
            r["generations"] = [gen] if gen else []
            print(f"sm_{args.arch} M={m:<3} {cfg.kernel:<5} bn={cfg.block_n:<3} kb={cfg.block_kb:<4} "
                  f"w={cfg.num_warps} s={cfg.num_stages}: " + (f"{r['loop_instructions']:5} instr/iter, "
                                            f"{r['weights_per_warp_instruction']:6} w/warp-instr, bound "
                                            f"{r['bound_weights_per_sm_clock']:6} w/SM-clk ({r['limiter']}), "
                                            f"{r['regs']} regs, spill {r['spill_bytes']}  {r['top']}"
                                            if "error" not in r else r["error"]), flush=True)
    tmp.unlink(missing_ok=True)
    if args.out:
        lines = [f"# W2A8 main loops on sm_{args.arch} (static; `{' '.join(['python', *sys.argv])}`)", "",
                 f"Triton {triton.__version__}; projection {n}x{k}; defaults sized for {args.sms} SMs. "
                 "Bound = weights per SM-clock the loop's instruction mix allows (tools/kernel_sass.py), with "
                 "Ampere's per-SM pipe rates (sm_80 / sm_86 / sm_87; a Hopper SM runs IMMA faster).", "",
                 "| M | default of | kernel | folded | BLOCK_N | CHUNKS | warps | stages | rows/program | "
                 "instr / iteration | weights / warp-instr | bound w / SM-clk | limiter | regs | spill B |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['M']} | {', '.join(r['generations'])} | {r['kernel']} | FAILED: {r['error']} "
                             "||||||||||||")
                continue
            lines.append(f"| {r['M']} | {', '.join(r['generations'])} | {r['kernel']} | {r['fold']} | {r['BLOCK_N']} | {r['CHUNKS']} | {r['warps']} | {r['stages']} | "
                         f"{r['rows_per_program']} | {r['loop_instructions']} | {r['weights_per_warp_instruction']} | "
                         f"{r['bound_weights_per_sm_clock']} | {r['limiter']} | {r['regs']} | {r['spill_bytes']} |")
        lines += project(rows)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
