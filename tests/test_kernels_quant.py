"""rmsnorm_quant, relu2_mul_rmsnorm_quant and silu_mul_quant against their twins.

The quantisation step is the twin's step for step (correctly rounded q and 1/q, round half
to even), but ``mean(h**2)`` is summed in a different float32 order and SiLU's ``exp`` is
the GPU's, so an int8 value may move by one where ``h * q`` sits within an ulp of .5.
Tolerances: int8 values differ by at most 1, in at most 0.1% of the elements (in practice
none); scales within 4 float32 ulps (rtol 5e-7).
"""

import pytest
import torch

pytest.importorskip("triton")  # the interpreter is set up by tests/__init__.py without CUDA

from kernels_ampere.numerics import SCALE_EPS  # noqa: E402
from tests.helpers import DEVICE, needs_gpu  # noqa: E402
from kernels_ampere.fused_quant import (  # noqa: E402
    relu2_mul_rmsnorm_quant,
    relu2_mul_rmsnorm_quant_reference,
    rmsnorm_quant,
    rmsnorm_quant_reference,
    silu_mul_quant,
    silu_mul_quant_reference,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
WIDTH_K = [(1, 384), (2, 640), (3, 100), (5, 640), (9, 384), (17, 200)]  # K=100, 200: masked tails


def assert_quant_close(got, ref, what):
    (q, s), (q_ref, s_ref) = got, ref
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    diff = (q.int() - q_ref.int()).abs()
    assert diff.max().item() <= 1, f"{what}: int8 off by {diff.max().item()}"
    assert (diff > 0).sum().item() <= max(1, q.numel() // 1000), f"{what}: {(diff > 0).sum().item()} int8 differ"
    torch.testing.assert_close(s, s_ref, rtol=5e-7, atol=0, msg=lambda m: f"{what} scale: {m}")


def rand(shape, gen, dtype, scale=3.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("m,k", WIDTH_K)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_quant_matches_twin(m, k, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x, w = rand((m, k), gen, dtype), (0.5 + torch.rand(k, generator=gen)).to(dtype).to(DEVICE)
    assert_quant_close(rmsnorm_quant(x, w, 1e-6), rmsnorm_quant_reference(x, w, 1e-6), f"M={m} K={k}")


@pytest.mark.parametrize("m,k", WIDTH_K)
@pytest.mark.parametrize("dtype", DTYPES)
def test_relu2_mul_rmsnorm_quant_reads_slices_of_the_fused_gate_up(m, k, dtype):
    gen = torch.Generator().manual_seed(m * 77 + k)
    gate_up = rand((m, 2 * k), gen, dtype)  # [M, 2F], as the fused gate/up projection writes it
    gate, up = gate_up[:, :k], gate_up[:, k:]  # row stride 2F, no copies
    w = (0.5 + torch.rand(k, generator=gen)).to(DEVICE)
    assert_quant_close(relu2_mul_rmsnorm_quant(gate, up, w, 1e-5),
                       relu2_mul_rmsnorm_quant_reference(gate, up, w, 1e-5), f"M={m} K={k}")


@pytest.mark.parametrize("m,k", WIDTH_K)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_quant_matches_twin(m, k, dtype):
    gen = torch.Generator().manual_seed(m * 13 + k)
    gate_up = rand((m, 2 * k), gen, dtype)
    gate, up = gate_up[:, :k], gate_up[:, k:]
    assert_quant_close(silu_mul_quant(gate, up), silu_mul_quant_reference(gate, up), f"M={m} K={k}")


def test_silu_mul_quant_clamps_the_scale_of_a_near_silent_row():
    """|h| < 1e-5 everywhere: q is clamped at 127 / 1e-5, exactly as quantize_activations."""
    gen = torch.Generator().manual_seed(4)
    gate = rand((2, 256), gen, torch.float32, scale=1e-3)
    up = rand((2, 256), gen, torch.float32, scale=1e-3)
    q, s = silu_mul_quant(gate, up)
    q_ref, s_ref = silu_mul_quant_reference(gate, up)
    assert torch.all(s == s_ref) and torch.allclose(s, torch.full_like(s, SCALE_EPS / 127), rtol=1e-6)
    assert (q.int() - q_ref.int()).abs().max().item() <= 1


def test_rmsnorm_quant_rejects_a_wrong_weight_shape():
    x = torch.randn(2, 128, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[K\]=128"):
        rmsnorm_quant(x, torch.ones(64, device=DEVICE), 1e-6)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("k", [2560, 6912, 6144])
def test_fused_quant_real_widths_on_gpu(k):
    gen = torch.Generator().manual_seed(k)
    x = rand((17, k), gen, torch.bfloat16)
    w = (0.5 + torch.rand(k, generator=gen)).to(torch.bfloat16).to(DEVICE)
    assert_quant_close(rmsnorm_quant(x, w, 1e-5), rmsnorm_quant_reference(x, w, 1e-5), f"rmsnorm K={k}")
    gu = rand((17, 2 * k), gen, torch.bfloat16)
    assert_quant_close(relu2_mul_rmsnorm_quant(gu[:, :k], gu[:, k:], w, 1e-5),
                       relu2_mul_rmsnorm_quant_reference(gu[:, :k], gu[:, k:], w, 1e-5), f"relu2 K={k}")
    assert_quant_close(silu_mul_quant(gu[:, :k], gu[:, k:]), silu_mul_quant_reference(gu[:, :k], gu[:, k:]),
                       f"silu K={k}")


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_rmsnorm_cast_matches_twin_and_ignores_the_width(out_dtype):
    """The verify head's input: close to the twin, and each row bit-identical whether it is
    normalised alone (an AR step) or among 9 rows (a verify)."""
    from kernels_ampere.fused_quant import rmsnorm_cast, rmsnorm_cast_reference

    gen = torch.Generator().manual_seed(41)
    x = (torch.randn(9, 640, generator=gen) * 3).to(DEVICE)
    w = (1 + 0.2 * torch.randn(640, generator=gen)).to(DEVICE)
    out = rmsnorm_cast(x, w, 1e-5, out_dtype)
    ref = rmsnorm_cast_reference(x, w, 1e-5, out_dtype)
    assert out.dtype == out_dtype
    tol = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 1e-6}[out_dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    for i in (0, 4, 8):
        assert torch.equal(rmsnorm_cast(x[i:i + 1], w, 1e-5, out_dtype)[0], out[i])
