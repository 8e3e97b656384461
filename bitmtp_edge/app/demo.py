"""The main job: AR vs multi-token decoding on held-out code prompts, in one run."""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Callable

from ..runtime.engine import Engine
from .bench import FALLBACK_PROMPTS, load_prompts  # FALLBACK_PROMPTS: tools and tests import it from here


def demo_prompts(engine: Engine, limit: int = 3) -> list[str]:
    """Held-out prompts shipped beside the artifact (``prompts.jsonl``), else built-in ones.

    A malformed file is a ``BenchError`` naming its line (read as ``bitmtp bench`` reads it),
    not a traceback from json; an empty one means the built-in prompts."""
    path = Path(engine.path) / "prompts.jsonl"
    if path.is_file() and path.read_bytes().strip():
        return [p.text for p in load_prompts(path)][:limit]
    return list(FALLBACK_PROMPTS[:limit])


def run_demo(engine: Engine, max_new_tokens: int = 96, policy: str = "hybrid",
             echo: Callable[[str], None] | None = print, prompts: list[str] | None = None) -> dict:
    if engine.manifest.mtp is None:
        if echo and policy != "ar":  # AR against AR would read as a measured ×1.00, say why instead
            echo(f"{engine.path} is AR-only (no MTP block in its manifest): {policy} decoding needs a BitMTP "
                 "model, so this demo runs AR twice; export a model trained with MTP blocks to see the speedup")
        policy = "ar"
    prompts = prompts or demo_prompts(engine)
    engine.generate(prompts[0], max_new_tokens=8, policy="ar")  # warm-up: allocations, first-call costs
    rows = []
    for prompt in prompts:
        ar = engine.generate(prompt, max_new_tokens=max_new_tokens, policy="ar")
        mtp = engine.generate(prompt, max_new_tokens=max_new_tokens, policy=policy)
        speedup = (mtp.stats.decode_tokens_per_s / ar.stats.decode_tokens_per_s
                   if ar.stats.decode_tokens_per_s else 0.0)
        rows.append({
            "prompt": prompt, "ar_text": ar.text, "text": mtp.text,
            "ar_tok_s": ar.stats.decode_tokens_per_s, "tok_s": mtp.stats.decode_tokens_per_s,
            "tokens_per_iteration": mtp.stats.tokens_per_iteration, "speedup": speedup,
            "identical_to_ar": mtp.token_ids == ar.token_ids[: len(mtp.token_ids)],
        })
        if echo:
            echo("─" * 72)
            echo(prompt + mtp.text)
            echo(f"  AR: {ar.stats.decode_tokens_per_s:7.1f} tok/s   {policy}: {mtp.stats.decode_tokens_per_s:7.1f} tok/s"
                 f"   {mtp.stats.tokens_per_iteration:.2f} tokens/iteration   speedup ×{speedup:.2f}")
    summary = {
        "artifact": str(engine.path), "backend": engine.backend.name, "device": str(engine.device),
        "policy": policy, "median_speedup": median(r["speedup"] for r in rows),
        "mean_tokens_per_iteration": sum(r["tokens_per_iteration"] for r in rows) / len(rows), "prompts": rows,
    }
    if echo:
        echo("─" * 72)
        echo(f"{engine.backend.name} on {engine.device}: median speedup ×{summary['median_speedup']:.2f}, "
             f"{summary['mean_tokens_per_iteration']:.2f} tokens/iteration ({policy} vs AR, same run)")
    return summary
