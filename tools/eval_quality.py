"""The quality report: SFT vs BitMTP on held-out code, every decoding policy, CPU decode speed.

    python -m tools.eval_quality --data runs/data --model sft=runs/sft/compact \
        --model d4=runs/d4/compact --model d8=runs/d8/compact --device cuda --jobs 9 \
        --json tools/results/quality.json --md tools/results/quality.md
    # add the CPU decode benchmark of the embedded artifact to an existing report
    python -m tools.eval_quality --sections cpu_bench --merge tools/results/quality.json --data runs/data ...

Sections:

* ``heldout``: NTP loss and perplexity of every model on the test split (non-overlapping
  ``--window``-token windows, the runtime's exact integer model), and each BitMTP model's
  gap to the AR-only (SFT) model in percent;
* ``decoding``: for each BitMTP model and policy (``ar``, ``confidence``, ``speculative``,
  ``hybrid``; τ and m as given), greedy completions of the held-out prompts: tokens
  committed per iteration, tokens per forward pass, the fraction of generated tokens
  identical (same index, same id) to the same model's AR greedy output, and the fraction of
  completions that are valid Python (``tools.prompts.is_valid_completion``); the SFT model
  runs ``ar`` for reference;
* ``cpu_bench``: the embedded artifact (``Engine.load()`` with no path, reference backend,
  CPU): AR vs hybrid decode tokens/s over a few prompts in one run, and the speedup.

Models load from checkpoint folders (``tools.hf_checkpoint.load_runtime_model``: exactly the
packed codes and scales an export carries, float64 reference numerics), so the report does
not depend on an export; ``cpu_bench`` measures the exported artifact itself.
"""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bitmtp_edge.runtime.policies import POLICIES
from tools.corpus import CorpusIndex, load_split
from tools.prompts import Prompt, cut_at_function_end, is_valid_completion, read_prompts
from tools.tokenizer import load_tokenizer

TARGET_NTP_GAP_PCT = 3.0
TARGET_HYBRID_TPI_D8 = 3.5
TARGET_PARSE_DROP_PTS = 2.0
# issue 14 (D = 8, greedy, held-out prompts)
TARGET_SPEC_TPI = 6.0
TARGET_HYBRID_VERIFY = 0.5
TARGET_HYBRID_TPF = 3.5
TARGET_DOC_TPF = 2.5
TARGET_FT_GAP_PCT = 5.0  # SFT -> BitMTP (--init) against the from-scratch model, at <= half its steps


@dataclass(frozen=True)
class DecodeTask:
    model: str
    path: str
    policy: str
    prompts: tuple[int, ...]  # prompt indices


# -- model loading (cached per process) ----------------------------------------------------

_CACHE: dict[tuple[str, str], tuple] = {}


def runtime(path: str, device: str, max_context: int = 2048):
    """(model, checkpoint, reference backend) for one checkpoint folder, cached per process."""
    key = (path, device)
    if key not in _CACHE:
        from bitmtp_edge.backends.reference import ReferenceBackend
        from bitmtp_edge.runtime.calibration import ConfidenceCalibration
        from bitmtp_edge.format.segments import plan_segments
        from tools.hf_checkpoint import load_runtime_model

        model, ck = load_runtime_model(path, torch.float64, device)
        d = ck.mtp.block_size if ck.mtp else 1
        plan = plan_segments(ck.model, max_context, workspace=2 * d + 1)
        backend = ReferenceBackend(model, plan, ck.mtp.mask_token_id if ck.mtp else None, torch.float64, device,
                                   calibration=ConfidenceCalibration.for_model(ck.mtp, device))
        _CACHE[key] = (model, ck, backend)
    return _CACHE[key]


# -- held-out loss ---------------------------------------------------------------------------

