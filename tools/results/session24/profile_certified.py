"""Session 24, call 2: where a certified head call's time goes on the H200 -- the GPU time of
each kernel of one call (M = 1 and 9, activations along a head row: certified), profiled over
five eager calls; the graph-replayed totals are bench_certified_head.py's. (As run in call 2 the
aggregation was written out here; it is bench_replay_widths' cuda_kernel_times since.)"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from kernels_ampere import certified_head as ch  # noqa: E402
from kernels_ampere.heads import f16_head_argmax  # noqa: E402
from tools.bench_certified_head import HIDDEN, VOCAB, activations, head_case  # noqa: E402
from tools.bench_replay_widths import cuda_kernel_times  # noqa: E402

*head, g = head_case(VOCAB, HIDDEN)
for m in (1, 9):
    x = activations(head[0], m, "planted", g)
    call = lambda: ch.certified_head_argmax(x, *head, certify=ch.certify_tokens, f16_head=f16_head_argmax)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    print(f"M = {m}: kernels of one call (GPU us)")
    for r in cuda_kernel_times(prof, 5):
        print(f"  {r['launches']:4.1f} x {r['us']:8.1f} us  {r['kernel']}")
