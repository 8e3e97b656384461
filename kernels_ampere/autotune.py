"""Tune the packed linears for the local GPU and write its table (``tuned/<gpu>.json``).

    python -m kernels_ampere.autotune --models bitnet-2b,bitmtp-27m          # known layer shapes
    python -m kernels_ampere.autotune --shapes 3840x2560,2560x6912 --widths 1,9,27
    python -m kernels_ampere.autotune --shapes 2048x2048g --op w2a16_linear   # g: group-128 scales

For every (N, K, width M) it times the candidates of ``tuning.linear_candidates`` and keeps
the fastest one that matches its pure-PyTorch twin; a model's projections are then chosen
as a layer (``tune_layer``: the per-shape picks against the untuned defaults, back to back as
a decode step runs them, the faster sequence wins). ``bitmtp tune`` runs this with the
shipped models' shapes. A minute or two per model on an Orin:

* candidates compile in parallel worker processes first (``--jobs``), which fill Triton's
  on-disk cache with exactly the kernels the timing run then loads (the same shapes, so the
  same specialisations);
* every candidate is checked against the twin once, then timed as a CUDA-graph replay of
  calls that rotate over enough weight copies (>= ``--rotate-mb``) that each call reads its
  weights from DRAM, not L2: what a decode step sees.

The table merges into the existing one (this run's keys replace the old entries), is
written atomically, and is what ``w2a8_linear`` / ``w2a16_linear`` look up at launch; a GPU
without a table gets ``tuning.default_linear`` (sized by its SM count).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import tuning
from .packing import pack_ternary

# (name, N, K, group-128 scales) of the ternary projections of the models this project ships
# or benchmarks; the runtime fuses Q/K/V and gate/up into one projection each.
MODEL_SHAPES = {
    "bitnet-2b": (("wqkv", 3840, 2560, False), ("wo", 2560, 2560, False), ("w13 (gate+up)", 13824, 2560, False),
                  ("w2 (down)", 2560, 6912, False)),
    "bonsai-1.7b": (("q / o", 2048, 2048, True), ("k / v", 1024, 2048, True), ("gate+up", 12288, 2048, True),
                    ("down", 2048, 6144, True)),
    "bitmtp-27m": (("wqkv", 768, 512, False), ("wo", 512, 512, False), ("w13 (gate+up)", 2816, 512, False),
                   ("w2 (down)", 512, 1408, False)),
    # 1bitLLM bitnet_b1_58-3B: the FFN's 8640 inputs are not a multiple of 128 (padded chunks)
    "bitnet-3b": (("wqkv", 9600, 3200, False), ("wo", 3200, 3200, False), ("w13 (gate+up)", 17280, 3200, False),
                  ("w2 (down)", 3200, 8640, False)),
}
MODEL_LAYERS = {"bitnet-2b": 30, "bonsai-1.7b": 28, "bitmtp-27m": 8, "bitnet-3b": 26}
DEFAULT_WIDTHS = (1, 2, 5, 9, 16, 27, 40, 80)
DEVICE = "cuda"  # where the benchmark tensors live (tests run the logic on the CPU interpreter)


class GraphTimer:
    """µs per call of ``calls[i % len(calls)]()``, replayed from one CUDA graph. ``stream``:
    where the calls are warmed up and captured (default a new side stream / torch's capture
    stream); a captured kernel runs where it was captured, so a partition of the GPU (a green
    context: ``tools/sm_partition_stack.py``) passes its own stream."""

    def __init__(self, reps: int = 64, replays: int = 5, stream: torch.cuda.Stream | None = None):
        self.reps, self.replays, self.stream = reps, replays, stream

    def __call__(self, calls: list, reps: int | None = None) -> float:
        reps = reps or self.reps
        side = self.stream or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile / warm every call outside the capture
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            for i in range(reps):
                calls[i % len(calls)]()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(self.replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / reps)
        del graph
        return statistics.median(times)


def n_copies(nbytes: int, rotate_mb: float, min_copies: int = 4) -> int:
    return max(min_copies, math.ceil(rotate_mb * 1e6 / max(nbytes, 1)))


class LinearBench:
    """One projection's packed weights (rotating copies) and one width's inputs, on the GPU."""

    def __init__(self, op: str, n: int, k: int, grouped: bool, rotate_mb: float, seed: int = 0,
                 residual: bool = False, out_dtype: torch.dtype = torch.float32, min_copies: int = 4):
        self.op, self.n, self.k, self.grouped = op, n, k, grouped
        self.residual, self.out_dtype = residual, out_dtype
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)
        codes = torch.randint(-1, 2, (n, k), generator=self.gen, device=DEVICE, dtype=torch.int8)
        packed = pack_ternary(codes)
        groups = packed.shape[1] * 4 // 128
        w_scale = 0.5 + torch.rand((n, groups) if grouped else (n,), generator=self.gen, device=DEVICE)
        copies = n_copies(packed.numel(), rotate_mb, min_copies)
        self.packed = [packed] + [packed.clone() for _ in range(copies - 1)]
        self.w_scale = [w_scale] + [w_scale.clone() for _ in range(copies - 1)]
        self.set_width(1)

    def set_width(self, m: int) -> None:
        self.m = m
        x = torch.randn(m, self.k, generator=self.gen, device=DEVICE) * 2
        self.x16 = x.to(torch.bfloat16)
        self.a_scale = (x.abs().amax(-1).clamp(min=1e-5) / 127).float()
        self.a_int8 = torch.round(x / self.a_scale[:, None]).clamp(-128, 127).to(torch.int8)
        self.res = torch.randn(m, self.n, generator=self.gen, device=DEVICE) if self.residual else None
        self._ref = None  # the twin's output at this width, computed once

    def call(self, i: int, config=None, next_weights: torch.Tensor | None = None):
        """A no-argument launch on weight copy ``i``; ``.config`` and ``.shape`` say what it launches.
        ``next_weights`` (W2A8): the bytes its programs ask the L2 for, as a decode step's
        launch asks for the next projection's."""
        from .w2a8 import w2a8_linear
        from .w2a16 import w2a16_linear

        packed, w_scale = self.packed[i], self.w_scale[i]
        if self.op == "w2a8_linear":
            def launch():
                return w2a8_linear(self.a_int8, self.a_scale, packed, w_scale, out_dtype=self.out_dtype,
                                   residual=self.res, config=config, next_weights=next_weights)
        else:
            def launch():
                return w2a16_linear(self.x16, packed, w_scale, out_dtype=self.out_dtype, config=config)
        launch.config, launch.shape = config, (self.n, self.k)
        return launch

    def check(self, config=None) -> None:
        """Raise unless the kernel matches its twin: exactly for W2A8 with per-row scales."""
        from .w2a8 import w2a8_linear_reference
        from .w2a16 import w2a16_linear_reference

        out = self.call(0, config)()
        if self._ref is None:
            self._ref = (w2a8_linear_reference(self.a_int8, self.a_scale, self.packed[0], self.w_scale[0],
                                               out_dtype=self.out_dtype, residual=self.res)
                         if self.op == "w2a8_linear" else
                         w2a16_linear_reference(self.x16, self.packed[0], self.w_scale[0], out_dtype=torch.float32))
        ref = self._ref
        if self.op == "w2a8_linear" and not self.grouped:
            if not torch.equal(out, ref):
                raise AssertionError(f"{config}: {(out != ref).sum().item()} values differ from the twin")
            return
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()
        if not err <= 2 ** -7:
            raise AssertionError(f"{config}: max error {err:.2e} of max|ref|")

    def time(self, timer: GraphTimer, config=None) -> float:
        return timer([self.call(i, config) for i in range(len(self.packed))])


