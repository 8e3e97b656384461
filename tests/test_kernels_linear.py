"""w2a8_linear and w2a16_linear against their pure-PyTorch twins.

Integer accumulation is checked exactly: per-row scales reproduce the twin's float32
epilogue bit for bit, and unit scales turn the output into the raw int32 accumulator.
Group-128 results too: every kernel adds the groups' float32 terms one chunk at a time in
K order, in K slices set by K alone, as the twin does. Weight-only results accumulate in
float32 in a different order than the twin's matmul (rtol 1e-5 of the output's scale).

Without CUDA the kernels run in Triton's interpreter, on small shapes.
"""

import os
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")  # the interpreter is set up by tests/__init__.py without CUDA

from kernels_ampere import pack_ternary  # noqa: E402
from kernels_ampere.numerics import int_matmul, quantize_activations  # noqa: E402
from kernels_ampere.packing import packed_width  # noqa: E402
from kernels_ampere.tuning import (DOT, GEMV, LANES, MMA, ROWS, W2A8_GENERATIONS, LinearConfig,  # noqa: E402
                                   default_linear, find_config, group_k_slices, linear_candidates, linear_key, record,
                                   tail_config, wave_fill)
from kernels_ampere.w2a16 import w2a16_linear, w2a16_linear_reference  # noqa: E402
from kernels_ampere.w2a8 import w2a8_linear, w2a8_linear_reference  # noqa: E402
from tests.helpers import DEVICE, ON_GPU, needs_gpu  # noqa: E402


WIDTHS = (1, 2, 3, 5, 9, 17)
# every width once, N never a power of two, K a multiple of 128 but not of 256
WIDTH_SHAPES = ((1, 40, 384), (1, 72, 640), (2, 72, 640), (3, 40, 384), (5, 72, 640), (9, 40, 384), (17, 72, 640))
GEMV_MAX_M = 3  # gemv runs one program per row: past a few rows the tuner never picks it


def configs(grouped: bool, m: int = 1) -> list[LinearConfig]:
    """Both kernels, each without and with split-K (64 bytes = two 128-chunks per step)."""
    dot = [LinearConfig(DOT, 32, 64, num_warps=4, num_stages=2),
           LinearConfig(DOT, 16, 32, num_warps=4, num_stages=2, split_k=3, prefetch=True)]
    gemv = [LinearConfig(GEMV, 16, 64, num_warps=2), LinearConfig(GEMV, 8, 64, num_warps=2, split_k=2, prefetch=True)]
    return gemv + dot if m <= GEMV_MAX_M else dot


def w2a8_configs(grouped: bool, m: int = 1) -> list[LinearConfig]:
    """Every W2A8 kernel: the shared two, the multi-row gemv, the masked-lane dp4a kernel and
    the tensor-core kernel (two chunks per step), each without and with split-K."""
    # split variants: 16-row tiles (N = 40, 72: a partial last tile) and two-chunk steps over
    # three slices of a 5-chunk K (the last slice ends mid-step); few programs for the interpreter
    rows = [LinearConfig(ROWS, 8, 64, num_warps=4), LinearConfig(ROWS, 16, 64, num_warps=2, split_k=3)]
    lanes = [LinearConfig(LANES, 8, 64, num_warps=2), LinearConfig(LANES, 16, 64, num_warps=2, split_k=3)]
    mma = [LinearConfig(MMA, 32, 64, num_warps=4), LinearConfig(MMA, 16, 64, num_warps=4, split_k=2, prefetch=True)]
    mma.append(LinearConfig(MMA, 16, 128, num_warps=2, num_stages=2, asum_by_dot=True))  # sums in the loop
    # the four lanes folded into one accumulator (Horner over their scales), split-K with a
    # slice ending mid-step, and the activation sums on the tensor cores
    mma += [LinearConfig(MMA, 16, 64, num_warps=4, num_stages=2, split_k=3, fold_lanes=True),
            LinearConfig(MMA, 32, 128, num_warps=4, num_stages=2, asum_by_dot=True, fold_lanes=True),
            LinearConfig(MMA, 16, 32, num_warps=4, num_stages=2, split_k=2, fold_lanes=True)]
    # four chunks per step with the activation-word sums of each step (the last slice is one
    # chunk of a four-chunk step), folded and with the first chunk peeled off the loop
    mma += [LinearConfig(MMA, 16, 128, num_warps=4, num_stages=2, split_k=2, fold_lanes=True),
            LinearConfig(MMA, 16, 128, num_warps=2, num_stages=2, split_k=2)]
    if m > 16:  # the width in 16-row tiles (the last one partial), side by side in the grid
        mma.append(LinearConfig(MMA, 32, 64, num_warps=4, num_stages=2, split_k=2, block_m=16))
    return configs(grouped, m) + rows + lanes + mma


def random_weight(n: int, k: int, gen: torch.Generator):
    codes = torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8)
    return codes, pack_ternary(codes).to(DEVICE)


def random_activations(m: int, k: int, gen: torch.Generator):
    x = torch.randn(m, k, generator=gen) * (1 + torch.rand(m, 1, generator=gen) * 4)
    a, s = quantize_activations(x)
    return a.to(DEVICE), s.to(DEVICE)


def residual_case(m: int, n: int, k: int, grouped: bool, seed: int):
    """(packed, a, a_s, w_s, residual, the twin's output): one linear on fresh random inputs with
    per-row or group-128 scales and a residual to fuse."""
    gen = torch.Generator().manual_seed(seed)
    _, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand((n, k // 128) if grouped else (n,), generator=gen)).to(DEVICE)
    res = torch.randn(m, n, generator=gen).to(DEVICE)
    return packed, a, a_s, w_s, res, w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32, residual=res)


def replayed(launches):
    """``launches()`` run once (compiled outside the capture), captured in a CUDA graph and the
    graph replayed three times -> the captured outputs after the replays."""
    launches()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launches()
    for _ in range(3):
        graph.replay()
    return out


def assert_exact(out: torch.Tensor, ref: torch.Tensor, what: str):
    bad = (out != ref).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} of {out.numel()} differ; first at {bad[0].tolist()}: "
                              f"{out[tuple(bad[0])].item()} vs {ref[tuple(bad[0])].item()}")


# --- w2a8 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k", WIDTH_SHAPES)
@pytest.mark.parametrize("grouped", [False, True], ids=["row", "group128"])
def test_w2a8_matches_twin(m, n, k, grouped):
    gen = torch.Generator().manual_seed(100 * m + n + k + grouped)
    codes, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand((n, k // 128) if grouped else (n,), generator=gen)).to(DEVICE)
    ref = w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32)
    for cfg in w2a8_configs(grouped, m):
        out = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg)
        assert_exact(out, ref, f"{cfg} M={m} N={n} K={k}")


@pytest.mark.parametrize("m", (1, 5, 17))
@pytest.mark.parametrize("grouped", [False, True], ids=["row", "group128"])
def test_w2a8_unit_scales_give_the_int32_accumulator(m, grouped):
    n, k = 56, 640
    gen = torch.Generator().manual_seed(7 + m)
    codes, packed = random_weight(n, k, gen)
    a = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8).to(DEVICE)
    ones_a = torch.ones(m, device=DEVICE)
    ones_w = torch.ones((n, k // 128) if grouped else (n,), device=DEVICE)
    expect = int_matmul(a.cpu(), codes).float()  # |acc| <= 640 * 128 < 2**24: exact in float32
    for cfg in configs(grouped, m):
        out = w2a8_linear(a, ones_a, packed, ones_w, out_dtype=torch.float32, config=cfg)
        assert_exact(out.cpu(), expect, f"{cfg.kernel} accumulator M={m}")


@pytest.mark.parametrize("m", WIDTHS)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_w2a8_default_config_and_16bit_output(m, out_dtype):
    n, k = 104, 384
    gen = torch.Generator().manual_seed(11 + m)
    _, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.01 + torch.rand(n, generator=gen) * 0.02).to(DEVICE)
    out = w2a8_linear(a, a_s, packed, w_s, out_dtype=out_dtype)  # the table / fallback picks
    ref = w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    if ON_GPU or out_dtype == torch.float16:
        assert_exact(out, ref, f"default config M={m}")  # same float32 value, same rounding
    else:  # the interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)  # one bf16 ulp


def test_w2a8_fused_qkv_keeps_each_segment_scale():
    """A fused Q/K/V weight with three scales equals the three projections done apart."""
    gen = torch.Generator().manual_seed(3)
    k, rows = 384, (64, 16, 16)
    parts = [random_weight(r, k, gen) for r in rows]
    seg_scales = [0.3, 0.02, 1.7]
    packed = torch.cat([p for _, p in parts])
    w_s = torch.cat([torch.full((r,), s) for r, s in zip(rows, seg_scales)]).to(DEVICE)
    a, a_s = random_activations(5, k, gen)
    fused = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32)
    apart = torch.cat([w2a8_linear(a, a_s, p, torch.tensor([s], device=DEVICE), out_dtype=torch.float32)
                       for (_, p), s in zip(parts, seg_scales)], dim=1)
    assert_exact(fused, apart, "fused QKV vs separate")


