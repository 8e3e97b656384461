"""The SDLM training layout: a clean causal stream with D-token mask blocks appended after it.

One training row of a BitMTP model (docs/decoding.md §Block drafting and §Training) is::

    clean x_0 .. x_{L-1}  ++  block_1  ++ … ++  block_K        (S = L + K·D tokens)
    block_b = [x_p, m, m, …, m]   anchored at clean index p = anchors[b]

* **positions**: clean token i sits at i; slot j of a block anchored at p sits at p + j, so
  slot 0 repeats the anchor token at the anchor's own position.
* **targets**: clean token i predicts x_{i+1}; block slot j predicts x_{p+j+1}. A block
  slot whose target lies after an ``<|endoftext|>`` inside the same block is ignored
  (``IGNORE``): decoding drops whatever follows a stop token, so nothing learns to draft past one.
* **visibility** (True = the query row may attend the key column):

  - clean row q sees clean columns kv <= q and never a block, so the clean stream is
    exactly the AR-causal pass the verifier runs;
  - a row of the block anchored at p sees the clean columns kv < p (the prefix *before* its
    anchor: the anchor's own clean row is hidden because slot 0 carries x_p) and every row
    of its own block, bidirectionally; never another block.

The window of tokens a row is cut from holds L + D tokens, so every anchor p in [0, L)
has all D targets x_{p+1} .. x_{p+D}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass(frozen=True)
class BlockLayout:
    """Shape of one training row: ``clean_len`` clean tokens + ``num_blocks`` blocks of ``block_size``."""

    clean_len: int
    block_size: int = 0
    num_blocks: int = 0

    def __post_init__(self) -> None:
        if self.clean_len < 2:
            raise ValueError(f"clean_len must be at least 2, got {self.clean_len}")
        if self.num_blocks and not 2 <= self.block_size <= 16:
            raise ValueError(f"block_size must be in 2..16 when blocks are used, got {self.block_size}")
        if self.num_blocks > self.clean_len:
            raise ValueError(f"{self.num_blocks} blocks need distinct anchors among {self.clean_len} clean tokens")

    @property
    def has_blocks(self) -> bool:
        return self.num_blocks > 0

    @property
    def window(self) -> int:
        """Tokens read from the corpus per row: L inputs plus the D (at least 1) tokens after them."""
        return self.clean_len + max(self.block_size if self.has_blocks else 0, 1)

    @property
    def seq_len(self) -> int:
        return self.clean_len + self.num_blocks * self.block_size


def sample_anchors(layout: BlockLayout, batch: int, generator: torch.Generator) -> torch.Tensor:
    """[B, K] int64 sorted anchors, drawn uniformly without replacement from [0, L) per row."""
    if not layout.has_blocks:
        return torch.empty(batch, 0, dtype=torch.long)
    keys = torch.rand(batch, layout.clean_len, generator=generator)
    return keys.topk(layout.num_blocks, dim=1).indices.sort(dim=1).values


def build_rows(window: torch.Tensor, anchors: torch.Tensor, layout: BlockLayout, mask_token_id: int,
               eos_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay out a batch of training rows.

    window [B, W] int64 corpus tokens (W = layout.window); anchors [B, K] int64.
    Returns input_ids [B, S], positions [B, S], targets [B, S] (``IGNORE`` where unscored)
    and the visibility mask [B, S, S] bool.
    """
    b, w = window.shape
    L, D, K = layout.clean_len, layout.block_size, layout.num_blocks
    if w != layout.window:
        raise ValueError(f"window has {w} tokens per row, the layout needs {layout.window}")
    dev = window.device
    clean_ids = window[:, :L]
    clean_pos = torch.arange(L, device=dev).expand(b, L)
    clean_tgt = window[:, 1:L + 1]
    if not K:
        return clean_ids, clean_pos, clean_tgt, clean_mask(L, dev).expand(b, L, L)
    slot = torch.arange(D, device=dev)
    blk_pos = (anchors.unsqueeze(-1) + slot).reshape(b, K * D)  # p + j
    blk_ids = torch.full((b, K, D), mask_token_id, dtype=window.dtype, device=dev)
    blk_ids[:, :, 0] = window.gather(1, anchors)
    tgt_idx = anchors.unsqueeze(-1) + slot + 1  # [B, K, D]: x_{p+j+1}
    blk_tgt = window.gather(1, tgt_idx.reshape(b, K * D)).view(b, K, D)
    if eos_token_id is not None:
        # Slot j is unscored when one of its block's earlier targets (slots < j) was EOS.
        after_eos = (blk_tgt == eos_token_id).long().cumsum(-1) - (blk_tgt == eos_token_id).long() > 0
        blk_tgt = blk_tgt.masked_fill(after_eos, IGNORE)
    ids = torch.cat([clean_ids, blk_ids.view(b, K * D)], dim=1)
    pos = torch.cat([clean_pos, blk_pos], dim=1)
    tgt = torch.cat([clean_tgt, blk_tgt.view(b, K * D)], dim=1)
    return ids, pos, tgt, block_mask(anchors, layout)


def clean_mask(clean_len: int, device=None) -> torch.Tensor:
    """[1, L, L] bool: plain causal."""
    return torch.ones(clean_len, clean_len, dtype=torch.bool, device=device).tril().unsqueeze(0)


def block_mask(anchors: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """anchors [B, K] -> [B, S, S] bool visibility of the SDLM layout (module docstring)."""
    b = anchors.shape[0]
    L, D, K = layout.clean_len, layout.block_size, layout.num_blocks
    S = layout.seq_len
    dev = anchors.device
    idx = torch.arange(S, device=dev)
    is_blk = idx >= L  # [S]
    blk_id = torch.where(is_blk, (idx - L) // max(D, 1), -1)  # [S]
    # Per row: the anchor a block row hangs from; clean rows get +inf-like L (unused).
    row_anchor = torch.full((b, S), L, dtype=torch.long, device=dev)
    if K:
        row_anchor[:, L:] = anchors.repeat_interleave(D, dim=1)
    q, kv = idx.view(S, 1), idx.view(1, S)
    clean_q, clean_kv = ~is_blk.view(S, 1), ~is_blk.view(1, S)
    clean_part = (clean_q & clean_kv & (kv <= q)).unsqueeze(0)  # [1, S, S]
    own_block = (is_blk.view(S, 1) & is_blk.view(1, S) & (blk_id.view(S, 1) == blk_id.view(1, S))).unsqueeze(0)
    prefix = (~clean_q).unsqueeze(0) & clean_kv.unsqueeze(0) & (kv.unsqueeze(0) < row_anchor.unsqueeze(-1))
    return clean_part | own_block | prefix


def block_mask_reference(anchors: list[int], layout: BlockLayout) -> list[list[bool]]:
    """The same mask written out one element at a time (the test oracle)."""
    L, D = layout.clean_len, layout.block_size
    S = layout.seq_len

    def block_of(i: int) -> int | None:
        return None if i < L else (i - L) // D

    mask = [[False] * S for _ in range(S)]
    for q in range(S):
        for kv in range(S):
            bq, bkv = block_of(q), block_of(kv)
            if bq is None:
                mask[q][kv] = bkv is None and kv <= q
            elif bkv is None:
                mask[q][kv] = kv < anchors[bq]
            else:
                mask[q][kv] = bkv == bq
    return mask
