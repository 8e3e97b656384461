"""Decoding policies priced at a board's step costs: the trained model's measured step sequences
(``tools/bench_e2e.py``'s report) at the replay costs of the 2B shape on a board's SM count
(``tools/bench_replay_widths.py --sms N``).

On the whole H200 a 2B decode step rides on launch latency, so a fused pass of width 32 costs
1.85× an AR step while a draft of width 9 costs 1.3×; on 8 SMs (an Orin NX's count) the W2A8 work
is the step, and the order can flip. Which policy a board should run is then a question of the
model's step sequence (how many passes of which width, from real acceptance) priced at the
board's costs — what this script computes, from files, without a GPU::

    python tools/project_board.py --steps tools/results/e2e.json \\
        --replays tools/results/session14/r8_board_mmasync_nopdl_v7.json \\
                  tools/results/session14/r8_board_mmasync_nopdl_v7_more.json \\
        --proxy d11=d12,d13=d14,d15=d16 --out tools/results/board_projection

A step ``(width, role)`` is priced by the replay labelled as ``bench_replay_widths`` labels it:
``1`` (the AR step), ``dM`` / ``vM`` (draft / verify of width M), ``M`` (the fused state of width
M); several ``--replays`` files of the same table and SM count are merged (a later file's
label wins). ``--proxy d11=d12`` prices a label that was not measured by one that was (the
report says so: it is an assumption). A route with a step neither measured nor proxied is listed with
what is missing, not priced. Per-pass host overhead is left out (on a board it is small against
milliseconds of W2A8 work; on the H200 ``bench_e2e.py`` adds it). A projection, not a decode.

Writes ``board_projection.json`` and ``board_projection.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.provenance import commit  # noqa: E402


def step_label(width: int, role: str) -> str:
    """``bench_replay_widths``' label of a decode step."""
    if role == "fused":
        return str(width)
    if width == 1 and role == "verify":
        return "1"
    return f"{role[0]}{width}"


def parse_proxies(text: str) -> dict[str, str]:
    proxies = {}
    for item in filter(None, text.split(",")):
        label, sep, by = item.partition("=")
        if not sep or not label or not by:
            raise SystemExit(f"project_board: --proxy {text!r}: expected LABEL=MEASURED pairs, e.g. v9=d9")
        proxies[label] = by
    return proxies


