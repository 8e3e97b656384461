"""Session 19, call 9: the certified head's int8 pass on 8 SMs of the H200 under a few HeadConfigs
(the default is the int8 head's table entry for M = 1). One-off sweep, kept with its output.
It times session 19's two-plane pass (``activation_planes``, ``certify_partials``), which
session 24 replaced: it runs against that session's tree only."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import torch  # noqa: E402

from kernels_ampere import certified_head as ch  # noqa: E402
from kernels_ampere.autotune import GraphTimer  # noqa: E402
from kernels_ampere.heads import f16_head_argmax  # noqa: E402
from kernels_ampere.tuning import HeadConfig, default_head, lookup  # noqa: E402
from tools.bench_certified_head import activations, head_case  # noqa: E402
from tools.sm_partition_stack import enter_partition, graph_sms_reached  # noqa: E402

ctx = enter_partition(8)
assert graph_sms_reached(torch.cuda.current_stream()) == 8
w16, q, s, err, mag, qn, g = head_case(128256, 2560)
timer = GraphTimer(reps=8, replays=5, stream=torch.cuda.current_stream())
x = activations(w16, 1, True, g)
planes = ch.activation_planes(x)
print("table / default:", lookup("int8_head_argmax", {"V": 128256, "H": 2560, "M": 1}, x.device) or default_head(1))
print("16-bit head", round(timer([lambda: f16_head_argmax(x, w16)]), 1))
for bv in (64, 128, 256):
    for bh in (128, 256):
        for warps in (4, 8):
            for stages in (2, 3):
                cfg = HeadConfig(block_v=bv, block_h=bh, num_warps=warps, num_stages=stages)
                try:
                    us = timer([lambda cfg=cfg: ch.certify_partials(planes, q, s, err, mag, qn, config=cfg)])
                except Exception as e:  # noqa: BLE001 - a tile that does not fit: reported
                    print(cfg, "failed", type(e).__name__)
                    continue
                print(f"bv {bv} bh {bh} w {warps} s {stages}: {us:.1f} us", flush=True)
