"""The fused verify + draft step as a replayable graph body (``runtime/masks.fused_step_mask``).

Two variants per candidate count c, told apart by their causal rows n:

* **after a draft step** (n = D + 1): ``[anchor, d_1..d_D]`` from the draft graph's hoisted
  verifier inputs, the anchor recomputed at its own slot L − 1, as a verify does;
* **after a fused hit** (n = D): ``[v, e_1..e_{D-1}]``, the tokens the last fused graph left
  in ``causal``: v pending at slot L, its D − 1 drafts after it.

Everything happens on the device: the candidate set C (``decoding_rules.candidate_lengths``
of the drafts' confidences), the rows' tokens, positions, slots and attention spans, the
accepted count a and the verifier token v, whether a ∈ C, the cheap head on the D − 1 rows
of block a only (the drafts after v), and the next step's inputs: ``causal``/``conf`` for a
fused hit, the draft graph's pending slot for a miss. One ``readback`` holds what the host
needs, read once per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.decoding_rules import candidate_lengths
from ..runtime.masks import fused_step_spans
from .base import flag_non_finite


@dataclass
class FusedInputs:
    """The fused graphs' own static tensors (fixed addresses; allocated once)."""

    causal: torch.Tensor  # [D] int64: [v, e_1..e_{D-1}] left by the last fused graph
    conf: torch.Tensor  # [D - 1] float32: c(e_1)..c(e_{D-1})
    readback: torch.Tensor  # [3 + (D + 1) + 2 (D - 1) + 2 D] float64, layout in ``slices``
    rows: torch.Tensor  # [max width] int64: 0, 1, 2, ... (constant)

    @classmethod
    def allocate(cls, block_size: int, device) -> "FusedInputs":
        d = block_size
        return cls(causal=torch.zeros(d, dtype=torch.long, device=device),
                   conf=torch.zeros(max(d - 1, 0), dtype=torch.float32, device=device),
                   readback=torch.zeros(3 + (d + 1) + 2 * (d - 1) + 2 * d, dtype=torch.float64, device=device),
                   rows=torch.arange(d + 1 + (d + 1) * d, device=device))

    def mutable(self) -> list[torch.Tensor]:
        return [self.causal, self.conf, self.readback]

    @staticmethod
    def slices(block_size: int) -> dict[str, slice]:
        """readback: a, v, hit, C (D + 1, −1 past |C|), next drafts and confidences (D − 1 each),
        the drafts this step verified and their confidences (D each, as read by the graph)."""
        d, out, at = block_size, {}, 0
        for name, n in (("accepted", 1), ("verifier", 1), ("hit", 1), ("candidates", d + 1),
                        ("next_tokens", d - 1), ("next_conf", d - 1), ("held_tokens", d), ("held_conf", d)):
            out[name] = slice(at, at + n)
            at += n
        return out


def fused_width(block_size: int, causal: int, count: int) -> int:
    """The width of a fused step: its causal rows plus min(c, m + 1) blocks of D."""
    return causal + min(count, causal) * block_size


def fused_body(fast, k_cache, v_cache, capacity: int, history_len: torch.Tensor, attn_rows: torch.Tensor,
               tokens: torch.Tensor, confidences: torch.Tensor, drafts: torch.Tensor, mask_ids: torch.Tensor,
               io: FusedInputs, count: int, pending_out: torch.Tensor) -> None:
    """One fused step over ``tokens`` = the causal rows [anchor, d_1..d_m] (n = m + 1 rows) with
    the drafts' ``confidences`` [m]; n = D + 1 means the anchor is history (slot L − 1), n = D
    that it is pending (slot L). ``drafts`` [m]: d_1..d_m as the host should read them back
    (``NON_FINITE_TOKEN`` where a draft row was not finite; ``tokens`` hold them clamped).
    Reads and writes static tensors only."""
    n, d = tokens.shape[0], mask_ids.shape[0] + 1
    m = n - 1
    pending = 1 if n == d else 0
    first = history_len - 1 + pending  # [1]: the anchor's slot
    chosen = candidate_lengths(confidences, count)  # [c] ascending, on the device
    c = chosen.shape[0]
    rows = io.rows
    heads = tokens.gather(0, chosen)  # d_j (the anchor for j = 0)
    block_tokens = torch.cat([heads.unsqueeze(1), mask_ids.unsqueeze(0).expand(c, d - 1)], dim=1).reshape(-1)
    step_tokens = torch.cat([tokens, block_tokens])
    in_block = rows[:d].repeat(c)  # 0..D-1 per block
    block_pos = first + chosen.unsqueeze(1).expand(c, d).reshape(-1) + in_block
    positions = torch.cat([first + rows[:n], block_pos])
    slots = torch.cat([first + rows[:n], capacity + rows[:c * d]])
    spans = fused_step_spans(first, n, chosen, d)
    attn_rows.copy_(first + n)  # history slots past the last causal row are skipped
    x = fast.forward(step_tokens, positions, k_cache, v_cache, slots, None, attn_rows, capacity=capacity,
                     row_spans=spans)
    greedy, gconf = fast.verify_top1(x[:n])  # the verify rows: the AR greedy token of each
    greedy = flag_non_finite(x[:n], greedy, gconf)
    match = (tokens[1:] == greedy[:-1]).long()
    accepted = match.cumprod(0).sum().view(1)
    verifier = greedy.gather(0, accepted)
    hit_at = chosen == accepted
    hit = hit_at.any().view(1)
    block = hit_at.long().argmax()  # a's block (block 0 on a miss: computed, never read)
    wanted = n + block * d + 1 + rows[:d - 1]  # rows 1..D-1 of block a: the drafts after v
    rows_a = x.index_select(0, wanted)
    top, conf = fast.draft_top1(rows_a)
    top = flag_non_finite(rows_a, top, conf)
    history_len += pending + accepted  # the pending anchor and d_1..d_a, all at their slots
    # readback (one host read) and the next step's inputs
    sl = FusedInputs.slices(d)
    rb = io.readback
    rb[sl["held_tokens"]][:m].copy_(drafts)
    rb[sl["held_conf"]][:m].copy_(confidences)
    rb[sl["accepted"]].copy_(accepted)
    rb[sl["verifier"]].copy_(verifier)
    rb[sl["hit"]].copy_(hit)
    rb[sl["candidates"]].fill_(-1)
    rb[sl["candidates"]][:c].copy_(chosen)
    rb[sl["next_tokens"]].copy_(top)
    rb[sl["next_conf"]].copy_(conf)
    io.causal[:1].copy_(verifier.clamp_min(0))  # a flagged row must not index the embedding
    io.causal[1:].copy_(top.clamp_min(0))
    io.conf.copy_(conf)
    pending_out.copy_(verifier.clamp_min(0))  # a miss drafts next from pending [v]