def _compile_worker(jobs: list[tuple]) -> list[str]:
    """Run each (op, n, k, grouped, m, residual, config) once on small copies: fills Triton's
    disk cache with the very specialisations the timing run loads. -> failures."""
    failed = []
    cases = {}
    for op, n, k, grouped, m, residual, cfg in jobs:
        key = (op, n, k, grouped, residual)
        if key not in cases:
            cases[key] = LinearBench(op, n, k, grouped, rotate_mb=0.0, residual=residual, min_copies=1)
        case = cases[key]
        if case.m != m:
            case.set_width(m)
        try:
            case.call(0, tuning.LinearConfig(**cfg) if cfg else None)()
        except Exception as e:  # reported by the timing run, which tries it again
            failed.append(f"{cfg}: {type(e).__name__}: {e}"[:200])
    torch.cuda.synchronize()
    return failed


def precompile(jobs: list[tuple], workers: int) -> None:
    """Compile ``jobs`` (see ``_compile_worker``) in ``workers`` processes, round robin."""
    if workers <= 1 or len(jobs) < 2:
        return
    # one job per Triton specialisation: K and the flags are constants, M is specialised on
    # == 1 and % 16 and sets the row tile, N on % 16
    unique = {}
    for op, n, k, g, m, res, cfg in jobs:
        unique.setdefault((op, k, g, res, m == 1, m % 16 == 0, min(1 << max(m - 1, 0).bit_length(), 128),
                           n % 16 == 0, cfg), (op, n, k, g, m, res, cfg))
    jobs = [(*j[:6], asdict(j[6]) if j[6] is not None else None) for j in unique.values()]
    parts = [jobs[i::workers] for i in range(workers)]
    import multiprocessing as mp

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        for failed in pool.map(_compile_worker, [p for p in parts if p]):
            for f in failed[:3]:
                print(f"  precompile: {f}", file=sys.stderr)


