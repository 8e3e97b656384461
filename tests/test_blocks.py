"""The SDLM training layout (tools.blocks): mask, positions and targets, element by element."""

from __future__ import annotations

import pytest
import torch

from tools.blocks import IGNORE, BlockLayout, block_mask, block_mask_reference, build_rows, sample_anchors

MASK, EOS = 1, 0


def _window(layout: BlockLayout, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 50, (batch, layout.window), generator=g)


@pytest.mark.parametrize("clean_len,block_size,num_blocks", [(12, 4, 3), (9, 2, 5), (16, 8, 2), (7, 3, 7)])
def test_block_mask_matches_brute_force_reference(clean_len, block_size, num_blocks):
    layout = BlockLayout(clean_len, block_size, num_blocks)
    anchors = sample_anchors(layout, 3, torch.Generator().manual_seed(clean_len))
    mask = block_mask(anchors, layout)
    assert mask.shape == (3, layout.seq_len, layout.seq_len) and mask.dtype == torch.bool
    for b in range(3):
        ref = torch.tensor(block_mask_reference(anchors[b].tolist(), layout))
        assert torch.equal(mask[b], ref), f"row {b}, anchors {anchors[b].tolist()}"


def test_clean_rows_never_see_blocks_and_blocks_see_exactly_prefix_plus_own_block():
    layout = BlockLayout(10, 4, 3)
    anchors = torch.tensor([[0, 4, 9]])
    mask = block_mask(anchors, layout)[0]
    L, D = 10, 4
    assert not mask[:L, L:].any(), "a clean row attends a block"
    assert torch.equal(mask[:L, :L], torch.ones(L, L, dtype=torch.bool).tril())
    for b, p in enumerate(anchors[0].tolist()):
        rows = slice(L + b * D, L + (b + 1) * D)
        seen_clean = mask[rows, :L]
        assert torch.equal(seen_clean, (torch.arange(L) < p).expand(D, L)), "block must see clean x_0..x_{p-1} only"
        assert not seen_clean[:, p].any(), "a block sees the clean copy of its own anchor"
        own = torch.zeros(layout.seq_len, dtype=torch.bool)
        own[rows] = True
        assert torch.equal(mask[rows, L:], own[L:].expand(D, -1)), "block rows: own block (bidirectional), no other"
    assert mask.any(-1).all(), "every row must attend somewhere (else SDPA yields NaN)"


def test_rows_positions_targets_follow_sdlm_layout():
    layout = BlockLayout(8, 4, 2)
    window = torch.arange(100, 100 + layout.window).unsqueeze(0)
    anchors = torch.tensor([[2, 7]])
    ids, pos, tgt, mask = build_rows(window, anchors, layout, MASK, eos_token_id=None)
    L = 8
    assert ids[0, :L].tolist() == list(range(100, 108))
    assert tgt[0, :L].tolist() == list(range(101, 109))
    assert pos[0, :L].tolist() == list(range(L))
    # block anchored at p: [x_p, m, m, m] at positions p..p+3, slot j predicts x_{p+j+1}
    for b, p in enumerate([2, 7]):
        sl = slice(L + 4 * b, L + 4 * b + 4)
        assert ids[0, sl].tolist() == [100 + p, MASK, MASK, MASK]
        assert pos[0, sl].tolist() == [p, p + 1, p + 2, p + 3]
        assert tgt[0, sl].tolist() == [100 + p + 1 + j for j in range(4)]
    assert mask.shape == (1, layout.seq_len, layout.seq_len)


def test_block_targets_after_eos_are_ignored():
    layout = BlockLayout(8, 4, 1)
    window = torch.tensor([[5, 6, 7, EOS, 9, 10, 11, 12, 13, 14, 15, 16]])
    ids, pos, tgt, _ = build_rows(window, torch.tensor([[1]]), layout, MASK, eos_token_id=EOS)
    # anchor x_1=6: targets x_2=7, x_3=EOS (scored), then x_4, x_5 ignored
    assert tgt[0, 8:].tolist() == [7, EOS, IGNORE, IGNORE]


def test_anchors_are_distinct_sorted_and_in_range():
    layout = BlockLayout(20, 4, 10)
    a = sample_anchors(layout, 5, torch.Generator().manual_seed(3))
    assert a.shape == (5, 10)
    for row in a.tolist():
        assert row == sorted(set(row)) and 0 <= row[0] and row[-1] < 20


def test_no_blocks_is_plain_causal():
    layout = BlockLayout(6)
    window = _window(layout, batch=2)
    ids, pos, tgt, mask = build_rows(window, sample_anchors(layout, 2, torch.Generator()), layout, MASK, EOS)
    assert ids.shape == (2, 6) and torch.equal(tgt, window[:, 1:7])
    assert torch.equal(mask[0], torch.ones(6, 6, dtype=torch.bool).tril())
