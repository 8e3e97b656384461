"""small_width_attention with row spans (the fused step's visibility) against its twin, and
bit for bit against the same kernel reading the equivalent [M, S] mask."""

import pytest
import torch

pytest.importorskip("triton")  # the interpreter is set up by tests/__init__.py without CUDA

from tests.helpers import DEVICE  # noqa: E402
from bitmtp_edge.runtime.masks import (  # noqa: E402
    draft_in_place_mask, draft_in_place_spans, fused_step_mask, fused_step_spans, history_step_mask,
    history_step_spans, spans_to_mask,
)
from kernels_ampere.attention import (  # noqa: E402
    row_spans_mask, small_width_attention, small_width_attention_reference,
)
from kernels_ampere.tuning import AttentionConfig  # noqa: E402
from tests.test_kernels_attention import TOL  # noqa: E402

SPLIT = AttentionConfig(block_s=16, split_slots=32)
ONE_PASS = AttentionConfig(block_s=16, split_slots=256)


def qkv(m, hq, hkv, hd, slots, dtype, gen):
    q = torch.randn(m, hq, hd, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(hkv, slots, hd, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(hkv, slots, hd, generator=gen).to(dtype).to(DEVICE)
    return q, k, v


@pytest.mark.parametrize("dtype,config,causal,cands,block", [
    (torch.float16, SPLIT, 5, [0, 2], 4),
    (torch.float16, SPLIT, 9, [0, 3, 5, 8], 8),
    (torch.bfloat16, ONE_PASS, 4, [1, 3, 4], 4),
    (torch.float32, ONE_PASS, 9, [0, 3, 5, 8], 8),
    (torch.float32, SPLIT, 4, [4], 4),
], ids=["f16-split-D4", "f16-split-D8", "bf16-one_pass-D4", "f32-one_pass-D8", "f32-split-one-block"])
def test_fused_spans_match_the_twin_and_the_mask_kernel(dtype, config, causal, cands, block):
    """GQA 4 (16-row query tiles cut across rows), history live up to the causal rows."""
    gen = torch.Generator().manual_seed(causal * 10 + len(cands))
    capacity, first = 96, 60
    workspace = len(cands) * block + 3  # wider than the blocks: the spare rows stay invisible
    cand = torch.tensor(cands, device=DEVICE)
    spans = fused_step_spans(first, causal, cand, block).to(DEVICE)
    m = spans.shape[0]
    q, k, v = qkv(m, 8, 2, 32, capacity + workspace, dtype, gen)
    hist = torch.tensor([first + causal], dtype=torch.int32, device=DEVICE)
    out = small_width_attention(q, k, v, None, hist, capacity=capacity, config=config, row_spans=spans)
    ref = small_width_attention_reference(q, k, v, None, hist, capacity=capacity, row_spans=spans)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err}"
    mask = fused_step_mask(capacity, workspace, first, causal, cand, block)
    with_mask = small_width_attention(q, k, v, mask, hist, capacity=capacity, config=config)
    assert torch.equal(out, with_mask)  # same visible set, same bits


def test_a_causal_row_computes_the_same_bits_alone_and_inside_a_fused_step():
    """An AR row (width 1) and the same row as causal row 0 of a wide fused step: identical."""
    gen = torch.Generator().manual_seed(3)
    capacity, first, block = 128, 70, 8
    cand = torch.arange(5, device=DEVICE)
    spans = fused_step_spans(first, 9, cand, block).to(DEVICE)
    q, k, v = qkv(spans.shape[0], 8, 2, 32, capacity + 48, torch.float16, gen)
    hist = torch.tensor([first + 9], dtype=torch.int32, device=DEVICE)
    wide = small_width_attention(q, k, v, None, hist, capacity=capacity, config=SPLIT, row_spans=spans)
    alone = small_width_attention(q[:1].contiguous(), k[:, :capacity + 1], v[:, :capacity + 1], None,
                                  torch.tensor([first + 1], dtype=torch.int32, device=DEVICE),
                                  capacity=capacity, config=SPLIT, row_spans=spans[:1].contiguous())
    assert torch.equal(wide[:1], alone)


def test_step_spans_describe_the_step_masks():
    cap, ws = 40, 20
    assert torch.equal(spans_to_mask(history_step_spans(17, 6), cap, cap + ws), history_step_mask(cap, ws, 17, 6))
    for k in (1, 3):
        assert torch.equal(spans_to_mask(draft_in_place_spans(12, k, 5), cap, cap + ws),
                           draft_in_place_mask(cap, ws, 12, k, 5))
    spans = fused_step_spans(9, 4, torch.tensor([0, 3]), 4)
    assert torch.equal(row_spans_mask(spans, cap, cap + ws), spans_to_mask(spans, cap, cap + ws))


def test_bad_visibility_arguments_are_named():
    gen = torch.Generator().manual_seed(0)
    q, k, v = qkv(2, 4, 2, 32, 20, torch.float32, gen)
    hist = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="exactly one of allowed_mask"):
        small_width_attention(q, k, v, None, hist, capacity=16)
    with pytest.raises(ValueError, match="row_spans must be a contiguous int32"):
        small_width_attention(q, k, v, None, hist, capacity=16, row_spans=torch.zeros(2, 3, dtype=torch.long))


def test_length_affine_spans_and_slots_match_their_builders():
    """The graph backend evaluates a step's spans and write slots as base + length * coef in
    one launch (``masks.LengthAffine``): at any length they must be what the builders give."""
    from bitmtp_edge.runtime.masks import LengthAffine

    gen = torch.Generator().manual_seed(5)
    builders = [lambda n: history_step_spans(n, 1), lambda n: history_step_spans(n - 9, 9),
                lambda n: draft_in_place_spans(n - 3, 3, 8),
                lambda n: torch.cat([n + torch.arange(2), 300 + torch.arange(8)])]
    for build in builders:
        moving = LengthAffine.of(build, DEVICE)
        for n in torch.randint(9, 5000, (6,), generator=gen).tolist():
            length = torch.tensor([n], dtype=moving.base.dtype, device=DEVICE)
            assert torch.equal(moving.at(length).cpu(), build(n).to(moving.base.dtype))
    with pytest.raises(ValueError, match="linearly"):
        LengthAffine.of(lambda n: torch.tensor([n * n]))

