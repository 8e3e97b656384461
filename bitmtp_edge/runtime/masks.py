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
