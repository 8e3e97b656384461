"""Hardware counters of a model step's W2A8 launches, read with Nsight Compute (``ncu``).

The stack and replay benchmarks give µs; this says where a launch's time goes: achieved
occupancy, DRAM throughput, issue activity, the tensor pipes and the warp stall reasons, per
projection and width, each launch exactly as the runtime makes it (the shipped table, else the
SM-count default; ``--config M:projection={...}`` launches another configuration). Two halves:

    ncu --clock-control none --profile-from-start off --kernel-name regex:_w2a8_ --set full \\
        -o RUN python tools/ncu_w2a8.py launch --widths 1,16,32 --calls RUN.calls.json
    ncu --import RUN.ncu-rep --page raw --csv > RUN.raw.csv
    ncu --import RUN.ncu-rep --page source --csv --print-source sass > RUN.source.csv
    python tools/ncu_w2a8.py summarize RUN.raw.csv --calls RUN.calls.json --source RUN.source.csv --out DIR

``launch`` checks every launch bit for bit against the twin, then profiles one call of each
(``cudaProfilerStart`` / ``Stop`` around them: compilation and warm-up stay out of the report);
ncu flushes the caches before each profiled kernel, so the weights come from DRAM as in a
decode step, and serialises the launches (no programmatic-launch overlap: the numbers are a
launch on its own). ``summarize`` joins the report's rows to the calls in launch order and
writes ``ncu_w2a8.json`` and ``ncu_w2a8.md``; ``--source`` adds, from the report's SASS page,
where each launch's stall samples fall (before its main loop, in it, after it).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script (python tools/ncu_w2a8.py), also under ncu

from tools.provenance import commit  # noqa: E402

# (column in the raw page, short name): what the summary table shows of each launch
SUMMARY_METRICS = (
    ("gpu__time_duration.sum", "duration"),
    ("launch__grid_size", "programs"),
    ("launch__block_size", "threads"),
    ("launch__registers_per_thread", "registers"),
    ("launch__waves_per_multiprocessor", "waves"),
    ("sm__warps_active.avg.pct_of_peak_sustained_active", "achieved occupancy %"),
    ("dram__bytes_read.sum.pct_of_peak_sustained_elapsed", "DRAM % of peak"),
    ("dram__bytes_read.sum", "DRAM bytes read"),
    ("lts__t_bytes.sum", "L2 bytes"),
    ("smsp__issue_active.avg.pct_of_peak_sustained_active", "issue active %"),
    ("smsp__inst_executed.sum", "instructions (warp)"),
    ("sm__cycles_active.avg", "SM active cycles"),
    ("gpc__cycles_elapsed.max", "elapsed cycles"),
)
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
TENSOR = re.compile(r"^sm__pipe_tensor\w*_cycles_active\.avg\.pct_of_peak_sustained_active$")
TOP_STALLS = 5


def launch(args) -> int:
    import torch

    from kernels_ampere import tuning
    from kernels_ampere.autotune import MODEL_SHAPES, LinearBench
    from kernels_ampere.tuning import LinearConfig

    from tools.kernel_stack import RESIDUAL_SHAPES

    if args.model not in MODEL_SHAPES:
        raise SystemExit(f"ncu_w2a8 launch: --model {args.model!r} is not one of {sorted(MODEL_SHAPES)}")
    names = [name for name, *_ in MODEL_SHAPES[args.model]]
    overrides = {}  # (m, projection) -> LinearConfig
    for spec in args.config:
        key, _, fields = spec.partition("=")
        m, _, name = key.partition(":")
        try:
            overrides[(int(m), name)] = LinearConfig(**json.loads(fields))
        except (ValueError, TypeError) as err:  # JSONDecodeError is a ValueError
            raise SystemExit(f"ncu_w2a8 launch: --config {spec!r}: {err}; expected "
                             'M:projection={"kernel": "mma", "block_n": 64, "block_kb": 64, ...}') from None
        if name not in names:
            raise SystemExit(f"ncu_w2a8 launch: --config {spec!r}: no projection {name!r} in {args.model} ({names})")
    if not torch.cuda.is_available():
        raise SystemExit("ncu_w2a8 launch: needs a CUDA GPU")
    dev = torch.device("cuda")
    cases = {name: LinearBench("w2a8_linear", n, k, g, rotate_mb=0.0, seed=i, residual=name in RESIDUAL_SHAPES,
                               min_copies=1)
             for i, (name, n, k, g) in enumerate(MODEL_SHAPES[args.model])}
    calls, launches = [], []
    for m in args.widths:
        for name, n, k, g in MODEL_SHAPES[args.model]:
            case = cases[name]
            case.set_width(m)
            config = overrides.get((m, name)) or tuning.lookup("w2a8_linear", tuning.linear_key(n, k, m, g), dev) \
                or tuning.default_linear(m, g, n=n, k=k, sms=tuning.sm_count(dev))
            case.check(config)  # compiles it too
            launches.append((case, m, config))  # profiled on fresh inputs of this width below
            calls.append({"model": args.model, "projection": name, "n": n, "k": k, "m": m,
                          "config": dataclasses.asdict(config)})
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for case, m, config in launches:
        case.set_width(m)
        case.call(0, config)()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    meta = {"device": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": commit(), "torch": torch.__version__}
    Path(args.calls).write_text(json.dumps({"calls": calls, **meta}, indent=1))
    print(f"ncu_w2a8: {len(calls)} launches profiled; calls in {args.calls}")
    return 0


def read_raw(path: Path) -> tuple[list[dict], dict]:
    """``ncu --page raw --csv``: a header row, a units row, one row per profiled kernel."""
    with path.open(newline="") as fh:
        rows = [r for r in csv.reader(fh) if r]
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None:
        raise SystemExit(f"ncu_w2a8: {path} has no 'Kernel Name' header: not an ncu --page raw --csv export")
    header, units = rows[start], rows[start + 1]
    return [dict(zip(header, r)) for r in rows[start + 2:]], dict(zip(header, units))


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def kernel_summary(row: dict, units: dict) -> dict:
    out = {short: number(row.get(col, "")) for col, short in SUMMARY_METRICS}
    unit = units.get("gpu__time_duration.sum", "")
    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit)
    if out["duration"] is not None and scale is not None:
        out["duration"] = out["duration"] * scale  # µs
    stalls = {m.group(1): number(v) for c, v in row.items() if (m := STALL.match(c)) and number(v)}
    out["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    out["tensor pipes %"] = {c.split("__")[1].split("_cycles")[0]: number(v) for c, v in row.items()
                             if TENSOR.match(c) and number(v)}
    out["kernel"] = row.get("Kernel Name", "")
    return out


SAMPLES = "Warp Stall Sampling (All Samples)"
BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
TOP_LINES = 3


def read_source(path: Path) -> list[list[dict]]:
    """``ncu --page source --csv --print-source sass``: per kernel a "Kernel Name" row, a
    header row, then one row per SASS instruction (address, text, stall samples by reason)."""
    kernels, header = [], None
    with path.open(newline="") as fh:
        for row in csv.reader(fh):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernels.append([])
            elif row[0] == "Address":
                header = row
            elif kernels and header:
                kernels[-1].append(dict(zip(header, row)))
    if not kernels or header is None or SAMPLES not in header:
        raise SystemExit(f"ncu_w2a8: {path} is not an ncu --page source --csv --print-source sass export "
                         "of a report with stall sampling (--set full)")
    return kernels


def main_loop(lines: list[dict]) -> tuple[int, int] | None:
    """Instruction indices [first, last] of the longest backward branch's body (the main loop)."""
    addr = [int(r["Address"], 16) for r in lines]
    best = None
    for i, r in enumerate(lines):
        hit = BRANCH.search(r["Source"])
        if hit and int(hit.group(1), 16) < addr[i]:
            first = next(j for j, a in enumerate(addr) if a >= int(hit.group(1), 16))
            if best is None or i - first > best[1] - best[0]:
                best = (first, i)
    return best