def test_w2a8_rejects_mismatched_shapes_with_a_clear_error():
    gen = torch.Generator().manual_seed(0)
    _, packed = random_weight(40, 384, gen)
    a, a_s = random_activations(2, 256, gen)
    with pytest.raises(ValueError, match="K=256"):
        w2a8_linear(a, a_s, packed, torch.ones(40, device=DEVICE))
    a, a_s = random_activations(2, 384, gen)
    with pytest.raises(ValueError, match="group scales"):
        w2a8_linear(a, a_s, packed, torch.ones(40, 2, device=DEVICE))


# --- w2a16 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("m", (1, 3, 17))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grouped", [True, False], ids=["group128", "row"])
def test_w2a16_matches_twin(m, dtype, grouped):
    n, k = 72, 640
    gen = torch.Generator().manual_seed(17 * m + grouped)
    _, packed = random_weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w_s = (0.5 + torch.rand((n, k // 128) if grouped else (n,), generator=gen)).to(DEVICE)
    ref = w2a16_linear_reference(x, packed, w_s, out_dtype=torch.float32)
    for cfg in configs(grouped, m):
        out = w2a16_linear(x, packed, w_s, out_dtype=torch.float32, config=cfg)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(),
                                   msg=lambda s: f"{cfg.kernel}: {s}")
    out = w2a16_linear(x, packed, w_s)  # default config, output in the activation dtype
    assert out.dtype == dtype
    tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("m,n,k", [(1, 72, 640), (5, 40, 384)])
@pytest.mark.parametrize("grouped", [False, True], ids=["row", "group128"])
def test_w2a8_fused_residual_equals_the_unfused_sum(m, n, k, grouped):
    """x + linear(a) in one launch: the product rounds to float32, then adds (every kernel, split-K too)."""
    gen = torch.Generator().manual_seed(7 * m + n + grouped)
    _, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand((n, k // 128) if grouped else (n,), generator=gen)).to(DEVICE)
    residual = (torch.randn(m, n, generator=gen) * 3).to(DEVICE)
    ref = w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32, residual=residual)
    if not grouped:  # per-row scales: the twin is bit-exact, so the fused launch must equal it exactly
        assert_exact(ref, residual + w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32), "twin")
    for cfg in w2a8_configs(grouped, m):
        fused = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg, residual=residual)
        unfused = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg)
        assert_exact(fused, residual + unfused, f"{cfg} fused vs unfused")
        assert_exact(fused, ref, f"{cfg}")
    with pytest.raises(TypeError, match="float32"):
        w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float16, residual=residual)
    with pytest.raises(ValueError, match="residual must be"):
        w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=residual[:, :-1])


# --- GPU only: the real layer shapes ---------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n,k", [(3840, 2560), (13824, 2560), (2560, 6912), (3200, 8640)])
@pytest.mark.parametrize("m", (1, 9, 33, 80))
def test_w2a8_real_shapes_exact_on_gpu(n, k, m):
    """The shipped kernels on BitNet-2B / 1bitLLM-3B shapes (8640 = 67.5 chunks: padded)."""
    gen = torch.Generator().manual_seed(n + m)
    _, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand(n, generator=gen)).to(DEVICE)
    new = [LinearConfig(MMA, 64, 64), LinearConfig(MMA, 32, 128, split_k=2),
           LinearConfig(MMA, 64, 64, num_stages=3, split_k=3), LinearConfig(DOT, 64, 64, num_stages=3, prefetch=True)]
    if m > 16:  # wide widths in 16- / 32-row tiles, the whole width over 8 warps, a deeper pipeline, folded lanes
        new += [LinearConfig(MMA, 64, 64, num_stages=3, split_k=3, fold_lanes=True),
                LinearConfig(MMA, 64, 64, num_stages=3, block_m=32, fold_lanes=True),
                LinearConfig(MMA, 128, 64, num_warps=8, num_stages=3, split_k=2, fold_lanes=True),
                LinearConfig(MMA, 64, 64, num_stages=3, split_k=2, block_m=16),
                LinearConfig(MMA, 32, 64, num_stages=3, block_m=32),
                LinearConfig(MMA, 64, 64, num_warps=8, num_stages=3),
                LinearConfig(MMA, 64, 64, num_stages=4, split_k=2, block_m=16, prefetch=True)]
    if m > 2:  # no K split, four chunks per step over four stages, the activation sums in the loop
        new += [LinearConfig(MMA, 32, 128, num_stages=4, block_m=16 if m > 16 else 0, asum_by_dot=True),
                LinearConfig(MMA, 16, 128, num_warps=2, num_stages=4, block_m=16 if m > 16 else 0, asum_by_dot=True)]
    defaults = [default_linear(m, False, n=n, k=k, sms=torch.cuda.get_device_properties(0).multi_processor_count,
                               generation=g) for g in ("v1", "v3", "v4", "v5", "v6")]
    for cfg in [None, *defaults, *([LinearConfig(LANES, 8, 256, prefetch=True)] if m <= 4 else []), *new]:
        out = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg)
        assert_exact(out, w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32),
                     f"{cfg} N={n} K={k} M={m}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m", (1, 2, 27))
def test_w2a8_fixed_carveout_changes_no_bit(m):
    """One L1 / shared split for every launch (common.shared_carveout), set and reset: the same bits."""
    from kernels_ampere.common import shared_carveout

    gen = torch.Generator().manual_seed(77 + m)
    _, packed = random_weight(2560, 6912, gen)
    a, a_s = random_activations(m, 6912, gen)
    w_s = (0.5 + torch.rand(2560, generator=gen)).to(DEVICE)
    ref = w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32)
    cfg = default_linear(m, False, n=2560, k=6912, sms=132, generation="v3")
    try:
        for percent in (100, 0, None):
            shared_carveout(percent)
            for _ in range(2):  # the preference holds from the launch after the one that sets it
                assert_exact(w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg), ref,
                             f"carveout {percent}")
    finally:
        shared_carveout(None)


def test_shared_carveout_switch_checks_its_argument():
    from kernels_ampere.common import shared_carveout

    before = shared_carveout()
    try:
        assert shared_carveout(50) == 50 and shared_carveout() == 50
        with pytest.raises(ValueError, match="0..100"):
            shared_carveout(101)
    finally:
        shared_carveout(before)
    assert shared_carveout() == before


@pytest.mark.parametrize("m", (1, 3, 17))
def test_w2a8_group_scales_follow_k_slices_set_by_k_alone(m):
    """K = 4096: 32 chunks, two K slices whatever the configuration asks (its split_k is
    overridden), every kernel equal to the twin bit for bit; the twin itself within float32
    rounding of float64 arithmetic."""
    n, k = 24, 4096
    assert group_k_slices(k) == 2 and group_k_slices(3968) == 1 and group_k_slices(6144) == 3
    gen = torch.Generator().manual_seed(91 + m)
    codes, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand(n, k // 128, generator=gen)).to(DEVICE)
    ref = w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32)
    exact = torch.einsum("mgk,ngk->mng", a.cpu().double().view(m, -1, 128), codes.double().view(n, -1, 128))
    exact = (exact * w_s.cpu().double()[None]).sum(-1) * a_s.cpu().double()[:, None]
    torch.testing.assert_close(ref.cpu().double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    picks = [LinearConfig(GEMV, 8, 256, num_warps=2), LinearConfig(GEMV, 8, 128, num_warps=2, split_k=4),
             LinearConfig(MMA, 16, 64, num_warps=4, num_stages=2, split_k=3),
             LinearConfig(DOT, 16, 128, num_warps=4, num_stages=2, split_k=1)]
    if m > 1:
        picks.append(LinearConfig(LANES, 8, 128, num_warps=2))
    for cfg in picks:
        assert_exact(w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg), ref, f"{cfg} M={m}")


