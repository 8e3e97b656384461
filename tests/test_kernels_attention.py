"""small_width_attention against its twin (masked softmax attention in float32).

Tolerances (max abs error; q, k, v ~ N(0, 1)): float32 1e-5; float16 2e-3 and bfloat16
2e-2, because the kernel rounds the softmax weights to the KV dtype before the P @ V
product, as flash attention does, where the twin keeps them in float32.
"""

import pytest
import torch

pytest.importorskip("triton")  # the interpreter is set up by tests/__init__.py without CUDA

from tests.helpers import DEVICE, needs_gpu  # noqa: E402
from kernels_ampere.attention import small_width_attention, small_width_attention_reference  # noqa: E402
from kernels_ampere.tuning import AttentionConfig  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make(m, hq, hkv, hd, capacity, workspace, dtype, gen, p_allowed=0.7):
    s = capacity + workspace
    q = torch.randn(m, hq, hd, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(hkv, s, hd, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(hkv, s, hd, generator=gen).to(dtype).to(DEVICE)
    mask = (torch.rand(m, s, generator=gen) < p_allowed).to(DEVICE)
    return q, k, v, mask


def check(q, k, v, mask, hist, capacity, config, dtype, what):
    history_len = torch.tensor([hist], dtype=torch.int32, device=DEVICE)
    out = small_width_attention(q, k, v, mask, history_len, capacity=capacity, config=config)
    ref = small_width_attention_reference(q, k, v, mask, history_len, capacity=capacity)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype], f"{what}: max abs error {err}"


SPLIT = AttentionConfig(block_s=16, split_slots=32)  # several history splits + the combine pass
ONE_PASS = AttentionConfig(block_s=16, split_slots=256)  # one split: the first pass writes the output


@pytest.mark.parametrize("m", (1, 2, 3, 5, 9, 17))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", [SPLIT, ONE_PASS], ids=["split", "one_pass"])
def test_attention_matches_twin(m, dtype, config):
    """GQA with 2 query heads per KV head; history partly live (70 of 96 slots)."""
    gen = torch.Generator().manual_seed(m)
    q, k, v, mask = make(m, hq=4, hkv=2, hd=32, capacity=96, workspace=m + 2, dtype=dtype, gen=gen)
    check(q, k, v, mask, 70, 96, config, dtype, f"M={m}")


@pytest.mark.parametrize("hq,hkv,hd", [(4, 4, 64), (8, 2, 48), (5, 1, 16)])
def test_attention_head_layouts(hq, hkv, hd):
    """MHA, GQA with a non-power-of-two head dim, MQA with five heads."""
    gen = torch.Generator().manual_seed(hq * hd)
    q, k, v, mask = make(3, hq, hkv, hd, capacity=64, workspace=4, dtype=torch.float32, gen=gen)
    check(q, k, v, mask, 50, 64, SPLIT, torch.float32, f"Hq={hq} Hkv={hkv} hd={hd}")


@pytest.mark.parametrize("hist", [0, 1, 31, 32, 33, 96])
def test_attention_history_len_boundaries(hist):
    """Empty history (workspace only), split edges, and a full history."""
    gen = torch.Generator().manual_seed(hist)
    q, k, v, mask = make(5, 4, 2, 32, capacity=96, workspace=6, dtype=torch.float32, gen=gen)
    check(q, k, v, mask, hist, 96, SPLIT, torch.float32, f"history_len={hist}")


def test_attention_dead_history_slots_are_never_read_even_if_the_mask_allows_them():
    gen = torch.Generator().manual_seed(9)
    q, k, v, mask = make(2, 4, 2, 32, capacity=64, workspace=3, dtype=torch.float32, gen=gen, p_allowed=1.0)
    hist = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    base = small_width_attention(q, k, v, mask, hist, capacity=64, config=SPLIT)
    k[:, 20:64], v[:, 20:64] = 1e4, float("nan")  # garbage beyond history_len
    again = small_width_attention(q, k, v, mask, hist, capacity=64, config=SPLIT)
    assert torch.equal(base, again)


def test_attention_row_that_sees_nothing_gets_zeros():
    gen = torch.Generator().manual_seed(2)
    q, k, v, mask = make(3, 4, 2, 32, capacity=64, workspace=3, dtype=torch.float32, gen=gen)
    mask[1] = False
    hist = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    for config in (SPLIT, ONE_PASS):
        out = small_width_attention(q, k, v, mask, hist, capacity=64, config=config)
        assert torch.all(out[1] == 0) and torch.isfinite(out).all()


def test_attention_follows_the_history_len_tensor_without_relaunch_arguments():
    """The length lives in device memory: same call, new value in place, new result."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, mask = make(2, 4, 2, 32, capacity=64, workspace=3, dtype=torch.float32, gen=gen)
    hist = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    for value in (10, 41, 64):
        hist.fill_(value)
        out = small_width_attention(q, k, v, mask, hist, capacity=64, config=SPLIT)
        ref = small_width_attention_reference(q, k, v, mask, hist, capacity=64)
        assert (out - ref).abs().max().item() <= 1e-5, f"history_len={value}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_graph_replay_reads_the_new_history_len(dtype):
    gen = torch.Generator().manual_seed(1)
    q, k, v, mask = make(9, 20, 5, 128, capacity=4096, workspace=17, dtype=dtype, gen=gen)
    hist = torch.tensor([1000], dtype=torch.int32, device=DEVICE)
    small_width_attention(q, k, v, mask, hist, capacity=4096)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = small_width_attention(q, k, v, mask, hist, capacity=4096)
    for value in (3000, 17, 4096):
        hist.fill_(value)
        graph.replay()
        ref = small_width_attention_reference(q, k, v, mask, hist, capacity=4096)
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= TOL[dtype], f"history_len={value}: {err}"
