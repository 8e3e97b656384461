"""The W2A8 stack confined to a few SMs of a large GPU: an Orin's SM count, measured.

``kernel_stack.py`` replays the BitNet-2B stack on the whole H200, where a launch of one
2B projection is a fraction of a wave and its time is mostly latency (ramp, round trips);
an Orin NX runs the same launch as many waves over 8 SMs. A CUDA green context confines
every launch of a stream to N SMs of this GPU, so this script measures what the Orin's
question actually is: how many ternary weights an SM gets through per clock when each
launch spans many waves. The SMs keep the H200's memory system (bytes per SM-clock are not
the limit here), so the rate is the kernels' own ceiling, which a board reaches only where
its bandwidth allows (Orin NX ≈ 56 weights per SM-clock, AGX Orin ≈ 39).

    python tools/sm_partition_stack.py --sms 8 --widths 1,9,16,32 --out runs/sm8.json
    python tools/sm_partition_stack.py --sms 0 ...     # the whole GPU, same timing, for the ratio
    python tools/sm_partition_stack.py --summarize runs/sm*.json --md runs/sm.md   # no GPU: one table
    python tools/sm_partition_stack.py --sms 0 --widths 9,16 --vary "block_n=64,128;split_k=1,2,4" \
        --vary-each --write-table runs/table --out runs/whole.json   # the whole GPU's own table, varied:
    # each projection alone, the winners timed together and written as a table (bench_replay_widths --tables)
    python tools/sm_partition_stack.py --sms 0 --widths 9,16 --vary "block_kb=64,256;num_stages=2,3" \
        --write-table runs/table --out runs/whole.json   # without --vary-each: per width the fastest
    # variant of all projections changed together (one changed alone can lose where all four win)

Schemes: ``shipped`` (this GPU's tuned table, else its defaults: the H200's launches),
``board defaults`` (``tuning.default_linear`` for the partition's SM count: what a board
with that many SMs and no table launches) and, at M <= 2, ``board, mma from M = 1`` (the
tensor-core launch the defaults give M = 3, instead of gemv). Every launch is checked against
the twin (exact) before it is timed; the stack is captured in one CUDA graph on the partition's
stream and replayed (sm_87 has no programmatic launch: ``BITMTP_PDL=0`` launches as a board
does; session 13's runs had it on, recorded in the JSON from then on). A bf16 matmul in the
same process shows the confinement (its TFLOP/s scales with the SMs). ``board defaults`` are the default generation's (recorded in the JSON: runs before
v6 have no such field and were v5's, gemv at M <= 2).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import types
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels_ampere import tuning  # noqa: E402
from kernels_ampere.common import programmatic_launch  # noqa: E402
from kernels_ampere.autotune import MODEL_LAYERS, MODEL_SHAPES, GraphTimer, precompile  # noqa: E402
from tools.kernel_stack import BOARDS, RESIDUAL_SHAPES, Stack, project, scheme_configs, sm_clock_mhz  # noqa: E402


def enter_partition(sms: int):
    """A stream whose launches run on ``sms`` SMs (a green context), made current. -> context,
    which the caller must hold: once it is collected the context is destroyed, and every launch
    on its stream fails with "context is destroyed" (the first GPU test of this function)."""
    from torch.cuda.green_contexts import GreenContext

    dev = torch.cuda.current_device()
    try:
        ctx = GreenContext.create(num_sms=sms, device_id=dev)
    except TypeError:  # torch 2.10-2.11 spell the arguments positionally
        ctx = GreenContext.create(sms, dev)
    if hasattr(ctx, "Stream"):
        torch.cuda.set_stream(ctx.Stream())
    else:
        ctx.set_context()  # swaps torch's current stream for the green context's
    return ctx


@triton.jit
def _sm_id_kernel(out_ptr):
    pid = tl.program_id(0)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(out_ptr + pid, sm)


def sms_reached(programs: int = 1 << 16) -> int:
    """How many distinct SMs the current stream's launches run on (each program stores its %smid)."""
    ids = torch.empty(programs, dtype=torch.int32, device="cuda")
    _sm_id_kernel[(programs,)](ids)
    return int(torch.unique(ids).numel())