@pytest.mark.parametrize("grouped", (False, True))
def test_w2a8_split_k_sums_in_the_last_slice_or_by_a_launch_the_same_bits(grouped, monkeypatch):
    """Split-K partials added by the last program of each tile (the arrival counts) and by
    ``split_k_reduce`` (where no counts can be had) give the twin's bits, residual fused; the
    in-kernel route launches no reduction and leaves every count at zero, so the next launch
    (here: a second call into the same counts) starts clean."""
    import kernels_ampere.w2a8 as w2a8
    from kernels_ampere import common

    m, n, k = (2, 24, 4096) if grouped else (3, 40, 768)  # grouped: two K slices from K alone
    packed, a, a_s, w_s, res, ref = residual_case(m, n, k, grouped, seed=7 + grouped)
    picks = [LinearConfig(MMA, 16, 64, num_warps=4, num_stages=2, split_k=3),
             LinearConfig(MMA, 16, 64, num_warps=4, num_stages=2, split_k=3, fold_lanes=True),
             LinearConfig(GEMV, 8, 128, num_warps=2, split_k=4), LinearConfig(DOT, 16, 64, num_stages=2, split_k=2),
             LinearConfig(LANES, 16, 64, num_warps=2, split_k=3), LinearConfig(ROWS, 16, 64, num_warps=2, split_k=3)]
    if grouped:  # the tile kernels share one epilogue: two of them (and gemv's own) keep the test short
        picks = picks[1:3] + picks[4:5]

    def no_launch(*args, **kwargs):
        raise AssertionError("split_k_reduce launched although the counts were there")

    with monkeypatch.context() as patch:
        patch.setattr(w2a8, "split_k_reduce", no_launch)
        for cfg in picks:
            for call in range(2):
                out = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=res, config=cfg)
                assert_exact(out, ref, f"in the kernel, call {call}: {cfg}")
                counts = common.split_counters(out.device, 1)
                assert counts is not None and counts.count_nonzero().item() == 0, cfg
    with monkeypatch.context() as patch:
        patch.setattr(w2a8, "split_counters", lambda device, tiles: None)
        for cfg in picks:
            out = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=res, config=cfg)
            assert_exact(out, ref, f"by a launch: {cfg}")


def test_w2a8_split_k_tiles_past_the_in_kernel_bound_reduce_by_a_launch(monkeypatch):
    """A tile over ``SLICE_SUM_MAX_TILE`` partials (64 x 32 here) is summed by a launch of its
    own (measured faster there), with the same bits as the twin."""
    import kernels_ampere.w2a8 as w2a8

    m, n, k = 17, 72, 768
    gen = torch.Generator().manual_seed(17)
    _, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand(n, generator=gen)).to(DEVICE)
    launches = []
    real = w2a8.split_k_reduce
    monkeypatch.setattr(w2a8, "split_k_reduce", lambda *args, **kw: launches.append(1) or real(*args, **kw))
    cfg = LinearConfig(MMA, 64, 64, num_warps=4, num_stages=2, split_k=3)
    assert cfg.block_n * 32 > w2a8.SLICE_SUM_MAX_TILE
    out = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg)
    assert launches == [1]
    assert_exact(out, w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32), str(cfg))


@pytest.mark.gpu
@needs_gpu
def test_w2a8_split_k_first_launch_in_a_capture_reduces_by_a_launch(monkeypatch):
    """No count buffer can be made inside a CUDA graph capture: a split launch captured before
    any launch outside made one takes the reduction launch, and the graph keeps that route
    (replays with the twin's bits) after later launches outside made the buffer and sum in
    the kernel."""
    import kernels_ampere.w2a8 as w2a8
    from kernels_ampere import common

    m, n, k = 3, 40, 768
    gen = torch.Generator().manual_seed(33)
    _, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand(n, generator=gen)).to(DEVICE)
    ref = w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32)
    cfg = LinearConfig(MMA, 16, 64, num_warps=4, num_stages=2, split_k=3)
    launches = []
    real = w2a8.split_k_reduce
    monkeypatch.setattr(w2a8, "split_k_reduce", lambda *args, **kw: launches.append(1) or real(*args, **kw))
    with monkeypatch.context() as patch:  # compile the reduction route outside the capture, making no counts
        patch.setattr(w2a8, "split_counters", lambda device, tiles: None)
        w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg)
    monkeypatch.setattr(common, "_split_counts", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg)
    assert launches == [1, 1] and common._split_counts == {}
    graph.replay()
    assert_exact(out, ref, "captured with the reduction launch")
    assert_exact(w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg), ref, "in the kernel")
    assert launches == [1, 1] and len(common._split_counts) == 1
    out.zero_()
    graph.replay()
    assert_exact(out, ref, "the graph after the counts were made")


