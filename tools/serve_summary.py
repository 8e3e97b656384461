"""The serving benchmark's headline, from bench_serve.py's JSON files: per policy and server,
SSE and JSON against Engine.generate (decode loop and all-in, µs per token and % of the AR step)
and the fixed cost per request. Prints a Markdown table and writes it to --out.

    python tools/serve_summary.py runs/h200_serve/serve_in-process.json runs/h200_serve/serve_separate.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(report: dict) -> list[str]:
    out = []
    step = report.get("ar_step_us")
    for policy, s in report.get("policies", {}).items():
        for name, v in s["servers"].items():
            sse, js = v["stream_vs_direct"], v["json_vs_direct"]

            def cell(o, key):
                pct = o.get(f"{key}_pct_of_ar_step")
                return f"{o[f'{key}_us_per_token']:.1f} ({'—' if pct is None else f'{pct:.1f} %'})"

            out.append(f"| {policy} | {name} | {'—' if step is None else f'{step:.1f}'} | "
                       f"{s['direct_decode_tok_s']:.0f} / {v['stream_decode_tok_s']:.0f} | "
                       f"{cell(sse, 'decode')} | {cell(sse, 'no_prefill')} | {cell(js, 'decode')} | "
                       f"{sse['fixed_ms_per_request']:.2f} | {'yes' if v['identical'] else 'NO'} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here (Markdown)")
    args = ap.parse_args()
    lines = ["| policy | server | AR step µs | decode tok/s direct / SSE | SSE − direct, decode loop µs/token "
             "| SSE − direct, all-in (prefill left out) | JSON − direct, decode loop | fixed ms/request "
             "| same text |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for path in args.reports:
        if not path.is_file():
            notes.append(f"- {path.name}: missing (that part did not run or did not finish)")
            continue
        report = json.loads(path.read_text())
        lines += rows(report)
        notes.append(f"- {path.name}: {report['device']}, {report['date']}, commit {report['commit']}, "
                     f"`{report['command']}`" + (f"; error: {report['error']}" if report.get("error") else ""))
    text = "\n".join(lines + [""] + notes) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
