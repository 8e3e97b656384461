"""int8_head_argmax and f16_head_argmax against their twins (which write the logits).

The int8 head's logits equal the twin's bit for bit, so top-1 must be identical and ties
resolve to the lowest index; confidence differs only by the float32 order of the
exp-sum (rtol 1e-5). The 16-bit head sums in float32 in tile order, so top-1 may differ
from the twin only at a near-tie: then the kernel's pick must be within 1e-5 (relative)
of the twin's maximum logit.
"""

import pytest
import torch

pytest.importorskip("triton")  # the interpreter is set up by tests/__init__.py without CUDA

from kernels_ampere.numerics import (  # noqa: E402
    pack_int4_rows,
    quantize_activations,
    quantize_rows_int4,
    quantize_rows_int8,
    unpack_int4_rows,
)
from tests.helpers import DEVICE, needs_gpu  # noqa: E402
from kernels_ampere.heads import (  # noqa: E402
    f16_head_argmax,
    f16_head_argmax_reference,
    f16_head_logits_reference,
    int4_head_argmax,
    int4_head_argmax_reference,
    int4_head_logits_reference,
    int8_head_argmax,
    int8_head_argmax_reference,
)
from kernels_ampere.tuning import HeadConfig  # noqa: E402

SMALL = HeadConfig(block_v=32, block_h=64, num_warps=4, num_stages=2)
WIDTH_VH = [(1, 1000, 256), (2, 777, 384), (3, 300, 128), (5, 513, 200), (9, 777, 128), (17, 300, 384)]


def int8_head(m, v, h, gen):
    w_int8, w_scale = quantize_rows_int8(torch.randn(v, h, generator=gen))
    h_int8, h_scale = quantize_activations(torch.randn(m, h, generator=gen) * 2)
    return [t.to(DEVICE) for t in (h_int8, h_scale, w_int8, w_scale)]


@pytest.mark.parametrize("m,v,h", WIDTH_VH)
@pytest.mark.parametrize("config", [SMALL, None], ids=["small_tiles", "default"])
def test_int8_head_matches_twin(m, v, h, config):
    args = int8_head(m, v, h, torch.Generator().manual_seed(m * v + h))
    top1, conf = int8_head_argmax(*args, config=config)
    top1_ref, conf_ref = int8_head_argmax_reference(*args)
    assert top1.dtype == torch.int64 and conf.dtype == torch.float32
    assert torch.equal(top1, top1_ref)
    torch.testing.assert_close(conf, conf_ref, rtol=1e-5, atol=0)


def test_int8_head_ties_pick_the_lowest_index_across_and_within_tiles():
    h = torch.ones(2, 128, dtype=torch.int8, device=DEVICE)
    h_scale = torch.ones(2, device=DEVICE)
    w = torch.zeros(300, 128, dtype=torch.int8)
    w[[40, 45, 100, 250]] = 1  # 40 and 45 share a 32-row tile; 100, 250 sit in later tiles
    w, w_scale = w.to(DEVICE), torch.ones(300, device=DEVICE)
    top1, conf = int8_head_argmax(h, h_scale, w, w_scale, config=SMALL)
    top1_ref, conf_ref = int8_head_argmax_reference(h, h_scale, w, w_scale)
    assert top1.tolist() == [40, 40] == top1_ref.tolist()
    torch.testing.assert_close(conf, conf_ref, rtol=1e-5, atol=0)


def test_int8_head_combines_partials_over_several_combine_steps():
    """63 partials folded 8 at a time: the running max / argmax / sum crosses steps."""
    args = int8_head(3, 1000, 64, torch.Generator().manual_seed(8))
    cfg = HeadConfig(block_v=16, block_h=64, num_warps=2, num_stages=1, combine_block=8)
    top1, conf = int8_head_argmax(*args, config=cfg)
    top1_ref, conf_ref = int8_head_argmax_reference(*args)
    assert torch.equal(top1, top1_ref)
    torch.testing.assert_close(conf, conf_ref, rtol=1e-5, atol=0)