def heldout_windows(tokens: np.ndarray, window: int, max_windows: int, device: str, batch: int):
    """-> (windows, batches): the number of non-overlapping ``window``-token windows of
    ``tokens`` used (at most ``max_windows``) and an iterator over batches of them as
    (inputs [B, W], next tokens [B, W], positions [B, W], causal mask [B, W, W])."""
    n = min((len(tokens) - 1) // window, max_windows)
    data = torch.from_numpy(tokens[: n * window + 1].astype(np.int64))
    pos = torch.arange(window, device=device).unsqueeze(0)
    mask = torch.ones(window, window, dtype=torch.bool, device=device).tril().unsqueeze(0)

    def batches():
        for i in range(0, n, batch):
            rows = range(i, min(i + batch, n))
            x = torch.stack([data[r * window:(r + 1) * window] for r in rows]).to(device)
            y = torch.stack([data[r * window + 1:(r + 1) * window + 1] for r in rows]).to(device)
            yield x, y, pos.expand(len(rows), -1), mask
    return n, batches()


CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"


def add_heldout_arguments(ap, window: int, max_windows: int) -> None:
    """The options of the tools that read the test split through checkpoints' heads:
    ``--data``, ``--model NAME=CHECKPOINT`` (repeatable), ``--window``, ``--max-windows``."""
    ap.add_argument("--data", type=Path, default=CHECKPOINTS / "data", help="corpus folder holding the test split")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=CHECKPOINT")
    ap.add_argument("--window", type=int, default=window)
    ap.add_argument("--max-windows", type=int, default=max_windows)


def named_checkpoints(specs: list[str], tool: str) -> dict[str, str]:
    """``--model`` values -> {name: checkpoint folder}; none given: the embedded D = 8 model's."""
    named = {}
    for spec in specs or [f"d8={CHECKPOINTS / 'bitmtp-d8-27m'}"]:
        name, _, path = spec.partition("=")
        if not name or not path or not Path(path).is_dir():
            raise SystemExit(f"{tool}: --model {spec!r}: give NAME=CHECKPOINT_FOLDER")
        named[name] = path
    return named


@torch.no_grad()
def heldout_loss(path: str, tokens: np.ndarray, window: int, max_windows: int, device: str, batch: int = 8) -> dict:
    """Mean NTP cross-entropy over non-overlapping windows of the test split."""
    model, _, _ = runtime(path, device)
    n, batches = heldout_windows(tokens, window, max_windows, device, batch)
    total, count = 0.0, 0
    for x, y, pos, mask in batches:
        logits = model.verify_logits(model(x, pos, mask))
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                                         y.reshape(-1), reduction="sum"))
        count += y.numel()
    loss = total / count
    return {"ntp_loss": loss, "ppl": math.exp(loss), "tokens": count, "windows": n, "window": window}


# -- decoding --------------------------------------------------------------------------------

def run_task(task: DecodeTask, prompts: list[Prompt], data: str, device: str, max_new_tokens: int,
             tau: float, min_prefix: int) -> dict:
    """Greedy completions of the task's prompts under one policy; per-prompt records."""
    from bitmtp_edge.runtime.decoding import DecodeOptions, DecodeStats, decode

    if device != "cpu":
        torch.set_num_threads(1)
        torch.cuda.set_device(torch.device(device))  # several workers share the host; the work is on the GPU
    model, ck, backend = runtime(task.path, device)
    tok = load_tokenizer(Path(task.path))
    eos = frozenset(ck.model.eos_token_ids)
    d = ck.mtp.block_size if ck.mtp else None
    opts = DecodeOptions(policy=task.policy, max_new_tokens=max_new_tokens, block_size=d,
                         tau=tau, min_prefix=min(min_prefix, d) if d else 1, stop_token_ids=eos)
    records = []
    for i in task.prompts:
        p = prompts[i]
        ids = tok.encode(p.model_prompt, add_special_tokens=False).ids
        stats = DecodeStats()
        t0 = time.perf_counter()
        out: list[int] = []
        with torch.no_grad():
            for chunk in decode(backend, ids, opts, stats):
                out.extend(chunk)
        wall = time.perf_counter() - t0
        text = tok.decode(out, skip_special_tokens=False)
        finished = stats.finish_reason == "stop"
        body, ended = cut_at_function_end(p.model_prompt, text, finished)
        records.append({
            "prompt": i, "tokens": out, "iterations": stats.iterations, "draft_calls": stats.draft_calls,
            "verifier_calls": stats.verifier_calls, "forward_passes": stats.forward_passes, "finish": stats.finish_reason, "wall_s": wall,
            "decode_s": stats.decode_s, "valid": is_valid_completion(p.model_prompt, text, finished),
            "function_ended": ended, "completion": body,
        })
    return {"model": task.model, "policy": task.policy, "records": records}


def _run_task_star(args):
    return run_task(*args)


