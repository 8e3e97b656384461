"""Monitored benchmarking: AR and each decoding policy on one workload, power included.

The protocol (docs/measuring.md §Monitored benchmark: the union of jetson-containers, jetson-ai-lab and TRT
Edge-LLM practice, plus what none of them records: power and energy):

1. the power posture is read *before* anything is loaded (``strict`` refuses a Jetson that
   is not at MAXN / MAXN_SUPER with locked clocks) and recorded in the result;
2. a monitoring :class:`~bitmtp_edge.jetson.monitor.Sampler` starts and runs through the whole
   benchmark, so the power timeline shows idle, warm-up and every run;
3. each **route** (a policy at the model's D and a chosen τ, m) runs ``warmup`` discarded
   generations on the first prompt, then ``repeats`` measured generations of every prompt.
   Routes are interleaved per (prompt, repeat), so drift and heat touch every route alike;
4. each measured run's **decode window** (after prefill, exactly the interval the decode
   loop's own timer covers) is marked on the sampler: energy is integrated over that window
   only, and J/token = window energy / generated tokens.

Aggregates per route: decode tok/s is the median over runs; tokens per iteration and the
verifier-call rate pool every run (sum / sum); speedup over AR is the median over prompts
of (route median tok/s / AR median tok/s) for the same prompt; average power and J/token
are medians over runs; peaks are maxima and clock ranges the union over runs.

``run_bench`` returns a :class:`BenchReport`; its ``to_dict()`` is ``bench.json``, and
``write_report`` (``bench_report.py``) writes it with ``bench.md`` and three PNG plots.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

from .bench_report import FILES, write_report  # noqa: F401  (write_report: the API's one entry point)
from ..jetson.posture import PowerPosture, check_posture

if TYPE_CHECKING:  # torch-free at import time: the CLI imports this module lazily anyway
    from ..runtime.decoding import DecodeStats
    from ..runtime.engine import Engine
    from ..jetson.monitor import Sampler, WindowStats

SCHEMA_VERSION = 1
MONITOR_CHOICES = ("auto", "tegrastats", "jtop", "nvml", "psutil", "none")


# ``bitmtp bench`` sizes when none are given. On a CPU (the reference backend, a pipeline
# check) the GPU sizes took ~100 minutes on 2 cores: 2 prompts × 32 tokens × 1 repeat keep
# every route measured in a few minutes.
GPU_DEFAULTS = {"num_prompts": 8, "max_new_tokens": 128, "repeats": 3}
CPU_DEFAULTS = {"num_prompts": 2, "max_new_tokens": 32, "repeats": 1}


class BenchError(ValueError):
    """A benchmark that cannot run as asked: says which file, line or option, and what to do."""


# ----------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class BenchPrompt:
    text: str
    where: str  # "prompts.jsonl:3" or "built-in #1": named in every error about it


def load_prompts(path: str | os.PathLike) -> list[BenchPrompt]:
    """Prompts from a JSONL file: one ``{"prompt": "..."}`` object per line (blank lines
    skipped, other keys ignored)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BenchError(f"{p}: no such prompts file; give a JSONL file with one {{\"prompt\": ...}} per line") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BenchError(f"{p}: cannot be read ({e})") from None
    out: list[BenchPrompt] = []
    example = '{"prompt": "def add(a, b):\\n"}'
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                             f"each line must be an object like {example}") from None
        if not isinstance(obj, dict) or "prompt" not in obj:
            raise BenchError(f"{where}: expected an object with a \"prompt\" key, like {example}")
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise BenchError(f"{where}: \"prompt\" must be a non-empty string")
        out.append(BenchPrompt(obj["prompt"], where))
    if not out:
        raise BenchError(f"{p}: no prompts (the file is empty); add one {{\"prompt\": ...}} object per line")
    return out


# The demo's prompts where an artifact ships none (here, not in demo.py: the demo reads
# prompts.jsonl with ``load_prompts``, and the two modules must not import each other).
FALLBACK_PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "def read_lines(path):\n",
    'class Stack:\n    """A last-in first-out stack."""\n\n    def __init__(self):\n',
)


