"""Visibility masks of one step over a segment buffer (True = the row may attend the slot).

The runtimes write every row whose KV may be kept **at its own absolute slot** (slot =
position): prefill, AR, the pending rows of a draft and the verifier's rows. A row at
position p then attends exactly slots 0..p of the history, in the same slots with the same
values whatever the step's width, so an AR step and a verify step compute every kept row
bit for bit alike (``history_step_mask``, ``draft_in_place_mask``). Only the draft block —
speculative rows at positions that overlap the anchor's — lives in the workspace.

``causal_step_mask`` / ``draft_step_mask`` below describe the same steps for a caller that
appends the step's rows after the history instead (the ONNX graphs: past + present).

Slots ``[0, capacity)`` are history (only ``[0, L)`` materialised), slots
``[capacity, capacity + workspace)`` are the step's own rows. The masks are built with
tensor comparisons only, so a captured graph can rebuild them from device tensors.

* **causal step** (AR, verify, the prefill tail): row i sees history [0, L) — minus one
  hidden slot, the verifier's repeated anchor — and workspace rows 0..i;
* **draft step** (docs/decoding.md §The draft step, SDLM layout): k pending rows then a block of D rows
  ``[anchor, mask, …]``. Pending row i sees history and pending rows 0..i; block rows see
  history, the pending rows except the *original* anchor (the last pending row: slot 0 of
  the block repeats it at the same position), and the whole block (bidirectional).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def _history_visible(capacity: int, slots: int, length, device, hidden_slot=None) -> torch.Tensor:
    s = torch.arange(slots, device=device)
    visible = s < length
    if hidden_slot is not None:
        visible = visible & (s != hidden_slot)
    return visible  # [slots]


def causal_step_mask(capacity: int, workspace: int, length, width: int, device=None,
                     hidden_slot=None) -> torch.Tensor:
    """[width, capacity + workspace] for rows written at workspace 0..width-1."""
    slots = capacity + workspace
    hist = _history_visible(capacity, slots, length, device, hidden_slot)
    s = torch.arange(slots, device=device)
    row = torch.arange(width, device=device).unsqueeze(1)
    ws = (s >= capacity) & (s - capacity <= row)
    return hist.unsqueeze(0) | ws


def draft_step_mask(capacity: int, workspace: int, length, pending: int, block: int,
                    device=None) -> torch.Tensor:
    """[pending + block, capacity + workspace]: causal pending rows, then the draft block."""
    slots = capacity + workspace
    width = pending + block
    hist = _history_visible(capacity, slots, length, device)
    s = torch.arange(slots, device=device)
    w = s - capacity  # workspace row index of each slot (negative for history)
    row = torch.arange(width, device=device).unsqueeze(1)
    in_ws = s >= capacity
    pending_rows = in_ws & (w <= row) & (row < pending)
    block_rows = (row >= pending) & in_ws & (
        (w < pending - 1) | ((w >= pending) & (w < width))
    )
    return hist.unsqueeze(0) | pending_rows | block_rows


def history_step_mask(capacity: int, workspace: int, first_position, width: int, device=None) -> torch.Tensor:
    """[width, capacity + workspace]: rows written at history slots first_position + i;
    row i sees history slots 0..first_position + i (``first_position`` may be a tensor)."""
    s = torch.arange(capacity + workspace, device=device)
    row = torch.arange(width, device=device).unsqueeze(1)
    return (s < capacity) & (s <= first_position + row)


def draft_in_place_mask(capacity: int, workspace: int, length, pending: int, block: int,
                        device=None) -> torch.Tensor:
    """[pending + block, capacity + workspace] for a draft step whose k pending rows are
    written at history slots L..L+k-1 and whose D block rows sit in workspace 0..D-1.

    Pending row i sees history 0..L+i; block rows see history 0..L+k-2 (everything but the
    original anchor at L+k-1: block slot 0 repeats it) and the whole block."""
    s = torch.arange(capacity + workspace, device=device)
    row = torch.arange(pending + block, device=device).unsqueeze(1)
    hist = s < capacity
    pending_rows = (row < pending) & hist & (s <= length + row)
    block_rows = (row >= pending) & ((hist & (s < length + pending - 1))
                                     | (~hist & (s - capacity < block)))
    return pending_rows | block_rows


def prefill_mask(slots: int, length, n: int, device=None) -> torch.Tensor:
    """[n, slots] for rows written straight into history at L..L+n-1: plain causal."""
    s = torch.arange(slots, device=device)
    row = torch.arange(n, device=device).unsqueeze(1)
    return s.unsqueeze(0) <= (length + row)


# --- row spans: the same visibility as three integers per row ------------------------------

def spans_to_mask(spans: torch.Tensor, capacity: int, slots: int) -> torch.Tensor:
    """[M, 3] int row spans -> [M, slots] bool mask.

    Every step mask of this module is, per row, "history slots below a limit plus one
    contiguous run of workspace rows": ``spans[m] = (history_end, workspace_begin,
    workspace_end)`` means row m sees history slots ``[0, history_end)`` and workspace rows
    ``[workspace_begin, workspace_end)`` (slots ``capacity + w``). The attention kernel
    takes the spans themselves, so no [M, S] mask is built or read on the device."""
    s = torch.arange(slots, device=spans.device)
    w = s - capacity
    hist_end, ws_begin, ws_end = (spans[:, i:i + 1] for i in range(3))
    return ((s < capacity) & (s < hist_end)) | ((s >= capacity) & (w >= ws_begin) & (w < ws_end))


def _int32(value, device) -> torch.Tensor:
    return torch.as_tensor(value, device=device).reshape(-1)[:1].to(torch.int32)


def history_step_spans(first_position, width: int, device=None) -> torch.Tensor:
    """[width, 3] spans of ``history_step_mask``: row i sees history slots 0..first + i."""
    first = _int32(first_position, device)
    row = torch.arange(width, device=first.device, dtype=torch.int32)
    zero = torch.zeros_like(row)
    return torch.stack([first + row + 1, zero, zero], dim=1)


def draft_in_place_spans(length, pending: int, block: int, device=None) -> torch.Tensor:
    """[pending + block, 3] spans of ``draft_in_place_mask``."""
    length = _int32(length, device)
    rows = history_step_spans(length, pending)
    ones = torch.ones(block, device=length.device, dtype=torch.int32)
    block_rows = torch.stack([(length + pending - 1) * ones, 0 * ones, block * ones], dim=1)
    return torch.cat([rows, block_rows])


def fused_step_spans(first, causal: int, candidates: torch.Tensor, block: int, anchor_row: int = 0) -> torch.Tensor:
    """[causal + c·block, 3] int32 row spans of a fused verify + draft step (see
    ``fused_step_mask``); ``first`` (int or [1] tensor) is the first causal row's slot,
    ``anchor_row`` the anchor's index among the causal rows and ``candidates`` [c] the
    acceptance lengths j whose draft blocks the step carries."""
    device = candidates.device
    first = _int32(first, device)
    c = candidates.shape[0]
    causal_spans = history_step_spans(first, causal)
    b = torch.arange(c * block, device=device, dtype=torch.int32) // block  # block index of each row
    block_spans = torch.stack([first + anchor_row + candidates.to(torch.int32)[b], b * block, (b + 1) * block], dim=1)
    return torch.cat([causal_spans, block_spans])


def fused_step_mask(capacity: int, workspace: int, first, causal: int, candidates: torch.Tensor,
                    block: int, anchor_row: int = 0) -> torch.Tensor:
    """[causal + c·D, capacity + workspace] for one fused verify + draft step.

    Rows, positions and slots (L = materialised history; ``first`` = L when the pending
    tokens p_1..p_k are not materialised yet, L − 1 when k = 0 and the anchor, the last
    history token, is recomputed at its own slot as in a verify; A = first + anchor_row is
    the anchor's slot)::

        causal rows   tokens     [p_1..p_k = anchor, d_1..d_m]  AR-causal, each written at its
                      slots      first .. first+n-1              own history slot (= position)
        block b of j  tokens     [d_j (the anchor if j = 0), MASK x (D-1)]   for each j in C
                      positions  A+j .. A+j+D-1, written in workspace rows b·D .. b·D+D-1

                        history slots                                     workspace rows
                        0 ... first-1 | first ... A ... A+j ...           | 0..D-1 | D..2D-1 | ...
        causal row i    ############# | ####### (slots <= first + i)      |        |         |
        block 0 (j0)    ############# | ### (slots < A + j0)              | ###### |         |
        block 1 (j1)    ############# | ####### (slots < A + j1)          |        | ####### |

    A causal row sees what the same row of a verify (and of an AR step) sees, so its logits
    are the AR ones bit for bit; the block of j sees the history and the causal rows before
    d_j (not the row it duplicates) and itself bidirectionally — the draft block the model
    was trained on, anchored at d_j."""
    spans = fused_step_spans(first, causal, candidates, block, anchor_row)
    return spans_to_mask(spans, capacity, capacity + workspace)


# --- a step's index tensors as one launch ---------------------------------------------------

@dataclass(frozen=True)
class LengthAffine:
    """An index tensor of one step shape that moves with one length on the device:
    ``value(n) = base + n * coef``. Every step's spans and slots are affine in the history
    length (``history_step_spans``, ``draft_in_place_spans``: the length is added, never
    multiplied), so a captured step evaluates them in one launch (``at``) where building
    them costs the arange / stack / cat launches of the functions above (5-12 per step,
    each a latency of its own on a board)."""

    base: torch.Tensor
    coef: torch.Tensor

    @classmethod
    def of(cls, value_at: Callable[[int], torch.Tensor], device=None) -> "LengthAffine":
        """``value_at(n)`` (n a Python int) -> the tensor at length n; checked affine at n = 2."""
        at0, at1, at2 = (value_at(n).to(device) for n in (0, 1, 2))
        coef = at1 - at0
        if not torch.equal(at2, at0 + 2 * coef):
            raise ValueError("LengthAffine.of: the tensor does not move linearly with the length")
        return cls(at0, coef)

    def at(self, length: torch.Tensor) -> torch.Tensor:
        """``length`` [1] on the device (the dtype of ``base``) -> ``base + length * coef``."""
        return torch.addcmul(self.base, self.coef, length)
