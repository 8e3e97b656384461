"""The replayable runtime: shared-KV CUDA-graph replay per replay state (M, σ, r).

**Storage (M2).** One physical allocation holds the KV of every capacity segment: segment
σ is the prefix view ``[0, |σ| + W)`` of ``[layers, Hkv, |σ_max| + W, hd]``, history slots
``[0, |σ|)`` followed by W workspace slots. Views are nested, so growing into the next
segment leaves the history where it is (no copy at all) and only moves the workspace
window; smaller segments keep attention short. Every graph of segment σ reads and writes
fixed-shape views of that one buffer, and all graphs share one memory pool.

**Dynamic values on the device.** The history length L lives in a device tensor; positions,
masks, write slots and the accepted count are computed inside the graphs. Every row that
may be kept is written at its own slot (slot = position; see ``masks.py``), so
materialising a draft's pending rows and promoting a verify's accepted rows are both just
``L += n`` on the device: a verify writes all D drafts, and the rejected ones past the
boundary are invisible and overwritten later. The same slots and values in every width
also make an AR step and a verify row compute bit for bit alike.

**Chaining.** Each graph writes its outputs into the static inputs of the next likely step:
the verifier token into the width-1 pending buffer, an AR token into the AR input, and
(M3, hoisted verifier preparation) the verifier's input ``[anchor, d_1..d_D]`` right after
the draft, so a verify replays with no preparation after the branch. Outputs land in one
``readback`` buffer the host reads once per decision.

**Sampling.** A sampled step (``sampler`` given) replays its own graph, captured on first
use, so the greedy graphs captured at load stay exactly as they were. Its random numbers,
sampling parameters and penalty counts are static device inputs the host fills before the
replay (a few bytes of uniforms per step); inside, the graph runs the pure functions of
``runtime/sampling.py`` on the head logits: drafts d_j ~ q_j (q kept on the device for
the verify) and speculative sampling in the verify, with the same readback layout.

Ablation switches (``RuntimeOptions``): ``specialize`` (M1: width-specialised kernel
configs and the cheap draft head), ``graphs`` (M2: capture + replay instead of eager
launches), ``hoist_verify`` (M3). Generic = none of them, Full = all three.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..format.segments import KVPlan
from ..runtime.masks import draft_in_place_mask, history_step_mask, prefill_mask
from ..runtime.replay import ReplayState
from ..runtime.sampling import filtered_probs, inverse_cdf, penalize, sample_drafts, speculative_accept, target_probs
from .base import DraftResult, StepLog, VerifyResult
from .fast_model import FastModel

PREFILL_CHUNK = 256


@dataclass(frozen=True)
class RuntimeOptions:
    specialize: bool = True  # M1
    graphs: bool = True  # M2
    hoist_verify: bool = True  # M3
    capture: str = "load"  # "load" (all states up front) or "lazy" (per state, first use)
    kv_dtype: torch.dtype = torch.float16

    PRESETS = ("generic", "m1", "m1+m2", "full")

    @classmethod
    def preset(cls, name: str, **kw) -> "RuntimeOptions":
        flags = {"generic": (False, False, False), "m1": (True, False, False),
                 "m1+m2": (True, True, False), "full": (True, True, True)}
        if name not in flags:
            raise ValueError(f"unknown runtime configuration {name!r}; choose one of {', '.join(flags)}")
        s, g, h = flags[name]
        return cls(specialize=s, graphs=g, hoist_verify=h, **kw)


class GraphBackend:
    def __init__(self, fast: FastModel, plan: KVPlan, mask_token_id: int | None, block_size: int | None,
                 options: RuntimeOptions = RuntimeOptions(), name: str = "ampere", progress=None):
        """``progress(done, total)``, when given, is called as graphs are captured at load."""
        if options.graphs and fast.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use RuntimeOptions(graphs=False) on the CPU")
        self.name, self.fast, self.plan, self.opts = name, fast, plan, options
        self.mask_token_id, self.block_size = mask_token_id, block_size
        cfg, dev = fast.cfg, fast.device
        self.device = dev
        d = block_size or 0
        self.workspace = plan.workspace
        if self.workspace < max(2 * d, 1):
            raise ValueError(f"the artifact's workspace ({self.workspace} slots) is narrower than 2·D = {2 * d}")
        slots = plan.segments[-1].capacity + self.workspace
        shape = (cfg.num_layers, cfg.num_kv_heads, slots, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=options.kv_dtype, device=dev)
        self.v = torch.zeros(shape, dtype=options.kv_dtype, device=dev)
        self.kv_bytes = 2 * self.k.numel() * self.k.element_size()

        def longs(n):
            return torch.zeros(n, dtype=torch.long, device=dev)

        # Device-resident state and static step inputs/outputs (fixed addresses for graphs).
        self.L = longs(1)
        self.hist32 = torch.zeros(1, dtype=torch.int32, device=dev)
        self.ar_token = longs(1)
        self.pending = {k: longs(k) for k in range(1, d + 1)}
        self.verify_tokens = longs(d + 1)
        self.mask_ids = torch.full((max(d - 1, 0),), mask_token_id if mask_token_id is not None else 0,
                                   dtype=torch.long, device=dev)
        self.readback = torch.zeros(2 + 2 * d, dtype=torch.float64, device=dev)  # a, v, drafts, confidences
        self.ar_out = longs(1)
        self._draft_off = {k: torch.tensor(list(range(k)) + list(range(k - 1, k - 1 + d)), device=dev)
                           for k in range(1, d + 1)}
        self._ws_rows = torch.arange(self.workspace, device=dev)

        self.segment = 0
        self.L_host = 0
        self.log = StepLog()
        self.graphs: dict[ReplayState, torch.cuda.CUDAGraph] = {}
        # Sampled steps: graphs keyed by (state, penalized), static inputs made on first use.
        self.sample_graphs: dict[tuple[ReplayState, bool], torch.cuda.CUDAGraph] = {}
        self._sample_inputs: dict[str, torch.Tensor] | None = None
        self._staged_sampler = None
        self.pool = torch.cuda.graph_pool_handle() if options.graphs else None
        self.capture_s = 0.0
        self.graph_pool_bytes = 0
        self._chain: tuple = ()
        if options.graphs and options.capture == "load":
            self.capture_all(progress)

    # -- geometry --------------------------------------------------------------------------
    @property
    def history_length(self) -> int:
        return self.L_host

    @property
    def max_context(self) -> int:
        return self.plan.segments[-1].capacity

    @property
    def vocab_size(self) -> int:
        return self.fast.cfg.vocab_size

    def _capacity(self, seg: int) -> int:
        return self.plan.segments[seg].capacity

    def _view(self, seg: int):
        s = self._capacity(seg) + self.workspace
        return self.k[:, :, :s], self.v[:, :, :s]

    def _ensure(self, needed: int) -> None:
        if needed > self._capacity(self.segment):
            self.segment = self.plan.segment_for(needed)
            self.log.segment_growths += 1  # nested views: the history stays in place

    def states(self) -> list[ReplayState]:
        d = self.block_size or 0
        out = []
        for seg in range(len(self.plan.segments)):
            out.append(ReplayState(1, seg, "verify"))
            if d:
                out.append(ReplayState(d + 1, seg, "verify"))
                out += [ReplayState(k + d, seg, "draft") for k in range(1, d + 1)]
        return out

    # -- graph bodies: everything below reads and writes static tensors only ------------------
    def _forward(self, seg, tokens, positions, write_slots, mask, history_rows):
        """One step over segment ``seg``; ``history_rows`` = rows this step writes at slots
        from L on (the attention kernel skips history slots past L + history_rows)."""
        k, v = self._view(seg)
        self.hist32.copy_(self.L + history_rows)
        return self.fast.forward(tokens, positions, k, v, write_slots, mask, self.hist32,
                                 capacity=self._capacity(seg))

    def _ar_body(self, seg: int, sampled: bool | None = None) -> None:
        """``sampled``: None = greedy; else sample (True: with penalty counts)."""
        cap = self._capacity(seg)
        mask = history_step_mask(cap, self.workspace, self.L, 1, self.device)
        x = self._forward(seg, self.ar_token, self.L, self.L, mask, 1)
        if sampled is None:
            top, _ = self.fast.verify_top1(x)
        else:
            s = self._sample_inputs
            temperature, top_k, top_p, rep, freq, pres = self._sample_params()
            logits = self.fast.verify_sample_logits(x)  # [1, V]
            if sampled:
                logits = penalize(logits, s["seen"], s["generated"], rep, freq, pres)
            top = inverse_cdf(filtered_probs(logits, temperature, top_k, top_p), s["u_ar"])
        self.L += 1
        self.ar_out.copy_(top)
        self.ar_token.copy_(top)

    def _draft_body(self, seg: int, k: int, sampled: bool | None = None) -> None:
        d, cap = self.block_size, self._capacity(seg)
        pending = self.pending[k]
        tokens = torch.cat([pending, pending[-1:], self.mask_ids])
        # Pending rows at their own history slots, the block in the workspace.
        slots = torch.cat([self.L + self._ws_rows[:k], cap + self._ws_rows[:d]])
        mask = draft_in_place_mask(cap, self.workspace, self.L, k, d, self.device)
        x = self._forward(seg, tokens, self.L + self._draft_off[k], slots, mask, k)
        if sampled is None:
            top, conf = self.fast.draft_top1(x[k:])
        else:
            s = self._sample_inputs
            top, q, conf = sample_drafts(self.fast.draft_sample_logits(x[k:]), s["seen"], s["generated"],
                                         self._sample_params(), s["u_draft"], sampled)
            s["q"].copy_(q)  # the verify compares against these very distributions
        self.L += k
        self.readback[2:2 + d].copy_(top)
        self.readback[2 + d:].copy_(conf)
        if self.opts.hoist_verify:  # M3: the verifier's inputs are ready before the host looks
            self.verify_tokens[:1].copy_(pending[-1:])
            self.verify_tokens[1:].copy_(top)

    def _verify_body(self, seg: int, sampled: bool | None = None) -> None:
        d, cap = self.block_size, self._capacity(seg)
        first = self.L - 1  # the anchor's own slot; its row is recomputed bit for bit
        mask = history_step_mask(cap, self.workspace, first, d + 1, self.device)
        positions = first + self._ws_rows[: d + 1]
        x = self._forward(seg, self.verify_tokens, positions, positions, mask, d)
        if sampled is None:
            greedy, _ = self.fast.verify_top1(x)  # [D + 1]
            match = (self.verify_tokens[1:] == greedy[:-1]).long()
            accepted = match.cumprod(0).sum().view(1)
            verifier = greedy.gather(0, accepted)
        else:
            s = self._sample_inputs
            drafts = self.verify_tokens[1:]
            p = target_probs(self.fast.verify_sample_logits(x), drafts, s["seen"], s["generated"],
                             self._sample_params(), sampled)
            accepted, verifier = speculative_accept(p, s["q"], drafts, s["u_verify"][:d], s["u_verify"][d:])
        self.L += accepted  # d_1..d_a are already at their slots
        self.readback[0:1].copy_(accepted)
        self.readback[1:2].copy_(verifier)
        self.pending[1].copy_(verifier)

    def _body(self, state: ReplayState, sampled: bool | None = None):
        d = self.block_size or 0
        if state.role == "verify" and state.width == 1:
            return lambda: self._ar_body(state.segment, sampled)
        if state.role == "verify":
            return lambda: self._verify_body(state.segment, sampled)
        return lambda: self._draft_body(state.segment, state.width - d, sampled)

    # -- sampling inputs -------------------------------------------------------------------------
    def _sample_params(self):
        s = self._sample_inputs
        return s["temperature"], s["top_k"], s["top_p"], s["repetition"], s["frequency"], s["presence"]

    def _stage(self, sampler, uniforms_key: str) -> bool:
        """Fill the sampled graphs' static inputs for one step; returns ``penalized``."""
        if self._sample_inputs is None:
            d, v, dev = self.block_size or 0, self.vocab_size, self.device

            def zeros(*shape):
                return torch.zeros(*shape, dtype=torch.float32, device=dev)

            self._sample_inputs = {
                **{name: zeros(()) for name in ("temperature", "top_k", "top_p", "repetition", "frequency",
                                                "presence")},
                "seen": zeros(v), "generated": zeros(v), "q": zeros(max(d, 1), v),
                "u_ar": zeros(1), "u_draft": zeros(max(d, 1)), "u_verify": zeros(d + 1),
            }
        s = self._sample_inputs
        if self._staged_sampler is not sampler:  # a new request: its parameters, once
            for name, value in zip(("temperature", "top_k", "top_p", "repetition", "frequency", "presence"),
                                   sampler.values):
                s[name].fill_(float(value))
            self._staged_sampler = sampler
        if sampler.penalized:  # counts change every iteration (device to device)
            s["seen"].copy_(sampler.seen)
            s["generated"].copy_(sampler.generated)
        u = s[uniforms_key]
        u.copy_(sampler.uniforms(u.numel()))
        return sampler.penalized

    # -- capture / replay ------------------------------------------------------------------
    def _snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self._state_tensors()]

    def _state_tensors(self) -> list[torch.Tensor]:
        return [self.L, self.ar_token, self.verify_tokens, self.readback, self.ar_out, *self.pending.values()]

    def _capture(self, state: ReplayState, sampled: bool | None = None) -> None:
        """Capture one state. Warm-up runs mutate L and the chained inputs, so those are
        restored afterwards. Their KV writes land at or past slot L - 1; mid-stream (lazy
        capture) the step's inputs are already staged, so slot L - 1 gets the very row the
        real step writes, and everything past L is invisible."""
        saved = self._snapshot()
        body = self._body(state, sampled)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles Triton kernels and settles the allocator outside capture
                if self.L_host == 0:  # at load: a verify recomputes slot L - 1, so L must be >= 1
                    self.L.fill_(1)
                body()
                for t, s in zip(self._state_tensors(), saved):
                    t.copy_(s)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        # A graph's intermediates are freed back into its private pool when capture ends:
        # allocated memory does not move, the pool's reserved segments do.
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            body()
        for t, s in zip(self._state_tensors(), saved):
            t.copy_(s)
        torch.cuda.synchronize(self.device)
        self.graph_pool_bytes += max(torch.cuda.memory_reserved(self.device) - before, 0)
        if sampled is None:
            self.graphs[state] = graph
        else:
            self.sample_graphs[(state, sampled)] = graph

    def capture_all(self, progress=None) -> None:
        t0 = time.perf_counter()
        states = self.states()
        for i, state in enumerate(states):
            self._capture(state)
            if progress is not None:
                progress(i + 1, len(states))
        self.capture_s = time.perf_counter() - t0

    def _run(self, state: ReplayState, sampled: bool | None = None) -> None:
        self.log.states.append(state)
        if not self.opts.graphs:
            self._body(state, sampled)()
            return
        graphs = self.graphs if sampled is None else self.sample_graphs
        key = state if sampled is None else (state, sampled)
        graph = graphs.get(key)
        if graph is None:
            self._capture(state, sampled)
            graph = graphs[key]
        graph.replay()

    def _read(self, t: torch.Tensor) -> list:
        self.log.host_syncs += 1
        return t.tolist()

    # -- the Backend interface ---------------------------------------------------------------
    def reset(self) -> None:
        self.L.zero_()
        self.L_host, self.segment = 0, 0
        self.log = StepLog()
        self._chain = ()
        self._staged_sampler = None

    def prefill(self, token_ids: list[int]) -> None:
        from kernels_ampere import small_width_attention_reference

        for start in range(0, len(token_ids), PREFILL_CHUNK):
            chunk = token_ids[start:start + PREFILL_CHUNK]
            n = len(chunk)
            self._ensure(self.L_host + n)
            cap = self._capacity(self.segment)
            k, v = self._view(self.segment)
            ids = torch.tensor(chunk, dtype=torch.long, device=self.device)
            pos = torch.arange(self.L_host, self.L_host + n, device=self.device)
            mask = prefill_mask(cap + self.workspace, self.L_host, n, self.device)
            self.hist32.fill_(self.L_host + n)  # the chunk's own rows are history already
            # Prefill is eager and wide; the small-width kernel is for decode widths.
            self.fast.forward(ids, pos, k, v, pos, mask, self.hist32, capacity=cap,
                              attention=small_width_attention_reference)
            self.L_host += n
        self.L.fill_(self.L_host)

    @staticmethod
    def _upload(buf: torch.Tensor, values: list[int]) -> None:
        buf.copy_(torch.tensor(values, dtype=torch.long))

    def ar_step(self, token: int, sampler=None) -> int:
        self._ensure(self.L_host + 1)
        if self._chain != ("ar", token):  # the last AR graph already wrote it otherwise
            self._upload(self.ar_token, [token])
        sampled = None if sampler is None else self._stage(sampler, "u_ar")
        self._run(ReplayState(1, self.segment, "verify"), sampled)
        self.L_host += 1
        nxt = int(self._read(self.ar_out)[0])
        self._chain = ("ar", nxt)
        return nxt

    def draft_step(self, pending: list[int], block_size: int, sampler=None) -> DraftResult:
        if self.mask_token_id is None:
            raise RuntimeError("this artifact has no MTP block (AR-only); use policy='ar'")
        if block_size != self.block_size:
            raise ValueError(f"block size {block_size} != the captured D={self.block_size}")
        k, d = len(pending), block_size
        self._ensure(self.L_host + k + d)
        if self._chain == ("verify", tuple(pending)):
            pass  # the verify graph already wrote v into pending[1]
        elif self._chain and self._chain[0] == "draft" and tuple(pending) == self._chain[1][:k]:
            self.pending[k].copy_(self.readback[2:2 + k].long())  # device to device
        else:
            self._upload(self.pending[k], pending)
        sampled = None if sampler is None else self._stage(sampler, "u_draft")
        self._run(ReplayState(k + d, self.segment, "draft"), sampled)
        self.L_host += k

        def load():
            values = self._read(self.readback[2:])
            tokens = [int(t) for t in values[:d]]
            self._chain = ("draft", tuple(tokens))
            return tokens, values[d:]

        self._chain = ()
        return DraftResult(loader=load)

    def verify_step(self, anchor: int, draft: DraftResult, sampler=None) -> VerifyResult:
        d = self.block_size
        if not self.opts.hoist_verify:  # Generic: prepare the verifier's inputs after the branch
            self._upload(self.verify_tokens, [anchor] + list(draft.tokens))
        sampled = None if sampler is None else self._stage(sampler, "u_verify")
        self._run(ReplayState(d + 1, self.segment, "verify"), sampled)
        values = self._read(self.readback)  # a, v, drafts, confidences: one transfer
        accepted, verifier = int(values[0]), int(values[1])
        if draft._tokens is None:
            draft._tokens, draft._confidences = [int(t) for t in values[2:2 + d]], values[2 + d:]
        self.L_host += accepted
        self._chain = ("verify", (verifier,))
        return VerifyResult(accepted, verifier)

    @torch.no_grad()
    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        from kernels_ampere import small_width_attention_reference

        ids = token_ids.to(self.device).view(-1)
        t = ids.numel()
        if t > self.max_context:
            raise ValueError(f"{t} tokens exceed the largest KV segment ({self.max_context})")
        self.reset()
        seg = self.plan.segment_for(t)
        cap = self._capacity(seg)
        k, v = self._view(seg)
        pos = torch.arange(t, device=self.device)
        self.hist32.fill_(t)
        x = self.fast.forward(ids, pos, k, v, pos, prefill_mask(cap + self.workspace, 0, t, self.device),
                              self.hist32, capacity=cap, attention=small_width_attention_reference)
        self.reset()
        return self.fast.verify_logits(x)


__all__ = ["GraphBackend", "RuntimeOptions"]