def builtin_prompts(engine: Engine) -> tuple[list[BenchPrompt], str]:
    """The held-out prompts shipped beside the artifact (``prompts.jsonl``), else the
    demo's fallback prompts. Returns (prompts, a description of where they came from)."""
    path = Path(engine.path) / "prompts.jsonl"
    if path.is_file():
        return load_prompts(path), f"held-out prompts {path}"
    return ([BenchPrompt(t, f"built-in #{i + 1}") for i, t in enumerate(FALLBACK_PROMPTS)],
            f"bitmtp_edge.app.demo.FALLBACK_PROMPTS ({path} not found)")


# ----------------------------------------------------------------------------- routes


@dataclass(frozen=True)
class Route:
    """One decoding configuration: a policy at the model's D with its τ and m (or c)."""

    policy: str
    tau: float | None = None  # confidence, hybrid
    min_prefix: int | None = None  # hybrid
    candidates: int | None = None  # fused: draft blocks per pass (None: the engine's, see ``auto``)
    auto: bool = False  # fused without c on an engine that chooses c per pass (``runtime/candidates.py``)

    @property
    def name(self) -> str:
        parts = [self.policy]
        if self.tau is not None:
            parts.append(f"τ={self.tau:g}")
        if self.min_prefix is not None:
            parts.append(f"m={self.min_prefix}")
        if self.candidates is not None or self.auto:
            parts.append(f"c={'auto' if self.auto else self.candidates}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return {"name": self.name, "policy": self.policy, "tau": self.tau, "min_prefix": self.min_prefix,
                "candidates": "auto" if self.auto else self.candidates}


def make_routes(engine: Engine, policies: Sequence[str] | None, taus: Sequence[float] = (),
                min_prefixes: Sequence[int] = (), candidates: Sequence[int] = ()) -> list[Route]:
    """Routes for ``policies`` (None: every policy the model supports) at each τ / m / c.

    τ matters to ``confidence`` and ``hybrid``, m to ``hybrid`` only, c (``candidates``, draft
    blocks per pass) to ``fused`` only; unset values are the model's (``bitmtp.json``) and the
    default c. AR comes first: it is the baseline of every speedup."""
    from ..runtime.policies import POLICIES

    mtp = engine.manifest.mtp
    if policies is None:
        policies = POLICIES if mtp is not None else ("ar",)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise BenchError(f"unknown policy {unknown[0]!r}; choose from {', '.join(POLICIES)}")
    if mtp is None:
        needs = [p for p in policies if p != "ar"]
        if needs:
            raise BenchError(f"policy {needs[0]!r} needs an MTP-trained model; {engine.path} is AR-only "
                             "(no MTP block in its manifest): use --policies ar")
    taus = tuple(dict.fromkeys(taus)) or ((mtp.tau,) if mtp else ())
    ms = tuple(dict.fromkeys(min_prefixes)) or ((mtp.min_prefix,) if mtp else ())
    for t in taus:
        if not 0.0 < t <= 1.0:
            raise BenchError(f"--tau {t}: τ must be in (0, 1]")
    for m in ms:
        if mtp is not None and not 1 <= m <= mtp.block_size:
            raise BenchError(f"--min-prefix {m}: m must be in 1..{mtp.block_size} (the model's D)")
    counts = tuple(dict.fromkeys(candidates))
    for c in counts:
        if mtp is not None and not 1 <= c <= mtp.block_size + 1:
            raise BenchError(f"--candidates {c}: c must be in 1..{mtp.block_size + 1} "
                             "(from D on, every acceptance length)")
    routes: list[Route] = []
    for policy in sorted(dict.fromkeys(policies), key=lambda p: p != "ar"):
        if policy == "fused" and counts:
            routes.extend(Route(policy, candidates=c) for c in counts)
        elif policy == "fused":
            routes.append(Route(policy, auto=getattr(engine, "candidate_chooser", None) is not None))
        elif policy in ("ar", "speculative"):  # no τ or m: they always verify
            routes.append(Route(policy))
        elif policy == "confidence":
            routes.extend(Route(policy, tau=t) for t in taus)
        else:
            routes.extend(Route(policy, tau=t, min_prefix=m) for t in taus for m in ms)
    return routes