def test_split_counters_refuse_too_many_tiles():
    from kernels_ampere import common

    device = torch.device(DEVICE)
    assert common.split_counters(device, common.SPLIT_COUNTS + 1) is None
    counts = common.split_counters(device, common.SPLIT_COUNTS)
    assert counts is not None and counts.numel() == common.SPLIT_COUNTS and counts.dtype == torch.int32
    assert common.split_counters(device, 1) is counts  # one tensor a device: graphs keep its pointer


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m", (1, 2, 9, 27, 40, 80))
def test_w2a8_group128_real_shapes_exact_on_gpu(m):
    """Qwen3-1.7B's down projection (K = 6144: three K slices) and gate+up: every default,
    the tuned launch and the kernels the tuner may pick equal the twin bit for bit."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in ((2048, 6144), (12288, 2048)):
        gen = torch.Generator().manual_seed(n + k + m)
        _, packed = random_weight(n, k, gen)
        a, a_s = random_activations(m, k, gen)
        w_s = (0.5 + torch.rand(n, k // 128, generator=gen)).to(DEVICE)
        ref = w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32)
        cfgs = [None, *(default_linear(m, True, n=n, k=k, sms=sms, generation=g)
                        for g in ("v1", "v3", "v4", "v5", "v6"))]
        cfgs += [LinearConfig(MMA, 64, 32, num_stages=3, block_m=16), LinearConfig(DOT, 64, 64, num_stages=3),
                 LinearConfig(MMA, 128, 64, num_warps=8, num_stages=3, fold_lanes=True)]
        for cfg in cfgs:
            assert_exact(w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg), ref,
                         f"{cfg} N={n} K={k} M={m}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m", (1, 9))
def test_w2a16_bonsai_group128_on_gpu(m):
    n, k = 12288, 2048
    gen = torch.Generator().manual_seed(m)
    _, packed = random_weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    w_s = (0.5 + torch.rand(n, k // 128, generator=gen)).to(DEVICE)
    ref = w2a16_linear_reference(x, packed, w_s, out_dtype=torch.float32)
    out = w2a16_linear(x, packed, w_s, out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.gpu
@needs_gpu
def test_w2a8_replays_inside_a_cuda_graph():
    gen = torch.Generator().manual_seed(5)
    _, packed = random_weight(2560, 2560, gen)
    w_s = (0.5 + torch.rand(2560, generator=gen)).to(DEVICE)
    a, a_s = random_activations(3, 2560, gen)
    w2a8_linear(a, a_s, packed, w_s)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w2a8_linear(a, a_s, packed, w_s)
    a2, s2 = random_activations(3, 2560, gen)
    a.copy_(a2)
    a_s.copy_(s2)
    graph.replay()
    assert_exact(out, w2a8_linear_reference(a2, s2, packed, w_s), "graph replay")


# --- K not a multiple of 128, per-tensor scales, untuned defaults --------------------------------

@pytest.mark.parametrize("m,n,k", [(1, 24, 200), (3, 40, 300), (9, 24, 452)])
@pytest.mark.parametrize("grouped", [False, True], ids=["row", "group128"])
def test_w2a8_k_padded_to_whole_chunks(m, n, k, grouped):
    """K = 200, 300, 452: the packed rows end in zero weights, the kernels read the missing
    activations as 0, and every kernel matches the twin (which checks the padding)."""
    gen = torch.Generator().manual_seed(31 * k + m + grouped)
    codes, packed = random_weight(n, k, gen)
    assert packed.shape == (n, packed_width(k)) and packed.shape[1] * 4 > k
    a, a_s = random_activations(m, k, gen)
    groups = -(-k // 128)
    w_s = (0.5 + torch.rand((n, groups) if grouped else (n,), generator=gen)).to(DEVICE)
    ref = w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32)
    if not grouped:  # the twin against plain integer arithmetic on the unpadded codes
        expect = (int_matmul(a.cpu(), codes).float() * a_s.cpu()[:, None] * w_s.cpu()[None, :])
        assert_exact(ref.cpu(), expect, "twin vs int_matmul")
    picks = [cfg for cfg in w2a8_configs(grouped, m) if cfg.kernel in (LANES, MMA, DOT)]
    if k % 4 == 0:
        picks.append(LinearConfig(GEMV, 8, 64, num_warps=2))
    for cfg in picks:
        out = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg)
        assert_exact(out, ref, f"{cfg} K={k}")


def test_w2a8_k_not_a_multiple_of_four_runs_on_the_tensor_core_kernel():
    """K = 130: activations cannot be read as 4-byte words; a word-kernel config gives way."""
    gen = torch.Generator().manual_seed(5)
    _, packed = random_weight(24, 130, gen)
    a, a_s = random_activations(2, 130, gen)
    w_s = (0.5 + torch.rand(24, generator=gen)).to(DEVICE)
    ref = w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32)
    for cfg in (None, LinearConfig(LANES, 8, 64, num_warps=2), LinearConfig(MMA, 16, 32)):
        assert_exact(w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg), ref, f"{cfg}")


def test_w2a8_accepts_a_0d_per_tensor_scale_as_one_element():
    gen = torch.Generator().manual_seed(6)
    _, packed = random_weight(40, 384, gen)
    a, a_s = random_activations(3, 384, gen)
    scalar = torch.tensor(0.37, device=DEVICE)
    ref = w2a8_linear_reference(a, a_s, packed, scalar.reshape(1), out_dtype=torch.float32)
    for cfg in (None, LinearConfig(MMA, 32, 64)):
        assert_exact(w2a8_linear(a, a_s, packed, scalar, out_dtype=torch.float32, config=cfg), ref, "0-d scale")
    assert_exact(w2a8_linear_reference(a, a_s, packed, scalar, out_dtype=torch.float32), ref, "twin 0-d")
    x = torch.randn(3, 384, generator=gen).to(DEVICE)
    torch.testing.assert_close(w2a16_linear(x, packed, scalar, out_dtype=torch.float32),
                               w2a16_linear_reference(x, packed, scalar.reshape(1), out_dtype=torch.float32),
                               rtol=1e-5, atol=1e-4)


def test_w2a16_k_padded_to_whole_chunks():
    gen = torch.Generator().manual_seed(8)
    _, packed = random_weight(40, 300, gen)
    x = torch.randn(2, 300, generator=gen).to(DEVICE)
    for grouped in (False, True):
        w_s = (0.5 + torch.rand((40, 3) if grouped else (40,), generator=gen)).to(DEVICE)
        ref = w2a16_linear_reference(x, packed, w_s, out_dtype=torch.float32)
        for cfg in configs(grouped, 2):
            out = w2a16_linear(x, packed, w_s, out_dtype=torch.float32, config=cfg)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_untuned_defaults_follow_the_sm_count():
    """An Orin (8-16 SMs) gets wider tiles and no K split where an H200 (132) slices K; the
    narrowest widths run dp4a kernels, wider ones the tensor cores (both generations)."""
    small, big = (default_linear(1, False, n=2560, k=2560, sms=s, generation="v2") for s in (8, 132))
    assert small.kernel == big.kernel == LANES and small.block_n > big.block_n and small.split_k == big.split_k == 1
    orin, h200 = (default_linear(27, False, n=2560, k=6912, sms=s, generation="v2") for s in (8, 132))
    assert orin.kernel == h200.kernel == MMA and orin.split_k == 1 < h200.split_k
    assert default_linear(80, False, n=2560, k=2560, sms=16, generation="v2").kernel == MMA
    orin, h200 = (default_linear(27, False, n=2560, k=6912, sms=s, generation="v1") for s in (8, 132))
    assert orin.kernel == h200.kernel == DOT and orin.split_k == 1 < h200.split_k
    assert default_linear(2, False, n=2560, k=2560, generation="v1").kernel == GEMV
    # v3: gemv (prefetching at M = 1) to M = 2, the pipelined tensor cores to M = 32 (sliced
    # on an H200 only), dot beyond
    orin, h200 = (default_linear(1, False, n=2560, k=2560, sms=s, generation="v3") for s in (8, 132))
    assert orin == h200 and h200.kernel == GEMV and h200.prefetch
    orin, h200 = (default_linear(9, False, n=2560, k=6912, sms=s, generation="v3") for s in (8, 132))
    assert orin.kernel == h200.kernel == MMA and h200.num_stages == 3 and orin.split_k == 1 < h200.split_k
    # M = 33..64: the M <= 32 launch (same K slices) in two 32-row tiles
    at32, at40 = (default_linear(m, False, n=2560, k=6912, sms=132, generation="v3") for m in (32, 40))
    assert at40.kernel == MMA and at40.block_m == 32 and at32.block_m == 0 and at40.split_k == at32.split_k > 1
    wide = default_linear(80, False, n=2560, k=2560, sms=132, generation="v3")  # 32-row tensor-core tiles from M = 65
    assert wide.kernel == MMA and wide.block_m == 32 and wide.split_k == 1
    assert default_linear(80, False, n=512, k=6912, sms=132, generation="v3").split_k > 1  # 8 x 3 tiles: sliced
    # v4: v3 to M = 16, then 16-row tensor-core tiles to M = 128 (fewer K slices as the tiles multiply)
    assert default_linear(9, False, n=2560, k=6912, sms=132, generation="v4") == h200
    orin, h200, wide = (default_linear(m, False, n=2560, k=6912, sms=s, generation="v4")
                        for m, s in ((27, 8), (27, 132), (80, 132)))
    assert orin.kernel == h200.kernel == wide.kernel == MMA and orin.block_m == h200.block_m == 16
    assert orin.split_k == 1 < h200.split_k and wide.split_k < h200.split_k
    assert default_linear(129, False, n=2560, k=2560, sms=132, generation="v4").block_m == 32  # v3's beyond 128
    with pytest.raises(ValueError, match="generation"):
        default_linear(1, False, generation="v11")


@pytest.mark.parametrize("generation", W2A8_GENERATIONS)
@pytest.mark.parametrize("m", (1, 2, 9, 21, 70))
def test_w2a8_defaults_of_both_generations_match_the_twin(generation, m):
    n, k = 72, 640
    gen = torch.Generator().manual_seed(40 + m)
    _, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand(n, generator=gen)).to(DEVICE)
    cfg = default_linear(m, False, n=n, k=k, sms=8, generation=generation)
    assert_exact(w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg),
                 w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32), f"{cfg}")


@pytest.mark.parametrize("grouped", [False, True], ids=["row", "group128"])
def test_w2a8_default_at_widths_33_to_64_is_two_32_row_tiles(grouped):
    """M = 40 (two 32-row tensor-core tiles, the second one partial; K = 1280 in two slices on
    a 132-SM GPU): the untuned default equals the twin bit for bit."""
    n, k, m = 72, 1280, 40
    gen = torch.Generator().manual_seed(44 + grouped)
    _, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand((n, k // 128) if grouped else (n,), generator=gen)).to(DEVICE)
    cfg = default_linear(m, grouped, n=n, k=k, sms=132, generation="v3")
    assert cfg.kernel == MMA and cfg.block_m == 32 and cfg.split_k == 2
    assert_exact(w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg),
                 w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32), f"{cfg}")


def test_w2a16_refuses_the_multi_row_w2a8_kernel():
    gen = torch.Generator().manual_seed(3)
    _, packed = random_weight(40, 384, gen)
    x = torch.randn(3, 384, generator=gen).to(DEVICE)
    w_s = (0.5 + torch.rand(40, generator=gen)).to(DEVICE)
    for kind in (ROWS, LANES, MMA):
        with pytest.raises(ValueError, match="W2A8 only"):
            w2a16_linear(x, packed, w_s, config=LinearConfig(kind, 8, 64))


def test_programmatic_launch_is_off_where_it_cannot_run():
    """Interpreted kernels (and CPUs, and GPUs before sm_90) launch plainly; the switch holds."""
    from kernels_ampere.common import pdl_options, pdl_status, programmatic_launch
    from kernels_ampere.w2a8 import _w2a8_gemv_kernel

    before = programmatic_launch()
    try:
        assert programmatic_launch(False) is False
        assert pdl_options(_w2a8_gemv_kernel) == {"USE_GDC": False}
        assert pdl_status() == (False, "off (BITMTP_PDL=0)")
        programmatic_launch(True)
        options = pdl_options(_w2a8_gemv_kernel)
        if not ON_GPU or torch.cuda.get_device_capability() < (9, 0):
            assert options == {"USE_GDC": False}
            assert pdl_status()[0] is False and "off (" in pdl_status()[1]
        else:  # Hopper: on where Triton has it, and then the kernel and the launch agree
            assert options in ({"USE_GDC": False}, {"USE_GDC": True, "launch_pdl": True})
    finally:
        programmatic_launch(before)


@pytest.mark.gpu
@needs_gpu
def test_w2a8_graph_with_and_without_programmatic_launch_agree():
    """A chain of dependent launches (quantise -> linear -> split-K reduce -> quantise -> linear)
    captured with and without PDL: the same bits, so every kernel waits for its producer."""
    from kernels_ampere.common import programmatic_launch
    from kernels_ampere.fused_quant import rmsnorm_quant

    gen = torch.Generator().manual_seed(9)
    _, p1 = random_weight(2560, 2560, gen)
    _, p2 = random_weight(6912, 2560, gen)
    s1, s2 = (0.5 + torch.rand(2560, generator=gen)).to(DEVICE), (0.5 + torch.rand(6912, generator=gen)).to(DEVICE)
    w = (0.5 + torch.rand(2560, generator=gen)).to(DEVICE)
    x = (torch.randn(1, 2560, generator=gen) * 3).to(DEVICE)
    split = LinearConfig(GEMV, 8, 64, num_warps=2, split_k=4)

    def chain():
        h = w2a8_linear(*rmsnorm_quant(x, w, 1e-5), p1, s1, out_dtype=torch.float32, residual=x, config=split)
        return w2a8_linear(*rmsnorm_quant(h, w, 1e-5), p2, s2, out_dtype=torch.float32)

    outs = {}
    before = programmatic_launch()
    try:
        for pdl in (False, True):
            programmatic_launch(pdl)
            outs[pdl] = replayed(chain).clone()
    finally:
        programmatic_launch(before)
    assert_exact(outs[True], outs[False], "PDL vs plain launches")


def test_next_weights_are_asked_only_of_a_compiled_launch_on_the_gpu():
    """The next launch's weights (common.next_weights_l2): asked where the launch is compiled,
    the switch on and the bytes on a CUDA device; at most a quarter of the L2, whole lines;
    otherwise the launch asks for nothing and any tensor stands in for the pointer."""
    from kernels_ampere.common import NEXT_L2_SHARE, next_weights_l2, prefetch_next
    from kernels_ampere.w2a8 import _w2a8_mma_kernel

    unused = torch.zeros(4, dtype=torch.uint8)
    before = prefetch_next()
    try:
        prefetch_next(True)
        off = {"next_ptr": unused, "next_bytes": 0}
        assert next_weights_l2(_w2a8_mma_kernel, None, 4, unused) == off
        assert next_weights_l2(_w2a8_mma_kernel, torch.zeros(64, 32, dtype=torch.uint8), 4, unused) == off  # CPU
        if ON_GPU and not os.environ.get("TRITON_INTERPRET"):
            big = torch.empty(1 << 26, dtype=torch.uint8, device="cuda")  # 64 MiB: more than a quarter of any L2
            args = next_weights_l2(_w2a8_mma_kernel, big, 8, unused)
            cap = torch.cuda.get_device_properties(0).L2_cache_size // NEXT_L2_SHARE
            assert args["PREFETCH_NEXT"] and args["next_ptr"] is big and args["NEXT_LINES"] == 256
            assert 0 < args["next_bytes"] <= cap and args["next_bytes"] % 128 == 0
            small = big[: 3 * 128 + 5]
            assert next_weights_l2(_w2a8_mma_kernel, small, 4, unused)["next_bytes"] == small.numel()
            prefetch_next(False)
            assert next_weights_l2(_w2a8_mma_kernel, big, 4, unused) == off
        assert prefetch_next(False) is False and prefetch_next() is False
    finally:
        prefetch_next(before)


@pytest.mark.parametrize("m", (3, 9))
def test_w2a8_with_next_weights_matches_the_twin(m):
    """Every kernel asked to warm the L2 with another matrix's bytes: the same bits as the twin
    (interpreted the hint is dropped; compiled on the GPU every program issues its share)."""
    gen = torch.Generator().manual_seed(31 + m)
    n, k = 72, 640
    _, packed = random_weight(n, k, gen)
    _, other = random_weight(200, 384, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand(n, generator=gen)).to(DEVICE)
    ref = w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32)
    for cfg in w2a8_configs(False, m):
        out = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, config=cfg, next_weights=other)
        assert_exact(out, ref, f"{cfg} with next weights")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m", (1, 9, 33))
def test_w2a8_chain_asking_for_the_next_weights_agrees_in_a_graph(m):
    """A chain of launches, each asking the L2 for the next one's weights (the last for the
    first's, as a decode step does), captured with programmatic launch: the twin's bits."""
    from kernels_ampere.common import prefetch_next

    gen = torch.Generator().manual_seed(5 + m)
    shapes = [(3840, 2560), (2560, 2560), (13824, 2560), (2560, 6912)]
    packed = [random_weight(n, k, gen)[1] for n, k in shapes]
    scales = [(0.5 + torch.rand(n, generator=gen)).to(DEVICE) for n, _ in shapes]
    acts = [random_activations(m, k, gen) for _, k in shapes]
    refs = [w2a8_linear_reference(a, s, p, w, out_dtype=torch.float32) for (a, s), p, w in zip(acts, packed, scales)]
    before = prefetch_next()
    try:
        prefetch_next(True)

        def chain():
            return [w2a8_linear(a, s, p, w, out_dtype=torch.float32, next_weights=nxt)
                    for (a, s), p, w, nxt in zip(acts, packed, scales, packed[1:] + packed[:1])]

        for i, (out, ref) in enumerate(zip(replayed(chain), refs)):
            assert_exact(out, ref, f"launch {i} of the chain, M={m}")
    finally:
        prefetch_next(before)


def test_w2a8_v5_default_folds_every_tensor_core_launch():
    """v5 (the default): v3's launches at M <= 16 with the lanes folded; M = 17..64 the whole
    width in one folded tile of 128 weight rows over 8 warps, M = 65..128 folded 32-row
    tiles; K sliced on a 132-SM GPU, not on an 8-SM Orin; M <= 2 and beyond 128 rows as v3;
    only the tensor-core kernel folds."""
    for m in (3, 9, 16):
        v3, v5 = (default_linear(m, False, n=2560, k=6912, sms=132, generation=g) for g in ("v3", "v5"))
        assert v5.fold_lanes and v5 == LinearConfig(**{**v3.__dict__, "fold_lanes": True})
    for m, block_n, block_m in ((17, 128, 0), (40, 128, 0), (64, 128, 0), (65, 64, 32), (128, 64, 32)):
        orin, h200 = (default_linear(m, False, n=2560, k=6912, sms=s, generation="v5") for s in (8, 132))
        assert orin.kernel == h200.kernel == MMA and orin.fold_lanes and h200.fold_lanes
        assert orin.block_n == h200.block_n == block_n and orin.block_m == h200.block_m == block_m
        assert orin.split_k == 1 < h200.split_k
    for m in (1, 2, 129):
        assert default_linear(m, False, n=2560, k=6912, sms=132, generation="v5") == default_linear(
            m, False, n=2560, k=6912, sms=132, generation="v3")
    for kind in (DOT, GEMV, LANES):
        with pytest.raises(ValueError, match="fold_lanes"):
            LinearConfig(kind, 64, 64, fold_lanes=True)


def test_w2a8_v6_default_runs_the_narrowest_widths_on_the_tensor_cores_of_a_small_gpu():
    """v6 (the default): v5, except that M = 1 on up to 16 SMs and M = 2 on up to 64 take
    v5's M = 3 launch (folded mma, no K slice on a board) instead of gemv; group-128
    weights, larger GPUs and every other width keep v5's launch."""
    m3 = {s: default_linear(3, False, n=2560, k=6912, sms=s, generation="v5") for s in (4, 8, 16, 32, 64, 132)}
    for sms in (4, 8, 16):
        for m in (1, 2):
            cfg = default_linear(m, False, n=2560, k=6912, sms=sms, generation="v6")
            assert cfg == m3[sms] and cfg.kernel == MMA and cfg.fold_lanes and cfg.split_k == 1
    assert default_linear(2, False, n=2560, k=6912, sms=64, generation="v6") == m3[64]
    for m, sms in ((1, 32), (1, 64), (1, 132), (2, 132)):
        v6, v5 = (default_linear(m, False, n=2560, k=6912, sms=sms, generation=g) for g in ("v6", "v5"))
        assert v6 == v5 and v6.kernel == GEMV
    for m in (1, 2):  # group-128 scales: not measured there, gemv stays
        assert default_linear(m, True, n=2560, k=6912, sms=8, generation="v6").kernel == GEMV
    for m in (3, 9, 27, 80, 129):
        for sms in (8, 132):
            assert default_linear(m, False, n=2560, k=6912, sms=sms, generation="v6") == default_linear(
                m, False, n=2560, k=6912, sms=sms, generation="v5")


