"""The benchmark's outputs, all rendered from the ``bench.json`` dict: the JSON itself,
``bench.md`` (provenance + one table row per route + notes) and three PNG plots (decode tok/s
per route; power over time with the decode windows shaded; tokens per iteration).

Rendering from the dict, not from live objects, means a saved ``bench.json`` can be redrawn.
Plots use matplotlib's object API on an Agg canvas: no pyplot state, no display.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILES = ("bench.json", "bench.md", "bench.csv", "tok_s.png", "power.png", "tokens_per_iteration.png")

# bench.csv: one row per route, the numbers of bench.md unformatted (for spreadsheets and pandas).
CSV_COLUMNS = ("name", "policy", "tau", "min_prefix", "candidates", "runs", "new_tokens", "decode_tok_s",
               "decode_tok_s_min", "decode_tok_s_max", "speedup_vs_ar", "tokens_per_iteration", "forward_passes",
               "tokens_per_forward", "verifier_call_rate", "prefill_s",
               "avg_power_w", "peak_power_w", "energy_j", "j_per_token", "tokens_per_joule", "max_temp_c",
               "avg_gpu_load_pct", "peak_ram_used_mb", "peak_gpu_mem_used_mb", "peak_torch_mb", "peak_rss_mb")


class ReportError(OSError):
    """The output folder cannot be written."""


def write_report(report: dict, out_dir: str | os.PathLike) -> list[Path]:
    """Write bench.json, bench.md, bench.csv and the PNG plots into ``out_dir``; returns the paths.

    Every file is first written under a temporary name in ``out_dir`` and renamed into place
    only once all of them are complete: a failure (a full disk, a name taken by a folder) or
    Ctrl-C while writing leaves no truncated bench.json and no mix of this run's files with an
    earlier run's, and raises ReportError naming the file."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"{out}: cannot create the output folder ({e}); choose another --out") from None
    paths = [out / name for name in FILES]
    writers = (
        lambda p: p.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n", encoding="utf-8"),
        lambda p: p.write_text(render_markdown(report), encoding="utf-8"),  # τ, ×, —: whatever the locale
        lambda p: write_csv(report, p),
        lambda p: plot_tok_s(report, p),
        lambda p: plot_power(report, p),
        lambda p: plot_tokens_per_iteration(report, p),
    )
    temps = [out / f".{path.name}.{os.getpid()}.tmp" for path in paths]
    try:
        for path in paths:  # before any work: a rename onto a folder would fail after the others
            if path.is_dir() and not path.is_symlink():
                raise ReportError(f"{path}: is a folder, so the report cannot be written there; "
                                  "choose another --out")
        for path, temp, write in zip(paths, temps, writers):
            try:
                write(temp)
            except OSError as e:
                raise ReportError(f"{path}: cannot be written ({e.strerror or e}); the report was not saved: "
                                  "choose another --out or free some space") from None
        for path, temp in zip(paths, temps):
            try:
                os.replace(temp, path)
            except OSError as e:
                raise ReportError(f"{path}: cannot be written ({e.strerror or e}); choose another --out") from None
    finally:
        for temp in temps:
            if temp.exists() or temp.is_symlink():
                try:
                    temp.unlink()
                except OSError:
                    pass
    return paths


def write_csv(report: dict, path: Path) -> None:
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([*CSV_COLUMNS, "partial"])
        for route in report["routes"]:
            writer.writerow([*("" if route.get(c) is None else route.get(c) for c in CSV_COLUMNS),
                             bool(report.get("partial"))])


def _fmt(v, spec: str = ".1f", none: str = "–") -> str:
    return none if v is None else format(v, spec)


def _clock(route: dict, key: str) -> str:
    c = route["clocks_mhz"].get(key)
    if not c:
        return "–"
    return f"{c['min']:.0f}" if c["min"] == c["max"] else f"{c['min']:.0f}–{c['max']:.0f}"