@dataclass(frozen=True)
class BenchConfig:
    max_new_tokens: int = 128
    warmup: int = 1  # discarded runs per route, on the first prompt
    repeats: int = 3  # measured runs per (route, prompt)
    ignore_eos: bool = False  # True: every run generates exactly max_new_tokens (fixed lengths)
    strict: bool = False
    monitor: str = "auto"
    interval_s: float = 0.1

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise BenchError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.warmup < 0 or self.repeats < 1:
            raise BenchError(f"need warmup >= 0 and repeats >= 1, got {self.warmup} and {self.repeats}")
        if self.monitor not in MONITOR_CHOICES:
            raise BenchError(f"unknown monitor {self.monitor!r}; choose from {', '.join(MONITOR_CHOICES)}")
        if self.interval_s <= 0:
            raise BenchError(f"the sampling interval must be > 0, got {self.interval_s}")

    def to_dict(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "warmup": self.warmup, "repeats": self.repeats,
                "ignore_eos": self.ignore_eos, "strict": self.strict, "monitor": self.monitor,
                "interval_s": self.interval_s}


# ----------------------------------------------------------------------------- one run


@dataclass
class RunRecord:
    route: Route
    prompt_index: int
    repeat: int  # -1 for a warm-up run
    stats: DecodeStats
    decode_start: float  # time.monotonic(), the decode loop's own window
    decode_end: float
    peak_torch_mb: float | None = None  # torch.cuda.max_memory_allocated during the run
    rss_mb: float | None = None  # this process's resident set after the run
    window: WindowStats | None = None

    @property
    def warmup(self) -> bool:
        return self.repeat < 0

    def j_per_token(self) -> float | None:
        return self.window.joules_per_token(self.stats.new_tokens) if self.window else None

    def j_per_token_counter(self) -> float | None:
        w = self.window
        if w is None or w.energy_counter_j is None or self.stats.new_tokens <= 0:
            return None
        return w.energy_counter_j / self.stats.new_tokens

    def to_dict(self, t0: float) -> dict:
        s = self.stats
        return {
            "route": self.route.name, "prompt_index": self.prompt_index, "repeat": self.repeat,
            "new_tokens": s.new_tokens, "prompt_tokens": s.prompt_tokens, "iterations": s.iterations,
            "decode_tok_s": s.decode_tokens_per_s, "tokens_per_iteration": s.tokens_per_iteration,
            "verifier_calls": s.verifier_calls, "verifier_call_rate": s.verifier_call_rate,
            "forward_passes": s.forward_passes, "tokens_per_forward": s.tokens_per_forward,
            "fused_candidates": {str(k): v for k, v in sorted(s.fused_candidates.items())},
            "prefill_s": s.prefill_s, "decode_s": s.decode_s, "finish_reason": s.finish_reason,
            "accepted_histogram": {str(k): v for k, v in sorted(s.accepted_histogram.items())},
            "decode_window": [self.decode_start - t0, self.decode_end - t0],
            "j_per_token": self.j_per_token(), "j_per_token_counter": self.j_per_token_counter(),
            "peak_torch_mb": self.peak_torch_mb, "rss_mb": self.rss_mb,
            "window": self.window.to_dict() if self.window else None,
        }


def run_once(engine: Engine, prompt: str, route: Route, config: BenchConfig) -> RunRecord:
    """One generation through the decoding loop, timed on the monotonic clock the sampler uses."""
    import psutil
    import torch

    from ..runtime.decoding import DecodeStats, decode

    opts = _options(engine, route, config)
    ids = engine.encode(prompt)
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(engine.device)
    stats = DecodeStats()
    for _ in engine.count_head_calls(decode(engine.backend, ids, opts, stats), stats):
        pass
    # decode() stops its timer in a `finally` as the generator ends, just before this line;
    # perf_counter and monotonic tick together, so the window is [end - decode_s, end].
    end = time.monotonic()
    return RunRecord(
        route=route, prompt_index=-1, repeat=-1, stats=stats, decode_start=end - stats.decode_s, decode_end=end,
        peak_torch_mb=torch.cuda.max_memory_allocated(engine.device) / 2**20 if cuda else None,
        rss_mb=psutil.Process().memory_info().rss / 2**20,
    )