def source_summary(lines: list[dict]) -> dict:
    """Where a kernel's stall samples fall: before its main loop, in it, after it (share of
    the samples and CTA barriers in each), the stall reasons over the whole kernel, and the
    instructions that hold the most samples."""
    samples = [int(number(r.get(SAMPLES, "")) or 0) for r in lines]
    total = sum(samples) or 1
    loop = main_loop(lines)
    first, last = loop if loop else (len(lines), len(lines) - 1)
    regions = {"before the loop": range(0, first), "loop": range(first, last + 1),
               "after the loop": range(last + 1, len(lines))}
    reasons = {}
    for col in lines[0] if lines else ():
        if col.startswith("stall_") and "Not Issued" not in col:
            reasons[col[len("stall_"):]] = sum(int(number(r[col]) or 0) for r in lines) / total
    top = sorted(range(len(lines)), key=lambda i: -samples[i])[:TOP_LINES]
    return {
        "samples": sum(samples),
        "regions": {name: {"samples": sum(samples[i] for i in idx) / total,
                           "barriers": sum("BAR.SYNC" in lines[i]["Source"] or "BAR.RED" in lines[i]["Source"]
                                           for i in idx),
                           "instructions": len(idx)} for name, idx in regions.items()},
        "stall reasons": dict(sorted(((k, v) for k, v in reasons.items() if v), key=lambda kv: -kv[1])),
        "top instructions": [{"index": i, "share": samples[i] / total, "sass": lines[i]["Source"].strip()}
                             for i in top if samples[i]],
    }


