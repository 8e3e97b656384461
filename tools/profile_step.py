"""Where the time of one decode step goes: kernels per role and width, GPU µs each.

Runs the fast backend eagerly (runtime ``m1``: the width-specialised kernels, no graphs, so
the profiler sees every launch) over an artifact, and for the AR step (M = 1), a draft step
(M = 1 + D) and a verify step (M = D + 1) prints the kernels grouped by name: launches per
step, GPU µs per step. A replayed graph runs the same kernels back to back, so the sum of
GPU time is what a replay costs minus the gaps between kernel nodes.

    python tools/profile_step.py ARTIFACT [--replay] [--out tools/results/profile.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bitmtp_edge import Engine  # noqa: E402
from bitmtp_edge.backends.base import DraftResult  # noqa: E402


def kernel_table(prof, steps: int) -> list[dict]:
    """GPU kernels of the profiled region, grouped by name, per step."""
    rows = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            rows[evt.name][0] += 1
            rows[evt.name][1] += evt.device_time
    out = [{"kernel": name[:70], "launches": n / steps, "us": us / steps} for name, (n, us) in rows.items()]
    return sorted(out, key=lambda r: -r["us"])


def profile_role(fn, steps: int) -> dict:
    fn()  # compile and warm up outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    table = kernel_table(prof, steps)
    return {"kernels_per_step": sum(r["launches"] for r in table), "gpu_us_per_step": sum(r["us"] for r in table),
            "by_kernel": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--runtime", default="m1")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--replay", action="store_true", help="also time every captured graph's replay (runtime full)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    eng = Engine.load(args.artifact, backend="ampere", device="cuda", runtime=args.runtime)
    b, d = eng.backend, eng.block_size
    prompt = list(range(10, 42))
    b.prefill(prompt)
    roles = {"ar M=1": lambda: b.ar_step(prompt[-1])}
    if d:
        def draft():
            b.draft_step([prompt[-1]], d).tokens  # noqa: B018 - reads the draft (one sync)
            b.kv.length -= 1
            b.static.history_len.sub_(1)

        def verify():
            b.static.verify_tokens.copy_(torch.tensor(prompt[-1:] * (d + 1)))
            b.verify_step(prompt[-1], DraftResult([prompt[-1]] * d, [0.0] * d))
            b.static.history_len.fill_(len(prompt))
            b.kv.length = len(prompt)

        roles[f"draft M={1 + d}"] = draft
        roles[f"verify M={d + 1}"] = verify
    report = {"artifact": str(args.artifact), "device": torch.cuda.get_device_name(), "runtime": args.runtime,
              "roles": {}}
    for name, fn in roles.items():
        r = profile_role(fn, args.steps)
        report["roles"][name] = r
        print(f"\n== {name}: {r['kernels_per_step']:.0f} kernels, {r['gpu_us_per_step']:.1f} GPU µs per step")
        for row in r["by_kernel"][:14]:
            print(f"  {row['launches']:6.1f} × {row['us']:8.1f} µs  {row['kernel']}")
    if args.replay:  # the same steps captured as graphs (runtime full): µs per replay
        from bench_e2e import replay_times

        del eng, b
        torch.cuda.empty_cache()
        full = Engine.load(args.artifact, backend="ampere", device="cuda", runtime="full")
        report["replay_us"] = replay_times(full, segment=0, base_len=len(prompt))
        for row in report["replay_us"]:
            print(f"  replay M={row['width']:2d} {row['role']:6s} {row['us']:8.1f} µs")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