def tune_shape(case: LinearBench, m: int, timer: GraphTimer, candidates=None, log=print) -> tuple[object, float, list]:
    """The fastest twin-exact candidate for ``case`` at width ``m`` -> (config, µs, everything tried)."""
    case.set_width(m)
    candidates = candidates if candidates is not None else tuning.linear_candidates(
        m, case.n, case.k, case.grouped, weight_only=case.op == "w2a16_linear")
    best, best_us, tried = None, float("inf"), []
    for cfg in candidates:
        try:
            case.check(cfg)
            us = case.time(timer, cfg)
        except Exception as e:  # a candidate that fails to compile or to match is skipped
            tried.append({"config": asdict(cfg), "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        tried.append({"config": asdict(cfg), "us": round(us, 3)})
        if us < best_us:
            best, best_us = cfg, us
    return best, best_us, tried


def untuned(case: LinearBench, m: int):
    """The launch a GPU without a table gets for ``case`` at width ``m``."""
    device = torch.device(DEVICE)
    return tuning.default_linear(m, case.grouped, weight_only=case.op == "w2a16_linear", n=case.n, k=case.k,
                                 sms=tuning.sm_count(device))


def layer_us(cases: dict, configs: dict, timer: GraphTimer) -> float:
    """µs of one layer: every projection once, back to back in model order, as a decode step
    runs them, rotating over the weight copies (cold L2)."""
    copies = max(len(c.packed) for c in cases.values())
    calls = [case.call(i % len(case.packed), configs[name]) for i in range(copies) for name, case in cases.items()]
    return timer(calls, reps=max(timer.reps, len(calls))) * len(cases)


def tune_layer(cases: dict, m: int, timer: GraphTimer, log=print) -> tuple[list[dict], list[dict]]:
    """One model layer's projections (``cases``: name -> LinearBench) at width ``m`` ->
    (table entries, tune log).

    Each projection's candidates are timed alone first; then the whole layer runs with those
    picks and with the untuned defaults, and the faster *layer* is kept: on an H200 per-shape
    winners of different kernels in a row measured up to 1.4x slower than either kernel alone
    (tools/results/kernels.md), so a table is only as good as the sequence it produces. Each of
    the two also runs with every folded launch's K steps lengthened together
    (``tuning.LAYER_STEP_VARIANTS``): a change that loses on one projection alone can win on all."""
    picks, alone, tune_log = {}, {}, []
    for name, case in cases.items():
        best, us, tried = tune_shape(case, m, timer)
        tune_log.append({"op": case.op, "key": tuning.linear_key(case.n, case.k, m, case.grouped), "tried": tried})
        if best is not None:
            picks[name], alone[name] = best, us
    options = {"untuned": {name: untuned(case, m) for name, case in cases.items()}}
    if len(picks) == len(cases):
        options["tuned"] = picks
    for label in list(options):  # every folded launch with longer K steps at once (tuning.LAYER_STEP_VARIANTS)
        for kb, stages in tuning.LAYER_STEP_VARIANTS:
            varied = {name: tuning.layer_step_variant(cfg, kb, stages) for name, cfg in options[label].items()}
            if varied != options[label] and varied not in options.values():
                options[f"{label}, kb{kb} s{stages}"] = varied
    timed = {}
    for label, configs in options.items():
        try:
            for name, case in cases.items():
                case.check(configs[name])
            timed[label] = layer_us(cases, configs, timer)
        except Exception as e:  # an untuned default that fails is a finding; the picks still count
            log(f"  layer M={m} with the {label} launches failed: {type(e).__name__}: {e}")
    if not timed:
        return [], tune_log
    winner = min(timed, key=timed.get)
    entries = []
    for name, case in cases.items():
        cfg = options[winner][name]
        entries.append({"op": case.op, "key": tuning.linear_key(case.n, case.k, m, case.grouped), "config": asdict(cfg),
                        "us": round(alone[name], 3) if winner == "tuned" else None,
                        "layer": winner, "layer_us": round(timed[winner], 3)})
    log(f"  layer M={m}: {', '.join(f'{k} {v:.2f} us' for k, v in timed.items())} -> {winner}")
    return entries, tune_log


def merge_entries(old: list[dict], new: list[dict]) -> list[dict]:
    """This run's winners replace entries of the same op and key."""
    fresh = {(e["op"], json.dumps(e["key"], sort_keys=True)) for e in new}
    return [e for e in old if (e["op"], json.dumps(e["key"], sort_keys=True)) not in fresh] + new


def write_table(path: Path, device_name: str, entries: list[dict], meta: dict) -> None:
    """Merge ``entries`` into the table at ``path`` and replace it atomically."""
    old = json.loads(path.read_text())["entries"] if path.is_file() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"gpu": device_name, **meta, "entries": merge_entries(old, entries)}, indent=1) + "\n")
    os.replace(tmp, path)


