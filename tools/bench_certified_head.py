"""The certified head against the 16-bit head: what a greedy step's head costs, and how often
the int8 rows answer alone on a trained model.

Part 1 (``--sms``, ``--widths``): a head of the BitNet-2B shape (random bf16 rows, V = 128256,
H = 2560: 656 MB, more than the L2, so every call streams it) timed in a CUDA graph on the whole
GPU (``0``) and on N SMs of it (a green context, as ``sm_partition_stack.py``: an Orin's 8 or
16), for each width M: the 16-bit head (``f16_head_argmax``), the int8 head (W8A8,
``int8_head_argmax``: half the bytes, not the 16-bit head's argmax), and the certified head on
three kinds of rows: along a head row (a clear argmax: the int8 pass, the candidates' 16-bit
rows, the 16-bit launches returning at once), random (random logits of a random head leave more
candidates than the slots: the 16-bit head runs after all), and along two equal head rows (an
exact tie: never certified); for widths from 2, also a fused step's head rows (the first half
verify rows, certified). Every timed call's tokens are checked against the 16-bit head's first.

Part 2 (``--artifact``, default the embedded model): greedy AR decoding of the held-out prompts
on the ampere backend with the 16-bit head and with the certified head: the tokens (equal, or
the run says where not), tokens per second, and the share of head calls the int8 rows answered.

    python tools/bench_certified_head.py --sms 0,8 --widths 1,9 --out tools/results/certified_head

Writes ``certified_head.json`` and ``certified_head.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels_ampere import certified_head as ch  # noqa: E402
from kernels_ampere.autotune import GraphTimer  # noqa: E402
from kernels_ampere.heads import f16_head_argmax, int8_head_argmax  # noqa: E402
from kernels_ampere.numerics import quantize_activations  # noqa: E402
from tools.provenance import commit  # noqa: E402

VOCAB, HIDDEN = 128256, 2560  # BitNet b1.58 2B-4T


TIE = (1000, 90000)  # head rows made equal (and longer than the rest): an exact tie for "tie"
CASES = {"planted": "certified, every row certified (planted argmax)",
         "random": "certified, random rows",
         "tie": "certified, a tie: int8 pass + candidates + 16-bit head"}


def head_case(vocab: int, hidden: int, seed: int = 0):
    """Random bf16 rows with rows ``TIE`` equal (and longer than the rest), their int8 rows and
    bounds, and the generator for the activations."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w16 = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w16[TIE[0]] *= 1.5
    w16[TIE[1]] = w16[TIE[0]]
    q, s = ch.int8_rows(w16)
    return w16, q, s, *ch.head_error_bounds(w16, q, s), g


def activations(w16, m: int, case: str, g) -> torch.Tensor:
    """``m`` rows: along head rows (``planted``: a clear argmax), random (``random``: many close
    logits), or along the head's two equal rows (``tie``: never certified)."""
    x = torch.randn(m, w16.shape[1], device="cuda", generator=g)
    if case == "planted":
        rows = torch.randint(0, w16.shape[0], (m,), device="cuda", generator=g)
        x = w16[rows].float() * 50 + 0.05 * x
    elif case == "tie":
        x = w16[TIE[0]].float()[None, :].expand(m, -1) * 50
    return x.to(torch.bfloat16)


def time_heads(vocab: int, hidden: int, widths: list[int], sms: int, reps: int) -> list[dict]:
    # a partition's own stream (its kernels run where they were captured); else a side stream
    timer = GraphTimer(reps=reps, replays=5, stream=torch.cuda.current_stream() if sms else None)
    *head, g = head_case(vocab, hidden)
    w16, q, s = head[:3]
    rows = []
    for m in widths:
        for case, label in CASES.items():
            x = activations(w16, m, case, g)
            expected = f16_head_argmax(x, w16)[0]
            top, _, every = ch.certified_head_argmax(x, *head, certify=ch.certify_tokens, f16_head=f16_head_argmax)
            if not torch.equal(top, expected):
                raise SystemExit(f"bench_certified_head: M={m}, {case}: tokens differ from the 16-bit head's")
            _, ok = ch.certify_tokens(x, *head)
            us = timer([lambda x=x: ch.certified_head_argmax(x, *head, certify=ch.certify_tokens,
                                                             f16_head=f16_head_argmax)])
            rows.append({"sms": sms, "M": m, "head": label, "us": round(us, 1), "rows_certified": int(ok.sum()),
                         "call_certified": bool(every)})
        if m >= 2:  # a fused step's head rows: the first half verify rows (certified, all accepted), then drafts
            n = (m + 1) // 2
            x = activations(w16, m, "planted", g)
            drafts = f16_head_argmax(x[:n], w16)[0][:n - 1]
            fused = lambda x=x, n=n, drafts=drafts: ch.certified_fused_head(  # noqa: E731
                x, *head, n=n, drafts=drafts, certify_rows=ch.certify_fused_rows, f16_head=f16_head_argmax)
            top, _, every = fused()
            if not bool(every) or not torch.equal(top[:n], f16_head_argmax(x[:n], w16)[0]):
                raise SystemExit(f"bench_certified_head: M={m}, fused: the verify rows are not the 16-bit head's")
            rows.append({"sms": sms, "M": m, "head": f"certified, a fused step's rows ({n} verify, certified)",
                         "us": round(timer([fused]), 1), "rows_certified": n, "call_certified": True})
        x = activations(w16, m, "random", g)
        a, a_s = quantize_activations(x.float())
        rows.append({"sms": sms, "M": m, "head": "16-bit", "us": round(timer([lambda x=x: f16_head_argmax(x, w16)]), 1)})
        rows.append({"sms": sms, "M": m, "head": "int8 (W8A8, not the 16-bit argmax)",
                     "us": round(timer([lambda a=a, a_s=a_s: int8_head_argmax(a, a_s, q, s)]), 1)})
        for r in rows[-6 if m >= 2 else -5:]:
            print(f"sms {sms or 'all'} M {m:2d} {r['head']:55s} {r['us']:9.1f} us "
                  f"{r.get('rows_certified', '')}", flush=True)
    return rows


