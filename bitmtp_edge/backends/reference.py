"""The reference backend: plain PyTorch, exact integer semantics, any device. The oracle.

On the CPU it computes in float64 so that float summation order (which differs between a
width-1 AR step and a width-(D+1) verify step) cannot flip a greedy choice: the ternary
projections are exact integer products either way, and float64 keeps the float parts
(norms, attention, head) ~1e-16 apart, far below any int8 rounding boundary or logit tie.
"""

from __future__ import annotations

import torch

from ..format.segments import KVPlan
from ..runtime.calibration import ConfidenceCalibration
from ..runtime.decoding_rules import accepted_prefix, candidate_lengths
from ..runtime.kv import KVStore, KVView
from ..runtime.masks import draft_in_place_mask, fused_step_mask, history_step_mask, prefill_mask
from ..runtime.model import TernaryLM
from ..runtime.replay import ReplayState
from .base import (NON_FINITE_TOKEN, PREFILL_CHUNK, DraftResult, FusedResult, StepLog, VerifyResult, check_pending,
                   flag_non_finite)


class ReferenceBackend:
    name = "reference"

    def __init__(self, model: TernaryLM, plan: KVPlan, mask_token_id: int | None, dtype: torch.dtype, device,
                 calibration: ConfidenceCalibration | None = None):
        """``calibration``: the artifact's per-slot confidence map (``runtime.calibration``), or None."""
        self.model, self.plan, self.mask_token_id = model, plan, mask_token_id
        self.calibration = calibration
        self.dtype, self.device = dtype, torch.device(device)
        self.kv = KVStore(model.cfg, plan, dtype, self.device)
        self.log = StepLog()

    # -- state ---------------------------------------------------------------------------
    @property
    def history_length(self) -> int:
        return self.kv.length

    @property
    def max_context(self) -> int:
        return self.kv.max_capacity

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def reset(self) -> None:
        self.kv.reset()
        self.log = StepLog()

    def _reserve(self, needed: int) -> KVView:
        growths = self.kv.growths
        view = self.kv.reserve(needed)
        self.log.segment_growths += self.kv.growths - growths
        return view

    def _record(self, width: int, role: str) -> None:
        self.log.states.append(ReplayState(width, self.kv.segment, role))

    # -- steps ---------------------------------------------------------------------------
    @torch.no_grad()
    def _run(self, kv: KVView, tokens: list[int], positions: list[int], mask: torch.Tensor, slots: torch.Tensor,
             blocks_from: int | None = None):
        """``blocks_from``: the first row of the step's draft blocks (mask-row adapters apply there)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        pos = torch.tensor([positions], dtype=torch.long, device=self.device)
        return self.model(ids, pos, mask.unsqueeze(0), kv=kv, write_slots=slots, adapter_from=blocks_from)[0]

    def prefill(self, token_ids: list[int]) -> None:
        for start in range(0, len(token_ids), PREFILL_CHUNK):
            chunk = token_ids[start:start + PREFILL_CHUNK]
            kv = self._reserve(self.kv.length + len(chunk))
            slots = self.kv.history_slots(len(chunk))
            mask = prefill_mask(kv.slots, self.kv.length, len(chunk), self.device)
            self._run(kv, chunk, list(range(self.kv.length, self.kv.length + len(chunk))), mask, slots)
            self.kv.advance(len(chunk))

    def ar_step(self, token: int, sampler=None) -> int:
        length = self.kv.length
        kv = self._reserve(length + 1)
        mask = history_step_mask(kv.capacity, kv.workspace, length, 1, self.device)
        hidden = self._run(kv, [token], [length], mask, self.kv.history_slots(1))
        self._record(1, "verify")
        self.kv.advance(1)  # the row sits at its own slot: materialising = moving L
        self.log.host_syncs += 1
        if sampler is None:
            return int(self._greedy(hidden)[0])
        logits = self.model.verify_logits(hidden)  # [1, V]
        token = torch.tensor([sampler.next_token(logits)], device=self.device)
        return int(flag_non_finite(hidden, token, logits.max(-1).values)[0])

    def draft_step(self, pending: list[int], block_size: int, sampler=None) -> DraftResult:
        if self.mask_token_id is None:
            raise RuntimeError("this artifact has no MTP block (AR-only); use policy='ar'")
        check_pending(pending, block_size)
        k = len(pending)
        # History must later hold the pending rows plus up to D verified drafts.
        kv = self._reserve(self.kv.length + k + block_size)
        length, cap = self.kv.length, kv.capacity
        tokens = pending + [pending[-1]] + [self.mask_token_id] * (block_size - 1)
        anchor_pos = length + k - 1
        positions = list(range(length, length + k)) + list(range(anchor_pos, anchor_pos + block_size))
        # Pending rows at their history slots; the block (speculative) in the workspace.
        slots = torch.cat([self.kv.history_slots(k), kv.workspace_slots(block_size)])
        mask = draft_in_place_mask(cap, kv.workspace, length, k, block_size, self.device)
        hidden = self._run(kv, tokens, positions, mask, slots, blocks_from=k)
        self._record(k + block_size, "draft")
        logits = self.model.draft_logits(hidden[k:])  # [D, V]
        self.kv.advance(k)  # materialise the pending rows
        self.log.host_syncs += 1
        if sampler is not None:
            drafts, q, conf = sampler.draft(logits, self.calibration)
            drafts = flag_non_finite(hidden[k:], drafts, logits.max(-1).values)
            return DraftResult(drafts.tolist(), conf.tolist(), probs=q)
        conf, top = torch.softmax(logits, dim=-1).max(dim=-1)
        conf = self._calibrated(conf, 0)
        top = flag_non_finite(hidden[k:], top, conf)
        return DraftResult(top.tolist(), conf.tolist())

    def _calibrated(self, conf: torch.Tensor, first_slot: int) -> torch.Tensor:
        return conf if self.calibration is None else self.calibration(conf, first_slot)

    def verify_step(self, anchor: int, draft: DraftResult, sampler=None) -> VerifyResult:
        drafts = list(draft.tokens)
        length = self.kv.length
        if length == 0:
            raise RuntimeError("verify needs a materialised anchor")
        width = len(drafts) + 1
        # [anchor, d_1..d_D] at positions L-1..L+D-1, each at its own slot: the anchor's row
        # is recomputed from the same inputs (identical values), the drafts land where they
        # stay if accepted; rejected ones lie past the boundary, invisible, overwritten later.
        first = length - 1
        kv = self.kv.view()  # the draft step reserved the slots of d_1..d_D
        mask = history_step_mask(kv.capacity, kv.workspace, first, width, self.device)
        slots = torch.arange(first, first + width, device=self.device)
        hidden = self._run(kv, [anchor] + [max(t, 0) for t in drafts], list(range(first, first + width)), mask, slots)
        self._record(width, "verify")
        self.log.host_syncs += 1
        if sampler is not None:
            if draft.probs is None:
                raise RuntimeError("a sampled verify needs the draft distributions; draft with the same sampler")
            logits = self.model.verify_logits(hidden)  # [D + 1, V]
            a, v = sampler.verify(logits, torch.tensor(drafts, device=self.device), draft.probs)
            if not bool(torch.isfinite(logits[: a + 1]).all()):  # NaN rows: flag the commit, as greedy does
                v = NON_FINITE_TOKEN
            self.kv.advance(a)
            return VerifyResult(a, v)
        greedy = self._greedy(hidden).tolist()
        a = accepted_prefix(drafts, greedy)
        self.kv.advance(a)  # promote d_1..d_a
        return VerifyResult(a, greedy[a])

    def fused_step(self, anchor: int, pending: list[int], draft: DraftResult, candidates: int,
                   block_size: int) -> FusedResult:
        drafts, confidences, d = list(draft.tokens), list(draft.confidences), block_size
        if not pending:  # after a draft step: d_1..d_{D-1}, a fused hit's width (graph.py, _reopen_anchor)
            drafts, confidences = drafts[:d - 1], confidences[:d - 1]
        chosen = candidate_lengths(torch.tensor(confidences, dtype=torch.float32), candidates).tolist()
        hidden = self.fused_rows(anchor, pending, drafts, chosen, d)
        self.log.host_syncs += 1
        k = len(pending)
        n, anchor_row = (k or 1) + len(drafts), max(k - 1, 0)
        greedy = self._greedy(hidden[anchor_row:n]).tolist()  # anchor, d_1..d_m
        a = accepted_prefix(drafts, greedy)
        self.kv.advance(k + a)  # the pending rows and d_1..d_a, already at their slots
        nxt = None
        if a in chosen:  # the drafts after v: rows 1..D-1 of a's block, under the verify head
            b = chosen.index(a)  # (the step reads it anyway: fused_graph.py, "One head pass")
            rows = hidden[n + b * d + 1:n + (b + 1) * d]
            nxt = DraftResult([], [])
            if rows.shape[0]:
                conf, top = torch.softmax(self.model.verify_logits(rows), dim=-1).max(dim=-1)
                conf = self._calibrated(conf, 1)  # rows 1..D-1 of a's block: slots 1..D-1
                nxt = DraftResult(flag_non_finite(rows, top, conf).tolist(), conf.tolist())
        return FusedResult(a, greedy[a], chosen, nxt)

    def fused_rows(self, anchor: int, pending: list[int], drafts: list[int], chosen: list[int],
                   block_size: int) -> torch.Tensor:
        """Run the fused step's forward (``masks.fused_step_mask``) for the candidate lengths
        ``chosen`` (ascending); write its KV; return the final-normed hidden rows, causal rows
        first, then block by block. The history boundary does not move."""
        if self.mask_token_id is None:
            raise RuntimeError("this artifact has no MTP block (AR-only); use policy='ar'")
        k, d, length = len(pending), block_size, self.kv.length
        if not k and length == 0:
            raise RuntimeError("a fused step without pending tokens needs a materialised anchor")
        if any(not 0 <= j <= len(drafts) for j in chosen):
            raise ValueError(f"candidate lengths {chosen} outside 0..{len(drafts)} (the drafts held)")
        causal = (pending if k else [anchor]) + [max(t, 0) for t in drafts]  # a flagged draft: any token
        n, anchor_row = len(causal), max(k - 1, 0)
        first = length if k else length - 1  # the anchor pending, or recomputed at its own slot
        c = len(chosen)
        self.kv.widen(c * d)  # the draft blocks may need more than the artifact's widest step
        self._reserve(first + n)
        kv = self.kv.view(workspace=max(self.kv.workspace, c * d))
        anchor_slot = first + anchor_row
        tokens, positions = list(causal), list(range(first, first + n))
        for j in chosen:
            tokens += [causal[anchor_row + j]] + [self.mask_token_id] * (d - 1)
            positions += list(range(anchor_slot + j, anchor_slot + j + d))
        slots = torch.cat([torch.arange(first, first + n, device=self.device), kv.workspace_slots(c * d)])
        mask = fused_step_mask(kv.capacity, kv.workspace, first, n, torch.tensor(chosen, device=self.device), d,
                               anchor_row)
        hidden = self._run(kv, tokens, positions, mask, slots, blocks_from=n)
        self._record(n + c * d, "fused")
        return hidden

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of the verify head; ``NON_FINITE_TOKEN`` where a row is NaN/Inf
        (argmax over NaN logits would pick token 0 and decode garbage silently)."""
        logits = self.model.verify_logits(hidden)
        top_value, top = logits.max(-1)  # max propagates NaN: one NaN logit flags its row
        return flag_non_finite(hidden, top, top_value)

    @torch.no_grad()
    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        assert token_ids.dim() == 1, f"token_ids must be [T], got {tuple(token_ids.shape)}"
        ids = token_ids.to(self.device).view(1, -1)
        t = ids.shape[1]
        pos = torch.arange(t, device=self.device).unsqueeze(0)
        mask = torch.ones(t, t, dtype=torch.bool, device=self.device).tril().unsqueeze(0)
        return self.model.verify_logits(self.model(ids, pos, mask)[0])
