"""Session 19: the share of verify calls the certified head answers from the int8 rows, with every row of
a call to prove and with rows only up to the first rejection (the embedded model, speculative, 6 held-out
prompts x 64 tokens, the graph backend eager on the CPU with the kernels' twins). Run from the repo root:
PYTHONPATH=. python tools/results/session19/verify_share_cpu.py
Output (2026-12-03, 1ef6e5c + the rule): "all rows (83, 28)", "up to the first rejection (83, 49)":
(verify calls, answered by the int8 rows)."""
import time, torch
from bitmtp_edge.runtime.engine import embedded_artifact_path
from bitmtp_edge.format.manifest import read_manifest, load_tensors
from bitmtp_edge.backends.fast_model import FastModel
from bitmtp_edge.backends.graph import GraphBackend, RuntimeOptions
from bitmtp_edge.backends.ops import twin_ops
from bitmtp_edge.runtime.decoding import DecodeOptions, DecodeStats, decode
from kernels_ampere import certified_head as ch
from tools.bench_e2e import held_out_prompts
from bitmtp_edge import Engine

folder = embedded_artifact_path()
m = read_manifest(folder)
tensors = load_tensors(folder)
eng = Engine.load(None, backend="reference", device="cpu")
prompts = [eng.tokenizer.encode(p).ids if hasattr(eng.tokenizer.encode(p), "ids") else eng.tokenizer.encode(p) for p in held_out_prompts(eng, 6)]
for rule in ("all rows", "up to the first rejection"):
    if rule == "all rows":
        orig = ch.certified_head_argmax

        def no_drafts(*a, drafts=None, **k):  # every row of a call must be proven
            return orig(*a, **k)
        ch.certified_head_argmax = no_drafts
    else:
        ch.certified_head_argmax = orig
    fast = FastModel(m, tensors, twin_ops(True), "cpu", verify_head="certified")
    be = GraphBackend(fast, m.kv, m.mtp.mask_token_id, m.mtp.block_size, RuntimeOptions(graphs=False, kv_dtype=torch.float32))
    t = time.time(); toks = []
    for p in prompts:
        st = DecodeStats()
        toks.append([x for c in decode(be, p, DecodeOptions("speculative", 64, block_size=m.mtp.block_size), st) for x in c])
    print(rule, fast.certified_counts(), round(time.time() - t, 1), "s")