def _options(engine: Engine, route: Route, config: BenchConfig):
    from ..runtime.decoding import DecodeOptions

    return DecodeOptions.for_model(engine.manifest.mtp, route.policy, config.max_new_tokens, tau=route.tau,
                                   min_prefix=route.min_prefix, candidates=route.candidates,
                                   stop_token_ids=frozenset() if config.ignore_eos else engine.eos_token_ids,
                                   chooser=getattr(engine, "candidate_chooser", None) if route.auto else None)


def check_workload(engine: Engine, prompts: Sequence[BenchPrompt], routes: Sequence[Route],
                   config: BenchConfig) -> None:
    """Refuse, before anything runs, a prompt some route cannot decode (empty once encoded,
    or too long for the KV cache with that policy's decoding room) and a route whose options
    the decoder refuses. Found in the middle of the runs instead, the error threw away every
    run measured before it: a GPU benchmark of many minutes, for its last prompt."""
    from ..runtime.decoding import DecodingError, check_prompt_fits

    try:
        options = [_options(engine, route, config) for route in routes]
    except DecodingError as e:
        raise BenchError(str(e)) from None
    for p in prompts:
        try:
            n = len(engine.encode(p.text))
            for opts in options:
                check_prompt_fits(n, opts, engine.backend.max_context)
        except DecodingError as e:
            raise BenchError(f"{p.where}: {e}") from None


# ----------------------------------------------------------------------------- the benchmark


class Progress:
    """What ``run_bench`` reports as it goes; the CLI draws a rich bar from it."""

    def start(self, total: int) -> None: ...

    def advance(self, description: str) -> None: ...

    def stop(self) -> None: ...


@dataclass
class BenchReport:
    meta: dict[str, Any]
    routes: list[Route]
    prompts: list[BenchPrompt]
    runs: list[RunRecord]
    t0: float
    samples: list = field(default_factory=list)  # monitor Samples, whole benchmark
    monitor: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    planned_runs: int = 0
    partial: bool = False  # interrupted (Ctrl-C): what was measured, fewer runs than planned

    def to_dict(self) -> dict:
        measured = [r for r in self.runs if not r.warmup]
        summaries = [summarize_route(route, measured, self.routes[0] if self.routes[0].policy == "ar" else None)
                     for route in self.routes]
        return {
            **self.meta,
            "monitor": self.monitor,
            "workload": {**self.meta.get("workload", {}),
                         "prompts": [{"where": p.where, "text": p.text} for p in self.prompts]},
            "routes": summaries,
            "runs": [r.to_dict(self.t0) for r in self.runs],
            "timeline": _timeline(self.samples, self.runs, self.t0),
            "notes": list(self.notes),
            "files": list(FILES),
            "partial": self.partial,
            "planned_runs": self.planned_runs,
        }