def _mem(route: dict) -> str:
    parts = []
    if route["peak_torch_mb"] is not None:
        parts.append(f"torch {route['peak_torch_mb']:.0f}")
    if route["peak_gpu_mem_used_mb"] is not None:
        parts.append(f"GPU {route['peak_gpu_mem_used_mb']:.0f}")
    if route["peak_ram_used_mb"] is not None:
        parts.append(f"RAM {route['peak_ram_used_mb']:.0f}")
    elif route["peak_rss_mb"] is not None:
        parts.append(f"RSS {route['peak_rss_mb']:.0f}")
    return ", ".join(parts) or "–"


TABLE_COLUMNS = ("route", "decode tok/s", "speedup vs AR", "tokens/iter", "tokens/forward", "verifier-call rate", "avg power W",
                 "J/token", "peak temp °C", "GPU MHz", "CPU MHz", "mem MB")
# The same columns, short enough for an 80-column terminal.
TERMINAL_COLUMNS = ("route", "tok/s", "×AR", "tok/it", "tok/fw", "verify", "W", "J/tok", "°C", "GPU MHz", "CPU MHz", "mem MB")


def table_rows(report: dict) -> list[list[str]]:
    rows = []
    for r in report["routes"]:
        rows.append([
            r["name"], _fmt(r["decode_tok_s"]), _fmt(r["speedup_vs_ar"], ".2f") if r["speedup_vs_ar"] else "–",
            _fmt(r["tokens_per_iteration"], ".2f"), _fmt(r.get("tokens_per_forward"), ".2f"),
            _fmt(r["verifier_call_rate"], ".2f"),
            _fmt(r["avg_power_w"]), _fmt(r["j_per_token"], ".3g"), _fmt(r["max_temp_c"], ".0f"),
            _clock(r, "gpu"), _clock(r, "cpu"), _mem(r),
        ])
    return rows


def markdown_table(report: dict) -> list[str]:
    return ["| " + " | ".join(TABLE_COLUMNS) + " |",
            "|" + "|".join("---" if i == 0 else "---:" for i in range(len(TABLE_COLUMNS))) + "|",
            *("| " + " | ".join(row) + " |" for row in table_rows(report))]


