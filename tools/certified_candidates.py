"""How the certified head's candidates fall on held-out text: per activation row, how many
vocabulary rows the int8 bound leaves (``l + B >= max(l - B)``), whether they fit the slots, and
whether the 16-bit logits of the leader keep their margin — i.e. how often a greedy head call
is answered without reading the whole 16-bit head.

The runtime's exact integer model (``load_runtime_model``) runs non-overlapping windows of the
test split; every ``--stride``-th position's final hidden state, cast to bfloat16 as the 16-bit
head reads it, goes through the certified head's twins (``kernels_ampere.certified_head``: the
same bounds, selection and resolution as the kernels) against the checkpoint's 16-bit head and
its int8 rows. Each certified token is checked against the 16-bit head's argmax.

    python tools/certified_candidates.py --model d8=tools/checkpoints/bitmtp-d8-27m \\
        --model sft=tools/checkpoints/sft-27m --out tools/results/certified_head
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels_ampere import certified_head as ch  # noqa: E402
from tools.corpus import load_split  # noqa: E402
from tools.eval_quality import add_heldout_arguments, heldout_windows, named_checkpoints  # noqa: E402
from tools.hf_checkpoint import load_runtime_model  # noqa: E402
from tools.provenance import commit  # noqa: E402


@torch.no_grad()
def candidate_stats(model, tokens: np.ndarray, window: int, max_windows: int, stride: int, slots: int) -> dict:
    w16 = model.head_weight.detach().to(torch.bfloat16).contiguous()
    q, s = model.draft_head_int8, model.draft_head_scale
    head = (w16, q, s, *ch.head_error_bounds(w16, q, s))
    _, batches = heldout_windows(tokens, window, max_windows, "cpu", 4)
    counts, fits, certified = [], [], []
    for x, _, pos, mask in batches:
        hidden = model(x, pos, mask).reshape(-1, w16.shape[1])[::stride].to(torch.bfloat16).contiguous()
        up, low, zero = ch.certify_bounds_reference(ch.activation_plane(hidden), *head[1:])
        cand, count = ch.select_candidates_reference(up, low, zero, k=slots)
        token, ok = ch.resolve_candidates_reference(hidden, w16, cand, count)
        expected = (hidden.float() @ w16.float().t()).argmax(dim=1)
        if not torch.equal(token[ok], expected[ok]):
            raise SystemExit("certified_candidates: a certified token is not the 16-bit head's argmax")
        counts += count.tolist()
        fits += (count <= slots).tolist()
        certified += ok.tolist()
    c = np.array(counts)
    return {"rows": len(c), "slots": slots, "candidates_p50": float(np.percentile(c, 50)),
            "candidates_p90": float(np.percentile(c, 90)), "candidates_p99": float(np.percentile(c, 99)),
            "candidates_max": int(c.max()), "alone": float(np.mean(c == 1)), "fit_slots": float(np.mean(fits)),
            "certified": float(np.mean(certified))}


def markdown(report: dict) -> str:
    lines = ["# Certified head: candidates on held-out text", "", f"- date: {report['date']}",
             f"- commit: {report['commit']}", f"- command: `{report['command']}`", "",
             "Per activation row (the final hidden state in bfloat16, one position in "
             f"{report['stride']} of {report['window']}-token test windows): the vocabulary rows the "
             "int8 bound leaves as candidates, the share of rows with one candidate, with at most the slots, and "
             "certified (they fit, and the leader's 16-bit logit keeps its margin).", "",
             "| model | rows | candidates p50 / p90 / p99 / max | one candidate | fit the slots | certified |",
             "|---|---|---|---|---|---|"]
    for name, r in report["models"].items():
        lines.append(f"| {name} | {r['rows']} | {r['candidates_p50']:g} / {r['candidates_p90']:g} / "
                     f"{r['candidates_p99']:g} / {r['candidates_max']} | {r['alone']:.1%} | "
                     f"{r['fit_slots']:.1%} ({r['slots']}) | {r['certified']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_heldout_arguments(ap, window=256, max_windows=16)
    ap.add_argument("--stride", type=int, default=3, help="one position in STRIDE of each window")
    ap.add_argument("--slots", type=int, default=ch.CANDIDATES)
    ap.add_argument("--out", type=Path, required=True, help="folder for certified_candidates.json and .md")
    args = ap.parse_args(argv)
    named = named_checkpoints(args.model, "certified_candidates")
    tokens = load_split(args.data, "test")
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
              "command": " ".join(["python tools/certified_candidates.py", *(argv if argv is not None else sys.argv[1:])]),
              "window": args.window, "stride": args.stride, "models": {}}
    for name, path in named.items():
        model, _ = load_runtime_model(path, torch.float64, "cpu")
        r = candidate_stats(model, tokens, args.window, args.max_windows, args.stride, args.slots)
        report["models"][name] = {"path": path, **r}
        print(f"{name}: {r}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "certified_candidates.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "certified_candidates.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