def int4_head(m, v, h, gen):
    w_packed, w_scale = quantize_rows_int4(torch.randn(v, h, generator=gen))
    h_int8, h_scale = quantize_activations(torch.randn(m, h, generator=gen) * 2)
    return [t.to(DEVICE) for t in (h_int8, h_scale, w_packed, w_scale)]


@pytest.mark.parametrize("m,v,h", WIDTH_VH + [(4, 300, 201), (2, 129, 63)])  # odd H: a half-filled last byte
@pytest.mark.parametrize("config", [SMALL, None], ids=["small_tiles", "default"])
def test_int4_head_matches_twin(m, v, h, config):
    args = int4_head(m, v, h, torch.Generator().manual_seed(m * v + h + 1))
    top1, conf = int4_head_argmax(*args, config=config)
    top1_ref, conf_ref = int4_head_argmax_reference(*args)
    assert torch.equal(top1, top1_ref)
    torch.testing.assert_close(conf, conf_ref, rtol=1e-5, atol=0)


def test_int4_head_decodes_every_code_in_both_nibbles():
    """Each of the 15 codes (and -8, which the quantiser never writes but the layout holds) in
    the low and in the high half of a row: one-hot activations read single weights back, so a
    wrong shift, sign or half gives a different argmax."""
    h = 40
    codes = torch.zeros(16, h, dtype=torch.int8)
    for k in range(16):
        codes[k, 3] = k - 8  # low nibble of byte 3
        codes[k, 20 + 5] = 7 - k  # high nibble of byte 5 (H / 2 = 20)
    w = pack_int4_rows(codes).to(DEVICE)
    scale = torch.ones(16, device=DEVICE)
    for col, best in ((3, 15), (25, 0)):
        x = torch.zeros(1, h, dtype=torch.int8)
        x[0, col] = 1
        top1, conf = int4_head_argmax(x.to(DEVICE), torch.ones(1, device=DEVICE), w, scale, config=SMALL)
        logits = int4_head_logits_reference(x.to(DEVICE), torch.ones(1, device=DEVICE), w, scale)
        assert logits[0].tolist() == codes[:, col].float().tolist()
        assert top1.tolist() == [best]
        torch.testing.assert_close(conf, torch.softmax(logits, -1).amax(-1), rtol=1e-5, atol=0)


def test_int4_clip_search_never_does_worse_than_absmax():
    """Each row's chosen clip ratio leaves no more squared error than the plain absmax scale
    (ratio 1.0 is a candidate), and heavy-tailed rows take a ratio below 1."""
    from kernels_ampere.numerics import INT4_CLIP_RATIOS, INT4_QMAX

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=gen)
    w[::2, 0] *= 12  # one outlier in every other row
    packed, scale = quantize_rows_int4(w)
    err = (unpack_int4_rows(packed, 256).double() * scale.double()[:, None] - w.double()).pow(2).sum(-1)
    s1 = w.abs().amax(-1) / INT4_QMAX
    q1 = torch.round(w / s1[:, None]).clamp(-7, 7)
    err1 = (q1.double() * s1.double()[:, None] - w.double()).pow(2).sum(-1)
    assert INT4_CLIP_RATIOS[0] == 1.0
    assert torch.all(err <= err1)
    assert torch.all(scale[::2] < s1[::2])


def test_int4_rows_round_trip_and_reject_a_wrong_width():
    codes = torch.randint(-8, 8, (7, 33), dtype=torch.int8)
    packed = pack_int4_rows(codes)
    assert packed.shape == (7, 17) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4_rows(packed, 33), codes)
    with pytest.raises(ValueError, match="uint8 for H = 32"):
        unpack_int4_rows(packed, 32)
    with pytest.raises(ValueError, match="packed int4"):
        int4_head_argmax(torch.zeros(1, 33, dtype=torch.int8, device=DEVICE), torch.ones(1, device=DEVICE),
                         torch.zeros(7, 33, dtype=torch.uint8, device=DEVICE), torch.ones(7, device=DEVICE))


