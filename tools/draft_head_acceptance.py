"""What a coarser draft head costs in acceptance: speculative and hybrid decoding replayed on
held-out prompts with the int8 draft head and with int4 ones (``--draft-head int4``).

Per prompt, as ``tools/eval_acceptance.py`` replays it: the AR greedy continuation, then one
forward in the training layout with a mask block hanging from every anchor; the draft rows'
hidden states go through each head (the same hidden states, so only the head differs), and
speculative and hybrid (τ, m) are replayed over each head's drafts and (calibrated)
confidences. Heads:

* ``int8``: the artifact's (``numerics.quantize_rows_int8``);
* ``int4``: the runtime's (``numerics.quantize_rows_int4``: per-row clip ratio of least error);
* ``int4-absmax``: int4 with the plain absmax scale (the clip search's alternative).

    python tools/draft_head_acceptance.py --prompts 40 --jobs 2 --out tools/results/int4_draft_head

Writes ``draft_head_acceptance.json`` and ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels_ampere.numerics import (INT4_QMAX, SCALE_EPS, quantize_rows_int4, quantize_rows_int8,  # noqa: E402
                                     unpack_int4_rows)
from tools.eval_acceptance import REPLAY_COUNTS, block_logits, exact_float32_int_matmul, replay, replay_rates  # noqa: E402
from tools.eval_quality import CHECKPOINTS  # noqa: E402
from tools.provenance import commit  # noqa: E402

HEADS = ("int8", "int4", "int4-absmax")
POLICIES = ("speculative", "hybrid")


def int4_absmax(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 codes (widened to int8) and scales with the absmax scale, no clip search."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=-1) / INT4_QMAX).clamp(min=SCALE_EPS / INT4_QMAX)
    return torch.round(w32 / scale.unsqueeze(-1)).clamp(-INT4_QMAX, INT4_QMAX).to(torch.int8), scale


def head_codes(w: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each head as (int8 codes [V, H], row scales [V]): what the reference model's draft path reads."""
    packed, scale = quantize_rows_int4(w)
    return {"int8": quantize_rows_int8(w), "int4": (unpack_int4_rows(packed, w.shape[1]), scale),
            "int4-absmax": int4_absmax(w)}


@torch.no_grad()
def evaluate(path: str, prompts: list[str], tau: float, min_prefix: int, max_new: int) -> dict:
    """Summed replay counts per (head, policy), and how many draft tokens each head shares with int8."""
    from bitmtp_edge.runtime.calibration import ConfidenceCalibration
    from tools.hf_checkpoint import load_runtime_model
    from tools.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    model, ck = load_runtime_model(path, torch.float32, "cpu")
    tok = load_tokenizer(Path(path))
    eos = set(ck.model.eos_token_ids)
    calibration = ConfidenceCalibration.for_model(ck.mtp, "cpu")
    heads = head_codes(model.head_weight.detach())
    totals = {f"{h}/{p}": dict.fromkeys(REPLAY_COUNTS, 0) for h in HEADS for p in POLICIES}
    same_as_int8 = dict.fromkeys(HEADS, 0)
    drafts = 0
    with exact_float32_int_matmul():
        for text in prompts:
            ids = tok.encode(text, add_special_tokens=False).ids
            tops = {}
            for h, (w, s) in heads.items():
                model.draft_head_int8, model.draft_head_scale = w, s.float()
                cont, logits, stop = block_logits(model, ids, ck.mtp.block_size, ck.mtp.mask_token_id, max_new, eos)
                conf, top = torch.softmax(logits, dim=-1).max(-1)
                if calibration is not None:
                    conf = torch.stack([calibration(row) for row in conf])
                tops[h] = top
                for p in POLICIES:
                    for k, v in replay(cont, top.tolist(), conf.tolist(), stop, max_new, p, tau, min_prefix).items():
                        totals[f"{h}/{p}"][k] += v
            drafts += tops["int8"].numel()
            for h in HEADS:
                same_as_int8[h] += int((tops[h] == tops["int8"]).sum())
    return {"totals": totals, "same_as_int8": same_as_int8, "drafts": drafts}


def _evaluate_job(job) -> dict:
    return evaluate(*job)


def summarise(parts: list[dict]) -> dict:
    totals = {k: {c: sum(p["totals"][k][c] for p in parts) for c in REPLAY_COUNTS} for k in parts[0]["totals"]}
    drafts = sum(p["drafts"] for p in parts)
    return {"rates": {k: replay_rates(t) for k, t in totals.items()},
            "draft_agreement_with_int8": {h: sum(p["same_as_int8"][h] for p in parts) / max(drafts, 1) for h in HEADS},
            "drafts": drafts}


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = ["# Draft heads on held-out prompts: int8 against int4", "",
             f"- checkpoint: `{s['checkpoint']}`; {s['prompts']} held-out prompts, {s['max_new_tokens']} tokens, "
             f"hybrid τ {s['tau']}, m {s['min_prefix']}", f"- date: {report['date']}; commit: {report['commit']}",
             f"- command: `{report['command']}`", "",
             "| head | draft tokens equal to int8's | speculative tokens / iteration | speculative tokens / forward "
             "| hybrid tokens / forward | hybrid verifier rate | hybrid unverified mistakes |",
             "|---|---|---|---|---|---|---|"]
    r = report["result"]
    for h in HEADS:
        sp, hy = r["rates"][f"{h}/speculative"], r["rates"][f"{h}/hybrid"]
        lines.append(f"| {h} | {r['draft_agreement_with_int8'][h]:.4f} | {sp['tokens_per_iteration']:.3f} | "
                     f"{sp['tokens_per_forward']:.3f} | {hy['tokens_per_forward']:.3f} | "
                     f"{hy['verifier_call_rate']:.3f} | {hy['unverified_mistakes']} |")
    return "\n".join(lines) + "\n"


def _shown(path: str) -> str:
    """A path as the report names it: relative to the repository where it lies inside."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(CHECKPOINTS / "bitmtp-d8-27m"))
    ap.add_argument("--data", type=Path, default=CHECKPOINTS / "data", help="corpus folder (its held-out prompts)")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tau", type=float, default=0.9)
    ap.add_argument("--min-prefix", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1, help="worker processes, each a share of the prompts")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from tools.corpus import CorpusIndex
    from tools.prompts import read_prompts

    prompts = [p.model_prompt for p in read_prompts(args.data / CorpusIndex.load(args.data).prompts)[:args.prompts]]
    if not prompts:
        raise SystemExit(f"draft_head_acceptance: {args.data}: no held-out prompts")
    jobs = [(args.checkpoint, prompts[i::args.jobs], args.tau, args.min_prefix, args.max_new_tokens)
            for i in range(max(args.jobs, 1)) if prompts[i::args.jobs]]
    if len(jobs) == 1:
        parts = [_evaluate_job(jobs[0])]
    else:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(len(jobs), mp_context=ctx) as pool:
            parts = list(pool.map(_evaluate_job, jobs))
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
              "command": " ".join(["python tools/draft_head_acceptance.py", *(argv if argv is not None else sys.argv[1:])]),
              "settings": {"checkpoint": _shown(args.checkpoint), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                           "tau": args.tau, "min_prefix": args.min_prefix},
              "result": summarise(parts)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_head_acceptance.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "draft_head_acceptance.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