def summarize(records: list[dict], ar_records: list[dict] | None) -> dict:
    new = sum(len(r["tokens"]) for r in records)
    its = sum(r["iterations"] for r in records)
    passes = sum(r["forward_passes"] for r in records)
    out = {
        "prompts": len(records), "new_tokens": new, "iterations": its,
        "tokens_per_iteration": new / its if its else 0.0,
        "tokens_per_forward": new / passes if passes else 0.0,
        "verifier_call_rate": sum(r["verifier_calls"] for r in records) / its if its else 0.0,
        "parse_rate": sum(r["valid"] for r in records) / len(records) if records else 0.0,
        "function_ended_rate": sum(r["function_ended"] for r in records) / len(records) if records else 0.0,
        "decode_s": sum(r["decode_s"] for r in records),
    }
    if ar_records is not None:
        ar = {r["prompt"]: r["tokens"] for r in ar_records}
        same = total = exact = 0
        for r in records:
            a, b = ar[r["prompt"]], r["tokens"]
            same += sum(x == y for x, y in zip(a, b))
            total += max(len(a), len(b))
            exact += a == b
        out["agreement_with_ar"] = same / total if total else 1.0
        out["identical_completions"] = exact / len(records) if records else 1.0
    return out


def task_devices(device: str, gpus: int | None = None) -> list[str]:
    """``cuda`` spreads the tasks over every visible GPU (batch-1 decoding is launch-bound: a
    GPU serves several worker processes), each named with its index (a worker selects it with
    ``torch.cuda.set_device``, which refuses a bare ``cuda``); anything else is used as given."""
    if device != "cuda":
        return [device]
    n = torch.cuda.device_count() if gpus is None else gpus
    if n < 1:
        raise ValueError("--device cuda: no CUDA GPU is visible; use --device cpu")
    return [f"cuda:{i}" for i in range(n)]


def evaluate_decoding(models: dict[str, str], prompts: list[Prompt], data: str, device: str, jobs: int,
                      max_new_tokens: int, tau: float, min_prefix: int, log=print, chunk: int = 0,
                      policies: tuple[str, ...] = POLICIES) -> dict:
    """``chunk`` > 0 splits each (model, policy) into tasks of that many prompts, so more
    workers than tasks can share the work."""
    from tools.hf_checkpoint import read_checkpoint

    n = len(prompts)
    step = chunk if chunk > 0 else max(n, 1)
    slices = [tuple(range(i, min(i + step, n))) for i in range(0, n, step)]
    tasks = []
    for name, path in models.items():
        pols = [p for p in POLICIES if p in policies or p == "ar"] if read_checkpoint(path).mtp else ["ar"]
        tasks += [DecodeTask(name, path, pol, sl) for pol in pols for sl in slices]
    # Longest first, so the pool's tail is short.
    weight = {"ar": 3, "confidence": 2, "speculative": 4, "hybrid": 4, "fused": 4}  # longest first
    tasks.sort(key=lambda t: -weight[t.policy])
    devices = task_devices(device)
    args = [(t, prompts, data, devices[i % len(devices)], max_new_tokens, tau, min_prefix)
            for i, t in enumerate(tasks)]
    t0 = time.perf_counter()
    if jobs > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(min(jobs, len(tasks))) as pool:
            results = []
            for r in pool.imap_unordered(_run_task_star, args):
                log(f"  {r['model']}/{r['policy']} done ({time.perf_counter() - t0:.0f}s)")
                results.append(r)
    else:
        results = []
        for a in args:
            results.append(run_task(*a))
            log(f"  {a[0].model}/{a[0].policy} done ({time.perf_counter() - t0:.0f}s)")
    by: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        by.setdefault((r["model"], r["policy"]), []).extend(r["records"])
    for recs in by.values():
        recs.sort(key=lambda rec: rec["prompt"])
    out: dict = {}
    for name in models:
        ar = by.get((name, "ar"))
        out[name] = {pol: summarize(by[(name, pol)], ar) for pol in POLICIES if (name, pol) in by}
    samples = {f"{m}/{p}": [{"prompt": prompts[r["prompt"]].model_prompt, "completion": r["completion"]}
                            for r in recs[:3]] for (m, p), recs in by.items() if p in ("ar", "hybrid")}
    return {"summary": out, "samples": samples, "wall_s": time.perf_counter() - t0}


# -- the CPU decode benchmark of the shipped artifact ------------------------------------------

