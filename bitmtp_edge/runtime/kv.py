"""The KV store: one sequence's keys and values, shared by every role, width and segment.

**One allocation, nested segment views.** K and V are each one tensor
``[layers, Hkv, |σ_max| + W, head_dim]`` (σ_max the largest capacity segment of the
artifact's ``KVPlan``, W its workspace). Segment σ is the prefix view ``[0, |σ| + W)``::

    [0, L)               materialised history (absolute positions 0..L-1)
    [L, |σ|)             free history slots
    [|σ|, |σ| + W)       workspace: the draft block of a step writes its rows here

Growing into the next segment copies nothing: the history stays at its slots and only the
workspace window moves up (what was the workspace becomes free history slots, invisible
until written). Smaller segments keep attention short; every step of segment σ reads and
writes a fixed-shape view, which is what lets the graph backend capture one graph per
(width, segment, role) over one buffer. Both backends use this store.

Every row whose KV may be kept is written at its own slot (slot = absolute position):
prefill, AR, a draft's pending rows, the verifier's [anchor, d_1..d_D]. *Materialising*
pending rows (after a draft) and *promoting* accepted drafts (after a verify) then move
the boundary L over rows already in place (``advance``); rejected rows past L are
invisible and overwritten later. Only the draft block, whose positions overlap the
anchor's, lives in the workspace.

The store's verb is ``reserve(needed)``: the view of the smallest segment that holds
``needed`` history slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format.config import ModelConfig
from ..format.segments import KVPlan


@dataclass(frozen=True)
class KVView:
    """K and V of every layer in one segment: views of the store, ``k[layer]`` is [Hkv, slots, hd]."""

    k: torch.Tensor  # [layers, Hkv, capacity + workspace, hd]
    v: torch.Tensor  # [layers, Hkv, capacity + workspace, hd]
    capacity: int
    workspace: int

    @property
    def slots(self) -> int:
        return self.capacity + self.workspace

    def workspace_slots(self, width: int) -> torch.Tensor:
        """[width] int64: the first ``width`` workspace slots."""
        return torch.arange(self.capacity, self.capacity + width, device=self.k.device)


class KVStore:
    """The KV history of one sequence: one buffer, viewed through the smallest segment that holds it."""

    def __init__(self, cfg: ModelConfig, plan: KVPlan, dtype: torch.dtype, device, workspace: int | None = None):
        """``workspace``: slots allocated after the largest segment, when a step needs more
        than the artifact's widest (the fused step's draft blocks); views default to W."""
        self.plan, self.device = plan, torch.device(device)
        self.workspace = plan.workspace
        self.allocated_workspace = max(workspace or 0, plan.workspace)
        shape = (cfg.num_layers, cfg.num_kv_heads, plan.segments[-1].capacity + self.allocated_workspace,
                 cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)  # [layers, Hkv, |σ_max| + W, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.segment = 0  # σ: index into plan.segments
        self.length = 0  # L: history slots materialised (the host's copy)
        self.growths = 0

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def capacity(self) -> int:
        """|σ|: the history slots of the current segment."""
        return self.plan.segments[self.segment].capacity

    @property
    def max_capacity(self) -> int:
        return self.plan.segments[-1].capacity

    def view(self, segment: int | None = None, workspace: int | None = None) -> KVView:
        """Segment ``segment`` (default: the current one) as the prefix view [0, |σ| + W), or
        with ``workspace`` slots instead of W (up to what ``widen`` allocated)."""
        seg = self.segment if segment is None else segment
        workspace = workspace or self.workspace
        assert workspace <= self.allocated_workspace, (workspace, self.allocated_workspace)
        capacity = self.plan.segments[seg].capacity
        slots = capacity + workspace
        k, v = self.k[:, :, :slots], self.v[:, :, :slots]
        assert k.shape[2] == slots and k.data_ptr() == self.k.data_ptr(), "segment views share one buffer"
        return KVView(k, v, capacity, workspace)

    def widen(self, workspace: int) -> bool:
        """Allocate ``workspace`` slots after the largest segment (views still default to W),
        keeping the contents; True if it reallocated. A graph backend sizes the store at
        construction instead: its captured views must never move."""
        if workspace <= self.allocated_workspace:
            return False
        k, v = self.k, self.v
        shape = (*k.shape[:2], self.plan.segments[-1].capacity + workspace, k.shape[3])
        self.k = torch.zeros(shape, dtype=k.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=v.dtype, device=self.device)
        self.k[:, :, :k.shape[2]].copy_(k)
        self.v[:, :, :v.shape[2]].copy_(v)
        self.allocated_workspace = workspace
        return True

    def reserve(self, needed: int) -> KVView:
        """The view of the smallest segment holding ``needed`` history slots (L plus the rows
        the next step may keep). Moving up a segment leaves the history where it is."""
        assert needed >= self.length, f"reserve({needed}) below the history length {self.length}"
        if needed > self.capacity:
            self.segment = self.plan.segment_for(needed)  # ValueError past the largest segment
            self.growths += 1
        assert self.length <= needed <= self.capacity
        return self.view()

    def reset(self) -> None:
        self.length, self.segment = 0, 0

    def history_slots(self, n: int) -> torch.Tensor:
        """[n] int64: slots L..L+n-1, for ``n`` rows written at their own positions."""
        if self.length + n > self.capacity:
            raise RuntimeError(f"history overflow: {self.length}+{n} > capacity {self.capacity}")
        return torch.arange(self.length, self.length + n, device=self.device)

    def advance(self, n: int) -> None:
        """Move the boundary over ``n`` rows already written at slots L..L+n-1."""
        assert 0 <= n and self.length + n <= self.capacity, (self.length, n, self.capacity)
        self.length += n

    def rewind(self, n: int) -> None:
        """Move the boundary back over the last ``n`` rows: they are recomputed at their slots
        by the next step (a fused step reopening its anchor after a draft step)."""
        assert 0 <= n <= self.length, (self.length, n)
        self.length -= n

    def history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The materialised history K, V: [layers, Hkv, L, hd] each (views)."""
        return self.k[:, :, : self.length], self.v[:, :, : self.length]
