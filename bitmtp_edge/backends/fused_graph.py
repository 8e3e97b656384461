"""The fused verify + draft step as a replayable graph body (``runtime/masks.fused_step_mask``).

One layout per candidate count c, D causal rows then c blocks of D (width D + c·D):

* **after a fused hit**: ``[v, e_1..e_{D-1}]``, the tokens the last fused graph left in
  ``causal``: v pending at slot L, its D − 1 drafts after it;
* **after a draft step**: ``[anchor, d_1..d_{D-1}]``, staged in ``causal`` by the backend
  (``GraphBackend._reopen_anchor``): the anchor, which the draft step materialised, pending
  again at its own slot, and the first D − 1 of its D drafts. Verifying d_D too would take
  D + 1 causal rows, one row past the hit's width (17 at D = 8, c = 1: past a 16-row tile).

(The kernels and their twins also take the anchor as history, ``pending`` = 0 with D + 1
causal rows, the layout a fused step after a draft step had before; tested, not replayed.)

Everything happens on the device: the candidate set C (``decoding_rules.candidate_lengths``
of the drafts' confidences), the rows' tokens, positions, slots and attention spans, the
accepted count a and the verifier token v, whether a ∈ C, the drafts after v (rows 1..D−1
of block a), and the next step's inputs: ``causal``/``conf`` for a fused hit, the draft
graph's pending slot for a miss. One ``readback`` holds what the host needs, read once per
iteration. Around the forward and the head this is three kernels on the Triton ops
(``fused_kernels.py``: prepare, accept, chain) and their torch twins below on the twin ops:
captured, each small torch op would be a kernel node of its own.

**One head pass.** The verify rows need the 16-bit verify head, so the step runs that head
once on them *and* on rows 1..D−1 of every candidate block (``FusedInputs.head_rows``), and
takes the next drafts and their confidences from it: one read of the 16-bit head instead of
that read plus one of the int8 draft head (the draft step, which reads no verify head, keeps
the cheap head). The next drafts are then the verify head's argmax on those rows on every
backend (the reference backend's fused step too), and the output is AR's either way. With the
certified head (``FastModel.fused_head``) the pass reads the int8 head instead: the verify rows'
tokens are still the 16-bit head's, the next drafts the int8 logits' argmax (as a draft step's).
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
    # (n, c) -> the step rows the head reads: the n causal ones, then rows 1..D-1 of each of the
    # c blocks (row 0 duplicates a causal row); constants, made here, outside any capture
    head_rows: dict[tuple[int, int], torch.Tensor]

    @classmethod
    def allocate(cls, block_size: int, device) -> "FusedInputs":
        d = block_size
        head_rows = {(d, c): torch.tensor(head_row_list(d, c, d), dtype=torch.long, device=device)
                     for c in range(1, d + 1)}
        return cls(causal=torch.zeros(d, dtype=torch.long, device=device),
                   conf=torch.zeros(max(d - 1, 0), dtype=torch.float32, device=device),
                   readback=torch.zeros(3 + (d + 1) + 2 * (d - 1) + 2 * d, dtype=torch.float64, device=device),
                   head_rows=head_rows)

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


def head_row_list(causal: int, blocks: int, block_size: int) -> list[int]:
    """The fused step's rows the head reads: the causal rows, then rows 1..D−1 of each block."""
    return list(range(causal)) + [causal + b * block_size + i for b in range(blocks) for i in range(1, block_size)]


def fused_width(block_size: int, causal: int, count: int) -> int:
    """The width of a fused step: its causal rows plus min(c, m + 1) blocks of D."""
    return causal + min(count, causal) * block_size


def fused_body(fast, k_cache, v_cache, capacity: int, history_len: torch.Tensor, attn_rows: torch.Tensor,
               mask_id: int, io: FusedInputs, count: int, pending_out: torch.Tensor, calibration=None) -> None:
    """One fused step over ``io.causal`` = the causal rows [anchor, d_1..d_{D-1}] (D rows, the
    anchor pending at slot L; drafts clamped, as staged) with the drafts' confidences ``io.conf``.
    Reads and writes static tensors only. The bookkeeping runs as three kernels
    (``fused_kernels.py``) on the Triton ops, as their torch twins below on the twin ops.
    ``calibration`` (``runtime.calibration``): maps the next drafts' confidences (slots 1..D-1
    of a's block) as the draft step's are mapped."""
    tokens, confidences = io.causal, io.conf
    n = d = tokens.shape[0]
    pending = 1
    sl = FusedInputs.slices(d)
    kernels = not fast.ops.twin
    if kernels:
        from . import fused_kernels as fk
    prepare = fk.fused_prepare if kernels else fused_prepare_reference
    chosen, step_tokens, positions, slots, spans, rows_limit = prepare(
        history_len, tokens, confidences, mask_id, capacity, count, d, pending)
    attn_rows.copy_(rows_limit)  # history slots past the last causal row are skipped
    x = fast.forward(step_tokens, positions, k_cache, v_cache, slots, None, attn_rows, capacity=capacity,
                     row_spans=spans)
    c = chosen.shape[0]
    rows = x[io.head_rows[(n, c)]]  # the causal rows, then every block's rows 1..D-1 (one gather launch)
    top, conf = fast.fused_head(rows, n, tokens[1:])  # verify rows: the AR greedy token of each; the rest: drafts
    wanted = torch.empty(d - 1, dtype=torch.long, device=x.device)
    accept = fk.fused_accept if kernels else fused_accept_reference
    accept(x, top[:n], conf[:n], tokens, chosen, tokens[1:], confidences, history_len, io.readback, wanted, io.causal,
           pending_out, d, pending, sl)
    next_conf = conf[n:]
    if calibration is not None:  # rows 1..D-1 of each block: slots 1..D-1
        next_conf = calibration(next_conf.view(c, d - 1), 1).view(-1)
    chain = fk.fused_chain if kernels else fused_chain_reference
    chain(rows[n:], top[n:], next_conf, wanted, io.readback, io.causal, io.conf, sl)