def graph_sms_reached(capture_stream, programs: int = 1 << 16) -> int:
    """``sms_reached`` for a kernel captured in a CUDA graph on ``capture_stream`` and replayed
    on the current stream, as the runtime runs its steps: a graph's kernels run where they
    were captured, which a green context must reach for a confined benchmark to mean anything."""
    ids = torch.zeros(programs, dtype=torch.int32, device="cuda")
    _sm_id_kernel[(programs,)](ids)  # compiled and loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        _sm_id_kernel[(programs,)](ids)
    ids.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    if bool((ids < 0).any()):
        raise RuntimeError("the replayed probe graph left programs unwritten")
    return int(torch.unique(ids).numel())


def median_seconds(fn, passes: int) -> float:
    """Seconds of ``fn()`` on the current stream, eager: one warm-up run, then the median of ``passes``."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(passes):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def matmul_tflops(passes: int) -> float:
    """A bf16 8192³ matmul on the current stream, eager (median of ``passes``)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / median_seconds(lambda: a @ b, passes) / 1e12


def configs_for(stack: Stack, scheme: str, m: int, sms: int) -> dict:
    """The launches of ``scheme`` at width ``m``: "shipped", "board defaults", "board, mma from
    M = 1", "board, tail" (the defaults split by ``tuning.tail_config``), or "board, <generation>" (``tuning.W2A8_GENERATIONS``: that generation's defaults for
    the partition's SM count, to choose a board's defaults between them)."""
    if scheme == "board, tail":  # the defaults with ``tuning.tail_config``'s tail tiles (M = 33..48 on a board)
        return {name: tuning.tail_config(tuning.default_linear(m, g, n=n, k=k, sms=sms), m)
                for name, n, k, g in stack.shapes}
    if scheme.startswith("board, v"):
        generation = scheme.removeprefix("board, ")
        return {name: tuning.default_linear(m, g, n=n, k=k, sms=sms, generation=generation)
                for name, n, k, g in stack.shapes}
    if scheme == "shipped":  # this GPU's table, else its own defaults, as kernel_stack.py times it
        return scheme_configs(stack, "shipped", m, (), {})
    if scheme == "board defaults":
        return {name: tuning.default_linear(m, g, n=n, k=k, sms=sms) for name, n, k, g in stack.shapes}
    # "board, mma from M = 1": the tensor-core launch of M = 3 at every width <= 2 as well
    return {name: tuning.default_linear(max(m, 3), g, n=n, k=k, sms=sms) for name, n, k, g in stack.shapes}


VARY_FIELDS = ("block_n", "block_kb", "num_warps", "num_stages", "split_k", "chains")
VARY_SHORT = {"block_n": "bn", "block_kb": "kb", "num_warps": "w", "num_stages": "s", "split_k": "sk", "chains": "ch"}


def parse_vary(text: str) -> list[dict]:
    """``"num_stages=3,4;block_kb=64,128"`` -> every combination, as dicts of LinearConfig fields
    ([] for an empty text). Names a field or value it cannot take in a SystemExit."""
    axes = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        field, _, values = part.partition("=")
        field = field.strip()
        if field not in VARY_FIELDS:
            raise SystemExit(f"sm_partition_stack: --vary {text!r}: {field!r} is not one of {', '.join(VARY_FIELDS)}")
        try:
            axes.append([(field, int(v)) for v in values.split(",")])
        except ValueError:
            raise SystemExit(f"sm_partition_stack: --vary {text!r}: {field}= takes comma-separated integers")
    return [dict(combo) for combo in itertools.product(*axes)] if axes else []


def vary_scheme(change: dict) -> str:
    """The scheme name of one ``--vary`` combination: "board, bn128 kb128 s4"."""
    return "board, " + " ".join(f"{VARY_SHORT[f]}{v}" for f, v in change.items())


def varied_configs(stack, m: int, sms: int, change: dict, only: tuple[str, ...] = ()) -> dict:
    """The board defaults at width ``m`` with ``change`` applied to every ``mma`` launch (gemv and
    ``dot`` launches have no such tiles and are left as they are); ``only``: to these projections
    alone (names of ``MODEL_SHAPES``), the others keep the defaults. ``sms`` 0 (the whole GPU):
    the shipped launches (this GPU's table) instead of the defaults, since those are what run there."""
    base = configs_for(stack, "board defaults" if sms else "shipped", m, sms)
    return {name: replace(cfg, **launch_change(cfg, change)) if not only or name in only else cfg
            for name, cfg in base.items()}


