"""Kernels per decode step on the graph backend, the fused step beside AR / draft / verify.

Runs the ampere backend eagerly (runtime ``m1``: the same kernels as Full, no graphs, so the
profiler sees every launch) on an artifact and counts, per step, the CUDA kernels and their
summed GPU time for an AR step, a draft step (k = 1), a verify step and fused steps after a
draft step (c = 1 and 3). A captured graph replays the same kernels back to back; at batch 1
each costs about its launch latency, so the count is most of what a replay costs.

    python tools/profile_fused.py [--artifact DIR] [--out tools/results]
Writes ``fused_profile.json`` and ``fused_profile.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bitmtp_edge import Engine  # noqa: E402
from bitmtp_edge.backends.base import DraftResult  # noqa: E402
from tools.profile_step import profile_role  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, default=None, help="artifact folder [default: the embedded model]")
    ap.add_argument("--out", type=Path, default=ROOT / "tools" / "results")
    args = ap.parse_args()
    eng = Engine.load(args.artifact, backend="ampere", device="cuda", runtime="m1")
    b, d = eng.backend, eng.block_size
    prompt = list(range(10, 42))
    b.reset()
    b.prefill(prompt)
    length = len(prompt)

    def restore():  # every step below starts from the same history
        b.kv.length = length
        b.static.history_len.fill_(length)
        b.staged = type(b.staged)()

    def staged_drafts():  # a draft step's outputs, as its graph leaves them
        b.kv.length = length + 1
        b.static.history_len.fill_(length + 1)
        b.static.verify_tokens.copy_(torch.tensor([prompt[-1]] + [5] * d))
        b.static.readback[2:2 + d].fill_(5)
        b.static.readback[2 + d:].fill_(0.5)
        b.staged = type(b.staged)()

    def ar():
        b.ar_step(prompt[-1])
        restore()

    def draft():
        b.draft_step([prompt[-1]], d).tokens  # noqa: B018 - reads the drafts (one sync)
        restore()

    def verify():
        staged_drafts()
        b.verify_step(prompt[-1], DraftResult([5] * d, [0.5] * d))
        restore()

    def fused(c):
        def step():
            staged_drafts()
            b.fused_step(prompt[-1], [], DraftResult([5] * d, [0.5] * d), c, d)
            restore()
        return step

    steps = {"ar": ar, "draft k=1": draft, "verify": verify, "fused c=1": fused(1), "fused c=3": fused(3)}
    report = {"device": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "artifact": str(eng.path),
              "steps": {name: profile_role(fn, steps=4) for name, fn in steps.items()}}
    lines = ["# Kernels per decode step (eager, runtime m1)", "", f"- device: {report['device']}",
             f"- date: {report['date']}", f"- command: `{report['command']}`", "",
             "| step | kernels | GPU µs |", "|---|---|---|"]
    lines += [f"| {k} | {v['kernels_per_step']:.0f} | {v['gpu_us_per_step']:.1f} |" for k, v in report["steps"].items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fused_profile.json").write_text(json.dumps(report, indent=1))
    (args.out / "fused_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