def run_bench(engine: Engine, prompts: Sequence[BenchPrompt], routes: Sequence[Route],
              config: BenchConfig = BenchConfig(), *, posture: PowerPosture | None = None,
              sampler: Sampler | None = None, progress: Progress | None = None,
              command: str | None = None, workload_source: str = "") -> BenchReport:
    """Run the benchmark. ``posture``: already checked by the caller (the CLI checks it
    before loading the model), else read here under ``config.strict``. ``sampler``: an
    unstarted Sampler to use instead of one made from ``config.monitor``. Ctrl-C
    (KeyboardInterrupt) ends the runs early: the report then holds what was measured, with
    ``partial`` set, for the caller to write."""
    from ..runtime.decoding import DecodingError
    from ..jetson.monitor import Sampler

    if not prompts:
        raise BenchError("no prompts to run")
    if not routes:
        raise BenchError("no routes to run (empty --policies)")
    check_workload(engine, prompts, routes, config)
    if posture is None:
        posture = check_posture(config.strict)
    if sampler is None and config.monitor != "none":
        sampler = Sampler(_source_for(engine, config), interval_s=config.interval_s)
    progress = progress or Progress()
    report = BenchReport(meta=describe_run(engine, posture, config, command, workload_source), routes=list(routes),
                         prompts=list(prompts), runs=[], t0=time.monotonic())
    if sampler is not None:
        sampler.start()  # SourceUnavailable propagates: the caller asked for that source
    try:
        plan = [(-1, 0, r) for _ in range(config.warmup) for r in routes]
        plan += [(rep, i, r) for i in range(len(prompts)) for rep in range(config.repeats) for r in routes]
        report.planned_runs = len(plan)
        progress.start(len(plan))
        try:
            for rep, i, route in plan:
                try:
                    rec = run_once(engine, prompts[i].text, route, config)
                except DecodingError as e:
                    raise BenchError(f"{prompts[i].where}: {e}") from None
                rec.prompt_index, rec.repeat = i, rep
                report.runs.append(rec)
                what = "warm-up" if rep < 0 else f"prompt {i + 1}/{len(prompts)}, repeat {rep + 1}/{config.repeats}"
                progress.advance(f"{route.name:<22} {what}: {rec.stats.decode_tokens_per_s:8.1f} tok/s")
        except KeyboardInterrupt:  # keep what was measured: minutes of runs are not thrown away
            report.partial = True
        if sampler is not None:
            # Marked at the end (the sampler still running): every window's closing sample
            # exists by then, so no per-run wait inflates the benchmark.
            for rec in report.runs:
                rec.window = sampler.mark_window(rec.decode_start, rec.decode_end)
    finally:
        progress.stop()
        if sampler is not None:
            sampler.stop()
    if sampler is not None:
        report.samples = sampler.samples
        interval = sampler.source.interval_s if sampler.source is not None else sampler.interval_s
        report.monitor = {"source": sampler.source_name, "interval_s": interval,
                          "power_note": sampler.power_note, "notes": list(sampler.notes),
                          "error": str(sampler.error) if sampler.error else None}
    else:
        report.monitor = {"source": "none", "interval_s": None,
                          "power_note": "no monitor (--monitor none): power, temperatures and clocks not recorded",
                          "notes": [], "error": None}
    chooser = getattr(engine, "candidate_chooser", None)  # where fused c=auto stood after the runs
    report.meta["engine"]["candidate_chooser"] = chooser.to_dict() if chooser is not None else None
    certified = _certified_totals(engine, report.runs)
    if certified is not None:
        report.meta["engine"]["certified_head"] = certified
    report.notes = _bench_notes(report, config)
    return report


def _certified_totals(engine: Engine, runs: list) -> dict | None:
    """A certified head's greedy head calls over ``runs`` (warm-ups included) and those the int8
    rows answered alone, summed from each run's stats (``Engine.count_head_calls`` read the
    device counters around it); None for any other head."""
    if engine.head != "certified" or getattr(engine.backend, "fast", None) is None:
        return None
    return {"calls": sum(r.stats.certified_head_calls for r in runs),
            "certified": sum(r.stats.certified_head_int8 for r in runs)}


def _source_for(engine: Engine, config: BenchConfig):
    """The monitor kind, or an NVML source on the engine's GPU when that is what runs."""
    if config.monitor == "nvml" and engine.device.type == "cuda" and engine.device.index:
        from ..jetson.monitor import NvmlSource

        # NVML counts GPUs in PCI order, CUDA by speed unless CUDA_DEVICE_ORDER=PCI_BUS_ID.
        return NvmlSource(config.interval_s, index=engine.device.index)
    return config.monitor


