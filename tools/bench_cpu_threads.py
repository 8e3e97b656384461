"""How many torch threads the reference backend should use on a CPU: decode tok/s of the
embedded model with 1 thread and with every usable core, alternating, on this host as it is
(a shared or busy host is the case that matters: ``Engine.load`` picks the count by
``runtime.engine.cpu_threads_rule``).

    python tools/bench_cpu_threads.py [--tokens 24] [--repeats 3] [--policy ar]

Writes ``tools/results/cpu_threads.json`` and ``cpu_threads.md`` (or under ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policy", default="ar")
    ap.add_argument("--out", type=Path, default=ROOT / "tools" / "results")
    args = ap.parse_args()

    import torch

    from bitmtp_edge.app.bench import command_line, git_commit
    from bitmtp_edge.runtime.engine import Engine

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    counts = sorted({1, cores})
    eng = Engine.load(backend="reference", device="cpu")
    prompt = "def fibonacci(n):\n    "
    runs = []
    for rep in range(args.repeats):
        for n in counts:  # alternating, so load changes touch both alike
            torch.set_num_threads(n)
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            res = eng.generate(prompt, max_new_tokens=args.tokens, policy=args.policy)
            runs.append({"threads": n, "repeat": rep, "decode_tok_s": res.stats.decode_tokens_per_s,
                         "new_tokens": res.stats.new_tokens, "wall_s": time.perf_counter() - t0, "load_1min": load})
            print(json.dumps(runs[-1]), flush=True)
    summary = {str(n): statistics.median(r["decode_tok_s"] for r in runs if r["threads"] == n) for n in counts}
    data = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(["python", "tools/bench_cpu_threads.py", *sys.argv[1:]]),
        "git": git_commit(ROOT), "host": platform.node(), "cpu": platform.processor() or platform.machine(),
        "cores": cores, "torch": torch.__version__, "policy": args.policy, "tokens": args.tokens,
        "median_decode_tok_s": summary, "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_threads.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = ["# Reference backend on the CPU: torch threads", "",
             f"{data['created']}, `{data['command']}`, commit `{(data['git'] or {}).get('commit', '?')[:12]}`, "
             f"{cores} cores, torch {torch.__version__}, embedded model, policy {args.policy}, "
             f"{args.tokens} new tokens, {args.repeats} alternating repeats.", "",
             "| threads | median decode tok/s | runs (tok/s @ 1-min load) |", "|---|---|---|"]
    for n in counts:
        per = ", ".join(f"{r['decode_tok_s']:.2f} @ {r['load_1min']:.1f}" for r in runs if r["threads"] == n)
        lines.append(f"| {n} | {summary[str(n)]:.2f} | {per} |")
    (args.out / "cpu_threads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