def test_w2a8_v7_default_adds_tail_tiles_at_33_to_48_rows_on_a_small_gpu():
    """v7: v6, except that M = 33..48 on up to 16 SMs run 32 + 16 rows (a tail
    tile) instead of the width padded to 64; every other width and larger GPUs keep v6."""
    for sms in (8, 16):
        for m in (33, 40, 48):
            cfg = default_linear(m, False, n=2560, k=6912, sms=sms, generation="v7")
            v6 = default_linear(m, False, n=2560, k=6912, sms=sms, generation="v6")
            assert (cfg.block_m, cfg.tail_m) == (32, 16) and cfg == replace(v6, block_m=32, tail_m=16)
    for m, sms in ((1, 8), (32, 8), (49, 8), (64, 16), (80, 8), (33, 32), (40, 132)):
        assert default_linear(m, False, n=2560, k=6912, sms=sms, generation="v7") == default_linear(
            m, False, n=2560, k=6912, sms=sms, generation="v6")


def test_w2a8_v8_default_gives_a_board_four_warps_of_wide_weight_tiles():
    """v8 (what v9, the default, gives a board): v7, except that on up to 16 SMs every folded
    launch runs on 4 warps of 128 weight rows (M <= 64; with v7's tail tile at 33..48) or 256
    (M = 65..128, 32-row tiles of the width), where those programs still give every SM one; a
    narrow projection on a board (the embedded model's 512 rows on 8 SMs) keeps v7's launch at
    M <= 16 and 65..96; larger GPUs, widths beyond 128 and group-128 weights keep v7."""
    for sms, slices in ((8, 2), (16, 3)):
        for m in (1, 2, 3, 9, 16, 17, 32, 33, 48, 64):
            v7, v8 = (default_linear(m, False, n=2560, k=6912, sms=sms, generation=g) for g in ("v7", "v8"))
            assert v7.kernel == MMA and v7.fold_lanes and v7.split_k == 1
            # M <= 16: the 20 programs of 2560 rows sliced until their last wave is nearly full
            assert v8 == replace(v7, block_n=128, num_warps=4, split_k=slices if m <= 16 else 1) != v7
        for m in (65, 80, 128):
            v7, v8 = (default_linear(m, False, n=2560, k=6912, sms=sms, generation=g) for g in ("v7", "v8"))
            assert v7.block_m == 32 and v8 == replace(v7, block_n=256, num_warps=4) != v7
    for m in (1, 9, 16):  # 108 programs of gate+up and 30 of QKV fill their last waves (>= 0.9)
        for n in (13824, 3840):
            for sms in (8, 16):
                assert default_linear(m, False, n=n, k=2560, sms=sms, generation="v8").split_k == 1
    assert wave_fill(20, 8) == 20 / 24 and wave_fill(30, 16) == 30 / 32 and wave_fill(40, 8) == 1
    for m in (1, 9, 16, 80):  # four 128-row programs (six of 256 rows at M = 80) would leave 8 SMs idle
        assert default_linear(m, False, n=512, k=512, sms=8, generation="v8") == default_linear(
            m, False, n=512, k=512, sms=8, generation="v7")
    assert default_linear(9, False, n=1024, k=512, sms=8, generation="v8").block_n == 128
    assert default_linear(24, False, n=512, k=512, sms=8, generation="v8").num_warps == 4  # 128 rows there anyway
    for m, sms, grouped in ((1, 32, False), (9, 132, False), (40, 32, False), (129, 8, False), (9, 8, True)):
        assert default_linear(m, grouped, n=2560, k=6912, sms=sms, generation="v8") == default_linear(
            m, grouped, n=2560, k=6912, sms=sms, generation="v7")
    assert default_linear(9, False, n=2560, k=6912, sms=8) == default_linear(9, False, n=2560, k=6912, sms=8,
                                                                             generation="v8")