def _energy_table(report: dict) -> list[str]:
    """Energy detail, when a power sensor was read: the integrated power and, where the GPU
    has one (NVML), its hardware energy counter over the same windows, as a cross-check."""
    routes = report["routes"]
    if not any(r["energy_j"] is not None for r in routes):
        return []
    counter = any(r["j_per_token_counter"] is not None for r in routes)
    head = ["route", "avg power W", "peak power W", "energy per run J", "J/token", "tokens/J"]
    head += ["J/token (energy counter)"] if counter else []
    lines = ["## Energy (decode windows)", "", "| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for r in routes:
        row = [r["name"], _fmt(r["avg_power_w"]), _fmt(r["peak_power_w"]), _fmt(r["energy_j"], ".3g"),
               _fmt(r["j_per_token"], ".3g"), _fmt(r["tokens_per_joule"], ".3g")]
        row += [_fmt(r["j_per_token_counter"], ".3g")] if counter else []
        lines.append("| " + " | ".join(row) + " |")
    return [*lines, ""]


def _posture_line(p: dict) -> str:
    if not p["on_jetson"]:
        return "not a Jetson: power-mode and clock checks skipped"
    mode = p["power_mode_name"] or (f"id {p['power_mode_id']}" if p["power_mode_id"] is not None else "unknown")
    locked = {True: "clocks locked", False: "clocks NOT locked", None: "clock lock unknown"}[p["clocks_locked"]]
    ready = "benchmark-ready" if p["ready"] else "NOT benchmark-ready"
    return f"{p['module'] or p['model'] or 'Jetson'}, L4T {p['l4t']} (JetPack {p['jetpack']}): {mode}, {locked} — {ready}"


def _head_note(engine: dict) -> str:
    """The verify head where it is not the 16-bit one (the certified head's share of greedy head
    calls the int8 rows answered alone), and the draft head where it is int4."""
    draft = ", int4 draft head" if engine.get("draft_head") == "int4" else ""
    return _verify_head_note(engine) + draft


def _verify_head_note(engine: dict) -> str:
    if engine.get("head") == "int8":
        return ", int8 verify head"
    if engine.get("head") != "certified":
        return ""
    counts = engine.get("certified_head") or {}
    if not counts.get("calls"):
        return ", certified head (no greedy head call in these runs)"
    return (f", certified head ({counts['certified']} of {counts['calls']} greedy head calls answered by the int8 "
            f"rows, {counts['certified'] / counts['calls']:.0%})")


def _chooser_row(chooser: dict | None) -> list[str]:
    """fused c=auto: the step costs timed at load and what each c cost per token in the runs."""
    if not chooser:
        return []
    costs = ", ".join(f"c={c} {us:.0f} µs" for c, us in chooser["fused_us"].items())
    per_token = ", ".join(f"c={c} {us:.1f}" if us is not None else f"c={c} not run"
                          for c, us in chooser["us_per_token"].items())
    return [f"| fused c=auto | settled on c={chooser['cheapest']}; fused passes timed at load {costs}, draft "
            f"{chooser['draft_us']:.0f} µs; µs per token of each c's passes {per_token} |"]


def render_markdown(report: dict) -> str:
    a, e, cfg, mon, w = report["artifact"], report["engine"], report["config"], report["monitor"], report["workload"]
    git = report["git"]
    git_s = "not a git checkout" if git is None else f"`{git['commit'][:12]}`" + (" (uncommitted changes)" if git["dirty"] else "")
    mtp = f"D={a['block_size']}, τ={a['tau']}, m={a['min_prefix']}" if a["block_size"] else "AR-only"
    lines = [
        f"# bitmtp bench — {report['device']}" + (" (PARTIAL: interrupted)" if report.get("partial") else ""),
        "",
        "| | |",
        "|---|---|",
        f"| date | {report['created']} |",
        f"| command | `{report['command'] or '(library call)'}` |",
        f"| git | {git_s} |",
        (f"| artifact | `{a['path']}` — manifest sha256 `{a['manifest_sha256'][:16]}…`, {a['family']} "
         f"{a['layers']}×{a['hidden']}, vocab {a['vocab']}, {mtp} |"),
        f"| backend | {e['backend']} on {e['device']}" + _head_note(e) + " |",
        *_chooser_row(e.get("candidate_chooser")),
        f"| posture | {_posture_line(report['posture'])} |",
        f"| monitor | {mon['source']}" + (f" every {mon['interval_s'] * 1000:.0f} ms" if mon["interval_s"] else "") + " |",
        (f"| workload | {len(w['prompts'])} prompts from {w.get('source') or 'the caller'}; up to {cfg['max_new_tokens']} "
         f"new tokens ({'fixed length, EOS ignored' if cfg['ignore_eos'] else 'EOS stops'}); {cfg['warmup']} "
         f"warm-up and {cfg['repeats']} measured runs per route and prompt |"),
        "",
        *markdown_table(report),
    ]
    lines += ["", ("Decode tok/s: median over runs; tokens/iter, tokens/forward (committed tokens per decode "
                   "forward pass: draft, verify and AR steps) and verifier-call rate: pooled over runs; "
                   "speedup: median over prompts of the per-prompt ratio to AR; power and J/token: decode window "
                   "only (after prefill), medians over runs."), ""]
    lines += _energy_table(report)
    warnings = report["posture"]["warnings"]
    notes = list(report["notes"]) + [f"posture: {x}" for x in warnings if report["posture"]["on_jetson"]]
    notes += [f"monitor: {x}" for x in mon["notes"]]
    for r in report["routes"]:
        notes += [f"{r['name']}: {x}" for x in r["notes"] if x != mon.get("power_note")]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in dict.fromkeys(notes)] + [""]
    lines += ["## Plots", "", "![decode tok/s per route](tok_s.png)", "",
              "![power over time, decode windows shaded](power.png)", "",
              "![tokens per iteration](tokens_per_iteration.png)", ""]
    return "\n".join(lines) + "\n"