def decode_model(artifact: str | None, prompts: int, tokens: int) -> dict:
    from bitmtp_edge import Engine
    from tools.bench_e2e import held_out_prompts

    out = {}
    ids = {}
    for head in ("16bit", "certified"):
        eng = Engine.load(artifact, backend="ampere", device="cuda", head=head)
        texts = held_out_prompts(eng, prompts)
        before = eng.backend.fast.certified_counts()
        for p in texts:  # untimed: every prompt once (the first engine's first calls compile and tune)
            eng.generate(p, max_new_tokens=tokens, policy="ar")
        torch.cuda.synchronize()
        t0, got, n, calls, certified = time.perf_counter(), [], 0, 0, 0
        for p in texts:
            r = eng.generate(p, max_new_tokens=tokens, policy="ar")
            got.append(list(r.token_ids))
            n += len(r.token_ids)
            calls, certified = calls + r.stats.certified_head_calls, certified + r.stats.certified_head_int8
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        ids[head] = got
        out[head] = {"tok_s": round(n / wall, 1), "tokens": n, "head_calls": calls, "certified_calls": certified,
                     "certified_share": round(certified / calls, 4) if calls else None,
                     "counted_at_load": list(before)}
        del eng
        torch.cuda.empty_cache()
    out["equal_prompts"] = sum(a == b for a, b in zip(ids["16bit"], ids["certified"]))
    out["prompts"] = len(ids["16bit"])
    return out


def markdown(report: dict) -> str:
    lines = ["# Certified head: the 16-bit head's token from the int8 rows", "",
             f"- device: {report['device']}", f"- date: {report['date']}", f"- commit: {report['commit']}",
             f"- command: `{report['command']}`", "",
             f"Head of V = {report['vocab']}, H = {report['hidden']} (random bf16 rows), µs per call in a CUDA graph "
             f"({report['reps']} calls per replay, median of 5 replays; the head is larger than the L2).", "",
             "| SMs | M | head | µs | × 16-bit head | rows certified |", "|---|---|---|---|---|---|"]
    base = {(r["sms"], r["M"]): r["us"] for r in report["heads"] if r["head"] == "16-bit"}
    for r in report["heads"]:
        ratio = r["us"] / base[(r["sms"], r["M"])]
        certified = f"{r['rows_certified']} of {r['M']}" if "rows_certified" in r else ""
        lines.append(f"| {r['sms'] or 'all'} | {r['M']} | {r['head']} | {r['us']} | {ratio:.2f} | {certified} |")
    d = report.get("decode")
    if d:
        lines += ["", f"Greedy AR on `{report['artifact']}`, {d['prompts']} held-out prompts, "
                      f"{report['tokens']} new tokens each: {d['equal_prompts']} of {d['prompts']} completions equal.", "",
                  "| head | tok/s | head calls | answered by the int8 rows |", "|---|---|---|---|"]
        for head in ("16bit", "certified"):
            r = d[head]
            share = "—" if r["certified_share"] is None else f"{r['certified_calls']} ({r['certified_share']:.1%})"
            lines.append(f"| {head} | {r['tok_s']} | {r['head_calls']} | {share} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", default="0", help="comma list of SM counts (0: the whole GPU)")
    ap.add_argument("--widths", default="1,9")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--reps", type=int, default=8, help="calls per graph replay")
    ap.add_argument("--artifact", default=None, help="the model decoded in part 2 (default: the embedded one)")
    ap.add_argument("--prompts", type=int, default=11)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--no-decode", action="store_true", help="part 1 only")
    ap.add_argument("--out", type=Path, default=ROOT / "tools" / "results" / "certified_head")
    args = ap.parse_args(argv)
    try:
        sms_list = [int(v) for v in args.sms.split(",")]
        widths = [int(v) for v in args.widths.split(",")]
    except ValueError:
        raise SystemExit(f"bench_certified_head: --sms {args.sms!r} / --widths {args.widths!r}: comma-separated integers")
    if not torch.cuda.is_available():
        raise SystemExit("bench_certified_head: needs a CUDA GPU")
    report = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "commit": commit(), "command": "python tools/bench_certified_head.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "vocab": args.vocab, "hidden": args.hidden, "reps": args.reps, "heads": [],
              "artifact": args.artifact or "embedded", "tokens": args.tokens}
    args.out.mkdir(parents=True, exist_ok=True)

    def save():  # after every part: a run cut short keeps what it measured
        (args.out / "certified_head.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "certified_head.md").write_text(markdown(report))

    if not args.no_decode:  # before any partition: the engine runs on the whole GPU
        report["decode"] = decode_model(args.artifact, args.prompts, args.tokens)
        print(json.dumps(report["decode"]), flush=True)
        save()
    for sms in sms_list:
        if sms:
            from tools.sm_partition_stack import enter_partition, graph_sms_reached

            ctx = enter_partition(sms)  # noqa: F841 (held: the partition lives as long as its context)
            reached = graph_sms_reached(torch.cuda.current_stream())
            if reached != sms:
                raise SystemExit(f"bench_certified_head: a graph on the partition reached {reached} SMs, not {sms}")
        report["heads"] += time_heads(args.vocab, args.hidden, widths, sms, args.reps)
        torch.cuda.set_stream(torch.cuda.default_stream())
        save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