# (M, SMs, N, K, block_n, K slices) of v8 launches: on 2 SMs two or three programs of 128 / 256 weight
# rows (the last one partial; the tail tile at M = 40, 32-row tiles side by side at 80; K padded to
# whole chunks); on 4 SMs five 128-row programs fill their waves to 0.625, so K (15 chunks) is
# sliced in three (15 programs, 0.94), the slices summed by the reduction launch
V8_LAUNCHES = [(1, 2, 300, 600, 128, 1), (9, 2, 300, 600, 128, 1), (16, 2, 300, 600, 128, 1),
               (27, 2, 300, 600, 128, 1), (40, 2, 300, 600, 128, 1), (80, 2, 300, 600, 256, 1),
               (1, 4, 600, 1920, 128, 3), (9, 4, 600, 1920, 128, 3), (16, 4, 600, 1920, 128, 3)]


def test_w2a8_v9_default_takes_layer_wide_k_steps_only_under_programmatic_launch():
    """v9 (the default): v8, except that on more than 16 SMs with programmatic launch every folded
    launch without a tail of M = 3..16 steps K 256 bytes at a time in one stage and of M = 17..24
    128 bytes; a board, a GPU without programmatic launch, group-128 weights, gemv (M <= 2 there)
    and widths past 24 keep v8's launch."""
    from kernels_ampere.tuning import LAYER_STEPS

    assert LAYER_STEPS == ((16, 256, 1), (24, 128, 1))
    for n, k in ((3840, 2560), (2560, 6912), (13824, 2560), (768, 512)):
        for m, (block_kb, stages) in ((3, (256, 1)), (9, (256, 1)), (16, (256, 1)), (17, (128, 1)), (24, (128, 1))):
            v8 = default_linear(m, False, n=n, k=k, sms=132, generation="v8")
            v9 = default_linear(m, False, n=n, k=k, sms=132, generation="v9", programmatic=True)
            assert v8.kernel == MMA and v8.fold_lanes and (v8.block_kb, v8.num_stages) == (64, 3)
            assert v9 == replace(v8, block_kb=block_kb, num_stages=stages)
            assert default_linear(m, False, n=n, k=k, sms=132, generation="v9", programmatic=False) == v8
        for m, sms, grouped in ((1, 132, False), (2, 132, False), (25, 132, False), (80, 132, False),
                                (9, 16, False), (9, 8, False), (9, 132, True)):
            assert default_linear(m, grouped, n=n, k=k, sms=sms, generation="v9", programmatic=True) == default_linear(
                m, grouped, n=n, k=k, sms=sms, generation="v8")
    # without CUDA (CI) nothing launches programmatically: the default is v8's launch
    if not torch.cuda.is_available():
        assert default_linear(9, False, n=3840, k=2560, sms=132) == default_linear(9, False, n=3840, k=2560, sms=132,
                                                                                   generation="v8")


@pytest.mark.parametrize("m,n,k", [(3, 72, 640), (9, 40, 1152), (16, 136, 2560), (20, 200, 640), (24, 72, 300)])
def test_w2a8_v9_launches_match_the_twin(m, n, k):
    """v9's launches on a large GPU with programmatic launch (as the H200 runs them; K steps past a
    slice, slices shorter than a step, K padded to whole chunks) with the residual fused: the twin's bits."""
    packed, a, a_s, w_s, res, ref = residual_case(m, n, k, False, seed=1100 + m + n)
    cfg = default_linear(m, False, n=n, k=k, sms=132, generation="v9", programmatic=True)
    assert cfg.block_kb == (256 if m <= 16 else 128) and cfg.num_stages == 1 and cfg.fold_lanes
    assert_exact(w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=res, config=cfg), ref, f"{cfg}")


TWO_B_SHAPES = ((3840, 2560), (2560, 2560), (13824, 2560), (2560, 6912))  # QKV, O, gate+up, down