def parse_shapes(text: str) -> list[tuple[str, int, int, bool]]:
    """``3840x2560,2048x2048g`` -> [(name, N, K, grouped)]; ``g``: group-128 scales."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        grouped = item.endswith("g")
        try:
            n, k = (int(v) for v in item.rstrip("g").lower().split("x"))
        except ValueError:
            raise SystemExit(f"autotune: --shapes item {item!r} is not NxK (e.g. 3840x2560, 2048x2048g)") from None
        if n < 1 or k < 1:
            raise SystemExit(f"autotune: --shapes item {item!r}: N and K must be positive")
        out.append((item, n, k, grouped))
    return out


def parse_widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise SystemExit(f"autotune: --widths {text!r} is not a comma list of integers (e.g. 1,2,9,16)") from None
    if not widths or min(widths) < 1:
        raise SystemExit(f"autotune: --widths {text!r}: give one width M >= 1 at least")
    return widths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma list of {sorted(MODEL_SHAPES)} (default: bitnet-2b)")
    ap.add_argument("--shapes", default=None, help="comma list of NxK (append g for group-128 scales)")
    ap.add_argument("--widths", default=",".join(map(str, DEFAULT_WIDTHS)), help="comma list of widths M")
    ap.add_argument("--op", default="w2a8_linear", choices=("w2a8_linear", "w2a16_linear"))
    ap.add_argument("--out", type=Path, default=None, help="table path (default kernels_ampere/tuned/<gpu>.json)")
    ap.add_argument("--rotate-mb", type=float, default=160.0, help="weight copies per shape (MB, beyond L2)")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="compile processes")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("autotune: needs a CUDA device", file=sys.stderr)
        return 2
    shapes = parse_shapes(args.shapes) if args.shapes else []
    models = args.models.split(",") if args.models else ([] if shapes else ["bitnet-2b"])
    for model in models:
        if model not in MODEL_SHAPES:
            raise SystemExit(f"autotune: unknown model {model!r}; known: {sorted(MODEL_SHAPES)} (or use --shapes)")
    widths = parse_widths(args.widths)
    every = shapes + [(f"{model} {name}", n, k, g) for model in models for name, n, k, g in MODEL_SHAPES[model]]
    import triton

    device_name = torch.cuda.get_device_name()
    out = args.out or tuning.TUNED_DIR / f"{tuning.gpu_table_name(device_name)}.json"
    t0 = time.time()
    jobs = [(args.op, n, k, g, m, False, cfg) for _, n, k, g in every for m in widths
            for cfg in tuning.linear_candidates(m, n, k, g, weight_only=args.op == "w2a16_linear")]
    print(f"autotune: {device_name}, {len(every)} shapes x {len(widths)} widths, {len(jobs)} candidates; "
          f"compiling in {args.jobs} processes", flush=True)
    precompile(jobs, args.jobs)
    print(f"autotune: compiled in {time.time() - t0:.0f} s; timing", flush=True)
    timer = GraphTimer(reps=32, replays=3)
    entries = []
    for model in models:  # a model's projections are chosen as a layer (tune_layer)
        cases = {name: LinearBench(args.op, n, k, g, args.rotate_mb, seed=i)
                 for i, (name, n, k, g) in enumerate(MODEL_SHAPES[model])}
        for m in widths:
            got, _ = tune_layer(cases, m, timer)
            entries += got
            for e in got:
                print(f"  {model} {e['key']['N']}x{e['key']['K']:<6} M={m:<3} {e['layer']:<8} {e['config']}", flush=True)
        del cases
        torch.cuda.empty_cache()
    for label, n, k, g in shapes:  # single shapes: their fastest candidate alone
        case = LinearBench(args.op, n, k, g, args.rotate_mb)
        for m in widths:
            best, us, tried = tune_shape(case, m, timer)
            if best is None:
                print(f"  {label} M={m}: no candidate ran: {tried[:1]}", file=sys.stderr)
                continue
            entries.append(tuning.record(args.op, tuning.linear_key(n, k, m, g), best, us))
            print(f"  {label:<28} M={m:<3} {us:8.2f} us  {best}", flush=True)
        del case
        torch.cuda.empty_cache()
    meta = {"triton": triton.__version__, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([sys.executable, "-m", "kernels_ampere.autotune", *(argv or sys.argv[1:])])}
    write_table(out, device_name, entries, meta)
    print(f"autotune: {len(entries)} entries -> {out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
