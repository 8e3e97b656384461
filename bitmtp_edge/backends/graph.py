"""The replayable runtime: shared-KV CUDA-graph replay per replay state (M, σ, r).

**Storage (M2).** The KV store (``runtime/kv.py``, shared with the reference backend) is
one allocation viewed through nested capacity segments: growing into the next segment
copies nothing. Every graph of segment σ reads and writes the fixed-shape view of σ, and
all graphs share one memory pool.

**Dynamic values on the device.** The history length L lives in a device tensor; positions,
masks, write slots and the accepted count are computed inside the graphs. Every row that
may be kept is written at its own slot (slot = position; see ``masks.py``), so
materialising a draft's pending rows and promoting a verify's accepted rows are both just
``L += n`` on the device: a verify writes all D drafts, and the rejected ones past the
boundary are invisible and overwritten later. The same slots and values in every width
also make an AR step and a verify row compute bit for bit alike.

**Static inputs.** Every tensor a graph reads or writes is a field of ``StaticInputs``,
allocated once at the largest width. A step is: copy in (host values, or nothing when a
graph already left them there) -> replay -> slice out (one read of ``readback``).

**Chaining.** Each graph writes its outputs into the static inputs of the next likely step:
the verifier token into ``pending[:1]``, an AR token into ``ar_token``, and (M3, hoisted
verifier preparation) the verifier's input ``[anchor, d_1..d_D]`` right after the draft, so
a verify replays with no preparation after the branch. ``Staged`` records what the last
step left on the device; the copy-in of the next step reads it, nothing else does.

**Sampling.** A sampled step (``sampler`` given) replays its own graph, captured on first
use, so the greedy graphs captured at load stay exactly as they were. Its random numbers,
sampling parameters and penalty counts are static device inputs (``SampleInputs``) the
host fills before the replay (a few bytes of uniforms per step); inside, the graph runs the
pure functions of ``runtime/sampling.py`` on the head logits: drafts d_j ~ q_j (q kept on
the device for the verify) and speculative sampling in the verify, with the same readback.

**Fused verify + draft** (policy ``fused``, ``fused_graph.py``): a verify that carries the
draft blocks of the c likeliest acceptance lengths. Its states are (D + c·D, σ, fused),
after a fused hit and after a draft step alike (``_reopen_anchor``); their blocks live in a
workspace widened to (D + 1)·D slots. Every decode step attends over that same view with
row spans (``_step_view``): a row is then the same attention computation in an AR step, a
verify and a fused step (tests/test_row_invariance.py). The wide view costs the other roles
nothing: a tile's workspace loop ends at its rows' last visible workspace slot.

**Cold start** (``precompile.py``): before capturing at load, every state's body runs once
(its first layer: every layer launches the same variants) with its Triton launches turned
into compile requests that a thread pool compiles in parallel (each kernel's launcher too);
capture takes each state once its own kernels are compiled, after one warm-up run where the
state launches a variant no earlier state launched and none elsewhere. The graphs are the
ones captured without it; a load whose kernels an earlier load left in the Triton cache
skips it. On by default (``RuntimeOptions(precompile=False)`` or ``BITMTP_PRECOMPILE=0``
turns it off).

Ablation switches (``RuntimeOptions``): ``specialize`` (M1: width-specialised kernel
configs and the cheap draft head), ``graphs`` (M2: capture + replay instead of eager
launches), ``hoist_verify`` (M3). Generic = none of them, Full = all three.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..format.config import AUTO_CANDIDATES
from ..format.segments import KVPlan
from ..runtime.calibration import ConfidenceCalibration
from ..runtime.kv import KVStore
from ..runtime.masks import LengthAffine, draft_in_place_spans, history_step_spans, prefill_mask
from ..runtime.replay import ReplayState
from ..runtime.sampling import filtered_probs, inverse_cdf, penalize, sample_drafts, speculative_accept, target_probs
from .base import (NON_FINITE_TOKEN, PREFILL_CHUNK, DraftResult, FusedResult, StepLog, VerifyResult, check_pending,
                   flag_non_finite)
from .fast_model import FastModel
from .fused_graph import FusedInputs, fused_body, fused_width

log = logging.getLogger(__name__)

# The stream graphs are warmed up and captured on; None: torch's own. A captured kernel runs
# where it was captured, so a benchmark that confines the runtime to part of a GPU (a green
# context: tools/bench_replay_widths.py --sms) hands a stream of that context here.
_CAPTURE_STREAM: list = [None]


@contextlib.contextmanager
def capture_stream(stream):
    """Capture (and warm up) every graph on ``stream`` inside this block."""
    previous, _CAPTURE_STREAM[0] = _CAPTURE_STREAM[0], stream
    try:
        yield
    finally:
        _CAPTURE_STREAM[0] = previous


@dataclass(frozen=True)
class RuntimeOptions:
    specialize: bool = True  # M1
    graphs: bool = True  # M2
    hoist_verify: bool = True  # M3
    capture: str = "load"  # "load" (all states up front) or "lazy" (per state, first use)
    kv_dtype: torch.dtype = torch.float16
    # candidate counts c whose fused states are captured at load (others: at first use); with
    # more than one, the load times them and policy fused picks c per pass among them
    # (``runtime/candidates.py``) unless a generation fixes c
    fused_candidates: tuple[int, ...] = AUTO_CANDIDATES
    # Compile every Triton kernel the states at load launch, in parallel, before capturing
    # them (``precompile.py``); BITMTP_PRECOMPILE=0 turns it off, =N sets N threads. On by
    # default: on the H200 (2B shape) a cold start took 9.3-9.7 s with it (over 33 s without),
    # and a warm start skips it (the warm marker) and captures after one warm-up run instead
    # of two, and most states after none: 4.3 s (5.5 s with one run each; 7.0 s without the
    # pass: two runs each; tools/results/startup.md).
    precompile: bool = True
    precompile_mode: str = "threads"  # or "processes"; BITMTP_PRECOMPILE_MODE overrides it
    # threads: capture a state as soon as its own kernels are compiled (later states' kernels
    # still compiling); False: wait for all first. BITMTP_PRECOMPILE_OVERLAP=0 turns it off.
    precompile_overlap: bool = True
    precompile_workers: int = 0  # compile threads (processes); 0: one per core, as memory allows
    precompile_timeout_s: float = 600.0

    PRESETS = ("generic", "m1", "m1+m2", "full")

    @classmethod
    def preset(cls, name: str, **kw) -> "RuntimeOptions":
        flags = {"generic": (False, False, False), "m1": (True, False, False),
                 "m1+m2": (True, True, False), "full": (True, True, True)}
        if name not in flags:
            raise ValueError(f"unknown runtime configuration {name!r}; choose one of {', '.join(flags)}")
        s, g, h = flags[name]
        return cls(specialize=s, graphs=g, hoist_verify=h, **kw)


def cuda_ms(fn, repeats: int, device=None) -> float:
    """Mean ms of ``fn`` over ``repeats`` calls, by CUDA events around all of them (the
    benchmarks' timer too: ``tools/bench_e2e.py``)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / repeats


def accept_on_device(block: torch.Tensor, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify graph's accept, without a host sync: ``decoding_rules.accepted_prefix`` on the device.

    block [D + 1] int64: [anchor, d_1..d_D]; greedy [D + 1] int64: the verifier's greedy
    token of each row -> (accepted a [1] int64, verifier token v = greedy[a] [1] int64).
    d_j is accepted while it equals the greedy token of row j - 1 (a cumulative product of
    matches counts the leading run).
    """
    assert block.dim() == 1 and greedy.shape == block.shape, (block.shape, greedy.shape)
    match = (block[1:] == greedy[:-1]).long()  # [D]
    accepted = match.cumprod(0).sum().view(1)
    return accepted, greedy.gather(0, accepted)


@dataclass
class StaticInputs:
    """Every tensor the captured graphs read or write, allocated once at the largest width.

    Graph bodies use these fields (and slices of them) only, so their addresses never
    change between capture and replay.
    """

    history_len: torch.Tensor  # [1] int64: L, the history length on the device
    attn_rows: torch.Tensor  # [1] int32: L + the rows this step keeps (attention skips slots past it)
    ar_token: torch.Tensor  # [1] int64: the AR step's input token
    ar_out: torch.Tensor  # [1] int64: the AR step's greedy next token
    pending: torch.Tensor  # [max(D, 1)] int64: p_1..p_k in [:k] (a verify writes v into [:1])
    verify_tokens: torch.Tensor  # [D + 1] int64: [anchor, d_1..d_D]
    mask_ids: torch.Tensor  # [D - 1] int64: the mask token, constant
    readback: torch.Tensor  # [2 + 2D] float64: a, v, d_1..d_D, c_1..c_D
    draft_offsets: dict[int, torch.Tensor]  # k -> [k + D] int64: positions of a width-(k + D) draft after L
    verify_offsets: torch.Tensor  # [D + 1] int64: -1..D-1, the verify rows' positions after L
    # in attn_rows (L + the rows a step keeps): ("ar" | "verify" | "draft", k) -> the step's [M, 3] spans
    spans: dict[tuple[str, int], LengthAffine]
    draft_slots: dict[tuple[int, int], LengthAffine]  # (segment, k) -> in L: a draft's [k + D] write slots
    fused: FusedInputs | None  # the fused steps' inputs and readback (D >= 2)

    @classmethod
    def allocate(cls, block_size: int, mask_token_id: int | None, device,
                 capacities: tuple[int, ...] = ()) -> "StaticInputs":
        """``capacities``: each segment's history capacity (a draft's block rows go past it)."""
        d = block_size

        def longs(n):
            return torch.zeros(n, dtype=torch.long, device=device)

        # A step keeping h rows from L on has attn_rows a = L + h: the AR row is at L = a - 1,
        # the verify rows from the anchor's slot L - 1 = a - D - 1, the draft's pending from a - k.
        spans = {("ar", 1): LengthAffine.of(lambda a: history_step_spans(a - 1, 1), device)}
        if d:
            spans[("verify", d + 1)] = LengthAffine.of(lambda a: history_step_spans(a - d - 1, d + 1), device)
        for k in range(1, d + 1):
            spans[("draft", k)] = LengthAffine.of(lambda a, k=k: draft_in_place_spans(a - k, k, d), device)
        draft_slots = {(seg, k): LengthAffine.of(lambda n, k=k, cap=cap: torch.cat(
            [n + torch.arange(k), cap + torch.arange(d)]), device)
            for seg, cap in enumerate(capacities) for k in range(1, d + 1)}

        return cls(
            history_len=longs(1), attn_rows=torch.zeros(1, dtype=torch.int32, device=device),
            ar_token=longs(1), ar_out=longs(1), pending=longs(max(d, 1)), verify_tokens=longs(d + 1),
            mask_ids=torch.full((max(d - 1, 0),), mask_token_id if mask_token_id is not None else 0,
                                dtype=torch.long, device=device),
            readback=torch.zeros(2 + 2 * d, dtype=torch.float64, device=device),
            draft_offsets={k: torch.tensor(list(range(k)) + list(range(k - 1, k - 1 + d)), device=device)
                           for k in range(1, d + 1)},
            verify_offsets=torch.arange(-1, d, device=device), spans=spans, draft_slots=draft_slots,
            fused=FusedInputs.allocate(d, device) if d > 1 else None,
        )

    def mutable(self) -> list[torch.Tensor]:
        """The tensors a step changes (warm-up runs before capture restore them)."""
        fused = self.fused.mutable() if self.fused is not None else []
        return [self.history_len, self.ar_token, self.ar_out, self.pending, self.verify_tokens, self.readback, *fused]


SAMPLING_PARAMS = ("temperature", "top_k", "top_p", "repetition", "frequency", "presence")


@dataclass
class SampleInputs:
    """The sampled graphs' extra static inputs (allocated at the first sampled step)."""

    params: tuple[torch.Tensor, ...]  # 6 x [] float32: SAMPLING_PARAMS, in SamplingState.values order
    seen: torch.Tensor  # [V] float32: counts of prompt + generated tokens (penalties)
    generated: torch.Tensor  # [V] float32: counts of generated tokens (penalties)
    q: torch.Tensor  # [D, V] float32: the last draft's distributions, for the verify
    u_ar: torch.Tensor  # [1] float32 uniforms of an AR step
    u_draft: torch.Tensor  # [D] float32 uniforms of a draft step
    u_verify: torch.Tensor  # [D + 1] float32 uniforms of a verify step

    @classmethod
    def allocate(cls, block_size: int, vocab: int, device) -> "SampleInputs":
        d = block_size

        def zeros(*shape):
            return torch.zeros(*shape, dtype=torch.float32, device=device)

        return cls(params=tuple(zeros(()) for _ in SAMPLING_PARAMS), seen=zeros(vocab), generated=zeros(vocab),
                   q=zeros(max(d, 1), vocab), u_ar=zeros(1), u_draft=zeros(max(d, 1)), u_verify=zeros(d + 1))

    def stage(self, sampler, uniforms: torch.Tensor, new_request: bool) -> None:
        """Copy in one step's values: the parameters once per request, the penalty counts
        when penalties are on (device to device), and the step's uniforms."""
        if new_request:
            for buf, value in zip(self.params, sampler.values):
                buf.fill_(float(value))
        if sampler.penalized:
            self.seen.copy_(sampler.seen)
            self.generated.copy_(sampler.generated)
        uniforms.copy_(sampler.uniforms(uniforms.numel()))


@dataclass(frozen=True)
class Staged:
    """What the last step left in the static inputs, so the next copy-in can skip an upload."""

    ar_token: int | None = None  # the AR graph wrote its next token into ar_token
    verifier_token: int | None = None  # the verify graph wrote v into pending[:1]
    drafts: DraftResult | None = None  # readback[2:2 + D] holds these drafts
    fused_drafts: DraftResult | None = None  # a fused hit left [v, these drafts] in static.fused


class GraphBackend:
    def __init__(self, fast: FastModel, plan: KVPlan, mask_token_id: int | None, block_size: int | None,
                 options: RuntimeOptions = RuntimeOptions(), name: str = "ampere", progress=None,
                 calibration: ConfidenceCalibration | None = None):
        """``progress(done, total)``, when given, is called as graphs are captured at load.
        ``calibration``: the artifact's per-slot confidence map (``runtime.calibration``), or None."""
        self.calibration = calibration
        if options.graphs and fast.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use RuntimeOptions(graphs=False) on the CPU")
        self.name, self.fast, self.plan, self.opts = name, fast, plan, options
        self.mask_token_id, self.block_size = mask_token_id, block_size
        self.device = fast.device
        d = block_size or 0
        if plan.workspace < max(2 * d, 1):
            raise ValueError(f"the artifact's workspace ({plan.workspace} slots) is narrower than 2·D = {2 * d}")
        # the fused steps' draft blocks: up to D + 1 blocks of D rows, in views of their own
        fused_workspace = (d + 1) * d if d > 1 else None
        self.kv = KVStore(fast.cfg, plan, options.kv_dtype, self.device, workspace=fused_workspace)
        self.kv_bytes = self.kv.nbytes
        self.static = StaticInputs.allocate(d, mask_token_id, self.device,
                                           capacities=tuple(seg.capacity for seg in plan.segments))
        self.staged = Staged()
        self.log = StepLog()
        self.graphs: dict[ReplayState, torch.cuda.CUDAGraph] = {}
        # Sampled steps: graphs keyed by (state, penalized), inputs made at the first one.
        self.sample_graphs: dict[tuple[ReplayState, bool], torch.cuda.CUDAGraph] = {}
        self.sample_inputs: SampleInputs | None = None
        self._staged_sampler = None
        self.pool = torch.cuda.graph_pool_handle() if options.graphs else None
        self.capture_s = 0.0  # capturing the graphs at load (kernels compiled by then: see precompile_s)
        self.precompile_s = 0.0  # the precompile pass before capture (see ``precompile``)
        self.compile_wait_s = 0.0  # of the load, waiting for compiles: in precompile_s, or capture_s when overlapped
        self.precompile_report = None  # precompile.PrecompileReport of the load, when it ran
        self.precompile_warm = False  # the pass was skipped: an earlier load left every kernel in the cache
        self._warm_marker = None  # (marker, identity) to write once capture succeeds
        self.capture_warmups = 0  # eager runs before capturing a state at load that needs them (``_capture``)
        self.captured_without_warmup = 0  # states at load whose variants an earlier state's warm-up launched
        self.capture_fallbacks = 0  # of those, captures a first launch aborted (then warmed up and captured)
        self._variants: dict[str, list] | None = None  # state label -> the kernel variants the pass saw it launch
        self._warmed_up: list[str] | None = None  # the states a warm marker's load captured after a warm-up
        self.graph_pool_bytes = 0
        # µs per replay measured at load: {"draft": the draft step after a miss, "fused": {c: µs}}
        self.step_costs: dict | None = None
        self.step_costs_s = 0.0
        if options.graphs and options.capture == "load":
            self.capture_all(progress)
            if self.static.fused is not None and len(set(options.fused_candidates)) > 1:
                self.step_costs = self.time_fused_states()

    # -- geometry --------------------------------------------------------------------------
    @property
    def history_length(self) -> int:
        return self.kv.length

    @property
    def max_context(self) -> int:
        return self.kv.max_capacity

    @property
    def vocab_size(self) -> int:
        return self.fast.cfg.vocab_size

    def _reserve(self, needed: int) -> None:
        growths = self.kv.growths
        self.kv.reserve(needed)
        self.log.segment_growths += self.kv.growths - growths

    def states(self) -> list[ReplayState]:
        d = self.block_size or 0
        out = []
        for seg in range(len(self.plan.segments)):
            out.append(ReplayState(1, seg, "verify"))
            if d:
                out.append(ReplayState(d + 1, seg, "verify"))
                out += [ReplayState(k + d, seg, "draft") for k in range(1, d + 1)]
            if self.static.fused is not None:
                # one layout after a draft step and after a hit (_reopen_anchor): D causal rows
                widths = sorted({fused_width(d, d, c) for c in self.opts.fused_candidates})  # c > D: D blocks
                out += [ReplayState(w, seg, "fused") for w in widths]
        return out

    # -- graph bodies: everything below reads and writes static tensors only ------------------
    def _step_view(self, seg: int):
        """The KV view every decode step of segment ``seg`` attends over: the widened
        workspace, for every role. With one view and one visibility form (row spans), a row
        runs the same compiled attention with the same loop over the workspace whatever the
        step's width; on the H200 a verify row over the artifact's narrow workspace with an
        [M, S] mask and the same row in a fused step (spans, wide view) differed in the last
        bits of the attention output, which flipped an exact bf16 tie of the head."""
        return self.kv.view(seg, workspace=self.kv.allocated_workspace)

    def _forward(self, seg, tokens, positions, write_slots, spans: tuple[str, int], history_rows):
        """One step over segment ``seg`` with the row spans ``StaticInputs.spans[spans]``;
        ``history_rows`` = rows this step writes at slots from L on (attention skips history
        slots past L + history_rows). One launch each for attn_rows and the spans."""
        st, kv = self.static, self._step_view(seg)
        torch.add(st.history_len, history_rows, out=st.attn_rows)
        return self.fast.forward(tokens, positions, kv.k, kv.v, write_slots, None, st.attn_rows,
                                 capacity=kv.capacity, row_spans=st.spans[spans].at(st.attn_rows))

    def _ar_body(self, seg: int, sampled: bool | None = None) -> None:
        """``sampled``: None = greedy; else sample (True: with penalty counts)."""
        st = self.static
        x = self._forward(seg, st.ar_token, st.history_len, st.history_len, ("ar", 1), 1)
        if sampled is None:
            top, conf = self.fast.verify_greedy(x)
            top = flag_non_finite(x, top, conf)  # read with the token: no extra sync
        else:
            si = self.sample_inputs
            temperature, top_k, top_p, rep, freq, pres = si.params
            logits = self.fast.verify_sample_logits(x)  # [1, V]
            if sampled:
                logits = penalize(logits, si.seen, si.generated, rep, freq, pres)
            top = inverse_cdf(filtered_probs(logits, temperature, top_k, top_p), si.u_ar)
            top = flag_non_finite(x, top, logits.max(-1).values)
        st.history_len += 1
        st.ar_out.copy_(top)
        torch.clamp(top, min=0, out=st.ar_token)  # a flagged row must not index the embedding

    def _draft_body(self, seg: int, k: int, sampled: bool | None = None) -> None:
        st, d = self.static, self.block_size
        pending, L = st.pending[:k], st.history_len
        tokens = torch.cat([pending, pending[-1:], st.mask_ids])  # [k + D]
        # Pending rows at their own history slots, the block in the workspace.
        slots = st.draft_slots[(seg, k)].at(L)
        x = self._forward(seg, tokens, L + st.draft_offsets[k], slots, ("draft", k), k)
        if sampled is None:
            top, conf = self.fast.draft_top1(x[k:])
            if self.calibration is not None:
                conf = self.calibration(conf, 0)
            top = flag_non_finite(x[k:], top, conf)
        else:
            si = self.sample_inputs
            top, q, conf = sample_drafts(self.fast.draft_sample_logits(x[k:]), si.seen, si.generated, si.params,
                                         si.u_draft, sampled, self.calibration)
            si.q.copy_(q)  # the verify compares against these very distributions
            top = flag_non_finite(x[k:], top, conf)
        L += k
        st.readback[2:2 + d].copy_(top)
        st.readback[2 + d:].copy_(conf)
        if self.opts.hoist_verify:  # M3: the verifier's inputs are ready before the host looks
            st.verify_tokens[:1].copy_(pending[-1:])
            torch.clamp(top, min=0, out=st.verify_tokens[1:])

    def _verify_body(self, seg: int, sampled: bool | None = None) -> None:
        st, d = self.static, self.block_size
        # from the anchor's own slot L - 1 (its row is recomputed bit for bit)
        positions = st.history_len + st.verify_offsets
        x = self._forward(seg, st.verify_tokens, positions, positions, ("verify", d + 1), d)
        if sampled is None:
            greedy, conf = self.fast.verify_greedy(x, drafts=st.verify_tokens[1:])  # [D + 1]
            greedy = flag_non_finite(x, greedy, conf)
            accepted, verifier = accept_on_device(st.verify_tokens, greedy)
        else:
            si, drafts = self.sample_inputs, st.verify_tokens[1:]
            p = target_probs(self.fast.verify_sample_logits(x), drafts, si.seen, si.generated, si.params, sampled)
            accepted, verifier = speculative_accept(p, si.q, drafts, si.u_verify[:d], si.u_verify[d:])
            finite = torch.isfinite(x).all() & torch.isfinite(p).all()  # NaN anywhere: flag the commit
            verifier = torch.where(finite, verifier, torch.full_like(verifier, NON_FINITE_TOKEN))
        st.history_len += accepted  # d_1..d_a are already at their slots
        st.readback[0:1].copy_(accepted)
        st.readback[1:2].copy_(verifier)
        torch.clamp(verifier, min=0, out=st.pending[:1])

    def _fused_body(self, seg: int, count: int) -> None:
        """[v, e_1..e_{D-1}] as the last fused graph left them, or [anchor, d_1..d_{D-1}] as
        ``_reopen_anchor`` staged them after a draft step: the anchor pending at slot L."""
        st = self.static
        kv = self._step_view(seg)
        fused_body(self.fast, kv.k, kv.v, kv.capacity, st.history_len, st.attn_rows, self.mask_token_id, st.fused,
                   count, st.pending[:1], self.calibration)

    def _body(self, state: ReplayState, sampled: bool | None = None):
        d = self.block_size or 0
        if state.role == "fused":
            if state.width % d:
                raise ValueError(f"fused width {state.width}: D causal rows plus whole blocks of D={d}")
            return lambda: self._fused_body(state.segment, state.width // d - 1)
        if state.role == "verify" and state.width == 1:
            return lambda: self._ar_body(state.segment, sampled)
        if state.role == "verify":
            return lambda: self._verify_body(state.segment, sampled)
        return lambda: self._draft_body(state.segment, state.width - d, sampled)

    # -- capture / replay ------------------------------------------------------------------
    def _capture(self, state: ReplayState, sampled: bool | None = None, warmups: int = 2) -> None:
        """Capture one state after ``warmups`` eager runs of its body on a side stream.

        What must not happen inside capture happens in the first run: each Triton kernel's
        first launch compiles it (or loads it from the disk cache), loads its module, builds
        its launcher and sets its attributes (``common.apply_carveout``); tuning-table lookups
        and the PDL check are cached; the torch ops allocate from the caching allocator (the
        graph's own allocations come from its private pool either way). Nothing here tunes
        at run time or counts calls, and the inputs are restored after each run, so a second
        run repeats the first exactly: ``capture_all`` asks for one when the precompile pass
        ran (or a warm cache vouches for) the states' kernels; two stay where capture also
        compiles (the pass off, sampled graphs at first use), the path measured before.

        ``warmups=0``: no run, for a state whose every kernel variant an earlier state's run
        already launched (``capture_all``); everything above then happened already. The
        capture is guarded (``precompile.first_launches_refused``): a launch that would be a
        variant's first aborts it before entering it, and the state is captured again after
        one warm-up run (``capture_fallbacks``).

        Warm-up runs mutate L and the chained inputs, so those are restored afterwards. Their
        KV writes land at or past slot L - 1; mid-stream (lazy capture) the step's inputs are
        already staged, so slot L - 1 gets the very row the real step writes, and everything
        past L is invisible."""
        if warmups < 0:
            raise ValueError(f"_capture: warmups must be >= 0, got {warmups}")
        mutable = self.static.mutable()
        saved = [t.clone() for t in mutable]
        body = self._body(state, sampled)
        graph = None
        if warmups == 0:
            graph = self._record_graph(body, mutable, saved, guarded=True)
            if graph is None:
                self.capture_fallbacks += 1
                warmups = 1
        if graph is None:
            side = _CAPTURE_STREAM[0] or torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(warmups):
                    if self.kv.length == 0:  # at load: a verify recomputes slot L - 1, so L must be >= 1
                        self.static.history_len.fill_(1)
                    body()
                    for t, s in zip(mutable, saved):
                        t.copy_(s)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = self._record_graph(body, mutable, saved, guarded=False)
        if sampled is None:
            self.graphs[state] = graph
        else:
            self.sample_graphs[(state, sampled)] = graph

    def _record_graph(self, body, mutable: list[torch.Tensor], saved: list[torch.Tensor], guarded: bool):
        """Capture ``body`` into a new graph in the shared pool; the inputs it changed are
        restored after. ``guarded``: refuse first launches; -> None when one aborted it."""
        from .precompile import FirstLaunch, first_launches_refused

        # A graph's intermediates are freed back into its private pool when capture ends:
        # allocated memory does not move, the pool's reserved segments do.
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        # No garbage collection while capturing: a collected CUDAGraph (an earlier engine's,
        # freed through a reference cycle) resets its graph mid-capture, which CUDA refuses
        # and which invalidates this capture (torch no longer collects on entering capture).
        collecting = gc.isenabled()
        gc.disable()
        try:
            with first_launches_refused() if guarded else contextlib.nullcontext():
                with torch.cuda.graph(graph, pool=self.pool, stream=_CAPTURE_STREAM[0]):
                    body()
        except FirstLaunch as e:  # nothing ran (capture only records): the restore below suffices
            log.info("capturing without a warm-up run stopped at a first launch (%s); warming up first", e)
            graph = None
        finally:
            if collecting:
                gc.enable()
        for t, s in zip(mutable, saved):
            t.copy_(s)
        torch.cuda.synchronize(self.device)
        self.graph_pool_bytes += max(torch.cuda.memory_reserved(self.device) - before, 0)
        return graph

    def capture_all(self, progress=None) -> None:
        gc.collect()  # free unreachable graphs now, not while capturing (see ``_capture``)
        states = self.states()
        job = self.precompile(states)  # compiles still running (overlap), or None
        warmups = self._warm_up_plan(states)
        t0 = time.perf_counter()
        try:
            for i, state in enumerate(states):
                if job is not None:
                    job.wait(str(state))  # this state's kernels compiled (bounded, errors named)
                fallbacks = self.capture_fallbacks
                self._capture(state, warmups=warmups[str(state)])
                if warmups[str(state)] == 0:
                    self.captured_without_warmup += 1
                    if self.capture_fallbacks > fallbacks:
                        warmups[str(state)] = 1  # a later load warms it up at once
                if progress is not None:
                    progress(i + 1, len(states))
            if job is not None:
                self.precompile_report = job.finish()
                self.compile_wait_s = job.wait_s
            if self._warm_marker is not None:  # every kernel of these states is in the cache now
                from .precompile import mark_warm

                mark_warm(*self._warm_marker, warmed_up=[label for label, n in warmups.items() if n])
                self._warm_marker = None
        except BaseException:
            if job is not None:
                job.abort()
            raise
        self.capture_s = time.perf_counter() - t0

    def time_fused_states(self, rounds: int = 5, history: int = 64) -> dict:
        """µs per replay of segment 0's fused states and of its draft step after a miss (width
        1 + D), at history length ``history`` (capped by the segment): what policy fused prices
        its candidate counts with on this GPU (``runtime/candidates.py``). The states take
        turns, one replay each per round, and each state's median counts: on a board whose
        clocks ramp while this runs, timing one state after another would price the last one
        at a faster clock. Each replay moves the device's history length, so it is reset before
        every replay and the reset alone (timed the same way, launch gap included) subtracted;
        before any generation nothing else of the graphs' writes is read, and the backend is
        reset after."""
        t0 = time.perf_counter()
        d, st = self.block_size, self.static
        length = min(history, self.plan.segments[0].capacity // 2)
        reset = lambda: st.history_len.fill_(length)  # noqa: E731
        wanted = {"draft": ReplayState(1 + d, 0, "draft")}
        wanted.update({c: ReplayState(fused_width(d, d, c), 0, "fused") for c in sorted(set(self.opts.fused_candidates))})
        steps = {key: (lambda graph=self.graphs[state]: (reset(), graph.replay())) for key, state in wanted.items()}
        times: dict = {key: [] for key in steps}
        resets = []
        try:
            for step in steps.values():
                step()  # the first replay after capture pays for what the capture left cold
            for _ in range(rounds):
                for key, step in steps.items():
                    resets.append(cuda_ms(reset, 1, self.device))
                    times[key].append(cuda_ms(step, 1, self.device))
        finally:
            self.reset()
        base = statistics.median(resets)
        us = {key: 1000 * (statistics.median(ms) - base) for key, ms in times.items()}
        self.step_costs_s = time.perf_counter() - t0
        return {"draft": us.pop("draft"), "fused": us, "history": length}

    def _warm_up_plan(self, states: list[ReplayState]) -> dict[str, int]:
        """Warm-up runs before capturing each state at load (``_capture``). Two where capture
        also compiles (the pass off). Once the pass ran (or a warm cache holds every kernel):
        one for a state that launches a kernel variant no earlier state launched, none for
        the others (their variants are loaded; the capture is guarded), as the pass saw the
        states launch them (``precompile.warm_up_plan``) or the warm marker's load captured
        them. 48 states x 30 ms of host Python a run on the 2B shape."""
        from .precompile import can_refuse_first_launches, warm_up_plan

        labels = [str(s) for s in states]
        if not (self.precompile_warm or self.precompile_report is not None):
            self.capture_warmups = 2
            return dict.fromkeys(labels, 2)
        self.capture_warmups = 1
        if not can_refuse_first_launches():
            return dict.fromkeys(labels, 1)
        if self._variants is not None:
            return warm_up_plan(labels, self._variants)
        warmed = set(self._warmed_up) if self._warmed_up is not None else set(labels)
        return {label: 1 if label in warmed else 0 for label in labels}

    def precompile(self, states: list[ReplayState]):
        """Compile the Triton kernels ``states`` launch, in parallel, so that capture finds
        them compiled (``precompile.py``). Each body runs as ``_capture``'s warm-up runs it
        (L >= 1 at load), its Triton launches turned into compile requests, and the static
        inputs it changes are restored after it. -> the running ``CompileJob`` (threads) or
        ``ProcessJob`` (processes) when capture overlaps the compiles (it waits per state),
        else None (all compiled, or nothing to compile)."""
        from .precompile import (default_workers, precompile_mode, precompile_overlap, precompile_setting,
                                 start_precompile, start_precompile_processes, warm_marker)

        on, workers = precompile_setting(self.opts.precompile, self.opts.precompile_workers)
        if not on or self.fast.ops.twin:  # the twins launch no kernel
            return None
        identity = self._kernel_identity(states)
        marker = warm_marker(identity)
        if marker.exists():  # an earlier load compiled all of them into this cache: capture loads them
            from .precompile import warmed_up_states

            log.info("precompile skipped: the Triton cache holds this load's kernels (%s)", marker)
            self.precompile_warm = True
            self._warmed_up = warmed_up_states(marker)
            return None
        self._warm_marker = (marker, identity)  # written once capture has succeeded
        mutable = self.static.mutable()
        saved = [t.clone() for t in mutable]

        def request(state: ReplayState):
            body = self._body(state)

            def run() -> None:
                if self.kv.length == 0:
                    self.static.history_len.fill_(1)
                with self.fast.first_layers(1):  # every layer launches the first one's variants
                    body()
                for t, s in zip(mutable, saved):
                    t.copy_(s)

            return str(state), run

        t0 = time.perf_counter()
        processes = precompile_mode(self.opts.precompile_mode) == "processes"
        bodies, workers = [request(s) for s in states], workers or default_workers(processes=processes)
        start = start_precompile_processes if processes else start_precompile
        job = start(bodies, workers, self.opts.precompile_timeout_s)
        if job is not None:
            self.precompile_report = job.report
            self._variants = job.variants
            if not precompile_overlap(self.opts.precompile_overlap):
                t1 = time.perf_counter()
                self.precompile_report = job.finish()
                self.compile_wait_s = time.perf_counter() - t1
                job = None
        self.precompile_s = time.perf_counter() - t0
        return job

    def _kernel_identity(self, states: list[ReplayState]) -> dict:
        """What decides the kernel variants ``states`` launch (``precompile.load_identity``): a
        later load with the same identity finds them all in the Triton cache."""
        import triton

        import kernels_ampere

        from .precompile import load_identity

        cuda = self.device.type == "cuda"
        options = {f.name: getattr(self.opts, f.name) for f in dataclasses.fields(self.opts)
                   if not f.name.startswith("precompile")}  # how it compiles changes no kernel
        fields = {"triton": triton.__version__, "torch": torch.__version__,
                  "gpu": torch.cuda.get_device_name(self.device) if cuda else str(self.device),
                  "capability": list(torch.cuda.get_device_capability(self.device)) if cuda else None,
                  "model": repr(self.fast.cfg), "quant": repr(self.fast.quant),
                  "head": (str(self.fast.head_dtype), self.fast.verify_head_kind),
                  "draft_head": (self.fast.draft_head_kind, self.fast.draft_head is not None),
                  "plan": repr(self.plan), "options": repr(options), "block_size": self.block_size,
                  "states": [str(s) for s in states]}
        return load_identity(fields, [Path(kernels_ampere.__file__).parent, Path(__file__).parent])

    def _replay(self, state: ReplayState, sampled: bool | None = None) -> None:
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

    def _stage(self, sampler, uniforms: str) -> bool | None:
        """Copy in a sampled step's inputs (``uniforms``: which buffer); returns the
        ``sampled`` key of its graph (None: greedy, no sampler)."""
        if sampler is None:
            return None
        if self.sample_inputs is None:
            self.sample_inputs = SampleInputs.allocate(self.block_size or 0, self.vocab_size, self.device)
        si = self.sample_inputs
        si.stage(sampler, getattr(si, uniforms), new_request=self._staged_sampler is not sampler)
        self._staged_sampler = sampler
        return sampler.penalized

    def _slice_out(self, t: torch.Tensor) -> list:
        """The one host read of a step."""
        self.log.host_syncs += 1
        return t.tolist()

    @staticmethod
    def _upload(buf: torch.Tensor, values: list[int]) -> None:
        buf.copy_(torch.tensor(values, dtype=torch.long))

    # -- the Backend interface ---------------------------------------------------------------
    def reset(self) -> None:
        self.kv.reset()
        self.static.history_len.zero_()
        self.log = StepLog()
        self.staged = Staged()
        self._staged_sampler = None

    def prefill(self, token_ids: list[int]) -> None:
        from kernels_ampere.attention import small_width_attention_reference

        st = self.static
        for start in range(0, len(token_ids), PREFILL_CHUNK):
            chunk = token_ids[start:start + PREFILL_CHUNK]
            n, length = len(chunk), self.kv.length
            self._reserve(length + n)
            kv = self.kv.view()
            ids = torch.tensor(chunk, dtype=torch.long, device=self.device)
            pos = torch.arange(length, length + n, device=self.device)
            mask = prefill_mask(kv.slots, length, n, self.device)
            st.attn_rows.fill_(length + n)  # the chunk's own rows are history already
            # Prefill is eager and wide; the small-width kernel is for decode widths.
            self.fast.forward(ids, pos, kv.k, kv.v, pos, mask, st.attn_rows, capacity=kv.capacity,
                              attention=small_width_attention_reference)
            self.kv.advance(n)
        st.history_len.fill_(self.kv.length)
        self.staged = Staged()

    def ar_step(self, token: int, sampler=None) -> int:
        self._reserve(self.kv.length + 1)
        if self.staged.ar_token != token:  # copy in, unless the last AR graph already wrote it
            self._upload(self.static.ar_token, [token])
        sampled = self._stage(sampler, "u_ar")
        self._replay(ReplayState(1, self.kv.segment, "verify"), sampled)
        self.kv.advance(1)
        nxt = int(self._slice_out(self.static.ar_out)[0])
        self.staged = Staged(ar_token=nxt)
        return nxt

    def draft_step(self, pending: list[int], block_size: int, sampler=None) -> DraftResult:
        if self.mask_token_id is None:
            raise RuntimeError("this artifact has no MTP block (AR-only); use policy='ar'")
        if block_size != self.block_size:
            raise ValueError(f"block size {block_size} != the captured D={self.block_size}")
        check_pending(pending, block_size)
        k, d, st = len(pending), block_size, self.static
        self._reserve(self.kv.length + k + d)
        # Copy in p_1..p_k: nothing when the verify graph left v there, device to device when
        # they are the drafts still in readback, else from the host.
        drafts = self.staged.drafts
        if k == 1 and self.staged.verifier_token == pending[0]:
            pass
        elif drafts is not None and drafts.loaded and list(pending) == drafts.tokens[:k]:
            st.pending[:k].copy_(st.readback[2:2 + k].long())
        else:
            self._upload(st.pending[:k], pending)
        sampled = self._stage(sampler, "u_draft")
        self._replay(ReplayState(k + d, self.kv.segment, "draft"), sampled)
        self.kv.advance(k)

        def slice_out():
            values = self._slice_out(st.readback[2:])
            return [int(t) for t in values[:d]], values[d:]

        result = DraftResult(loader=slice_out)
        self.staged = Staged(drafts=result)
        return result

    def verify_step(self, anchor: int, draft: DraftResult, sampler=None) -> VerifyResult:
        d, st = self.block_size, self.static
        if not self.opts.hoist_verify:  # Generic: prepare the verifier's inputs after the branch
            self._upload(st.verify_tokens, [anchor] + [max(t, 0) for t in draft.tokens])
        sampled = self._stage(sampler, "u_verify")
        self._replay(ReplayState(d + 1, self.kv.segment, "verify"), sampled)
        values = self._slice_out(st.readback)  # a, v, drafts, confidences: one transfer
        accepted, verifier = int(values[0]), int(values[1])
        draft.deliver([int(t) for t in values[2:2 + d]], values[2 + d:])
        self.kv.advance(accepted)
        self.staged = Staged(verifier_token=verifier)
        return VerifyResult(accepted, verifier)

    def fused_step(self, anchor: int, pending: list[int], draft: DraftResult, candidates: int,
                   block_size: int) -> FusedResult:
        d, st = self.block_size, self.static
        if st.fused is None or self.mask_token_id is None:
            raise RuntimeError("fused steps need an MTP block of D >= 2; use policy='ar' or 'speculative'")
        if block_size != d:
            raise ValueError(f"block size {block_size} != the captured D={d}")
        if len(pending) > 1:
            raise ValueError(f"the graph backend fuses right after a draft step (no pending tokens) or after a "
                             f"fused hit (pending [v]); got {len(pending)} pending tokens")
        drafts_on_device = False
        if not pending:  # right after a draft step: the anchor pending again, d_1..d_{D-1}
            drafts_on_device = self._reopen_anchor(anchor, draft)
        elif not (self.staged.fused_drafts is draft and self.staged.verifier_token == pending[0]):
            self._check_drafts(draft, d - 1)
            self._upload(st.fused.causal, [pending[0]] + list(draft.tokens))
            st.fused.conf.copy_(torch.tensor(draft.confidences, dtype=torch.float32))
        self._reserve(self.kv.length + d)  # the causal rows end at slot L + D - 1
        self._replay(ReplayState(fused_width(d, d, candidates), self.kv.segment, "fused"))
        sl = FusedInputs.slices(d)
        if drafts_on_device:  # the draft step's D drafts (flagged) and confidences come back with this read
            st.fused.readback[sl["held_tokens"].start:sl["held_conf"].stop].copy_(st.readback[2:2 + 2 * d])
        values = self._slice_out(st.fused.readback)  # everything the host needs: one transfer
        accepted, verifier, hit = int(values[0]), int(values[1]), values[2] != 0
        chosen = [int(j) for j in values[sl["candidates"]] if j >= 0]
        # a draft step's lazy drafts come back with this read
        draft.deliver([int(t) for t in values[sl["held_tokens"]]], values[sl["held_conf"]])
        self.kv.advance(1 + accepted)  # the pending anchor or v, and d_1..d_a
        nxt = DraftResult([int(t) for t in values[sl["next_tokens"]]], values[sl["next_conf"]]) if hit else None
        # pending[:1] holds v for a draft step after a miss; static.fused the drafts after a hit
        self.staged = Staged(verifier_token=verifier, fused_drafts=nxt)
        return FusedResult(accepted, verifier, chosen, nxt)

    def _reopen_anchor(self, anchor: int, draft: DraftResult) -> bool:
        """After a draft step a fused step verifies d_1..d_{D-1} in the layout of a fused hit:
        the anchor pending at its own slot (its KV row, which the draft step wrote, is
        recomputed there bit for bit), D causal rows, width D + c·D. Verifying d_D as well
        would take one row more (D + 1 + c·D): past a 16-row tile at c = 1 and a 32-row one at
        c = 3, which cost a board proxy 1.31x and the H200 1.14x the pass (docs/decoding.md,
        "Fused steps after a draft step"). True when the draft graph's outputs are still on the
        device (the host has not read them: they come back with the fused step's read)."""
        d, st = self.block_size, self.static
        self.kv.rewind(1)
        st.history_len.sub_(1)
        if self.staged.drafts is draft and self.opts.hoist_verify:
            st.fused.causal.copy_(st.verify_tokens[:d])  # [anchor, clamped d_1..d_{D-1}]
            st.fused.conf.copy_(st.readback[2 + d:2 + 2 * d - 1])
            return True
        self._check_drafts(draft, d)
        self._upload(st.fused.causal, [anchor] + list(draft.tokens[:d - 1]))
        st.fused.conf.copy_(torch.tensor(draft.confidences[:d - 1], dtype=torch.float32))
        return False

    @staticmethod
    def _check_drafts(draft: DraftResult, expected: int) -> None:
        if len(draft.tokens) != expected:
            raise ValueError(f"a fused step here verifies {expected} drafts, got {len(draft.tokens)}")

    @torch.no_grad()
    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        from kernels_ampere.attention import small_width_attention_reference

        assert token_ids.dim() == 1, f"token_ids must be [T], got {tuple(token_ids.shape)}"
        ids = token_ids.to(self.device)
        t = ids.numel()
        if t > self.max_context:
            raise ValueError(f"{t} tokens exceed the largest KV segment ({self.max_context})")
        self.reset()
        kv = self.kv.view(self.plan.segment_for(t))
        pos = torch.arange(t, device=self.device)
        self.static.attn_rows.fill_(t)
        x = self.fast.forward(ids, pos, kv.k, kv.v, pos, prefill_mask(kv.slots, 0, t, self.device),
                              self.static.attn_rows, capacity=kv.capacity, attention=small_width_attention_reference)
        self.reset()
        return self.fast.verify_logits(x)


__all__ = ["GraphBackend", "RuntimeOptions", "SampleInputs", "StaticInputs", "Staged", "accept_on_device",
           "capture_stream"]