def _bench_notes(report: BenchReport, config: BenchConfig) -> list[str]:
    notes: list[str] = []
    measured = [r for r in report.runs if not r.warmup]
    if report.monitor.get("power_note"):
        notes.append(report.monitor["power_note"])
    durations = sorted(r.stats.decode_s for r in measured)
    interval = report.monitor.get("interval_s")
    if interval and durations and durations[len(durations) // 2] < 2 * interval:
        notes.append(f"median decode window {durations[len(durations) // 2] * 1000:.0f} ms is under two sampling "
                     f"intervals ({interval * 1000:.0f} ms): energy rests on interpolated edge readings; "
                     "use more --max-new-tokens for energy numbers")
    short = [r for r in measured if r.stats.finish_reason == "stop"]
    if short and not config.ignore_eos:
        notes.append(f"{len(short)} of {len(measured)} runs stopped at EOS before max_new_tokens "
                     "(--ignore-eos gives fixed lengths)")
    if report.routes[0].policy != "ar":
        notes.append("AR is not among the routes: no speedups (add ar to --policies)")
    if report.meta["engine"]["device"] == "cpu":
        notes.append("ran on the CPU: the numbers check the pipeline, they are not edge performance")
    if report.partial:
        done = sum(1 for r in report.runs)
        notes.insert(0, f"PARTIAL: interrupted after {done} of {report.planned_runs} runs; "
                        "routes and prompts without runs are empty")
    return notes


# ----------------------------------------------------------------------------- aggregation


def _med(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return median(vals) if vals else None


def _max(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def summarize_route(route: Route, measured: Sequence[RunRecord], ar: Route | None) -> dict:
    runs = [r for r in measured if r.route == route]
    tokens = sum(r.stats.new_tokens for r in runs)
    iterations = sum(r.stats.iterations for r in runs)
    verifier = sum(r.stats.verifier_calls for r in runs)
    passes = sum(r.stats.forward_passes for r in runs)
    tok_s = [r.stats.decode_tokens_per_s for r in runs]
    per_prompt = {}
    for i in sorted({r.prompt_index for r in runs}):
        per_prompt[i] = median(r.stats.decode_tokens_per_s for r in runs if r.prompt_index == i)
    speedup = None
    if ar is not None:
        ratios = []
        for i, v in per_prompt.items():
            base = [r.stats.decode_tokens_per_s for r in measured if r.route == ar and r.prompt_index == i]
            if base and median(base) > 0:
                ratios.append(v / median(base))
        speedup = median(ratios) if ratios else None
    hist: dict[int, int] = {}
    per_c: dict[int, int] = {}  # fused passes per candidate count (several when c is chosen per pass)
    for r in runs:
        for k, v in r.stats.accepted_histogram.items():
            hist[k] = hist.get(k, 0) + v
        for c, v in r.stats.fused_candidates.items():
            per_c[c] = per_c.get(c, 0) + v
    windows = [r.window for r in runs if r.window is not None]
    temps: dict[str, float] = {}
    clocks: dict[str, list[float]] = {}
    notes: list[str] = []
    for w in windows:
        for k, v in w.peak_temps_c.items():
            temps[k] = max(v, temps.get(k, v))
        for k, (lo, hi) in w.clocks_mhz.items():
            old = clocks.get(k, [lo, hi])
            clocks[k] = [min(old[0], lo), max(old[1], hi)]
        notes.extend(n for n in w.notes if n not in notes)
    return {
        **route.to_dict(),
        "runs": len(runs),
        "new_tokens": tokens,
        "decode_tok_s": _med(tok_s),
        "decode_tok_s_min": min(tok_s) if tok_s else None,
        "decode_tok_s_max": max(tok_s) if tok_s else None,
        "per_prompt_tok_s": [per_prompt[i] for i in sorted(per_prompt)],
        "speedup_vs_ar": speedup,
        "tokens_per_iteration": tokens / iterations if iterations else None,
        "verifier_call_rate": verifier / iterations if iterations else None,
        "forward_passes": passes,
        "tokens_per_forward": tokens / passes if passes else None,
        "prefill_s": _med([r.stats.prefill_s for r in runs]),
        "accepted_histogram": {str(k): hist[k] for k in sorted(hist)},
        "fused_candidates": {str(c): per_c[c] for c in sorted(per_c)},
        "avg_power_w": _med([w.avg_power_w for w in windows]),
        "peak_power_w": _max([w.peak_power_w for w in windows]),
        "energy_j": _med([w.energy_j for w in windows]),
        "j_per_token": _med([r.j_per_token() for r in runs]),
        "j_per_token_counter": _med([r.j_per_token_counter() for r in runs]),
        "tokens_per_joule": (1 / j) if (j := _med([r.j_per_token() for r in runs])) else None,
        "peak_temps_c": temps,
        "max_temp_c": max(temps.values()) if temps else None,
        "clocks_mhz": {k: {"min": lo, "max": hi} for k, (lo, hi) in clocks.items()},
        "avg_gpu_load_pct": _med([w.avg_gpu_load_pct for w in windows]),
        "peak_ram_used_mb": _max([w.peak_ram_used_mb for w in windows]),
        "peak_gpu_mem_used_mb": _max([w.peak_gpu_mem_used_mb for w in windows]),
        "peak_torch_mb": _max([r.peak_torch_mb for r in runs]),
        "peak_rss_mb": _max([r.rss_mb for r in runs]),
        "window_samples": sum(w.n_samples for w in windows),
        "notes": notes,
    }


def _timeline(samples, runs: Sequence[RunRecord], t0: float) -> dict:
    return {
        "samples": [{
            "t": s.t - t0, "power_w": s.power_w, "cpu_load_pct": s.cpu_load_pct, "gpu_load_pct": s.gpu_load_pct,
            "gpu_freq_mhz": s.gpu_freq_mhz, "cpu_freq_mhz": s.cpu_freq_mhz,
            "max_temp_c": max(s.temps_c.values()) if s.temps_c else None,
        } for s in samples],
        "windows": [{"route": r.route.name, "prompt_index": r.prompt_index, "repeat": r.repeat, "warmup": r.warmup,
                     "start": r.decode_start - t0, "end": r.decode_end - t0} for r in runs],
    }


# ----------------------------------------------------------------------------- provenance


def git_commit(where: Path | None = None) -> dict | None:
    """The commit of the source tree this package runs from (None when not a git checkout).

    ``BITMTP_COMMIT`` overrides it: a tree copied to another machine may carry a stale .git."""
    if os.environ.get("BITMTP_COMMIT"):
        return {"commit": os.environ["BITMTP_COMMIT"], "dirty": None}
    where = where or Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5, check=False)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}


def device_name(engine: Engine, posture: PowerPosture) -> str:
    import torch

    if engine.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(engine.device)
        gpu = f"{torch.cuda.get_device_name(engine.device)} ({engine.device}, sm_{major}{minor})"
        return f"{posture.module} — {gpu}" if posture.on_jetson and posture.module else gpu
    cpu = _cpu_model() or platform.processor() or platform.machine()
    where = posture.module if posture.on_jetson and posture.module else socket.gethostname()
    return f"{where} — CPU {cpu} ({os.cpu_count()} cores)"


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def describe_run(engine: Engine, posture: PowerPosture, config: BenchConfig, command: str | None,
                 workload_source: str = "") -> dict:
    import torch

    from ..format.manifest import MANIFEST, sha256_file

    m = engine.manifest
    mtp = m.mtp
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "git": git_commit(),
        "device": device_name(engine, posture),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(),
                 "python": platform.python_version(), "torch": torch.__version__,
                 "cuda": torch.version.cuda, "cpu_count": os.cpu_count()},
        "engine": {
            "backend": engine.backend.name,
            "device": str(engine.device),
            "runtime": _runtime(engine),
            "head": engine.head,
            "draft_head": engine.draft_head,
        },
        "artifact": {
            "path": str(engine.path),
            "manifest_sha256": sha256_file(Path(engine.path) / MANIFEST),
            "weights_sha256": m.files.get("weights.safetensors"),
            "family": m.model.family, "layers": m.model.num_layers, "hidden": m.model.hidden_size,
            "vocab": m.model.vocab_size, "block_size": mtp.block_size if mtp else None,
            "tau": mtp.tau if mtp else None, "min_prefix": mtp.min_prefix if mtp else None,
            "max_context": engine.backend.max_context,
        },
        "posture": posture.to_dict(),
        "config": config.to_dict(),
        "workload": {"source": workload_source},
    }


def _runtime(engine: Engine) -> dict | None:
    """The fast backends' ablation flags (M1, M2, M3); None for the reference backend."""
    from dataclasses import asdict, is_dataclass

    opts = getattr(engine.backend, "opts", None)
    if not is_dataclass(opts):
        return None
    return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in asdict(opts).items()}


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(list(argv))
