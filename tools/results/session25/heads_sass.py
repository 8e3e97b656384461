"""Static instruction counts of the head kernel's main loop (int8 and int4, M = 9), compiled for
sm_87 (or the arch given) without a GPU: ``tools/kernel_sass.py``'s counting and bounds.

    python tools/results/session25/heads_sass.py 87
"""
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels_ampere import heads
from tools.kernel_sass import loop_profile, bound

def compile_head(int4, m, block_v, block_h, warps, stages, arch):
    fn = heads._head_partial_kernel
    sig = {"h_ptr": "*i8", "h_scale_ptr": "*fp32", "w_ptr": "*u8" if int4 else "*i8", "w_scale_ptr": "*fp32",
           "pmax_ptr": "*fp32", "pidx_ptr": "*i32", "psum_ptr": "*fp32", "M": "i32", "V": "i32", "H": "i32",
           "stride_hm": "i32", "stride_wv": "i32", "skip_ptr": "*i32", "HP": "i32"}
    const = dict(INT8=True, BLOCK_M=16, BLOCK_V=block_v, BLOCK_H=block_h, UPCAST=False, ROW_TILES=1, USE_GDC=False,
                 SKIP=False, INT4=int4)
    if m == 1:
        const["M"] = 1
    sig.update({k: "constexpr" for k in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(7)}
    for name in ("H", "stride_hm", "stride_wv", "HP", "V"):
        attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})

arch = int(sys.argv[1]) if len(sys.argv) > 1 else 87
for int4, bh in ((False, 128), (False, 256), (True, 256), (True, 512)):
    for warps in (4, 8):
        k = compile_head(int4, 9, 128, bh, warps, 3, arch)
        counts, res = loop_profile(k.asm["cubin"], Path(tempfile.mktemp()))
        weights = 128 * bh  # per loop iteration per program
        b, lim = bound(counts, weights / warps)
        print(f"int4={int4} block_h={bh} warps={warps}: loop {sum(counts.values())} instr, bound {b:.1f} w/SM-clk ({lim}), regs {res.get('reg')}, top {dict(counts.most_common(7))}")