def read_json(path: str, keys: tuple[str, ...], what: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
        for key in keys:
            data[key]  # noqa: B018 (the keys this script reads)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"project_board: {path}: not {what} ({type(e).__name__}: {e})")
    return data


def project(steps_report: dict, replay_us: dict[str, float], proxies: dict[str, str]) -> dict:
    """Per trained route: its passes priced at ``replay_us`` (µs per label, proxies applied)."""
    cost = dict(replay_us)
    for label, by in proxies.items():
        if label not in cost and by in replay_us:
            cost[label] = replay_us[by]
    if "1" not in cost:
        raise SystemExit("project_board: the replays have no AR step (width 1): nothing to compare against")
    routes = {}
    for art, by_config in steps_report["trained"].items():
        for config, per in by_config.items():
            for route, r in per.items():
                if route == "prompts" or not r.get("steps"):
                    continue
                labels = Counter(step_label(w, role) for seq in r["steps"] for w, role in seq)
                tokens = sum(r["tokens"])
                missing = sorted(set(labels) - set(cost))
                entry = {"artifact": art, "config": config, "passes": sum(labels.values()), "tokens": tokens,
                         "steps": dict(sorted(labels.items(), key=lambda kv: -kv[1]))}
                if missing:
                    entry["missing"] = missing
                else:
                    us = sum(n * cost[label] for label, n in labels.items())
                    entry.update(us=us, us_per_token=us / tokens, tok_s=tokens / (us * 1e-6))
                routes[route] = entry
    ar = routes.get("ar")
    for entry in routes.values():
        if ar and "tok_s" in ar and "tok_s" in entry:
            entry["vs_ar"] = entry["tok_s"] / ar["tok_s"]
    return {"cost_us": cost, "proxies": {k: v for k, v in proxies.items() if k not in replay_us}, "routes": routes,
            "auto": auto_choice(routes)}


def auto_choice(routes: dict) -> dict | None:
    """Where policy fused without a fixed c settles at these costs: the c of ``AUTO_CANDIDATES``
    whose measured route costs the fewest µs per token (``runtime/candidates.py`` measures the
    same quantity while it decodes). The trained report's own ``fused auto`` route is the c its
    GPU chose, so it is not what a board would run: it is priced above as measured, not used here."""
    from bitmtp_edge.format.config import AUTO_CANDIDATES

    priced = {c: routes[f"fused c={c}"] for c in AUTO_CANDIDATES if "us_per_token" in routes.get(f"fused c={c}", {})}
    if len(priced) < len(AUTO_CANDIDATES):
        return None
    c = min(priced, key=lambda k: (priced[k]["us_per_token"], k))
    return {"c": c, "us_per_token": priced[c]["us_per_token"], "vs_ar": priced[c].get("vs_ar")}


def markdown(report: dict) -> str:
    lines = ["# Decoding policies priced at a board's step costs (projection)", "",
             f"- steps: `{report['steps_file']}` (the trained model's measured step sequences, "
             f"{report['steps_device']})",
             f"- step costs: `{report['replays_file']}`, table `{report['table']}` ({report['replays_device']}, "
             f"{report['replays_command']})",
             f"- proxies (assumed, not measured): "
             + (", ".join(f"{k} priced as {v}" for k, v in report["proxies"].items()) or "none"),
             f"- date: {report['date']}; commit: {report['commit']}", f"- command: `{report['command']}`", "",
             "Per pass the replay cost of its (width, role); no host overhead. Projected, not decoded.", "",
             "| route | passes | tokens | µs per token | tok/s | vs AR | steps (label × count) |",
             "|---|---|---|---|---|---|---|"]
    for route, e in report["routes"].items():
        steps = ", ".join(f"{k} × {n}" for k, n in e["steps"].items())
        if "missing" in e:
            lines.append(f"| {route} | {e['passes']} | {e['tokens']} | not priced: no replay of "
                         f"{', '.join(e['missing'])} | | | {steps} |")
        else:
            lines.append(f"| {route} | {e['passes']} | {e['tokens']} | {e['us_per_token']:.0f} | {e['tok_s']:.0f} | "
                         f"{e.get('vs_ar', float('nan')):.2f}× | {steps} |")
    auto = report.get("auto")
    if auto:
        lines += ["", f"Policy fused without a fixed c (`runtime/candidates.py`) would settle on **c = {auto['c']}** "
                  f"at these costs ({auto['us_per_token']:.0f} µs per token"
                  + (f", {auto['vs_ar']:.2f}× AR" if auto.get("vs_ar") else "") + "), after measuring each c for a "
                  "block of passes; a `fused auto` row above is the c the steps' own GPU chose, priced here."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", required=True, help="bench_e2e.py's JSON report (its trained routes' steps)")
    ap.add_argument("--replays", required=True, nargs="+", help="bench_replay_widths.py's JSON reports (merged)")
    ap.add_argument("--table", default=None, help="which table of the replays (default: the only one)")
    ap.add_argument("--proxy", default="", help="LABEL=MEASURED pairs: price an unmeasured label by a measured one")
    ap.add_argument("--out", required=True, help="folder for board_projection.json / .md")
    args = ap.parse_args(argv)
    steps = read_json(args.steps, ("trained",), "a bench_e2e.py report with trained routes")
    runs = [read_json(path, ("tables",), "a bench_replay_widths.py report") for path in args.replays]
    replays = runs[0]
    tables = replays["tables"]
    table = args.table or (next(iter(tables)) if len(tables) == 1 else None)
    replay_us = {}
    for path, run in zip(args.replays, runs):
        if table not in run["tables"]:
            raise SystemExit(f"project_board: --table {args.table!r}: {path} holds {', '.join(run['tables'])}; "
                             "name one that every --replays file holds")
        if (run.get("device"), run.get("sms")) != (replays.get("device"), replays.get("sms")):
            raise SystemExit(f"project_board: {path} was measured on {run.get('device')} / {run.get('sms')} SMs, "
                             f"{args.replays[0]} on {replays.get('device')} / {replays.get('sms')}: merge runs of "
                             "one device and SM count")
        replay_us.update(run["tables"][table]["replay_us"])
    result = project(steps, replay_us, parse_proxies(args.proxy))
    sms = f", {replays['sms']} SMs (green context)" if replays.get("green_context") else ""
    report = {"steps_file": args.steps, "steps_device": steps.get("device", "unrecorded"),
              "replays_file": ", ".join(args.replays), "replays_device": f"{replays.get('device', 'unrecorded')}{sms}",
              "replays_command": "; ".join(run.get("command", "unrecorded") for run in runs), "table": table,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
              "command": "python tools/project_board.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              **result}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "board_projection.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / "board_projection.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