def cpu_bench(prompts: list[Prompt], n_prompts: int, max_new_tokens: int, artifact: str | None = None,
              repeats: int = 3) -> dict:
    """AR vs hybrid decode tok/s of the embedded (or given) artifact on the CPU reference backend.

    Per prompt the two routes alternate ``repeats`` times and each keeps its median decode
    time (docs/measuring.md §Rules), so a busy shared host slows both alike.
    """
    from statistics import median

    from bitmtp_edge import Engine

    eng = Engine.load(artifact, backend="reference", device="cpu")
    chosen = prompts[:n_prompts]
    eng.generate(chosen[0].model_prompt, max_new_tokens=8, policy="ar")  # warm-up
    rows = []
    agree = same = 0
    for p in chosen:
        row, outs = {"prompt_id": p.id}, {}
        times: dict[str, list[float]] = {"ar": [], "hybrid": []}
        for _ in range(repeats):
            for pol in ("ar", "hybrid"):
                res = eng.generate(p.model_prompt, max_new_tokens=max_new_tokens, policy=pol)
                outs[pol] = res.token_ids
                times[pol].append(res.stats.decode_s)
                row[pol] = {"new_tokens": res.stats.new_tokens, "iterations": res.stats.iterations}
        for pol in ("ar", "hybrid"):
            row[pol]["decode_s"] = median(times[pol])
            row[pol]["tok_s"] = row[pol]["new_tokens"] / row[pol]["decode_s"] if row[pol]["decode_s"] else 0.0
        same += sum(x == y for x, y in zip(outs["ar"], outs["hybrid"]))
        agree += max(len(outs["ar"]), len(outs["hybrid"]))
        rows.append(row)
    tot = {pol: (sum(r[pol]["new_tokens"] for r in rows), sum(r[pol]["decode_s"] for r in rows)) for pol in ("ar", "hybrid")}
    ar_tps, hy_tps = (tot[p][0] / tot[p][1] if tot[p][1] else 0.0 for p in ("ar", "hybrid"))
    return {
        "artifact": str(eng.path), "block_size": eng.block_size, "backend": "reference", "device": "cpu",
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "prompts": len(rows), "max_new_tokens": max_new_tokens, "repeats": repeats,
        "ar_tok_s": ar_tps, "hybrid_tok_s": hy_tps, "speedup": hy_tps / ar_tps if ar_tps else 0.0,
        "hybrid_tokens_per_iteration": tot["hybrid"][0] / max(sum(r["hybrid"]["iterations"] for r in rows), 1),
        "hybrid_agreement_with_ar": same / agree if agree else 1.0, "per_prompt": rows,
    }


# -- the report ------------------------------------------------------------------------------

def check_targets(report: dict) -> dict:
    t: dict = {}
    gaps = report.get("heldout", {}).get("gap_pct", {})
    for name, gap in gaps.items():
        t[f"{name}: NTP loss within {TARGET_NTP_GAP_PCT}% of SFT"] = {"value": round(gap, 2), "pass": gap <= TARGET_NTP_GAP_PCT}
    dec = report.get("decoding", {}).get("summary", {})
    for name, pols in dec.items():
        if "speculative" in pols:
            a = pols["speculative"]["agreement_with_ar"]
            t[f"{name}: speculative agreement with AR = 100%"] = {"value": round(a, 4), "pass": a == 1.0}
        if "hybrid" in pols and "ar" in pols:
            drop = 100 * (pols["ar"]["parse_rate"] - pols["hybrid"]["parse_rate"])
            t[f"{name}: hybrid parse rate no more than {TARGET_PARSE_DROP_PTS} points below AR"] = {
                "value": round(drop, 2), "pass": drop <= TARGET_PARSE_DROP_PTS}
    rc = report.get("recipes", {})
    shipped = rc.get("shipped")
    if shipped and shipped in rc.get("models", {}):
        m = rc["models"][shipped]
        sp, hy = m["speculative"], m["hybrid"]
        how = "decoded" if rc.get("settings", {}).get("source") == "decode" else "replay"
        for label, value, ok in (
                (f"{shipped}: speculative >= {TARGET_SPEC_TPI} tokens/iteration ({how})", sp["tokens_per_iteration"],
                 sp["tokens_per_iteration"] >= TARGET_SPEC_TPI),
                (f"{shipped}: hybrid verifier rate <= {TARGET_HYBRID_VERIFY} ({how})", hy["verifier_call_rate"],
                 hy["verifier_call_rate"] <= TARGET_HYBRID_VERIFY),
                (f"{shipped}: hybrid >= {TARGET_HYBRID_TPF} tokens/forward ({how})", hy["tokens_per_forward"],
                 hy["tokens_per_forward"] >= TARGET_HYBRID_TPF)):
            t[label] = {"value": round(value, 3), "pass": ok}
        if m.get("heldout_gap_pct") is not None:
            gap = m["heldout_gap_pct"]
            t[f"{shipped}: held-out NTP loss within {TARGET_NTP_GAP_PCT}% of SFT ({how})"] = {
                "value": round(gap, 2), "pass": gap <= TARGET_NTP_GAP_PCT}
        if "ar" in m and "parse_rate" in hy:
            drop = 100 * (m["ar"]["parse_rate"] - hy["parse_rate"])
            t[f"{shipped}: hybrid parse rate no more than {TARGET_PARSE_DROP_PTS} points below AR ({how})"] = {
                "value": round(drop, 2), "pass": drop <= TARGET_PARSE_DROP_PTS}
        doc = rc.get("docstring_prompts", {}).get(shipped)
        if doc:
            v = doc["hybrid"]["tokens_per_forward"]
            t[f"{shipped}: hybrid >= {TARGET_DOC_TPF} tokens/forward on docstring prompts ({how})"] = {
                "value": round(v, 3), "pass": v >= TARGET_DOC_TPF}
        ft, scratch = rc.get("fine_tune_pair") or (None, None)
        if ft in rc["models"] and scratch in rc["models"]:
            ratio = rc["models"][ft]["hybrid"]["tokens_per_forward"] / rc["models"][scratch]["hybrid"]["tokens_per_forward"]
            t[f"{ft}: hybrid tokens/forward within {TARGET_FT_GAP_PCT:.0f}% of {scratch} (from scratch) at half its "
              f"budget ({how})"] = {"value": round(ratio, 3), "pass": ratio >= 1 - TARGET_FT_GAP_PCT / 100}
    if "d8" in dec and "hybrid" in dec["d8"]:
        v = dec["d8"]["hybrid"]["tokens_per_iteration"]
        t[f"d8: hybrid tokens/iteration >= {TARGET_HYBRID_TPI_D8}"] = {"value": round(v, 3), "pass": v >= TARGET_HYBRID_TPI_D8}
    return t


