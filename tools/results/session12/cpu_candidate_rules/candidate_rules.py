"""Session 12, CPU: how well the fused step's candidate rule picks the accepted length.

``log``: decode the 40 held-out prompts (``tools/checkpoints/data/prompts.jsonl``, 128 new tokens) with
the embedded model, fused policy with every candidate (c = D + 1: every iteration hits, so the
states visited do not depend on a rule), on the reference backend; record each fused iteration's
drafts' confidences (calibrated, as the runtime sees them) and its accepted length a.
``eval``: the share of those iterations whose a is among the c lengths each rule ranks first.

    python tools/results/session12/cpu_candidate_rules/candidate_rules.py log 20 0 log_prompts_00_19.json
    python tools/results/session12/cpu_candidate_rules/candidate_rules.py eval log_*.json
"""
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))


def log(n: int, skip: int, out: str) -> None:
    import torch

    import fused_candidates as fc
    from bitmtp_edge.backends import reference
    from bitmtp_edge.runtime.engine import Engine

    torch.set_num_threads(1)
    fc.convert_codes_once()
    eng = Engine.load(None, backend="reference", device="cpu")
    records = []
    original = reference.ReferenceBackend.fused_step

    def logged(self, anchor, pending, draft, candidates, block_size):
        r = original(self, anchor, pending, draft, candidates, block_size)
        records.append({"conf": list(draft.confidences), "a": r.accepted})
        return r

    reference.ReferenceBackend.fused_step = logged
    rows = [json.loads(line) for line in (ROOT / "tools/checkpoints/data/prompts.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows[skip:skip + n]):
        t0 = time.perf_counter()
        r = fc.run_one(eng, eng.encode(row["prompt"]), "fused", 128, {"candidates": eng.block_size + 1})
        print(i, r["new_tokens"], r["forward_passes"], f"{time.perf_counter() - t0:.0f}s", len(records), flush=True)
        Path(out).write_text(json.dumps(records))


def reach_product(c):  # independent errors (the shipped rule, decoding_rules.acceptance_probabilities)
    r, out = 1.0, [1.0]
    for x in c:
        r *= x
        out.append(r)
    return out


def reach_min(c):  # perfectly correlated errors
    r, out = 1.0, [1.0]
    for x in c:
        r = min(r, x)
        out.append(r)
    return out


def reach_geo(c, alpha):
    p, m = reach_product(c), reach_min(c)
    return [a ** alpha * b ** (1 - alpha) for a, b in zip(p, m)]


def reach_arith(c, w):
    return [w * a + (1 - w) * b for a, b in zip(reach_product(c), reach_min(c))]


def top(reach, k):
    r = reach + [0.0]
    p = [max(r[j] - r[j + 1], 0.0) for j in range(len(reach))]  # P(a = j)
    return set(sorted(range(len(p)), key=lambda j: (-p[j], j))[:k])


def evaluate(files) -> None:
    records = [r for f in files for r in json.loads(Path(f).read_text())]
    print(len(records), "iterations")
    print(sorted(Counter(r["a"] for r in records).items()))
    rules = [("product", reach_product), ("min", reach_min)]
    rules += [(f"geo {a}", lambda c, a=a: reach_geo(c, a)) for a in (0.1, 0.25, 0.5)]
    rules += [(f"arith {w}", lambda c, w=w: reach_arith(c, w)) for w in (0.25, 0.5, 0.75)]
    for name, rule in rules:
        hits = {k: sum(r["a"] in top(rule(r["conf"]), k) for r in records) / len(records) for k in (1, 2, 3, 4)}
        print(f"{name:10s}", " ".join(f"c={k}: {v:.3f}" for k, v in hits.items()))


if __name__ == "__main__":
    if sys.argv[1] == "log":
        log(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        evaluate(sys.argv[2:])
