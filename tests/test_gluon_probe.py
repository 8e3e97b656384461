"""tools/gluon_w2a8_probe.py: the explicit-layout probe compiles (no GPU) to what it claims, and
on a GPU computes the exact integer product."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def probe_cli(*args: str) -> subprocess.CompletedProcess:
    """The probe's command line in a process of its own: the tests run under the Triton
    interpreter, which compiles nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "tools/gluon_w2a8_probe.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def static_counts(*variants: str, width: int = 16, arch: int = 87) -> list[dict]:
    """The probe's --sass counts of each variant."""
    run = probe_cli("--sass", str(arch), "--widths", str(width), "--variants", ",".join(variants))
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_probe_loop_has_no_shared_memory_and_loads_16_bytes_per_thread_on_orin():
    wide, narrow, chained = static_counts("128:2:16", "64:2:4", "128:2:16:0:2")
    for row in (wide, narrow, chained):  # operands loaded straight into the mma.sync layouts: no CTA barrier anywhere
        assert row["shared_bytes"] == 0 and row["barriers"] == 0 and row["shared_ops"] == 0, row
    assert wide["loop_imma"] == narrow["loop_imma"] == 32  # 2 chunks x 4 lanes x (codes + offset) x two n8 tiles
    assert chained["loop_imma"] == 64  # two steps per iteration, one per chain
    # k_width 16: each thread's operand bytes are 16 contiguous bytes in memory (the K order is the layout's)
    assert set(wide["loads_by_width"]) == {"LDG.E.128"}, wide
    assert narrow["loop_loads"] >= 4 * wide["loop_loads"], (narrow, wide)


def test_probe_refuses_programmatic_launch_below_sm90():
    run = probe_cli("--sass", "87", "--variants", "128:2:16:1")
    assert run.returncode != 0 and "sm_90" in run.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", (1, 9, 16, 32))
@pytest.mark.parametrize("k_width,chains", [(4, 1), (16, 1), (16, 2)])
def test_probe_is_the_exact_integer_product_on_gpu(m, k_width, chains):
    from kernels_ampere.packing import pack_ternary
    from tools.gluon_w2a8_probe import probe_block_m, probe_launch

    gen = torch.Generator(device="cuda").manual_seed(m + k_width + chains)
    n, k = 384, 1280
    codes = torch.randint(-1, 2, (n, k), generator=gen, device="cuda", dtype=torch.int8)
    a = torch.randint(-127, 128, (m, k), generator=gen, device="cuda", dtype=torch.int8)
    out = torch.zeros((m, n), dtype=torch.int32, device="cuda")
    # K = 10 chunks in 3 slices of 4, 4, 2: a last slice shorter than a step pair (chains = 2)
    probe_launch(a, pack_ternary(codes), out, 64, probe_block_m(m), 3, 2, k_width, chains=chains)
    assert torch.equal(out, (a.double() @ codes.double().T).to(torch.int32))
