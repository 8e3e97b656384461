"""End-to-end decode benchmarks of the replayable runtime (issue 5), in one run.

Parts (all on the same GPU, same process, so every ratio is measured in one run):

* ``2b``: a BitNet-2B-shaped artifact exported from a random-weight HF BitNet checkpoint
  (packed offline, made here) with a D = 8 MTP block: startup (load + capture), KV and
  graph-pool memory, µs per replay of every (M, r), AR tok/s, and decode at *forced*
  acceptance levels (drafts replaced by the AR route's tokens, truncated to a fixed accepted
  length — labelled forced, like the paper's forced-rejection test) for Generic and Full;
* ``baselines``: on the same 2B shape, transformers ``generate`` (eager, bf16) and a
  ``torch.compile(mode="reduce-overhead")`` bf16 AR loop with a static cache;
* ``trained``: artifacts of trained models (``--artifact``, repeatable; the embedded model
  when none is given): AR vs confidence / speculative / hybrid / fused (and hybrid with fused
  passes) on held-out code prompts,
  Generic vs Full, tok/s, tokens per iteration and per forward pass, speedup over AR;
* fused on the 2B shape: the replay cost of every fused width (c = 1..D, one layout after a
  draft step and after a fused hit), and a **projection**: the trained model's measured step
  sequences (every draft / verify / fused step it ran, so its acceptance and hit/miss
  histogram) priced at the 2B shape's replay costs plus the per-step overhead measured by
  its AR decode — labelled projected.

Writes ``tools/results/e2e.json``, ``e2e.md`` and ``e2e.png`` (or under ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bitmtp_edge import Engine  # noqa: E402
from bitmtp_edge.backends.base import DraftResult  # noqa: E402
from bitmtp_edge.backends.graph import RuntimeOptions, cuda_ms  # noqa: E402
from bitmtp_edge.format.config import AUTO_CANDIDATES  # noqa: E402
from bitmtp_edge.runtime.decoding import DEFAULT_CANDIDATES, DecodeOptions, DecodeStats, decode  # noqa: E402
from bitmtp_edge.runtime.replay import ReplayState  # noqa: E402
from tools.provenance import commit  # noqa: E402

BITNET_2B = dict(vocab_size=128256, hidden_size=2560, intermediate_size=6912, num_hidden_layers=30,
                 num_attention_heads=20, num_key_value_heads=5, max_position_embeddings=4096)
CONFIGS = ("generic", "m1", "m1+m2", "full")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the 2B-shaped checkpoint ----------------------------------------------------------------

def make_random_bitnet_2b(folder: Path, dims: dict, block_size: int, seed: int = 0) -> Path:
    """An HF BitNet checkpoint in the packed offline form (autobitlinear), random codes."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from kernels_ampere.packing import pack_hf_bitnet

    folder.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    h, f, v = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"]
    hd = h // dims["num_attention_heads"]
    kv = dims["num_key_value_heads"] * hd
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
    state = {}
    for i in range(dims["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, (n, k) in shapes.items():
            codes = torch.randint(-1, 2, (n, k), generator=g, device=dev, dtype=torch.int8)
            state[p + name + ".weight"] = pack_hf_bitnet(codes).cpu()
            state[p + name + ".weight_scale"] = torch.tensor([1.0 / (k ** 0.5)], dtype=torch.bfloat16)
        for norm, size in (("input_layernorm", h), ("post_attention_layernorm", h),
                           ("self_attn.attn_sub_norm", h), ("mlp.ffn_sub_norm", f)):
            state[p + norm + ".weight"] = torch.ones(size, dtype=torch.bfloat16)
    state["model.embed_tokens.weight"] = (torch.randn(v, h, generator=g, device=dev) * 0.02).to(torch.bfloat16).cpu()
    state["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["BitNetForCausalLM"], "model_type": "bitnet", "hidden_act": "relu2",
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
              "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16", **dims,
              "quantization_config": {"quant_method": "bitnet", "linear_class": "autobitlinear",
                                      "quantization_mode": "offline"}}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "bitmtp.json").write_text(json.dumps({"block_size": block_size, "mask_token_id": v - 1}))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(v)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def export(ckpt: Path, out: Path, max_context: int) -> Path:
    from export.writer import ExportOptions, export_checkpoint

    return export_checkpoint(ckpt, out, ExportOptions(max_context=max_context, overwrite=True)).out


# -- measurement helpers -------------------------------------------------------------------------

def replay_times(eng: Engine, segment: int, base_len: int, repeats: int = 50) -> list[dict]:
    """µs per replay of every captured (M, r) at one segment, history length ``base_len``.

    Each replay advances the device history length, so it is reset before every replay;
    the reset alone is timed and subtracted."""
    b = eng.backend
    reset = lambda: b.static.history_len.fill_(base_len)  # noqa: E731
    t_reset = cuda_ms(reset, repeats)
    rows = []
    for state, graph in sorted(b.graphs.items()):
        if state.segment != segment:
            continue

        def one():
            reset()
            graph.replay()

        one()
        rows.append({"width": state.width, "role": state.role, "segment": state.segment,
                     "capacity": b.plan.segments[segment].capacity,
                     "us": 1000 * (cuda_ms(one, repeats) - t_reset)})
    b.reset()
    return rows


def timed_generate(eng: Engine, prompt, policy: str, n: int, repeats: int, **kw) -> dict:
    """Decode ``prompt`` ``repeats`` times (after a warm-up); ``hybrid_fused`` in ``kw`` runs
    hybrid with fused passes."""
    hybrid_fused = kw.pop("hybrid_fused", False)

    def once(tokens: int):
        stats = DecodeStats()
        opts = eng.decode_options(policy, tokens, None, kw.get("tau"), kw.get("min_prefix"),
                            candidates=kw.get("candidates"))
        if hybrid_fused:
            from dataclasses import replace

            opts = replace(opts, hybrid_fused=True)
        ids = eng._prompt_ids(prompt)
        out = [t for chunk in decode(eng.backend, ids, opts, stats) for t in chunk]
        return out, stats

    once(min(n, 16))  # warm-up
    runs = [once(n) for _ in range(repeats)]
    tps = [st.decode_tokens_per_s for _, st in runs]
    out, s = runs[-1]
    return {"policy": policy, "tok_s": statistics.median(tps), "tokens": s.new_tokens,
            "tokens_per_iteration": s.tokens_per_iteration, "iterations": s.iterations,
            "forward_passes": s.forward_passes, "tokens_per_forward": s.tokens_per_forward,
            "verifier_calls": s.verifier_calls, "host_syncs": s.host_syncs, "token_ids": out,
            "fused_candidates": dict(s.fused_candidates),
            "steps": [[st.width, st.role] for st in eng.backend.log.states]}


def fused_replay_times(eng: Engine, segment: int, base_len: int, repeats: int = 50) -> list[dict]:
    """µs per replay of every fused width (c = 1..D; D causal rows, after a hit and after a
    draft step alike) at one segment; the widths not captured at load are captured here
    (their inputs are whatever the buffers hold: the cost of a replay does not depend on the
    token values)."""
    b, d = eng.backend, eng.block_size
    from bitmtp_edge.backends.fused_graph import fused_width

    b.static.history_len.fill_(base_len)
    b.kv.length = base_len  # warm-up runs before capture keep the history they see
    widths = sorted({fused_width(d, d, c) for c in range(1, d + 1)})
    for w in widths:
        state = ReplayState(w, segment, "fused")
        if state not in b.graphs:
            b._capture(state)
    reset = lambda: b.static.history_len.fill_(base_len)  # noqa: E731
    t_reset = cuda_ms(reset, repeats)
    rows = []
    for w in widths:
        graph = b.graphs[ReplayState(w, segment, "fused")]

        def one():
            reset()
            graph.replay()

        one()
        rows.append({"width": w, "causal": d, "candidates": w // d - 1, "after": "hit or draft step",
                     "us": 1000 * (cuda_ms(one, repeats) - t_reset)})
    b.reset()
    return rows


class ForcedAcceptance:
    """Speculative decoding whose drafts are the AR route's tokens, cut to ``accepted``
    correct ones: every iteration commits exactly accepted + 1 tokens. Labelled forced."""

    def __init__(self, backend, ar_tokens: list[int], prompt_len: int, accepted: int, vocab: int):
        self.inner, self.ar, self.prompt_len, self.accepted, self.vocab = backend, ar_tokens, prompt_len, accepted, vocab

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft_step(self, pending, block_size):
        self.inner.draft_step(pending, block_size)  # the real draft replay (its cost counts)
        done = self.inner.history_length - self.prompt_len
        want = (self.ar[done:done + block_size] + [0] * block_size)[:block_size]
        forced = want[: self.accepted] + [(t + 1) % self.vocab for t in want[self.accepted:]]
        self.inner.static.verify_tokens[1:].copy_(torch.tensor(forced), non_blocking=True)
        return DraftResult(forced, [0.0] * block_size)


def forced_decode(eng: Engine, prompt: list[int], ar_tokens: list[int], accepted: int, n: int, repeats: int) -> dict:
    d = eng.block_size
    tps, stats = [], None
    for _ in range(repeats + 1):
        stats = DecodeStats()
        forced = ForcedAcceptance(eng.backend, ar_tokens + [0] * (2 * d), len(prompt), accepted,
                                  eng.manifest.model.vocab_size)
        out = [t for c in decode(forced, prompt, DecodeOptions("speculative", n, block_size=d), stats) for t in c]
        tps.append(stats.decode_tokens_per_s)
    same = sum(x == y for x, y in zip(out, ar_tokens))
    return {"accepted": accepted, "tok_s": statistics.median(tps[1:]), "tokens_per_iteration": stats.tokens_per_iteration,
            "identical_to_ar": same / max(len(out), 1), "host_syncs_per_iteration": stats.host_syncs / max(stats.iterations, 1)}


# -- parts ---------------------------------------------------------------------------------------

def part_2b(work: Path, args, progress) -> dict:
    log("building the random 2B-shaped HF BitNet checkpoint (packed offline)")
    t0 = time.perf_counter()
    dims = dict(BITNET_2B)
    if args.quick:
        dims.update(num_hidden_layers=4, vocab_size=32000)
    ckpt = make_random_bitnet_2b(work / "bitnet2b-ckpt", dims, block_size=8)
    make_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    art = export(ckpt, work / "bitnet2b-artifact", max_context=args.max_context)
    export_s = time.perf_counter() - t0
    log(f"checkpoint {make_s:.1f} s, export {export_s:.1f} s")
    prompt = list(range(10, 10 + 32))
    result = {"checkpoint_s": make_s, "export_s": export_s, "dims": dims, "configs": {}}
    ar_tokens = None
    for name in args.configs.split(","):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cached_kernels = triton_cache_entries()
        t0 = time.perf_counter()
        eng = load_config(art, name, args.backend)
        torch.cuda.synchronize()
        startup = time.perf_counter() - t0
        b = eng.backend
        # kernels this load had to compile (new entries in Triton's on-disk cache): 0 = a warm
        # start; otherwise capture compiled them, most of a cold start
        compiled = triton_cache_entries() - cached_kernels
        split = dict(eng.startup)  # load / precompile / capture (Engine.load's own clock)
        row = {"startup_s": startup, "kernels_compiled": compiled, "startup_split": split,
               "kernel_cache": "warm" if compiled == 0 else f"cold ({compiled} compiled)",
               "capture_s": b.capture_s, "graphs": len(b.graphs),
               "step_costs": b.step_costs,  # timed at load for policy fused's choice of c (None: eager)
               "kv_bytes": b.kv_bytes, "graph_pool_bytes": b.graph_pool_bytes,
               "workspace_bytes": b.kv.workspace * eng.manifest.kv.bytes_per_slot,
               "peak_mem_bytes": torch.cuda.max_memory_allocated()}
        # Eager configurations pay Python launch overhead on every kernel: fewer tokens and
        # forced levels keep the run short (tok/s is decode-only, so lengths compare).
        eager = not b.graphs
        tokens, repeats = (min(args.tokens, 32), 1) if eager else (args.tokens, args.repeats)
        levels = (0, 2, 4, 8) if eager else (0, 1, 2, 4, 6, 8)
        row["tokens"], row["repeats"] = tokens, repeats
        ar = timed_generate(eng, prompt, "ar", tokens, repeats)
        row["ar"] = {k: v for k, v in ar.items() if k != "token_ids"}
        if ar_tokens is None or len(ar["token_ids"]) > len(ar_tokens):
            ar_tokens = ar["token_ids"]
        n = min(len(ar_tokens), len(ar["token_ids"]))
        row["ar_tokens_same_as_other_configs"] = ar["token_ids"][:n] == ar_tokens[:n]
        if b.graphs:
            row["replay_us"] = replay_times(eng, segment=0, base_len=len(prompt))
            if b.static.fused is not None:
                row["fused_replay_us"] = fused_replay_times(eng, segment=0, base_len=len(prompt))
        row["forced"] = [forced_decode(eng, prompt, ar_tokens, a, min(tokens, len(ar_tokens)), repeats)
                         for a in levels]
        result["configs"][name] = row
        progress(result)
        log(f"{name}: startup {startup:.1f} s (load {split.get('load_s', 0):.1f}, precompile "
            f"{split.get('precompile_s', 0):.1f} [{split.get('kernels_precompiled', 0)} kernels], capture "
            f"{split.get('capture_s', 0):.1f}), AR {ar['tok_s']:.0f} tok/s, forced a=8 "
            f"{row['forced'][-1]['tok_s']:.0f} tok/s")
        del eng
    result["artifact"] = str(art)
    return result


def compiled_ar_loop(model, ids: torch.Tensor, n: int) -> dict:
    """The gpt-fast recipe a user would write: eager prefill into a ``StaticCache``, then one
    ``torch.compile(mode="reduce-overhead", fullgraph=True)`` decode step (a CUDA graph per
    shape, one shape) called once per token. ``generate`` with a compiled forward compiles
    the prefill and decode shapes and its own Python loop around them: it did not finish
    compiling in 150 s on the 2B shape."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + n + 8)

    def decode_one(tok, pos):
        logits = model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    step = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True)

    def run(tokens: int) -> None:
        cache.reset()
        prefill = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(ids.shape[1], device="cuda"),
                        use_cache=True).logits
        tok = prefill[:, -1].argmax(-1, keepdim=True)
        pos = torch.tensor([ids.shape[1]], device="cuda")
        for _ in range(tokens):
            tok = step(tok, pos).clone()  # the graph's output buffer is reused by the next replay
            pos += 1

    t0 = time.perf_counter()
    run(4)  # compile, record the graph, replay once
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    run(n)
    torch.cuda.synchronize()
    return {"tok_s": n / (time.perf_counter() - t0), "tokens": n, "compile_s": compile_s}


def part_baselines(work: Path, args, dims: dict, progress) -> dict:
    """transformers eager bf16 generate and a torch.compile reduce-overhead AR loop, 2B shape."""
    from transformers import BitNetConfig, BitNetForCausalLM

    out = {}
    cfg = BitNetConfig(**dims, hidden_act="relu2", tie_word_embeddings=True, rope_theta=500000.0)
    with torch.device("cuda"):
        model = BitNetForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.arange(10, 42, device="cuda").unsqueeze(0)
    n = args.baseline_tokens
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
        torch.cuda.synchronize()
        out["transformers_eager_bf16"] = {"tok_s": n / (time.perf_counter() - t0), "tokens": n}
        log(f"transformers eager bf16: {out['transformers_eager_bf16']['tok_s']:.1f} tok/s")
        progress(out)  # torch.compile may outlast the time limit: keep this number
        try:
            out["torch_compile_reduce_overhead_bf16"] = compiled_ar_loop(model, ids, n)
            log(f"torch.compile bf16: {out['torch_compile_reduce_overhead_bf16']['tok_s']:.1f} tok/s "
                f"(compiled in {out['torch_compile_reduce_overhead_bf16']['compile_s']:.0f} s)")
        except Exception as e:  # noqa: BLE001 - report, don't lose the other numbers
            out["torch_compile_reduce_overhead_bf16"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    del model
    torch.cuda.empty_cache()
    return out


def part_trained(args) -> dict:
    out = {}
    counts = args.candidates
    routes = {"ar": ("ar", {}), "confidence": ("confidence", {}), "speculative": ("speculative", {}),
              "hybrid": ("hybrid", {})}
    routes.update({f"fused c={c}": ("fused", {"candidates": c}) for c in counts})
    routes["fused auto"] = ("fused", {})  # c per pass from the costs timed at load (runtime/candidates.py)
    c_hybrid = DEFAULT_CANDIDATES if DEFAULT_CANDIDATES in counts else counts[-1]
    routes[f"hybrid+fused c={c_hybrid}"] = ("hybrid", {"candidates": c_hybrid, "hybrid_fused": True})
    for art in args.artifact:
        res = {}
        for name in args.trained_configs.split(","):
            runtime = RuntimeOptions.preset(name, fused_candidates=tuple(sorted(set(counts) | set(AUTO_CANDIDATES))))
            eng = Engine.load(art, backend=args.backend, device="cuda", runtime=runtime)
            # fused auto as a user gets it: an engine loaded with the defaults (AUTO_CANDIDATES timed)
            auto = Engine.load(art, backend=args.backend, device="cuda", runtime=name)
            prompts = held_out_prompts(eng, args.prompts)
            per = {}
            for route, (policy, kw) in routes.items():
                if route == "fused auto" and auto.candidate_chooser is None:
                    continue  # nothing timed at load (eager runtime): c would be the default
                on = auto if route == "fused auto" else eng
                rows = [timed_generate(on, p, policy, args.tokens, args.repeats, **kw) for p in prompts]
                tokens, passes = sum(r["tokens"] for r in rows), sum(r["forward_passes"] for r in rows)
                per[route] = {"tok_s": statistics.mean(r["tok_s"] for r in rows),
                              "tokens_per_iteration": statistics.mean(r["tokens_per_iteration"] for r in rows),
                              "tokens_per_forward": tokens / max(passes, 1),
                              "host_syncs_per_iteration": sum(r["host_syncs"] for r in rows)
                              / max(sum(r["iterations"] for r in rows), 1),
                              "verifier_call_rate": statistics.mean(r["verifier_calls"] / max(r["iterations"], 1)
                                                                    for r in rows),
                              "steps": [r["steps"] for r in rows], "tokens": [r["tokens"] for r in rows],
                              "_ids": [r["token_ids"] for r in rows]}
                if route == "fused auto":
                    per[route]["fused_candidates"] = dict(sum((Counter(r["fused_candidates"]) for r in rows), Counter()))
                    per[route]["chooser"] = auto.candidate_chooser.to_dict()
            per["prompts"] = [p[:60] for p in prompts]
            ar_ids = per["ar"].pop("_ids")
            for policy in [r for r in routes if r != "ar" and r in per]:
                ids = per[policy].pop("_ids")
                per[policy]["unequal_prompts"] = [i for i, (a, b) in enumerate(zip(ar_ids, ids)) if a != b]
                per[policy]["speedup"] = per[policy]["tok_s"] / per["ar"]["tok_s"]
                same = sum(x == y for a, b in zip(ar_ids, ids) for x, y in zip(a, b))
                per[policy]["agreement_with_ar"] = same / max(sum(len(a) for a in ar_ids), 1)
                per[policy]["equal_to_ar"] = sum(a == b for a, b in zip(ar_ids, ids))
                per[policy]["prompts"] = len(ids)
            res[name] = per
            log(f"{art} {name}: AR {per['ar']['tok_s']:.0f} tok/s, hybrid {per['hybrid']['tok_s']:.0f} tok/s "
                f"(×{per['hybrid']['speedup']:.2f}, {per['hybrid']['tokens_per_iteration']:.2f} tok/iter)")
            del eng, auto
        out[f"D={Engine.load(art, backend='reference', device='cpu').block_size}:{Path(art).name}"] = res
    return out


# -- report ------------------------------------------------------------------------------------

def held_out_prompts(eng: Engine, limit: int) -> list[str]:
    """The artifact's held-out prompts (``prompts.jsonl``), then the demo's built-in ones, up
    to ``limit``."""
    from bitmtp_edge.app.demo import FALLBACK_PROMPTS, demo_prompts

    prompts = demo_prompts(eng, limit=limit)
    return (prompts + [p for p in FALLBACK_PROMPTS if p not in prompts])[:limit]


def markdown(report: dict) -> str:
    lines = ["# End-to-end decode benchmark", "",
             f"- device: {report['device']}", f"- date: {report['date']}", f"- commit: {report['commit']}",
             f"- command: `{report['command']}`", ""]
    if "2b" in report:
        r = report["2b"]
        lines += ["## BitNet-2B shape (random weights, D = 8)", "",
                  "| configuration | startup s | load / precompile / capture s | kernel cache | graphs | AR tok/s "
                  "| forced a=0 | a=2 | a=4 | a=8 tok/s | KV MiB | shared-KV increment MiB | graph pool MiB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, c in r["configs"].items():
            f = {x["accepted"]: x["tok_s"] for x in c["forced"]}
            sp = c.get("startup_split", {})
            split = (f"{sp['load_s']:.1f} / {sp['precompile_s']:.1f} / {sp['capture_s']:.1f}" if sp else "?")
            lines.append(f"| {name} | {c['startup_s']:.1f} | {split} | {c.get('kernel_cache', '?')} | {c['graphs']} | "
                         f"{c['ar']['tok_s']:.0f} | {f[0]:.0f} | "
                         f"{f[2]:.0f} | {f[4]:.0f} | {f[8]:.0f} | {c['kv_bytes'] / 2**20:.0f} | "
                         f"{c['workspace_bytes'] / 2**20:.2f} | {c['graph_pool_bytes'] / 2**20:.1f} |")
        full = r["configs"].get("full", {})
        if full.get("replay_us"):
            lines += ["", "Replay cost per (M, role), Full, segment 0:", "", "| M | role | µs |", "|---|---|---|"]
            lines += [f"| {x['width']} | {x['role']} | {x['us']:.1f} |" for x in full["replay_us"]]
            t = targets_2b(r)
            lines += ["", "Targets (issue 5):", "",
                      f"- AR ≥ 1500 tok/s: {t['ar_tok_s']:.0f} tok/s ({'met' if t['ar_met'] else 'missed'})",
                      f"- draft replay at M = 2D ≤ 1.5× an AR replay: {t['draft_2d_over_ar']:.2f}× "
                      f"({'met' if t['draft_met'] else 'missed'})",
                      f"- startup ≤ 15 s: {t['startup_s']:.1f} s, kernel cache {t['kernel_cache']} "
                      f"({'met' if t['startup_met'] else 'missed'})"]
        lines += ["", "Shared-KV increment: the W workspace slots every segment carries beyond its history "
                  "(the rows of a draft block); the history of all segments is one nested allocation.", "",
                  "Forced acceptance: drafts replaced by the AR route's tokens, cut to a fixed accepted "
                  "length a (each iteration commits a + 1 tokens). Labelled forced: no model drafts this well.", ""]
    if "baselines" in report:
        lines += ["## Other routes on the same 2B shape (bf16, no ternary)", "", "| route | tok/s |", "|---|---|"]
        for name, b in report["baselines"].items():
            lines.append(f"| {name} | {b.get('tok_s', float('nan')):.1f} |" if "tok_s" in b else f"| {name} | {b['error']} |")
        lines.append("")
    for art, res in report.get("trained", {}).items():
        lines += [f"## Trained model {art}", "",
                  "| runtime | policy | tok/s | tokens/iter | tokens/forward | verifier rate | host reads/iter "
                  "| speedup vs AR | equal to AR | agreement with AR |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, per in res.items():
            for policy, p in per.items():
                if policy == "prompts":
                    continue
                equal = f"{p['equal_to_ar']}/{p['prompts']}" if "equal_to_ar" in p else "—"
                lines.append(f"| {name} | {policy} | {p['tok_s']:.0f} | {p['tokens_per_iteration']:.2f} | "
                             f"{p.get('tokens_per_forward', 0.0):.2f} | {p.get('verifier_call_rate', 0.0):.2f} | "
                             f"{p.get('host_syncs_per_iteration', 0.0):.2f} | "
                             f"{p.get('speedup', 1.0):.2f} | {equal} | {p.get('agreement_with_ar', 1.0):.3f} |")
        lines.append("")
        for name, per in res.items():
            auto = per.get("fused auto")
            if auto and "chooser" in auto:
                ch = auto["chooser"]
                lines += [f"{name}, fused auto: passes per c {auto['fused_candidates']}; costs timed at load "
                          f"(µs) fused {ch['fused_us']}, draft {ch['draft_us']}; µs per token of each c's passes "
                          f"at the end {ch['us_per_token']} (`runtime/candidates.py`).", ""]
    for name, c in report.get("2b", {}).get("configs", {}).items():
        if not c.get("fused_replay_us"):
            continue
        ar_us = next(x["us"] for x in c["replay_us"] if x["width"] == 1)
        lines += [f"## Fused replays on the 2B shape ({name}, segment 0)", "",
                  "| M | after | c | µs | vs AR replay |", "|---|---|---|---|---|"]
        lines += [f"| {x['width']} | {x['after']} | {x['candidates']} | {x['us']:.1f} | {x['us'] / ar_us:.2f}× |"
                  for x in c["fused_replay_us"]]
        lines.append("")
    proj = report.get("fused_projection")
    if proj and proj.get("routes"):
        lines += ["## Projected 2B decode from the trained model's measured steps", "",
                  f"Each route's measured step sequence (its acceptance and fused hit/miss histogram) priced at "
                  f"the 2B shape's replay costs ({proj['config']}, segment 0) plus "
                  f"{proj['overhead_us_per_pass']:.0f} µs per pass (measured 2B AR decode minus its replay). "
                  f"Projected, not decoded. Measured 2B AR: {proj['ar_tok_s']:.0f} tok/s.", "",
                  "| route | passes | tokens | projected tok/s | vs AR |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['passes']} | {v['tokens']} | {v['tok_s']:.0f} | {v['speedup_vs_ar']:.2f}× |"
                  for k, v in proj["routes"].items()]
        lines.append("")
    return "\n".join(lines) + "\n"


def project_2b(report: dict) -> dict:
    """Price each trained route's measured step sequence at the 2B shape's replay costs.

    Per forward pass: the replay cost of its (M, role) at segment 0, plus the overhead the
    2B AR decode measured on top of its own replay (graph launch, host read, Python). The
    sequences carry the trained model's acceptance lengths and fused hits and misses, so the
    projection replays its measured histogram; it is a projection, not a decode."""
    configs = {n: c for n, c in report["2b"]["configs"].items() if c.get("fused_replay_us")}
    if not configs:
        return {}
    name, full = next(iter(configs.items()))
    cost = {(x["width"], x["role"]): x["us"] for x in full["replay_us"]}
    cost.update({(x["width"], "fused"): x["us"] for x in full["fused_replay_us"]})
    ar_us = cost[(1, "verify")]
    overhead = max(1e6 / full["ar"]["tok_s"] - ar_us, 0.0)
    out = {"config": name, "ar_replay_us": ar_us, "overhead_us_per_pass": overhead,
           "ar_tok_s": full["ar"]["tok_s"], "routes": {}}
    for art, res in report["trained"].items():
        per = res.get(name) or next(iter(res.values()))
        for route, r in per.items():
            if route == "prompts":
                continue
            steps = [tuple(x) for seq in r.get("steps", []) for x in seq]
            missing = {s for s in steps if s not in cost}
            if not steps or missing:
                continue
            us = sum(cost[s] + overhead for s in steps)
            tok_s = sum(r["tokens"]) / (us / 1e6)
            out["routes"][f"{art} {route}"] = {"tok_s": tok_s, "speedup_vs_ar": tok_s / full["ar"]["tok_s"],
                                               "passes": len(steps), "tokens": sum(r["tokens"])}
    return out


def load_config(art: Path, name: str, backend: str) -> Engine:
    """A runtime preset, or ``<preset>-nopdl``: the same with programmatic dependent launch off
    while its graphs are captured (a graph keeps the launch mode it was captured with), the
    before/after of ``kernels_ampere.common.pdl_options`` in one run."""
    from kernels_ampere.common import programmatic_launch

    runtime, pdl = (name.removesuffix("-nopdl"), False) if name.endswith("-nopdl") else (name, True)
    previous = programmatic_launch()
    programmatic_launch(pdl)
    try:
        return Engine.load(art, backend=backend, device="cuda", runtime=runtime)
    finally:
        programmatic_launch(previous)


def triton_cache_entries() -> int:
    """Entries in Triton's on-disk cache (one per compiled kernel variant)."""
    try:
        from triton import knobs

        folder = Path(knobs.cache.dir)
    except (ImportError, AttributeError):  # older Triton
        folder = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0


def targets_2b(r: dict) -> dict:
    full = r["configs"]["full"]
    replay = {(x["width"], x["role"]): x["us"] for x in full["replay_us"]}
    d = max(w for w, role in replay if role == "verify") - 1
    ratio = replay[(2 * d, "draft")] / replay[(1, "verify")]
    return {"ar_tok_s": full["ar"]["tok_s"], "ar_met": full["ar"]["tok_s"] >= 1500,
            "draft_2d_over_ar": ratio, "draft_met": ratio <= 1.5,
            "startup_s": full["startup_s"], "startup_met": full["startup_s"] <= 15,
            "kernel_cache": full.get("kernel_cache", "unrecorded")}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, c in report.get("2b", {}).get("configs", {}).items():
        xs = [f["tokens_per_iteration"] for f in c["forced"]]
        ys = [f["tok_s"] for f in c["forced"]]
        ax.plot(xs, ys, marker="o", label=f"{name} (forced)")
        ax.axhline(c["ar"]["tok_s"], ls=":", lw=0.8, color=ax.lines[-1].get_color())
    ax.set_xlabel("tokens per iteration")
    ax.set_ylabel("decode tok/s")
    ax.set_title("BitNet-2B shape: tok/s vs tokens per iteration (dotted: AR)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="2b,baselines,trained")
    ap.add_argument("--artifact", action="append", default=[],
                    help="trained artifact(s) for the 'trained' part (default: the embedded model)")
    ap.add_argument("--backend", default="ampere", choices=["ampere", "server"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--baseline-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="runtime configurations of the 2b part")
    ap.add_argument("--trained-configs", default="generic,full", help="runtime configurations of the trained part")
    ap.add_argument("--candidates", type=lambda v: [int(x) for x in v.split(",")], default=[DEFAULT_CANDIDATES],
                    help="draft blocks per fused pass (c), comma-separated: one fused route each in the trained part")
    ap.add_argument("--quick", action="store_true", help="4 layers, small vocab: a smoke run")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bitmtp-bench"))
    ap.add_argument("--out", type=Path, default=ROOT / "tools" / "results")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if "trained" in parts and not args.artifact:  # the part a user asked for runs: on the model that ships
        from bitmtp_edge.runtime.engine import embedded_artifact_path

        args.artifact = [str(embedded_artifact_path())]
    report = {"device": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "commit": commit(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "torch": torch.__version__, "backend": args.backend}
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)

    def save():
        (args.out / "e2e.json").write_text(json.dumps(report, indent=1))
        (args.out / "e2e.md").write_text(markdown(report))

    def progress(part):
        def keep(partial):
            report[part] = partial
            save()
        return keep

    # `timeout` sends SIGTERM: raise instead, so what was measured so far is saved
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        # trained first: it is short, and the 2B part's fused projection prices its step sequences
        for part, fn in (("trained", lambda: part_trained(args)),
                         ("2b", lambda: part_2b(args.work, args, progress("2b"))),
                         ("baselines", lambda: part_baselines(args.work, args, report.get("2b", {}).get("dims", BITNET_2B),
                                                              progress("baselines")))):
            if part not in parts:
                continue
            try:
                report[part] = fn()
            except Exception as e:  # noqa: BLE001 - keep the other parts' numbers
                import traceback

                traceback.print_exc()
                report[f"{part}_error"] = f"{type(e).__name__}: {e}"[:2000]
            save()
    finally:
        if report.get("2b", {}).get("configs") and report.get("trained"):
            report["fused_projection"] = project_2b(report)
        save()
        if report.get("2b", {}).get("configs"):
            plot(report, args.out / "e2e.png")
    print(markdown(report))


if __name__ == "__main__":
    main()