def _figure(width: float = 7.5, height: float = 4.0):
    # The object API with an explicit Agg canvas: no pyplot state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def plot_tok_s(report: dict, path: Path) -> None:
    routes = report["routes"]
    fig = _figure()
    ax = fig.add_subplot()
    names = [r["name"] for r in routes]
    vals = [r["decode_tok_s"] or 0.0 for r in routes]
    lo = [v - (r["decode_tok_s_min"] or v) for v, r in zip(vals, routes)]
    hi = [(r["decode_tok_s_max"] or v) - v for v, r in zip(vals, routes)]
    bars = ax.bar(names, vals, yerr=[lo, hi], capsize=4, color=_colors(len(routes)))
    for bar, r, up in zip(bars, routes, hi):
        label = f"{bar.get_height():.1f}" + (f"\n×{r['speedup_vs_ar']:.2f}" if r["speedup_vs_ar"] else "")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height() + up), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_ylabel("decode tokens/s (median, min–max)")
    ax.set_title(f"{report['device']}\n{report['engine']['backend']} backend", fontsize=9)
    ax.margins(y=0.2)
    ax.tick_params(axis="x", labelsize=8)
    fig.savefig(path, format="png")


def plot_power(report: dict, path: Path) -> None:
    samples = report["timeline"]["samples"]
    windows = report["timeline"]["windows"]
    fig = _figure(9, 4)
    ax = fig.add_subplot()
    powered = [(s["t"], s["power_w"]) for s in samples if s["power_w"] is not None]
    if powered:
        ax.plot([t for t, _ in powered], [p for _, p in powered], lw=1, color="black")
        ax.set_ylabel("power W" + (" (NVML: GPU board)" if report["monitor"]["source"] == "nvml" else " (total)"))
        title = f"power over time, {report['monitor']['source']} every {report['monitor']['interval_s'] * 1000:.0f} ms"
    else:
        load = [(s["t"], s["cpu_load_pct"]) for s in samples if s["cpu_load_pct"] is not None]
        if load:
            ax.plot([t for t, _ in load], [v for _, v in load], lw=1, color="gray")
        ax.set_ylabel("CPU load % (power unknown)")
        title = f"power unknown ({report['monitor']['source']}): CPU load shown instead"
    names = [r["name"] for r in report["routes"]]
    colors = dict(zip(names, _colors(len(names))))
    seen = set()
    for w in windows:
        if w["warmup"]:
            ax.axvspan(w["start"], w["end"], color="lightgray", alpha=0.5, lw=0,
                       label=None if "warm-up" in seen else "warm-up")
            seen.add("warm-up")
        else:
            ax.axvspan(w["start"], w["end"], color=colors.get(w["route"], "C0"), alpha=0.35, lw=0,
                       label=None if w["route"] in seen else w["route"])
            seen.add(w["route"])
    ax.set_xlabel("seconds since the benchmark started (shaded: decode windows)")
    ax.set_title(title, fontsize=9)
    if seen:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, format="png")


def plot_tokens_per_iteration(report: dict, path: Path) -> None:
    routes = report["routes"]
    ks = list(range(1, max((int(k) for r in routes for k in r["accepted_histogram"]), default=1) + 1))
    fig = _figure()
    ax = fig.add_subplot()
    width = 0.8 / max(len(routes), 1)
    for j, (r, color) in enumerate(zip(routes, _colors(len(routes)))):
        total = sum(r["accepted_histogram"].values()) or 1
        frac = [r["accepted_histogram"].get(str(k), 0) / total for k in ks]
        ax.bar([k + (j - (len(routes) - 1) / 2) * width for k in ks], frac, width=width, color=color,
               label=f"{r['name']} (mean {_fmt(r['tokens_per_iteration'], '.2f')})")
    ax.set_xticks(ks)
    ax.set_xlabel("tokens committed per iteration")
    ax.set_ylabel("fraction of iterations")
    ax.set_title("tokens per iteration (measured runs)", fontsize=9)
    ax.legend(fontsize=7)
    fig.savefig(path, format="png")
