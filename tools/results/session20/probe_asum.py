"""Probe (session 20, not a benchmark of shipped code): the 2B stack at M = 9 and 16 with the
shipped launches, cold and with every weight in the L2, under the tree's w2a8.py. Run once on
the tree as it is and once with the mma kernel's activation-word sums switched off (sed on the
device copy: wrong results, timing only), to bound what precomputed offset sums could save.

    python tools/results/session20/probe_asum.py LABEL
"""
import json
import os
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tools")
from kernels_ampere.autotune import GraphTimer  # noqa: E402
from tools.kernel_stack import Stack, scheme_configs  # noqa: E402

label = sys.argv[1]
torch.cuda.set_stream(torch.cuda.Stream())
timer = GraphTimer(replays=5, stream=torch.cuda.current_stream())
stack = Stack("bitnet-2b", rotate_mb=0.0)
rows = []
for m in (9, 16, 32):
    stack.set_width(m)
    cfgs = scheme_configs(stack, "shipped", m, (), {})
    cold = [stack.time_us(timer, cfgs) for _ in range(2)]
    hot = stack.time_hot_step_us(timer, cfgs)
    rows.append({"label": label, "M": m, "cold_us": [round(c, 1) for c in cold], "hot_us": round(hot, 1)})
    print(rows[-1], flush=True)
out = os.environ.get("OUT", "/tmp")
with open(os.path.join(out, f"probe_asum_{label}.json"), "w") as f:
    json.dump(rows, f, indent=1)