def launch_change(cfg, change: dict) -> dict:
    """The part of a ``--vary`` combination one launch takes: all of it on an ``mma`` launch,
    except two chains (``LinearConfig.chains``), which only the folded launches without a tail
    tile have; nothing on the others (gemv and ``dot`` have no such tiles)."""
    if cfg.kernel != tuning.MMA:
        return {}
    if cfg.fold_lanes and not cfg.tail_m:
        return change
    return {field: value for field, value in change.items() if field != "chains"}


def combined_configs(stack, m: int, sms: int, rows: list[dict], changes: list[dict]) -> tuple[dict, dict]:
    """Per projection, the fastest of its ``--vary-each`` rows at width ``m`` against the base
    launches (each varied alone, the others at the base) -> (launches of all projections
    together, {projection: the change that won, or None where the base stayed fastest})."""
    base_scheme = "board defaults" if sms else "shipped"
    base_us = next(r["us"] for r in rows if r["M"] == m and r["scheme"] == base_scheme)
    cfgs, won = dict(configs_for(stack, base_scheme, m, sms)), {}
    for name, *_ in stack.shapes:
        best, best_us = None, base_us
        for change in changes:
            row = next((r for r in rows if r["M"] == m and r["scheme"] == vary_scheme(change) + f" on {name}"), None)
            if row and row["us"] < best_us:
                best, best_us = change, row["us"]
        won[name] = best
        if best:
            cfgs[name] = varied_configs(stack, m, sms, best, (name,))[name]
    return cfgs, won


def fastest_variant(stack, m: int, sms: int, rows: list[dict], variants: dict) -> tuple[dict, str | None]:
    """Without ``--vary-each``: the fastest of the variants timed at width ``m`` (every projection
    changed together) against the base launches -> (its launches, its scheme, or None where the
    base stayed fastest). Measured on the 2B stack (H200, session 21): one projection changed
    alone can lose where all four changed together win, so this mode times what it writes."""
    base_scheme = "board defaults" if sms else "shipped"
    timed = [r for r in rows if r["M"] == m and (r["scheme"] == base_scheme or r["scheme"] in variants)]
    best = min(timed, key=lambda r: r["us"])
    if best["scheme"] == base_scheme:
        return dict(configs_for(stack, base_scheme, m, sms)), None
    change, group = variants[best["scheme"]]
    return varied_configs(stack, m, sms, change, group), best["scheme"]


def write_table(folder: Path, stack, chosen: dict[int, dict], meta: dict) -> Path:
    """This GPU's shipped table with the entries of ``chosen`` ({M: {projection: launch}})
    put in (replacing the same keys): a folder ``bench_replay_widths.py --tables`` reads."""
    dev = torch.device("cuda")
    name = tuning.gpu_table_name(torch.cuda.get_device_name(dev))
    shipped = tuning.TUNED_DIR / f"{name}.json"
    data = json.loads(shipped.read_text()) if shipped.is_file() else {"entries": []}
    new = {}
    for m, cfgs in chosen.items():
        for shape, n, k, g in stack.shapes:
            key = tuning.linear_key(n, k, m, g)
            new[json.dumps(key, sort_keys=True)] = {"op": "w2a8_linear", "key": key, "config": cfgs[shape].__dict__}
    kept = [e for e in data["entries"]
            if not (e["op"] == "w2a8_linear" and json.dumps(e["key"], sort_keys=True) in new)]
    out = folder / f"{name}.json"
    meta = {k: v for k, v in data.items() if k not in ("gpu", "entries")} | {
        "note": (data.get("note", "") + f" {meta['date']}: W2A8 entries at M = {sorted(chosen)} of the "
                 f"{stack.model} shapes from `{meta['command']}` "
                 + ("(sm_partition_stack.py --vary-each --write-table: per projection the fastest launch "
                    "varied alone)." if meta.get("each", True) else
                    "(sm_partition_stack.py --write-table: per width the fastest variant, all projections "
                    "changed together).")).strip()}
    tuning.save_table(out, torch.cuda.get_device_name(dev), kept + list(new.values()), meta)
    return out


def timed_row(stack, scheme: str, m: int, us: float, sms: int, mhz: float | None, cfgs: dict) -> dict:
    """One result row (printed as it is made): µs per step and ternary weights per SM-clock."""
    rate = stack.weights / (us * 1e-6 * sms * mhz * 1e6) if mhz else None
    print(f"sms {sms} M {m:3d} {scheme:15s} {us:9.1f} us  {rate or 0:6.2f} weights/SM-clock", flush=True)
    return {"M": m, "scheme": scheme, "us": round(us, 1), "weights_per_sm_clock": rate and round(rate, 2),
            "configs": {k: v.__dict__ for k, v in cfgs.items()}}


