"""Which held-out prompts decode differently under speculative / fused than under AR on the
reference backend, and where (the first differing token): run it on the GPU to find them, then
on the CPU (the oracle) for just those prompts.

    python tools/reference_divergence.py --device cuda --prompts 40 --out gpu.json
    python tools/reference_divergence.py --device cpu --only 20 --out cpu.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
from pathlib import Path

from tools import eval_quality as eq

POLICIES = ("speculative", "fused")


def decode_one(args):
    ckpt, data, policy, idx, device, prompts, max_new = args
    task = eq.DecodeTask("model", ckpt, policy, (idx,))
    return policy, idx, eq.run_task(task, prompts, data, device, max_new, 0.9, 3)["records"][0]["tokens"]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="tools/checkpoints/bitmtp-d8-27m")
    ap.add_argument("--data", default="tools/checkpoints/data")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--only", default="", help="comma list of prompt indices (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    prompts = eq.read_prompts(Path(args.data) / eq.CorpusIndex.load(args.data).prompts)[:args.prompts]
    only = [int(i) for i in args.only.split(",")] if args.only else list(range(len(prompts)))
    device = "cuda:0" if args.device == "cuda" else args.device
    jobs = [(args.checkpoint, args.data, pol, i, device, prompts, args.max_new_tokens)
            for i in only for pol in ("ar",) + POLICIES]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        tokens = {(pol, i): t for pol, i, t in pool.map(decode_one, jobs)}
    diffs = {}
    for i in only:
        for pol in POLICIES:
            if tokens[(pol, i)] != tokens[("ar", i)]:
                diffs[f"{pol}/{i}"] = {"first_difference": first_difference(tokens[("ar", i)], tokens[(pol, i)]),
                                       "ar": tokens[("ar", i)], pol: tokens[(pol, i)]}
                print(f"prompt {i} {pol}: differs from AR at token {diffs[f'{pol}/{i}']['first_difference']}")
    Path(args.out).write_text(json.dumps({"device": args.device, "checkpoint": args.checkpoint,
                                          "prompts": only, "differences": diffs}, indent=1))
    print(f"checked {len(only)} prompts on {args.device}: {len(diffs)} decodes differ from AR")


if __name__ == "__main__":
    main()