def summarize(args) -> int:
    rows, units = read_raw(Path(args.raw))
    meta = json.loads(Path(args.calls).read_text())
    calls = meta["calls"]
    if len(rows) != len(calls):
        raise SystemExit(f"ncu_w2a8: {args.raw} has {len(rows)} kernels, {args.calls} {len(calls)} calls: "
                         "profile with --kernel-name regex:_w2a8_ so each call is one row")
    sources = read_source(Path(args.source)) if args.source else None
    if sources is not None and len(sources) != len(calls):
        raise SystemExit(f"ncu_w2a8: {args.source} has {len(sources)} kernels, {args.calls} {len(calls)} calls")
    out = []
    for i, (call, row) in enumerate(zip(calls, rows)):
        s = kernel_summary(row, units)
        if sources is not None:
            s["source"] = source_summary(sources[i])
        weights = call["n"] * call["k"]
        if s["duration"]:
            s["weights per SM-clock"] = weights / (s["elapsed cycles"] or float("nan")) / \
                max(1.0, number(row.get("device__attribute_multiprocessor_count", "")) or 1.0)
        out.append({**call, **s})
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "ncu_w2a8.json").write_text(json.dumps({"launches": out, **{k: v for k, v in meta.items() if k != "calls"}},
                                                   indent=1))
    (dest / "ncu_w2a8.md").write_text("\n".join(markdown(out, meta, args.command)) + "\n")
    print("\n".join(markdown(out, meta, args.command)))
    return 0


def fmt(v, digits=1) -> str:
    return "" if v is None else f"{v:,.{digits}f}" if isinstance(v, float) else str(v)


def markdown(launches: list[dict], meta: dict, command: str) -> list[str]:
    lines = ["# W2A8 launches under Nsight Compute", ""]
    lines += [f"- {k}: {meta[k]}" for k in ("device", "date", "commit") if k in meta]
    if command:
        lines.append(f"- command: `{command}`")
    lines += ["- each launch alone (ncu serialises kernels and flushes the caches first: weights from DRAM, "
              "no programmatic-launch overlap); stall columns: warps stalled per issued instruction", ""]
    lines += ["| projection | M | kernel | µs | programs | regs | waves | occupancy % | DRAM % | issue % | "
              "tensor % | weights / SM-clock | top stalls |", "|" + "---|" * 13]
    for r in launches:
        cfg = r["config"]
        kern = f"{cfg.get('kernel')} {cfg.get('block_n')}x{cfg.get('block_kb')} w{cfg.get('num_warps')}" \
               f" s{cfg.get('num_stages')} k{cfg.get('split_k')}" + (" fold" if cfg.get("fold_lanes") else "")
        tensor = max(r["tensor pipes %"].values(), default=None)
        stalls = ", ".join(f"{k} {v:.2f}" for k, v in list(r["stalls"].items())[:TOP_STALLS])
        lines.append(f"| {r['projection']} | {r['m']} | {kern} | {fmt(r['duration'], 2)} | {fmt(r['programs'], 0)} | "
                     f"{fmt(r['registers'], 0)} | {fmt(r['waves'], 2)} | {fmt(r['achieved occupancy %'])} | "
                     f"{fmt(r['DRAM % of peak'])} | {fmt(r['issue active %'])} | {fmt(tensor)} | "
                     f"{fmt(r.get('weights per SM-clock'))} | {stalls} |")
    if any("source" in r for r in launches):
        lines += ["", "Where the stall samples fall (share of the kernel's samples; CTA barriers in each part; "
                      "the main loop = the longest backward branch of the SASS):", "",
                  "| projection | M | samples | before the loop (barriers) | loop (barriers) | after (barriers) | "
                  "instructions holding the most samples |", "|" + "---|" * 7]
        for r in launches:
            src = r.get("source")
            if not src:
                continue
            parts = [f"{p['samples']:.0%} ({p['barriers']})" for p in src["regions"].values()]
            top = "; ".join(f"{t['share']:.0%} `{t['sass'][:48]}`" for t in src["top instructions"])
            lines.append(f"| {r['projection']} | {r['m']} | {src['samples']} | {' | '.join(parts)} | {top} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    la = sub.add_parser("launch", help="make the launches (run under ncu)")
    la.add_argument("--model", default="bitnet-2b")
    la.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 32])
    la.add_argument("--calls", required=True, help="where to write the launches' list (JSON)")
    la.add_argument("--config", action="append", default=[],
                    help='M:projection={"kernel": "mma", ...} (LinearConfig fields) instead of the shipped launch')
    su = sub.add_parser("summarize", help="join an ncu --page raw --csv export to the launches")
    su.add_argument("raw")
    su.add_argument("--calls", required=True)
    su.add_argument("--out", required=True)
    su.add_argument("--command", default="", help="the ncu command, for the report")
    su.add_argument("--source", default=None,
                    help="the report's source page (ncu --import R --page source --csv --print-source sass): "
                         "where each launch's stall samples fall")
    args = ap.parse_args(argv)
    return launch(args) if args.what == "launch" else summarize(args)


if __name__ == "__main__":
    sys.exit(main())