def read_rate(nbytes: int, passes: int) -> float:
    """GB/s of a float32 sum over ``nbytes`` on the current stream: what its SMs can stream."""
    buf = torch.rand(nbytes // 4, device="cuda")
    return nbytes / median_seconds(buf.sum, passes) / 1e9


def summary_markdown(runs: list[dict]) -> list[str]:
    """One table over runs (the JSON this script writes): a row per (SMs, instruction, M),
    µs and weights per SM-clock per scheme."""
    schemes = list(dict.fromkeys(r["scheme"] for run in runs for r in run["rows"]))
    lines = ["| SMs | tensor-core instruction | M | " + " | ".join(f"{s}: µs (weights/SM-clock)" for s in schemes) + " |",
             "|---|---|---|" + "---|" * len(schemes)]
    cells = {}
    for run in runs:
        meta = run["meta"]
        inst = "wgmma (sm_90)" if meta.get("mma_v3", True) else "mma.sync (DISABLE_MMA_V3=1)"
        for r in run["rows"]:
            key = (meta["sms"], inst, r["M"])
            cells.setdefault(key, {})[r["scheme"]] = f"{r['us']:.0f} ({r['weights_per_sm_clock']:.1f})"
    for (sms, inst, m), row in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        lines.append(f"| {sms} | {inst} | {m} | " + " | ".join(row.get(s, "") for s in schemes) + " |")
    return lines


def projection_markdown(runs: list[dict]) -> list[str]:
    """Each board's step time for the stack's ternary linears (``kernel_stack.project``: per
    call max(bytes / (0.8 BW), weights / (r SMs f)) + 3 µs), r = the rate measured on a
    partition of the board's SM count (an Orin's ``mma.sync`` where such a run exists)."""
    lines = ["| board | measured on | M | scheme | weights/SM-clock | ternary linears per step, ms (steps/s) | "
             "bandwidth-bound steps/s |", "|---|---|---|---|---|---|---|"]
    for board, (board_sms, _, _) in BOARDS.items():
        same = [run for run in runs if run["meta"]["sms"] == board_sms]
        if not same:
            continue
        orin_isa = [run for run in same if not run["meta"].get("mma_v3", True)]
        rates = {}
        for run in orin_isa or same:  # later files win, as in the table above
            for r in run["rows"]:
                rates[(r["M"], r["scheme"])] = (r["weights_per_sm_clock"], run["meta"])
        for (m, scheme), (rate, meta) in sorted(rates.items()):
            stack = types.SimpleNamespace(shapes=MODEL_SHAPES[meta["model"]], layers=MODEL_LAYERS[meta["model"]])
            p = project(stack, m, lambda *_: rate)[board]
            inst = "wgmma" if meta.get("mma_v3", True) else "mma.sync"
            lines.append(f"| {board} | {board_sms} SMs, {inst} | {m} | {scheme} | {rate:.1f} | "
                         f"{p['step_ms']:.2f} ({p['steps_per_s']:.0f}) | {p['bandwidth_bound_steps_per_s']:.0f} |")
    return lines if len(lines) > 2 else []


def summarize(paths: list[str], md: str | None) -> int:
    runs = []
    for p in paths:
        try:
            run = json.loads(Path(p).read_text())
            run["meta"], run["rows"]  # noqa: B018 (the two keys this script writes)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"sm_partition_stack: {p}: not a result of this script ({e})")
        runs.append(run)
    meta = runs[0]["meta"]
    lines = [f"W2A8 stack of {meta['model']} on N SMs of one {meta['device']} (CUDA green contexts), "
             f"graph-replayed, SM clock {meta['sm_clock_mhz']:.0f} MHz; every launch checked exact against the twin.",
             "", *summary_markdown(runs), ""]
    projection = projection_markdown(runs)
    if projection:
        lines += ["Projected on the boards (per call max(bytes / (0.8 · BW), weights / (r · SMs · f)) + 3 µs, "
                  "r measured on the board's SM count here; assumes an Orin SM sustains per clock what an H200 SM "
                  "does on the same instructions):", "", *projection, ""]
    lines += [f"- `{Path(p).name}`: {r['meta']['sms']} SMs reached (asked {r['meta']['sms_asked']}), bf16 matmul "
              f"{r['meta']['bf16_matmul_tflops']} TFLOP/s, {r['meta']['date']}: `{r['meta']['command']}`"
              for p, r in zip(paths, runs)]
    text = "\n".join(lines) + "\n"
    if md:
        Path(md).write_text(text)
    print(text, end="")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summarize", nargs="+", metavar="JSON", help="no GPU: one Markdown table over earlier runs")
    ap.add_argument("--md", help="with --summarize: the Markdown file to write")
    ap.add_argument("--sms", type=int, default=8, help="SMs of the partition (0: the whole GPU)")
    ap.add_argument("--model", default="bitnet-2b")
    ap.add_argument("--widths", default="1,9,16,32")
    ap.add_argument("--tail", action="store_true", help="with --sms: time the board defaults with tail tiles too")
    ap.add_argument("--generations", default="",
                    help="comma list of W2A8 default generations timed beside the board defaults (with --sms)")
    ap.add_argument("--vary", default="",
                    help='with --sms: the board defaults with mma launch fields changed, every combination '
                         '(e.g. "num_stages=3,4,5;block_kb=64,128"; fields: ' + ", ".join(VARY_FIELDS) + ")")
    ap.add_argument("--vary-only", default="",
                    help="with --vary: change only these projections (comma list of the model's shape names, "
                         "e.g. \"wo,w2 (down)\")")
    ap.add_argument("--vary-each", action="store_true",
                    help="with --vary: change one projection at a time (those of --vary-only, else every one), "
                         "the others at the base launches")
    ap.add_argument("--write-table", type=Path, default=None,
                    help="with --vary: write this GPU's table with every width's fastest launches (a folder for "
                         "bench_replay_widths.py --tables): with --vary-each the per-projection winners, timed "
                         "together; without it the fastest variant of all projections changed together")
    ap.add_argument("--ahead", action="store_true",
                    help="time the shipped launches also asking the L2 for the next launch's weights "
                         "(common.next_weights_l2, as the runtime does: from M = 3, w2a8.NEXT_WEIGHTS_MIN_M) "
                         "and with every weight in the L2 (a floor)")
    ap.add_argument("--jobs", type=int, default=0, help="with --vary: compile the variants in this many processes first")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--out", help="JSON file to write")
    args = ap.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize, args.md)
    if not args.out:
        raise SystemExit("sm_partition_stack: give --out FILE.json for the measurement (or --summarize)")
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        raise SystemExit(f"sm_partition_stack: --widths {args.widths!r}: expected comma-separated integers")
    generations = [g for g in args.generations.split(",") if g]
    unknown = [g for g in generations if g not in tuning.W2A8_GENERATIONS]
    if unknown:
        raise SystemExit(f"sm_partition_stack: --generations {args.generations!r}: "
                         f"choose from {', '.join(tuning.W2A8_GENERATIONS)}")
    changes = parse_vary(args.vary)
    only = tuple(n.strip() for n in args.vary_only.split(",") if n.strip())
    shapes = {name: (n, k, g) for name, n, k, g in MODEL_SHAPES[args.model]}
    if [n for n in only if n not in shapes]:
        raise SystemExit(f"sm_partition_stack: --vary-only {args.vary_only!r}: {args.model}'s projections are "
                         f"{', '.join(shapes)}")
    if (args.vary_each or args.write_table) and not changes:
        raise SystemExit("sm_partition_stack: --vary-each and --write-table need --vary")
    if not torch.cuda.is_available():
        raise SystemExit("sm_partition_stack: needs a CUDA GPU")
    # the projections each variant changes together: one group, or each alone (--vary-each)
    groups = [(name,) for name in (only or shapes)] if args.vary_each else [only]
    if changes and args.jobs > 1:  # Triton's disk cache filled before the partition is entered
        model_shapes = types.SimpleNamespace(shapes=MODEL_SHAPES[args.model])  # no GPU tensors yet
        jobs = [("w2a8_linear", *shapes[name], m, name in RESIDUAL_SHAPES, cfg) for m in widths for change in changes
                for group in groups for name, cfg in varied_configs(model_shapes, m, args.sms, change, group).items()]
        precompile(jobs, args.jobs)
    full_sms = tuning.sm_count(torch.device("cuda"))
    if args.sms:
        partition = enter_partition(args.sms)  # noqa: F841 (the green context lives as long as its stream)
    else:
        torch.cuda.set_stream(torch.cuda.Stream())  # graphs are captured on a side stream
    sms = sms_reached()
    if args.sms and sms != args.sms:
        print(f"the partition runs on {sms} SMs (asked for {args.sms}): rates are per SM reached", flush=True)
    mhz = sm_clock_mhz()
    timer = GraphTimer(replays=args.passes, stream=torch.cuda.current_stream())  # the partition's stream
    stack = Stack(args.model, rotate_mb=0.0)
    schemes = ["shipped"] + (["board defaults", "board, mma from M = 1"] + [f"board, {g}" for g in generations]
                             + (["board, tail"] if args.tail else []) if args.sms else [])
    variants = {vary_scheme(c) + (f" on {', '.join(group)}" if group else ""): (c, group)
                for c in changes for group in groups}
    rows, failed, combined = [], [], {}
    for m in widths:
        stack.set_width(m)
        for scheme in schemes:
            if scheme.endswith("M = 1") and m > 2:
                continue  # the same launches as "board defaults"
            cfgs = configs_for(stack, scheme, m, args.sms or sms)
            stack.check(cfgs)
            us = stack.time_us(timer, cfgs)
            rows.append(timed_row(stack, scheme, m, us, sms, mhz, cfgs))
            if args.ahead and scheme == "shipped":  # in turn with the plain stack, then the floor
                for label, timed in (("shipped, next weights asked", lambda: stack.time_us(timer, cfgs, ahead=True)),
                                     ("shipped again", lambda: stack.time_us(timer, cfgs)),
                                     ("shipped, next weights asked again",
                                      lambda: stack.time_us(timer, cfgs, ahead=True)),
                                     ("shipped, weights in the L2", lambda: stack.time_hot_step_us(timer, cfgs))):
                    rows.append(timed_row(stack, label, m, timed(), sms, mhz, cfgs))
        for scheme, (change, group) in variants.items():
            cfgs = varied_configs(stack, m, args.sms, change, group)
            try:
                stack.check(cfgs)
                us = stack.time_us(timer, cfgs)
            except Exception as e:  # a tile that does not fit this GPU: reported, the sweep goes on
                failed.append({"M": m, "scheme": scheme, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"sms {sms} M {m:3d} {scheme}: failed: {failed[-1]['error']}", flush=True)
                continue
            rows.append(timed_row(stack, scheme, m, us, sms, mhz, cfgs))
        if args.write_table and args.vary_each:  # the winners together: projections varied alone need not add up
            cfgs, won = combined_configs(stack, m, args.sms, rows, changes)
            stack.check(cfgs)
            rows.append(timed_row(stack, "combined", m, stack.time_us(timer, cfgs), sms, mhz, cfgs))
            rows[-1]["won"] = {name: change and vary_scheme(change) for name, change in won.items()}
            combined[m] = cfgs
        elif args.write_table:  # the fastest variant as it was timed, every projection together
            combined[m], rows_won = fastest_variant(stack, m, args.sms, rows, variants)
            print(f"sms {sms} M {m:3d} written: {rows_won or 'the base launches'}", flush=True)
    read_gbps = read_rate(stack.packed_bytes, args.passes)
    read_rate_per_clock = read_gbps * 1e9 / (sms * mhz * 1e6) if mhz else None
    print(f"float32 sum over {stack.packed_bytes / 1e6:.0f} MB on this partition: {read_gbps:.0f} GB/s"
          + (f", {read_rate_per_clock:.1f} bytes per SM-clock" if mhz else ""), flush=True)
    tflops = matmul_tflops(args.passes)
    print(f"bf16 8192^3 matmul on this partition: {tflops:.1f} TFLOP/s", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "sms": sms, "sms_asked": args.sms or full_sms, "gpu_sms": full_sms,
            "mma_v3": os.environ.get("DISABLE_MMA_V3", "0") != "1",
            "default_generation": tuning.W2A8_DEFAULT_GENERATION,
            "programmatic_launch": programmatic_launch(),  # BITMTP_PDL=0: as an Orin (sm_87) launches
            "sm_clock_mhz": mhz,
            "read_gbps": round(read_gbps, 1),
            "read_bytes_per_sm_clock": read_rate_per_clock and round(read_rate_per_clock, 2),
            "failed": failed,
            "model": args.model, "bf16_matmul_tflops": round(tflops, 1), "green_context": bool(args.sms),
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "command": "python tools/sm_partition_stack.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    if args.write_table:
        print(f"table: {write_table(args.write_table, stack, combined, meta | {'each': args.vary_each})}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
