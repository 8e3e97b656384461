"""Tokens per forward pass of the fused policy against speculative, for each candidate count c.

Runs the reference backend (the oracle) on the CPU over the artifact's held-out prompts
(``prompts.jsonl``): AR, speculative, fused with c = 1.. and c = D + 1 (every acceptance
length), and hybrid with and without fused passes. Forward passes, not seconds: a pass is
one step of the model (draft, verify, fused or AR); the wall-clock cost of each width is a
GPU question (``tools/bench_e2e.py``). Fused and speculative must equal AR token for token:
the script says for how many prompts they did. Writes ``fused_candidates.json`` and ``.md``
under ``--out`` (default tools/results), rewritten after every prompt.

    python tools/fused_candidates.py --prompts 8 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bitmtp_edge.runtime.model as model_module  # noqa: E402
from bitmtp_edge.runtime.engine import Engine  # noqa: E402


def convert_codes_once() -> None:
    """Speed only: the reference projections convert their int8 codes to float64 on every
    call (80% of a CPU step); convert each matrix once. The products are the same float64
    GEMMs of the same values, so every logit is unchanged."""
    converted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def int_matmul(a_int8: torch.Tensor, w_int8: torch.Tensor) -> torch.Tensor:
        hit = converted.get(id(w_int8))
        if hit is None or hit[0] is not w_int8:
            hit = converted[id(w_int8)] = (w_int8, w_int8.double().t().contiguous())
        return (a_int8.double() @ hit[1]).to(torch.int32)

    model_module.int_matmul = int_matmul


def configs(block_size: int, counts: list[int]) -> list[tuple[str, str, dict]]:
    out = [("ar", "ar", {}), ("speculative", "speculative", {})]
    out += [(f"fused c={c}" if c <= block_size else f"fused c={c} (all)", "fused", {"candidates": c})
            for c in counts]
    out += [("hybrid", "hybrid", {}), ("hybrid + fused c=2", "hybrid", {"candidates": 2, "hybrid_fused": True})]
    return out


def run_one(eng: Engine, ids: list[int], policy: str, tokens: int, extra: dict) -> dict:
    from bitmtp_edge.runtime.decoding import DecodeStats, decode

    opts = eng.decode_options(policy, tokens, None, None, None, candidates=extra.get("candidates"))
    if extra.get("hybrid_fused"):
        from dataclasses import replace

        opts = replace(opts, hybrid_fused=True)
    stats = DecodeStats()
    out = [t for chunk in decode(eng.backend, ids, opts, stats) for t in chunk]
    widths = [s.width for s in eng.backend.log.states]
    return {"ids": out, "new_tokens": stats.new_tokens, "forward_passes": stats.forward_passes,
            "iterations": stats.iterations, "draft_calls": stats.draft_calls, "fused_calls": stats.fused_calls,
            "width_sum": sum(widths), "width_max": max(widths, default=0)}


def summarise(rows: dict[str, list[dict]], ar_rows: list[dict]) -> dict:
    out = {}
    for name, rs in rows.items():
        tokens = sum(r["new_tokens"] for r in rs)
        passes = sum(r["forward_passes"] for r in rs)
        agree = sum(x == y for r, a in zip(rs, ar_rows) for x, y in zip(r["ids"], a["ids"]))
        out[name] = {
            "prompts": len(rs), "tokens": tokens, "forward_passes": passes,
            "tokens_per_forward": tokens / passes if passes else 0.0,
            "tokens_per_iteration": tokens / max(sum(r["iterations"] for r in rs), 1),
            "mean_width": sum(r["width_sum"] for r in rs) / passes if passes else 0.0,
            "max_width": max(r["width_max"] for r in rs),
            "draft_steps": sum(r["draft_calls"] for r in rs),
            "equal_to_ar": sum(r["ids"] == a["ids"] for r, a in zip(rs, ar_rows)),
            "agreement_with_ar": agree / max(sum(len(a["ids"]) for a in ar_rows[:len(rs)]), 1),
        }
    return out


def markdown(report: dict) -> str:
    lines = ["# Fused verify + draft: tokens per forward pass by candidate count", "",
             f"- artifact: {report['artifact']} (D = {report['block_size']})",
             f"- prompts: {report['prompts_done']} held-out prompts, {report['tokens']} new tokens each",
             f"- backend: reference (float64, CPU); device: {report['device']}",
             f"- date: {report['date']}", f"- commit: {report['commit']}", f"- command: `{report['command']}`", "",
             "| policy | tokens / forward | vs speculative | tokens / iteration | mean width | max width "
             "| draft steps | equal to AR | token agreement with AR |",
             "|---|---|---|---|---|---|---|---|---|"]
    spec = report["summary"].get("speculative", {}).get("tokens_per_forward", 0.0)
    for name, s in report["summary"].items():
        ratio = s["tokens_per_forward"] / spec if spec else 0.0
        lines.append(f"| {name} | {s['tokens_per_forward']:.2f} | {ratio:.2f}× | {s['tokens_per_iteration']:.2f} | "
                     f"{s['mean_width']:.1f} | {s['max_width']} | {s['draft_steps']} | "
                     f"{s['equal_to_ar']}/{s['prompts']} | {s['agreement_with_ar']:.3f} |")
    lines += ["", "A forward pass is one model step (AR, draft, verify or fused); the mean width is over "
              "those passes. Fused with c candidates carries c draft blocks of D rows beside the verify; "
              "when the accepted length is not among them the next iteration drafts first (draft steps). "
              "Hybrid commits a confident prefix unverified, so it is not lossless: its agreement with AR "
              "is the share of positions where it chose AR's token."]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", default=None, help="artifact folder (default: the embedded model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--candidates", default="1,2,3,4,all", help="comma-separated c values; 'all' = D + 1")
    ap.add_argument("--out", type=Path, default=ROOT / "tools" / "results")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (a step's products are too small to gain from more)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    convert_codes_once()
    eng = Engine.load(args.artifact, backend="reference", device="cpu")
    if eng.block_size is None:
        sys.exit(f"{eng.path}: an AR-only artifact has no drafts to fuse; pick an MTP artifact")
    d = eng.block_size
    try:
        counts = [d + 1 if c.strip() == "all" else int(c) for c in args.candidates.split(",")]
    except ValueError:
        sys.exit(f"--candidates {args.candidates!r}: give integers in 1..{d + 1} or 'all', comma-separated")
    from bitmtp_edge.app.demo import demo_prompts

    prompts = [eng.encode(p) for p in demo_prompts(eng, limit=args.prompts)]
    rows: dict[str, list[dict]] = {}
    report = {"artifact": str(eng.path.name if args.artifact is None else args.artifact), "block_size": d,
              "tokens": args.tokens, "device": f"{platform.processor() or platform.machine()} CPU",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": _commit(),
              "command": "python " + " ".join(sys.argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    for i, ids in enumerate(prompts):
        for name, policy, extra in configs(d, counts):
            t0 = time.perf_counter()
            rows.setdefault(name, []).append(run_one(eng, ids, policy, args.tokens, extra))
            r = rows[name][-1]
            print(f"prompt {i} {name}: {r['new_tokens']} tokens / {r['forward_passes']} passes "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        report["prompts_done"] = i + 1
        report["summary"] = summarise(rows, rows["ar"])
        report["per_prompt"] = {n: [{k: v for k, v in r.items() if k != "ids"} for r in rs] for n, rs in rows.items()}
        write_atomic(args.out / "fused_candidates.json", json.dumps(report, indent=1))
        write_atomic(args.out / "fused_candidates.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