# --- the pure-PyTorch twins of fused_kernels.py ------------------------------------------------

def fused_prepare_reference(history_len, tokens, confidences, mask_id: int, capacity: int, count: int, block: int,
                            pending: int):
    """-> (C [c] ascending, step tokens [W], positions [W], KV slots [W] int64, row spans
    [W, 3] int32, attention row limit [1] int32), W = n + c·D. Rows: the n causal ones
    ([anchor, d_1..d_m], at their own slots from ``first`` = L − 1 + pending), then per
    j ∈ C the block [d_j, MASK × (D − 1)] at positions A + j.. in workspace rows b·D..
    (``masks.fused_step_spans``)."""
    n, d, dev = tokens.shape[0], block, tokens.device
    first = history_len - 1 + pending  # [1]: the anchor's slot
    chosen = candidate_lengths(confidences, count)  # [c] ascending
    c = chosen.shape[0]
    rows = torch.arange(n + c * d, device=dev)
    heads = tokens.gather(0, chosen)  # d_j (the anchor for j = 0)
    masks = torch.full((c, d - 1), mask_id, dtype=torch.long, device=dev)
    step_tokens = torch.cat([tokens, torch.cat([heads.unsqueeze(1), masks], dim=1).reshape(-1)])
    in_block = rows[:d].repeat(c)  # 0..D-1 per block
    block_pos = first + chosen.unsqueeze(1).expand(c, d).reshape(-1) + in_block
    positions = torch.cat([first + rows[:n], block_pos])
    slots = torch.cat([first + rows[:n], capacity + rows[:c * d]])
    spans = fused_step_spans(first, n, chosen, d)
    return chosen, step_tokens, positions, slots, spans, (first + n).to(torch.int32)


def fused_accept_reference(x, greedy, gconf, tokens, chosen, drafts, confidences, history_len, readback, wanted,
                           causal, pending_out, block: int, pending: int, slices: dict) -> None:
    """After the head: a, v, a ∈ C, a's block among the head's draft rows (``wanted``: rows
    1..D-1 of each block, block after block), L += pending + a, the readback's first part; v
    into the next step's inputs (a fused hit's causal[0], a draft step's pending[0])."""
    n, d, m = tokens.shape[0], block, tokens.shape[0] - 1
    c = chosen.shape[0]
    greedy = flag_non_finite(x[:n], greedy, gconf)
    match = (tokens[1:] == greedy[:-1]).long()
    accepted = match.cumprod(0).sum().view(1)
    verifier = greedy.gather(0, accepted)
    hit_at = chosen == accepted
    hit = hit_at.any().view(1)
    block_index = hit_at.long().argmax()  # a's block (block 0 on a miss: computed, never read)
    wanted.copy_(block_index * (d - 1) + torch.arange(d - 1, device=x.device))
    history_len += pending + accepted  # the pending anchor and d_1..d_a, all at their slots
    rb = readback
    rb[slices["held_tokens"]][:m].copy_(drafts)
    rb[slices["held_conf"]][:m].copy_(confidences.float())
    rb[slices["accepted"]].copy_(accepted)
    rb[slices["verifier"]].copy_(verifier)
    rb[slices["hit"]].copy_(hit)
    rb[slices["candidates"]].fill_(-1)
    rb[slices["candidates"]][:c].copy_(chosen)
    causal[:1].copy_(verifier.clamp_min(0))  # a flagged row must not index the embedding
    pending_out.copy_(verifier.clamp_min(0))  # a miss drafts next from pending [v]


def fused_chain_reference(rows, top, conf, wanted, readback, causal, next_conf, slices: dict) -> None:
    """The next drafts (rows ``wanted`` of the blocks' draft rows and of the head on them),
    flagged, and their confidences into the readback and the next fused step's inputs."""
    rows, top, conf = rows.index_select(0, wanted), top.index_select(0, wanted), conf.index_select(0, wanted)
    top = flag_non_finite(rows, top, conf)
    readback[slices["next_tokens"]].copy_(top)
    readback[slices["next_conf"]].copy_(conf)
    causal[1:].copy_(top.clamp_min(0))
    next_conf.copy_(conf)