def assert_f16_top1(h, w, top1, top1_ref):
    logits = f16_head_logits_reference(h, w)
    best = logits.gather(1, top1_ref[:, None]).squeeze(1)
    picked = logits.gather(1, top1[:, None]).squeeze(1)
    near_tie = (best - picked).abs() <= 1e-5 * best.abs()
    assert torch.all((top1 == top1_ref) | near_tie), f"top1 {top1.tolist()} vs {top1_ref.tolist()}"


@pytest.mark.parametrize("m,v,h", WIDTH_VH)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_f16_head_matches_twin(m, v, h, dtype):
    gen = torch.Generator().manual_seed(m + v + h)
    hs = torch.randn(m, h, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(v, h, generator=gen) / h ** 0.5).to(dtype).to(DEVICE)
    top1, conf = f16_head_argmax(hs, w, config=SMALL)
    top1_ref, conf_ref = f16_head_argmax_reference(hs, w)
    assert_f16_top1(hs, w, top1, top1_ref)
    torch.testing.assert_close(conf, conf_ref, rtol=1e-4, atol=0)


def f16_rows_alone_and_together(m, v, h, dtype, config, seed):
    gen = torch.Generator().manual_seed(seed)
    hs = torch.randn(m, h, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(v, h, generator=gen) / h ** 0.5).to(dtype).to(DEVICE)
    together = f16_head_argmax(hs, w, config=config)
    alone = [f16_head_argmax(hs[i:i + 1], w, config=config) for i in range(m)]
    return together, [torch.cat(x) for x in zip(*alone)]


@pytest.mark.parametrize("m", [16, 17, 40, 64, 70])  # 1-4 row tiles in one program, and a second program
def test_f16_head_rows_are_the_same_alone_and_in_a_many_tile_program(m):
    """A fused step's head reads ~30 rows, its verify rows among them, in programs of several
    16-row tiles: each row's top-1 and confidence must be bit for bit those of the row alone
    (an AR step), whatever tile of whatever program it lands in."""
    (top1, conf), (top1_1, conf_1) = f16_rows_alone_and_together(m, 300, 128, torch.bfloat16, SMALL, seed=m)
    assert torch.equal(top1, top1_1)
    assert torch.equal(conf, conf_1)


def test_f16_head_rejects_mixed_dtypes():
    with pytest.raises(TypeError, match="must match"):
        f16_head_argmax(torch.randn(1, 64, device=DEVICE).half(), torch.randn(8, 64, device=DEVICE).bfloat16())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m", (30, 72))
def test_f16_head_rows_alone_and_together_on_gpu(m):
    """The 2B shape's 16-bit head, tuned launch: a fused step's rows (two and five row tiles)
    give every row the bits it gets alone."""
    (top1, conf), (top1_1, conf_1) = f16_rows_alone_and_together(m, 128256, 2560, torch.bfloat16, None, seed=m)
    assert torch.equal(top1, top1_1)
    assert torch.equal(conf, conf_1)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m", (1, 17))
def test_heads_full_vocabulary_on_gpu(m):
    v, h = 128256, 2560
    args = int8_head(m, v, h, torch.Generator().manual_seed(m))
    top1, conf = int8_head_argmax(*args)
    top1_ref, conf_ref = int8_head_argmax_reference(*args)
    assert torch.equal(top1, top1_ref)
    torch.testing.assert_close(conf, conf_ref, rtol=1e-5, atol=0)
    args = int4_head(m, v, h, torch.Generator().manual_seed(m + 2))
    top1, conf = int4_head_argmax(*args)
    top1_ref, conf_ref = int4_head_argmax_reference(*args)
    assert torch.equal(top1, top1_ref)
    torch.testing.assert_close(conf, conf_ref, rtol=1e-5, atol=0)
    gen = torch.Generator().manual_seed(m + 1)
    hs = torch.randn(m, h, generator=gen).bfloat16().to(DEVICE)
    w = (torch.randn(v, h, generator=gen) / h ** 0.5).bfloat16().to(DEVICE)
    top1, conf = f16_head_argmax(hs, w)
    top1_ref, conf_ref = f16_head_argmax_reference(hs, w)
    assert_f16_top1(hs, w, top1, top1_ref)
    torch.testing.assert_close(conf, conf_ref, rtol=1e-4, atol=0)
