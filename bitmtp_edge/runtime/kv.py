"""Shared KV storage: one physical buffer per capacity segment, history + workspace.

Slot layout of a segment's buffer (``[layers, Hkv, capacity + workspace, head_dim]`` for K
and for V)::

    [0, L)                         materialised history (absolute positions 0..L-1)
    [L, capacity)                  free history slots
    [capacity, capacity + M_max)   workspace: a step of width M writes its rows here

Every row whose KV may be kept is written at its own slot (slot = absolute position):
prefill, AR, a draft's pending rows, the verifier's [anchor, d_1..d_D]. *Materialising*
pending rows (after a draft) and *promoting* accepted drafts (after a verify) then move the
boundary L over rows already in place — no copy — and rejected rows past L are invisible
and overwritten later. Only the draft block, whose positions overlap the anchor's, lives
in the workspace. Every role and width shares one buffer per segment: switching width or
role keeps the history in place; growing into the next segment copies the history once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format.config import ModelConfig
from ..format.segments import KVPlan


@dataclass
class KVBuffer:
    """K and V for every layer in one capacity segment. ``k[layer]`` is [Hkv, slots, hd]."""

    k: torch.Tensor  # [layers, Hkv, capacity + workspace, hd]
    v: torch.Tensor
    capacity: int
    workspace: int

    @classmethod
    def allocate(cls, cfg: ModelConfig, capacity: int, workspace: int, dtype, device) -> "KVBuffer":
        shape = (cfg.num_layers, cfg.num_kv_heads, capacity + workspace, cfg.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device), capacity, workspace)

    @property
    def slots(self) -> int:
        return self.capacity + self.workspace

    def workspace_slots(self, width: int) -> torch.Tensor:
        return torch.arange(self.capacity, self.capacity + width, device=self.k.device)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class SegmentedKV:
    """The KV history of one sequence, living in the smallest segment that holds it."""

    def __init__(self, cfg: ModelConfig, plan: KVPlan, dtype: torch.dtype, device):
        self.cfg, self.plan, self.dtype, self.device = cfg, plan, dtype, device
        self.segment_index = 0
        self.buffer = self._allocate(0)
        self.length = 0  # L: history slots materialised
        self.growths = 0

    def _allocate(self, index: int) -> KVBuffer:
        seg = self.plan.segments[index]
        return KVBuffer.allocate(self.cfg, seg.capacity, self.plan.workspace, self.dtype, self.device)

    @property
    def capacity(self) -> int:
        return self.buffer.capacity

    @property
    def max_capacity(self) -> int:
        return self.plan.segments[-1].capacity

    def reset(self) -> None:
        self.length = 0
        if self.segment_index != 0:
            self.segment_index, self.buffer = 0, self._allocate(0)

    def ensure_capacity(self, needed_history: int) -> bool:
        """Move to the smallest segment holding ``needed_history`` slots; True if it moved.

        The history is copied once into the new buffer; the old buffer is released.
        """
        if needed_history <= self.capacity:
            return False
        index = self.plan.segment_for(needed_history)
        new = self._allocate(index)
        new.k[:, :, : self.length].copy_(self.buffer.k[:, :, : self.length])
        new.v[:, :, : self.length].copy_(self.buffer.v[:, :, : self.length])
        self.segment_index, self.buffer = index, new
        self.growths += 1
        return True

    def history_slots(self, n: int) -> torch.Tensor:
        """Slots L..L+n-1 for ``n`` rows written at their own positions."""
        if self.length + n > self.capacity:
            raise RuntimeError(f"history overflow: {self.length}+{n} > capacity {self.capacity}")
        return torch.arange(self.length, self.length + n, device=self.device)

    def advance(self, n: int) -> None:
        """Move the boundary over ``n`` rows already written at slots L..L+n-1."""
        self.length += n

    def history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The materialised history K, V: [layers, Hkv, L, hd] each (views)."""
        return self.buffer.k[:, :, : self.length], self.buffer.v[:, :, : self.length]
