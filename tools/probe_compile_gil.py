"""How much of a Triton compile holds the GIL: the share that compile threads cannot overlap.

A pure-Python thread counts loop iterations alone, then while this thread compiles a few
variants of a small matmul kernel (``triton.compile``, no launch, so no GPU is needed: the
target is this GPU's, else sm_90). The compile held the GIL for about ``1 - during / alone``
of its time. On a busy machine the ticker also loses CPU to ptxas, which overstates it.

    python tools/probe_compile_gil.py [--out tools/results/compile_gil.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.provenance import commit  # noqa: E402


@triton.jit
def _matmul(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm, rn, rk = pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :], mask=rm[:, None] < M)
        y = tl.load(b + (k + rk)[:, None] * N + rn[None, :], mask=rn[None, :] < N)
        acc += tl.dot(x, y)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.float16), mask=(rm[:, None] < M) & (rn[None, :] < N))


def target():
    from triton.backends.compiler import GPUTarget

    try:
        return triton.runtime.driver.active.get_current_target()
    except Exception:  # noqa: BLE001 - no GPU here: compile for the H200's architecture
        return GPUTarget("cuda", 90, 32)


def compile_variant(block_m: int, tgt) -> float:
    from triton.compiler import ASTSource

    signature = {"a": "*fp16", "b": "*fp16", "c": "*fp16", "M": "i32", "N": "i32", "K": "i32",
                 "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
    src = ASTSource(_matmul, signature, constexprs={"BM": block_m, "BN": 64, "BK": 32})
    t0 = time.perf_counter()
    triton.compile(src, target=tgt, options={"num_warps": 4})
    return time.perf_counter() - t0


def ticks_per_s(seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(200):
            pass
        n += 1
    return n / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    args = ap.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gil-probe-")  # every compile cold
    triton.knobs.cache.dir = os.environ["TRITON_CACHE_DIR"]
    tgt = target()
    compile_variant(16, tgt)  # imports and first-use costs, outside the measurement
    alone = ticks_per_s(1.0)
    count, stop = [0], threading.Event()

    def tick():
        while not stop.is_set():
            for _ in range(200):
                pass
            count[0] += 1

    ticker = threading.Thread(target=tick)
    t0 = time.perf_counter()
    ticker.start()
    compiles = [compile_variant(bm, tgt) for bm in (32, 64, 128, 256)]
    stop.set()
    ticker.join()
    window = time.perf_counter() - t0
    alone = (alone + ticks_per_s(1.0)) / 2
    during = count[0] / window
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
              "triton": triton.__version__, "target": f"{tgt.backend} {tgt.arch}", "cpu_count": os.cpu_count(),
              "load_avg": os.getloadavg(), "compile_s": compiles, "ticker_alone_per_s": alone,
              "ticker_during_per_s": during, "gil_share_held_by_compile": 1 - during / alone,
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    print(f"Triton {triton.__version__}, target {result['target']}: compiles {[round(c, 2) for c in compiles]} s; "
          f"a Python thread beside them ran at {during / alone:.0%} of its own speed -> the compile held the GIL "
          f"about {1 - during / alone:.0%} of its time (load average {os.getloadavg()[0]:.1f})")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