def test_w2a8_v10_slices_the_whole_width_launch_by_its_own_tiles():
    """v10 (the default): v9, except that on more than 16 SMs the folded whole-width launch of
    M = 17..64 (128 weight rows over 8 warps) slices K until its 128-row tiles cover the SMs once,
    five chunks per slice at least; v5-v9 counted 64-row tiles, so its programs covered half an
    H200. Every other launch is v9's."""
    def splits(m, generation, sms=132, programmatic=True):
        return [default_linear(m, False, n=n, k=k, sms=sms, generation=generation, programmatic=programmatic).split_k
                for n, k in TWO_B_SHAPES]

    for m in (17, 24, 32, 33, 40, 64):
        assert splits(m, "v9") == [3, 4, 1, 4]
        assert splits(m, "v10") == [4, 4, 2, 7]  # 30 / 20 / 108 / 20 tiles of 128 rows on 132 SMs
        assert splits(m, "v10", programmatic=False) == [4, 4, 2, 7]
        for n, k in TWO_B_SHAPES:
            v9, v10 = (default_linear(m, False, n=n, k=k, sms=132, generation=g, programmatic=True)
                       for g in ("v9", "v10"))
            assert (v10.block_n, v10.num_warps, v10.fold_lanes) == (128, 8, True)
            assert v10 == replace(v9, split_k=v10.split_k)
    assert default_linear(24, False, n=768, k=512, sms=132, generation="v10").split_k == 1  # 4 chunks: no slice
    for n, k in TWO_B_SHAPES:
        for m, sms, grouped in ((1, 132, False), (9, 132, False), (16, 132, False), (65, 132, False),
                                (80, 132, False), (24, 16, False), (40, 8, False), (24, 132, True)):
            assert default_linear(m, grouped, n=n, k=k, sms=sms, generation="v10", programmatic=True) == \
                default_linear(m, grouped, n=n, k=k, sms=sms, generation="v9", programmatic=True)


@pytest.mark.parametrize("m,n,k,sms", [(24, 512, 3840, 24), (40, 264, 3200, 20), (17, 1000, 2600, 32)])
def test_w2a8_v10_launches_match_the_twin(m, n, k, sms):
    """v10's re-sliced launches (more K slices than v9's, the last one short; K padded to whole
    chunks in the last case), residual fused, under programmatic launch as a large GPU runs
    them: the twin's bits."""
    packed, a, a_s, w_s, res, ref = residual_case(m, n, k, False, seed=1300 + m + n)
    cfg = default_linear(m, False, n=n, k=k, sms=sms, generation="v10", programmatic=True)
    v9 = default_linear(m, False, n=n, k=k, sms=sms, generation="v9", programmatic=True)
    assert cfg.block_n == 128 and cfg.split_k > v9.split_k
    assert_exact(w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=res, config=cfg), ref, f"{cfg}")


@pytest.mark.parametrize("m,sms,n,k,block_n,slices", V8_LAUNCHES)
def test_w2a8_v8_board_launch_matches_the_twin(m, sms, n, k, block_n, slices):
    """The v8 launches of small GPUs, with the residual fused, on fresh random inputs: the twin's bits."""
    gen = torch.Generator().manual_seed(960 + m + sms)
    _, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand(n, generator=gen)).to(DEVICE)
    res = torch.randn(m, n, generator=gen).to(DEVICE)
    cfg = default_linear(m, False, n=n, k=k, sms=sms, generation="v8")
    assert (cfg.kernel, cfg.block_n, cfg.num_warps, cfg.fold_lanes, cfg.split_k) == (MMA, block_n, 4, True, slices)
    assert_exact(w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=res, config=cfg),
                 w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32, residual=res), f"{cfg}")


@pytest.mark.parametrize("m,n,k", [(1, 72, 640), (2, 40, 384), (1, 24, 200)])
def test_w2a8_v6_board_launch_at_the_narrowest_widths_matches_the_twin(m, n, k):
    """The launch v6 gives M = 1 and 2 on an 8-SM board, on fresh random inputs (K padded to
    whole 128-chunks in the last case), with the residual fused: the twin's bits."""
    gen = torch.Generator().manual_seed(900 + 10 * m + n)
    _, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand(n, generator=gen)).to(DEVICE)
    res = torch.randn(m, n, generator=gen).to(DEVICE)
    cfg = default_linear(m, False, n=n, k=k, sms=8, generation="v6")
    assert cfg.kernel == MMA
    assert_exact(w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=res, config=cfg),
                 w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32, residual=res), f"{cfg}")


# --- tail tiles: a folded program over block_m + tail_m rows (LinearConfig.tail_m) ------------------

TAIL_SHAPE = (40, 300)  # N, K: a partial last weight tile, K padded to three whole chunks


@pytest.mark.parametrize("m,block_m,tail_m", [(33, 32, 16), (40, 32, 16), (48, 32, 16), (90, 64, 32)])
def test_w2a8_tail_tile_matches_the_twin(m, block_m, tail_m):
    """Widths past a power of two in a main tile and a smaller tail tile that multiplies the
    same decoded weights, on fresh random inputs: the twin's bits with and without the fused
    residual, with the activation sums by dp4a over the words and on the tensor cores, and
    with K split (two slices; the sums in the kernel at 16 x 48 rows, by a launch at 16 x 96)."""
    import kernels_ampere.w2a8 as w2a8

    n, k = TAIL_SHAPE
    gen = torch.Generator().manual_seed(500 + m)
    _, packed = random_weight(n, k, gen)
    a, a_s = random_activations(m, k, gen)
    w_s = (0.5 + torch.rand(n, generator=gen)).to(DEVICE)
    res = (torch.randn(m, n, generator=gen) * 3).to(DEVICE)
    fold = dict(block_m=block_m, tail_m=tail_m, num_warps=4, num_stages=2, fold_lanes=True)
    cfgs = [LinearConfig(MMA, 16, 64, **fold), LinearConfig(MMA, 16, 64, asum_by_dot=True, **fold),
            LinearConfig(MMA, 16, 32, split_k=2, **fold)]
    for residual in (None, res):
        ref = w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32, residual=residual)
        for cfg in cfgs:
            assert w2a8.mma_rows(cfg, m, k) == (block_m, tail_m)  # one program: both tiles
            out = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=residual, config=cfg)
            assert_exact(out, ref, f"{cfg} M={m} residual={residual is not None}")


def test_w2a8_tail_rows_do_not_depend_on_the_width():
    """The rows that launches of widths 32, 33 and 48 share get the same bits: M = 32 in one
    32-row tile, M = 33 and 48 in a 32-row tile and a 16-row tail (the 8-SM board's default
    with ``tail_config``, 128 weight rows over 8 warps), and M = 33 also padded to 64 rows
    without a tail; each against the twin too."""
    n, k = TAIL_SHAPE
    gen = torch.Generator().manual_seed(532)
    _, packed = random_weight(n, k, gen)
    a, a_s = random_activations(48, k, gen)
    w_s = (0.5 + torch.rand(n, generator=gen)).to(DEVICE)
    outs = {}
    for m, tail in ((32, False), (33, True), (33, False), (48, True)):
        board = default_linear(m, False, n=n, k=k, sms=8, generation="v6")  # v6: no tail of its own
        cfg = tail_config(board, m) if tail else board
        assert cfg.tail_m == (16 if tail else 0)
        outs[m, tail] = w2a8_linear(a[:m], a_s[:m], packed, w_s, out_dtype=torch.float32, config=cfg)
        assert_exact(outs[m, tail], w2a8_linear_reference(a[:m], a_s[:m], packed, w_s, out_dtype=torch.float32),
                     f"{cfg} M={m}")
    assert_exact(outs[33, True][:32], outs[32, False], "M = 33 (32 + 16) vs M = 32")
    assert_exact(outs[33, True], outs[33, False], "M = 33 with and without the tail")
    assert_exact(outs[48, True][:33], outs[33, True], "M = 48 vs M = 33")


@pytest.mark.parametrize("grouped", [False, True], ids=["row", "group128"])
def test_w2a8_tail_tile_split_k_counts_each_tile(grouped, monkeypatch):
    """Split-K with a tail: the main and the tail tile of a program have arrival counts of their
    own, so the last slice to finish each adds it, no reduction launch runs and every count is
    back at zero (a second call starts clean); with no counts, a reduction launch: the same
    bits. Group-128 scales (K = 4096: two slices from K alone) too; residual fused."""
    import kernels_ampere.w2a8 as w2a8
    from kernels_ampere import common

    m, n, k = (40, 24, 4096) if grouped else (40, 24, 640)
    packed, a, a_s, w_s, res, ref = residual_case(m, n, k, grouped, seed=540 + grouped)
    # three slices of a five-chunk K (the last one chunk of a two-chunk step); grouped: K's two
    cfg = LinearConfig(MMA, 16, 64, num_warps=4, num_stages=2, split_k=3, block_m=32, tail_m=16, fold_lanes=True)

    def no_launch(*args, **kwargs):
        raise AssertionError("split_k_reduce launched although the counts were there")

    with monkeypatch.context() as patch:
        patch.setattr(w2a8, "split_k_reduce", no_launch)
        for call in range(2):
            out = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=res, config=cfg)
            assert_exact(out, ref, f"in the kernel, call {call}: {cfg}")
            assert common.split_counters(out.device, 1).count_nonzero().item() == 0
    with monkeypatch.context() as patch:
        patch.setattr(w2a8, "split_counters", lambda device, tiles: None)
        assert_exact(w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=res, config=cfg), ref,
                     f"by a launch: {cfg}")


