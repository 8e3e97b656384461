"""Round 4 analysis: do the new models' drafts follow the old verifier (d8sd2, whose greedy
continuations they were trained on) or their own? On the 12 held-out prompts of the replay,
along d8sd2's greedy continuation (teacher forcing: the same prefixes for every model), the
agreement of each model's drafts, per slot, with (a) d8sd2's greedy next token and (b) the
model's own verifier's greedy next token on that same prefix; and how often the two verifiers'
greedy tokens differ.

    PYTHONPATH=. python tools/results/round4/draft_agreement.py OLD=CKPT NAME=CKPT ... OUT.json
"""
import json
import sys
import time
from pathlib import Path

import torch

from tools.blocks import BlockLayout, build_rows
from tools.distill import greedy_continue
from tools.eval_acceptance import exact_float32_int_matmul
from tools.hf_checkpoint import load_runtime_model
from tools.prompts import read_prompts
from tools.tokenizer import load_tokenizer

N_PROMPTS, MAX_NEW = 12, 128


@torch.no_grad()
def tables(model, clean: list[int], n_prompt: int, n_anchor: int, D: int, mask_id: int):
    """(verifier argmax at every clean position [L], drafts [n_anchor, D]) over ``clean``."""
    L = len(clean) - D
    anchors = torch.arange(n_prompt - 1, n_prompt - 1 + n_anchor).unsqueeze(0)
    x, pos, _, mask = build_rows(torch.tensor([clean]), anchors, BlockLayout(L, D, n_anchor), mask_id, None)
    h = model(x, pos, mask)[0]
    return model.verify_logits(h[:L]).argmax(-1), model.draft_logits(h[L:]).argmax(-1).view(n_anchor, D)


def main(specs: list[str], out: str) -> None:
    torch.set_num_threads(1)
    models = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        models[name] = (path, *load_runtime_model(path, torch.float32, "cpu"))
    old_name = next(iter(models))
    _, old, ck = models[old_name]
    D, mask_id = ck.mtp.block_size, ck.mtp.mask_token_id
    tok = load_tokenizer(Path(models[old_name][0]))
    prompts = read_prompts("tools/checkpoints/data/prompts.jsonl")[:N_PROMPTS]
    counts = {n: {"vs_old": torch.zeros(D), "vs_own": torch.zeros(D), "n": torch.zeros(D), "verifiers_differ": 0,
                  "positions": 0} for n in models}
    t0 = time.perf_counter()
    with exact_float32_int_matmul():
        for p in prompts:
            ids = tok.encode(p.model_prompt, add_special_tokens=False).ids
            full = greedy_continue(old, torch.tensor([ids]), MAX_NEW + D)[0].tolist()  # d8sd2's text
            P, n_anchor = len(ids), MAX_NEW
            clean = full[: P - 1 + n_anchor + D]
            for name, (_, model, _) in models.items():
                ver, drafts = tables(model, clean, P, n_anchor, D, mask_id)
                c = counts[name]
                for j in range(D):
                    at = torch.arange(n_anchor) + P - 1 + j  # the clean row predicting slot j's token
                    keep = at < len(ver)  # rows the layout scores (the last anchors' high slots are not)
                    at, d = at[keep], drafts[keep, j]
                    old_tok = torch.tensor(clean)[at + 1]   # d8sd2's greedy token there (its own text)
                    c["vs_old"][j] += (d == old_tok).sum()
                    c["vs_own"][j] += (d == ver[at]).sum()
                    c["n"][j] += len(at)
                rows = torch.arange(P - 1, P - 1 + n_anchor)
                c["verifiers_differ"] += int((ver[rows] != torch.tensor(clean)[rows + 1]).sum())
                c["positions"] += n_anchor
    report = {"method": __doc__.strip().splitlines()[0:6], "old": old_name, "prompts": N_PROMPTS,
              "max_new_tokens": MAX_NEW, "wall_s": round(time.perf_counter() - t0, 1),
              "when": time.strftime("%Y-%m-%d %H:%M"), "models": {}}
    for name, c in counts.items():
        report["models"][name] = {
            "path": models[name][0],
            "draft_agrees_with_old_verifier": [round(float(a / n), 4) for a, n in zip(c["vs_old"], c["n"])],
            "draft_agrees_with_own_verifier": [round(float(a / n), 4) for a, n in zip(c["vs_own"], c["n"])],
            "own_verifier_differs_from_old": round(c["verifiers_differ"] / c["positions"], 4)}
        r = report["models"][name]
        print(name, "old", r["draft_agrees_with_old_verifier"][:4], "own", r["draft_agrees_with_own_verifier"][:4],
              "verifiers differ", r["own_verifier_differs_from_old"])
    Path(out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:-1], sys.argv[-1])