def _num(v, fmt: str = ".4f") -> str:
    return "—" if v is None else format(v, fmt)


def to_markdown(r: dict) -> str:
    meta = r.get("meta", {})
    lines = ["# Quality report: SFT vs BitMTP (ternary code models)", ""]
    lines.append(f"Produced by `python -m tools.eval_quality`. Corpus sha256 {str(meta.get('corpus_sha256', ''))[:12]}…; "
                 "models loaded from their compact checkpoints, reference backend, float64.")
    lines.append("")
    if r.get("training"):
        lines += ["## Training", "", "| model | params | D | blocks/row | MTP weight | steps | clean tokens | wall (s) | val NTP | val MTP |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, t in r["training"].items():
            lines.append(f"| {name} | {t['params'] / 1e6:.1f}M | {t.get('block_size') or '—'} | {t.get('blocks') or '—'} | "
                         f"{t['mtp_weight']} | {t['steps']} | {t['clean_tokens'] / 1e6:.1f}M | {t['wall_s']:.0f} | "
                         f"{_num(t.get('val_ntp'))} | {_num(t.get('val_mtp'))} |")
        lines.append("")
    if r.get("heldout"):
        h = r["heldout"]
        lines += ["## Held-out NTP loss (test split)", "", "| model | NTP loss | perplexity | gap to SFT |", "|---|---|---|---|"]
        for name, m in h["models"].items():
            gap = h.get("gap_pct", {}).get(name)
            lines.append(f"| {name} | {m['ntp_loss']:.4f} | {m['ppl']:.3f} | {'—' if gap is None else f'{gap:+.2f}%'} |")
        first = next(iter(h["models"].values()))
        lines += ["", f"{first['tokens']} test-split tokens in {first['windows']} windows of {first['window']}; "
                  f"computed on {h.get('device', '?')} ({h.get('when', '')}).", ""]
    if r.get("decoding"):
        st = r["decoding"].get("settings", {})
        lines += ["## Decoding policies (held-out prompts)", "",
                  f"{st.get('prompts', '?')} prompts from the test split (function signature + docstring, or the first "
                  f"lines of a function), greedy, up to {st.get('max_new_tokens', '?')} new tokens; confidence and hybrid "
                  f"use τ = {st.get('tau')}, hybrid m = {st.get('min_prefix')}. Computed on "
                  f"{r['decoding'].get('device', '?')} ({r['decoding'].get('when', '')}).", "",
                  "| model | policy | tokens / iteration | tokens / forward | verifier rate | agreement with AR | identical completions | parse rate |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, pols in r["decoding"]["summary"].items():
            for pol, s in pols.items():
                lines.append(f"| {name} | {pol} | {s['tokens_per_iteration']:.2f} | {s['tokens_per_forward']:.2f} | "
                             f"{s['verifier_call_rate']:.2f} | {s.get('agreement_with_ar', 1.0):.3f} | "
                             f"{s.get('identical_completions', 1.0):.3f} | {s['parse_rate']:.3f} |")
        lines.append("")
    if r.get("cpu_bench"):
        c = r["cpu_bench"]
        lines += ["## CPU decode speed of the embedded artifact (reference backend)", "",
                  "| route | decode tok/s |", "|---|---|",
                  f"| AR | {c['ar_tok_s']:.2f} |", f"| hybrid (D={c['block_size']}) | {c['hybrid_tok_s']:.2f} |", "",
                  f"Speedup {c['speedup']:.2f}× over {c['prompts']} prompts × up to {c['max_new_tokens']} tokens (median of "
                  f"{c.get('repeats', 1)} alternating repeats per prompt), {c['threads']} threads on {c['cpu']}; hybrid commits "
                  f"{c.get('hybrid_tokens_per_iteration', float('nan')):.2f} tokens per iteration and agrees with AR "
                  f"{c['hybrid_agreement_with_ar']:.3f}. The host is shared, so absolute tok/s vary between runs.", ""]
    if r.get("recipes"):
        lines += recipes_markdown(r["recipes"], "Training recipes (issue 14): drafts the verifier agrees with")
    if r.get("recipes_earlier"):
        lines += recipes_markdown(r["recipes_earlier"], "Training recipes, first round (superseded)")
    for e in r.get("earlier_runs", []):
        lines += [f"## Earlier run: {e['label']}", "", e.get("note", ""), "",
                  "| model | policy | tokens / iteration | agreement with AR | parse rate |", "|---|---|---|---|---|"]
        for name, pols in e.get("decoding", {}).items():
            for pol, v in pols.items():
                lines.append(f"| {name} | {pol} | {v['tokens_per_iteration']:.2f} | {v.get('agreement_with_ar', 1.0):.3f} | "
                             f"{v['parse_rate']:.3f} |")
        if e.get("heldout_gap_pct"):
            lines += ["", "Held-out NTP gap to SFT: " + ", ".join(f"{k} {v:+.2f}%" for k, v in e["heldout_gap_pct"].items())]
        lines.append("")
    if r.get("targets"):
        lines += ["## Targets", "", "| target | value | pass |", "|---|---|---|"]
        for k, v in r["targets"].items():
            lines.append(f"| {k} | {v['value']} | {'yes' if v['pass'] else '**no**'} |")
        lines.append("")
    return "\n".join(lines)


def recipes_markdown(rc: dict, title: str) -> list[str]:
    """One recipes table: ``settings.source`` says whether its numbers come from the real decode
    (``decode``: this module's decoding section) or ``tools.eval_acceptance``'s replay."""
    st = rc.get("settings", {})
    decoded = st.get("source") == "decode"
    lines = [f"## {title}", "", rc.get("note", ""), ""]
    if decoded:
        lines += [f"Decoded by `tools.eval_quality` (the runtime's decoding loop, reference backend, float64) on "
                  f"{st.get('device', '?')}: {st.get('prompts', '?')} held-out prompts, greedy, up to "
                  f"{st.get('max_new_tokens', '?')} new tokens, hybrid τ = {st.get('tau')}, m = {st.get('min_prefix')}. "
                  "Held-out NTP gap: test-split loss against sft-27m in the same run.", "",
                  "| model | recipe | training budget | val NTP | held-out NTP gap | spec tok/iter | spec tok/forward | "
                  "hybrid tok/iter | hybrid tok/forward | hybrid verifier rate | hybrid agreement with AR | "
                  "parse rate AR / hybrid |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    else:
        lines += [f"Decoding replayed by `tools.eval_acceptance` on {st.get('prompts', '?')} held-out prompts, greedy, up "
                  f"to {st.get('max_new_tokens', '?')} new tokens, hybrid τ = {st.get('tau')}, m = {st.get('min_prefix')} "
                  "(speculative counts are the real decode's; hybrid's until its first unverified mistake, counted).", "",
                  "| model | recipe | training budget | val NTP | spec tok/iter | spec tok/forward | hybrid tok/iter | "
                  "hybrid tok/forward | hybrid verifier rate | hybrid unverified mistakes |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in rc["models"].items():
        sp, hy = m["speculative"], m["hybrid"]
        row = (f"| {name} | {m.get('recipe', '')} | {m.get('budget', '')} | {_num(m.get('val_ntp'))} | "
               + (f"{'—' if m.get('heldout_gap_pct') is None else format(m['heldout_gap_pct'], '+.2f') + '%'} | "
                  if decoded else "")
               + f"{sp['tokens_per_iteration']:.2f} | {sp['tokens_per_forward']:.2f} | "
               f"{hy['tokens_per_iteration']:.2f} | {hy['tokens_per_forward']:.2f} | {hy['verifier_call_rate']:.2f} | ")
        if decoded:
            row += f"{hy.get('agreement_with_ar', 1.0):.3f} | {m['ar']['parse_rate']:.3f} / {hy['parse_rate']:.3f} |"
        else:
            row += f"{hy['unverified_mistakes']} |"
        lines.append(row)
    lines.append("")
    if rc.get("docstring_prompts"):
        lines += [f"Short docstring-style function prompts unlike the corpus (`{rc.get('docstring_file', '')}`):", "",
                  "| model | spec tok/iter | spec tok/forward | hybrid tok/iter | hybrid tok/forward | hybrid verifier rate |",
                  "|---|---|---|---|---|---|"]
        for name, m in rc["docstring_prompts"].items():
            sp, hy = m["speculative"], m["hybrid"]
            lines.append(f"| {name} | {sp['tokens_per_iteration']:.2f} | {sp['tokens_per_forward']:.2f} | "
                         f"{hy['tokens_per_iteration']:.2f} | {hy['tokens_per_forward']:.2f} | "
                         f"{hy['verifier_call_rate']:.2f} |")
        lines.append("")
    if rc.get("findings"):
        lines += [rc["findings"], ""]
    return lines


def training_summary(models: dict[str, str], logs_dir: str | None) -> dict:
    """Pull the training facts from each run's log: ``logs_dir/train_{name}.json``, else the
    ``train_log.json`` next to or above the checkpoint."""
    out = {}
    for name, path in models.items():
        cands = [Path(path) / "train_log.json", Path(path).parent / "train_log.json"]
        if logs_dir:
            cands.insert(0, Path(logs_dir) / f"train_{name}.json")
        for cand in cands:
            if cand.is_file():
                d = json.loads(cand.read_text())
                s, c = d.get("summary") or {}, d["config"]
                has_blocks = d["layout"]["num_blocks"] > 0
                out[name] = {"params": d["params"], "block_size": d["layout"]["block_size"] if has_blocks else None,
                             "blocks": d["layout"]["num_blocks"], "mtp_weight": c["mtp_weight"],
                             "steps": s.get("steps", 0), "clean_tokens": s.get("clean_tokens", 0),
                             "wall_s": s.get("wall_s", 0.0), "val_ntp": s.get("val_ntp"),
                             "val_mtp": s.get("val_mtp"), "stop_reason": s.get("stop_reason")}
                break
    return out


def main(argv: list[str] | None = None) -> None:
    import click

    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @click.option("--data", required=True, help="corpus folder (test split + prompts.jsonl)")
    @click.option("--model", "models", multiple=True, help="NAME=CHECKPOINT; the AR-only one is the SFT baseline")
    @click.option("--sections", default="heldout,decoding", show_default=True,
                  help="comma list of heldout, decoding, cpu_bench (none: only re-render a --merge report)")
    @click.option("--device", default="cpu", show_default=True)
    @click.option("--jobs", default=1, show_default=True, help="decoding worker processes")
    @click.option("--chunk", default=0, show_default=True, help="prompts per decoding task (0: all of them)")
    @click.option("--policies", default=",".join(POLICIES), show_default=True,
                  help="comma list of the policies to decode (ar always runs: the others' agreement needs it)")
    @click.option("--prompts", "n_prompts", default=48, show_default=True)
    @click.option("--prompt-file", default=None, type=click.Path(exists=True, dir_okay=False),
                  help="decode these prompts (prompts.jsonl form) instead of the corpus' held-out ones")
    @click.option("--max-new-tokens", default=96, show_default=True)
    @click.option("--tau", default=0.9, show_default=True)
    @click.option("--min-prefix", default=3, show_default=True)
    @click.option("--window", default=512, show_default=True)
    @click.option("--max-windows", default=128, show_default=True)
    @click.option("--bench-prompts", default=4, show_default=True)
    @click.option("--bench-tokens", default=64, show_default=True)
    @click.option("--artifact", default=None, help="cpu_bench: artifact folder (default: the embedded model)")
    @click.option("--merge", default=None, type=click.Path(dir_okay=False), help="start from this report JSON")
    @click.option("--train-logs", default="tools/results", show_default=True,
                  help="folder with train_NAME.json logs (else OUT/train_log.json beside each checkpoint)")
    @click.option("--attach-earlier", "earlier", multiple=True,
                  help="LABEL=REPORT.json[::NOTE]: keep an earlier run's decoding summary beside this one")
    @click.option("--recipes", default=None, type=click.Path(exists=True, dir_okay=False),
                  help="attach a recipes comparison (tools.eval_acceptance JSON + recipe/budget/val_ntp per model)")
    @click.option("--json", "json_out", default="tools/results/quality.json", show_default=True)
    @click.option("--md", "md_out", default="tools/results/quality.md", show_default=True)
    def cli(data, models, sections, device, jobs, chunk, policies, n_prompts, prompt_file, max_new_tokens, tau, min_prefix, window, max_windows,
            bench_prompts, bench_tokens, artifact, merge, train_logs, earlier, recipes, json_out, md_out):
        """Write the SFT vs BitMTP quality report (JSON for machines, Markdown for people)."""
        from tools.hf_checkpoint import read_checkpoint

        wanted = {s.strip() for s in sections.split(",") if s.strip() and s.strip() != "none"}
        unknown = wanted - {"heldout", "decoding", "cpu_bench"}
        if unknown:
            raise click.BadParameter(f"unknown section(s) {sorted(unknown)}", param_hint="--sections")
        named = {}
        for spec in models:
            name, sep, path = spec.partition("=")
            if not sep:
                raise click.BadParameter(f"{spec!r}: expected NAME=CHECKPOINT", param_hint="--model")
            named[name] = path
        from tools.hf_checkpoint import CheckpointError

        try:  # every input checked before the first (long) section
            for name, path in named.items():
                try:
                    read_checkpoint(path)
                except CheckpointError as e:
                    raise CheckpointError(f"--model {name}={path}: {e}") from None
            report = json.loads(Path(merge).read_text()) if merge else {}
            index = CorpusIndex.load(data)
            prompt_path = Path(prompt_file) if prompt_file else Path(data) / index.prompts
            prompts = read_prompts(prompt_path)[:n_prompts]
        except (ValueError, OSError, CheckpointError) as e:
            raise click.ClickException(str(e)) from None
        where = {"device": (torch.cuda.get_device_name() if device == "cuda"
                            else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"),
                 "torch": torch.__version__, "when": time.strftime("%Y-%m-%d %H:%M")}
        if named:
            report.setdefault("meta", {}).update({"corpus_sha256": index.corpus_sha256, "models": named})
            report["training"] = training_summary(named, train_logs) or report.get("training", {})
        if "heldout" in wanted:
            tokens = load_split(data, "test")
            click.echo("held-out loss ...")
            h = {name: heldout_loss(path, tokens, window, max_windows, device) for name, path in named.items()}
            sft = [n for n, p in named.items() if read_checkpoint(p).mtp is None]
            gaps = {}
            if sft:
                base = h[sft[0]]["ntp_loss"]
                gaps = {n: 100 * (m["ntp_loss"] - base) / base for n, m in h.items() if n != sft[0]}
            report["heldout"] = {"models": h, "baseline": sft[0] if sft else None, "gap_pct": gaps, **where}
        if "decoding" in wanted:
            click.echo(f"decoding {len(prompts)} prompts x {len(named)} models ...")
            wanted_pol = tuple(p.strip() for p in policies.split(",") if p.strip())
            bad = set(wanted_pol) - set(POLICIES)
            if bad:
                raise click.BadParameter(f"unknown policies {sorted(bad)}; choose from {', '.join(POLICIES)}",
                                         param_hint="--policies")
            dec = evaluate_decoding(named, prompts, data, device, jobs, max_new_tokens, tau, min_prefix, log=click.echo,
                                    chunk=chunk, policies=wanted_pol)
            report["decoding"] = {**dec, "settings": {"prompts": len(prompts), "prompt_file": str(prompt_path),
                                                      "max_new_tokens": max_new_tokens,
                                                      "tau": tau, "min_prefix": min_prefix}, **where}
        if "cpu_bench" in wanted:
            click.echo("CPU decode benchmark of the embedded artifact ...")
            report["cpu_bench"] = {**cpu_bench(prompts, bench_prompts, bench_tokens, artifact), "when": where["when"],
                                   "torch": torch.__version__}
        for spec in earlier:
            label, sep, rest = spec.partition("=")
            path, _, note = rest.partition("::")
            old = json.loads(Path(path).read_text())
            runs = [e for e in report.get("earlier_runs", []) if e["label"] != label]
            runs.append({"label": label, "note": note, "decoding": old.get("decoding", {}).get("summary", {}),
                         "heldout_gap_pct": old.get("heldout", {}).get("gap_pct", {}),
                         "device": old.get("decoding", {}).get("device") or old.get("meta", {}).get("device")})
            report["earlier_runs"] = runs
        if recipes:
            report["recipes"] = json.loads(Path(recipes).read_text())
        report["targets"] = check_targets(report)
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(report, indent=1) + "\n")
        Path(md_out).write_text(to_markdown(report))
        click.echo(to_markdown(report))

    cli.main(args=argv, prog_name="python -m tools.eval_quality", standalone_mode=True)


if __name__ == "__main__":
    main()