def test_tail_m_is_checked_and_old_tables_load_without_it():
    """A tail only on the folded ``mma`` kernel, 16 / 32 / 64 rows below a main tile that is
    set; the launcher drops it where the width fits the main tile or K is too long to fold;
    a tuned record without the field (tables before it) loads as no tail."""
    import kernels_ampere.w2a8 as w2a8

    good = LinearConfig(MMA, 64, 64, block_m=32, tail_m=16, fold_lanes=True)
    bad = [dict(kernel=MMA, block_m=32, tail_m=16),  # not folded
           dict(kernel=DOT, block_m=32, tail_m=16),
           dict(kernel=MMA, tail_m=16, fold_lanes=True),  # no main tile
           dict(kernel=MMA, block_m=32, tail_m=32, fold_lanes=True),  # not smaller than it
           dict(kernel=MMA, block_m=128, tail_m=8, fold_lanes=True),  # not a tensor-core tile
           dict(kernel=MMA, block_m=64, tail_m=24, fold_lanes=True)]
    for fields in bad:
        with pytest.raises(ValueError, match="tail_m"):
            LinearConfig(block_n=64, block_kb=64, **fields)
    assert w2a8.mma_rows(good, 40, 300) == (32, 16)
    assert w2a8.mma_rows(good, 20, 300) == (32, 0)  # the width fits the main tile
    assert w2a8.mma_rows(good, 40, w2a8.FOLD_MAX_K + 128) == (32, 0)  # four accumulators: no tail
    key = linear_key(2560, 2560, 40, False)
    entry = record("w2a8_linear", key, good, 1.0)
    assert entry["config"]["tail_m"] == 16 and find_config([entry], "w2a8_linear", key) == good
    del entry["config"]["tail_m"]
    assert find_config([entry], "w2a8_linear", key) == LinearConfig(MMA, 64, 64, block_m=32, fold_lanes=True)


def test_tail_config_splits_the_whole_width_where_it_pads_fewer_rows():
    """``tail_config``: the board's whole-width folded launch as 32 + 16 rows at M = 33..48,
    64 + 16 at 65..80, 64 + 32 at 81..96, unchanged elsewhere (and for tiled or unfolded
    launches); the defaults before v7 never take a tail; the tuner is offered exactly these widths' tails."""
    n, k = 2560, 6912
    expect = {m: (32, 16) for m in range(33, 49)} | {m: (64, 16) for m in range(65, 81)}
    expect |= {m: (64, 32) for m in range(81, 97)}
    for m in range(1, 140):
        whole = LinearConfig(MMA, 128, 64, num_warps=8, num_stages=3, fold_lanes=True)
        got = tail_config(whole, m)
        assert ((got.block_m, got.tail_m) if got != whole else None) == expect.get(m), m
        assert got.tail_m + got.block_m >= m or got == whole
        for sms in (8, 132):
            board = default_linear(m, False, n=n, k=k, sms=sms, generation="v6")
            assert board.tail_m == 0
            if m > 64:  # 32-row tiles already
                assert tail_config(board, m) == board
    unfolded = LinearConfig(MMA, 64, 64, num_stages=3)
    tiled = LinearConfig(MMA, 64, 64, num_stages=3, block_m=32, fold_lanes=True)
    assert tail_config(unfolded, 40) == unfolded and tail_config(tiled, 40) == tiled
    for m in (20, 32, 33, 48, 49, 64, 80, 96, 97, 128):
        tails = {(c.block_m, c.tail_m) for c in linear_candidates(m, n, k, False) if c.tail_m}
        assert tails == ({expect[m]} if m in expect else set()), m



# --- two chains: the folded loop with two K steps in flight (LinearConfig.chains) -------------------

CHAIN_CASES = [  # (M, N, K, grouped, launch): steps that overshoot the slice, K padded, partial tiles
    (5, 40, 640, False, dict(block_n=16, block_kb=64)),  # five chunks: two pairs and a lone step
    (9, 40, 300, False, dict(block_n=16, block_kb=32, split_k=2)),  # K padded; slices of one and two chunks
    (3, 24, 896, False, dict(block_n=16, block_kb=32, split_k=3)),  # seven chunks in three slices
    (17, 40, 1152, False, dict(block_n=16, block_kb=64, asum_by_dot=True)),  # the sums on the tensor cores
    (33, 24, 640, False, dict(block_n=16, block_kb=64, block_m=32)),  # the width in 32-row tiles
    (5, 40, 640, True, dict(block_n=16, block_kb=64)),  # group scales: five steps of one chunk
    (9, 24, 4096, True, dict(block_n=16, block_kb=32)),  # two K slices from K alone
]


@pytest.mark.parametrize("m,n,k,grouped,launch", CHAIN_CASES)
def test_w2a8_two_chains_match_the_twin(m, n, k, grouped, launch):
    """Two K steps per iteration into two accumulators, their lanes interleaved: the twin's bits
    on fresh random inputs, with and without the fused residual, and the same bits as one chain
    (integer sums in any order; group scales still added one chunk at a time in K order)."""
    packed, a, a_s, w_s, res, _ = residual_case(m, n, k, grouped, seed=600 + m + k)
    one = LinearConfig(MMA, num_warps=4, num_stages=2, fold_lanes=True, **launch)
    two = replace(one, chains=2)
    for residual in (None, res):
        ref = w2a8_linear_reference(a, a_s, packed, w_s, out_dtype=torch.float32, residual=residual)
        out = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=residual, config=two)
        assert_exact(out, ref, f"{two} M={m} N={n} K={k} residual={residual is not None}")
        assert_exact(out, w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=residual, config=one),
                     f"two chains vs one: {one}")


def test_chains_are_checked_and_old_tables_load_without_them():
    """Two chains only on the folded ``mma`` kernel without a tail; ``tail_config`` leaves such a
    launch as it is; a tuned record without the field (tables before it) loads as one chain."""
    good = LinearConfig(MMA, 64, 64, num_stages=3, fold_lanes=True, chains=2)
    bad = [dict(kernel=MMA, chains=2),  # not folded
           dict(kernel=GEMV, chains=2),
           dict(kernel=MMA, fold_lanes=True, block_m=32, tail_m=16, chains=2),  # a tail tile
           dict(kernel=MMA, fold_lanes=True, chains=3),
           dict(kernel=MMA, fold_lanes=True, chains=0)]
    for fields in bad:
        with pytest.raises(ValueError, match="chains"):
            LinearConfig(block_n=64, block_kb=64, **fields)
    assert tail_config(good, 40) == good
    key = linear_key(2560, 2560, 16, False)
    entry = record("w2a8_linear", key, good, 1.0)
    assert entry["config"]["chains"] == 2 and find_config([entry], "w2a8_linear", key) == good
    del entry["config"]["chains"]
    assert find_config([entry], "w2a8_linear", key) == replace(good, chains=1)
    # the tuner times two chains beside each folded launch without a tail up to 16 rows, not wider
    for m in (3, 9, 16):
        cands = linear_candidates(m, 2560, 6912, False)
        two = [c for c in cands if c.chains == 2]
        assert two and all(replace(c, chains=1) in cands for c in two)
    assert not [c for c in linear_candidates(17, 2560, 6912, False) if c.chains == 2]


@pytest.mark.parametrize("block_kb,num_stages,split_k", [(256, 2, 1), (256, 1, 2), (512, 1, 1), (128, 2, 3)])
def test_w2a8_long_folded_k_steps_match_the_twin(block_kb, num_stages, split_k):
    """The folded launch with K steps of 4-16 chunks (``tuning.LAYER_STEP_VARIANTS``): one step
    that holds a whole slice, one that overshoots it, slices shorter than a step; residual fused."""
    for m, n, k in ((9, 40, 1152), (16, 24, 640), (3, 40, 300)):
        packed, a, a_s, w_s, res, ref = residual_case(m, n, k, False, seed=700 + m + block_kb + split_k)
        cfg = LinearConfig(MMA, 16, block_kb, num_warps=4, num_stages=num_stages, split_k=split_k, fold_lanes=True)
        out = w2a8_linear(a, a_s, packed, w_s, out_dtype=torch.float32, residual=res, config=cfg)
        assert_exact(out, ref, f"{cfg} M={m} N={n} K={k}")
