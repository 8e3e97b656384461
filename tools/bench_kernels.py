"""Kernel micro-benchmarks on one GPU (issues 4, 15): W2A8 / W2A16 linears, heads, attention, quant.

Sections (``--only``, in this order): ``floor`` (µs per launch of empty kernels and of the
smallest W2A8 launch, tools/kernel_probe.py), ``large`` (single very large matrices: the
kernels' sustained weights per SM-clock), ``stack`` (the Orin proxy: a model's whole stack of
ternary linears per launch scheme and width, tools/kernel_stack.py; with ``--sweep`` the
table of this GPU gets, per width, the launches of the stack-fastest scheme), then the
per-kernel sections below. The Orin projection uses the large-matrix rates.

For each layer shape of BitNet-2B and Bonsai-1.7B, the LM head, and widths M in {1, 5, 9, 17}:

* check the kernel against its pure-PyTorch twin on fresh random inputs (before any timing);
* time it: CUDA-graph replay of ``--reps`` back-to-back calls that rotate over enough weight
  copies (>= 8, >= ``--rotate-mb`` MB together) that every call reads its weights from DRAM,
  not L2; median over ``--replays`` replays; µs per call;
* report effective GB/s (bytes each call must move / time) against the device-to-device copy
  bandwidth measured in the same run (bytes read + written), and bf16 cuBLAS ``F.linear`` on
  the same shape in the same run.

``--tune`` first times the candidate configurations of ``kernels_ampere.tuning`` for every
(op, N, K, M) benchmarked and writes the winners to ``kernels_ampere/tuned/<gpu>.json``
(and a copy under ``--out``); the benchmark then runs with that table.

Each variant runs in its own try/except: a failure is recorded with its message and the run
goes on (a CUDA fault that poisons the context still ends the run; the JSON written so far
stays). Writes ``<out>/kernels.json`` and ``<out>/kernels.md`` (default ``tools/results``)
with the device, date, git commit and the exact command.

    python tools/bench_kernels.py               # everything (~5 min on an H200)
    python tools/bench_kernels.py --quick       # smoke run: two shapes, M in {1, 17}
    python tools/bench_kernels.py --tune        # tune, save the table, then benchmark
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels_ampere import pack_ternary, tuning  # noqa: E402
from kernels_ampere.common import shared_carveout  # noqa: E402
from kernels_ampere.autotune import GraphTimer, precompile  # noqa: E402
from kernels_ampere.numerics import quantize_activations, quantize_rows_int4, quantize_rows_int8  # noqa: E402
from tools.kernel_probe import best_large, fixed_cost, floor_rows, large_candidates, large_rows  # noqa: E402
from tools.kernel_probe import LARGE_SHAPES  # noqa: E402
from tools.kernel_stack import (BOARDS, ORIN_LAUNCH_US, STACK_MODELS, STACK_WIDTHS, Stack, project,  # noqa: E402
                                scheme_configs, sm_clock_mhz, stack_row, sweep)

# before = the previous release's table; shipped = what a call without a config launches now;
# +pf = the same launches with the L2 prefetch before the programmatic-launch wait;
TABLE_SCHEMES = ("tuned", "before (tuned table)", "v1 untuned", "v1 untuned+pf", "v3 untuned", "v4 untuned",
                 "v5 untuned", "v5 untuned+bm32", "v5 untuned+bn128", "v5 untuned+fold")
CARVEOUT_PERCENT = 100  # the '+co' schemes: every W2A8 launch prefers the largest shared-memory split
# +co = the same launches with one fixed L1 / shared-memory split for every W2A8 kernel
STACK_SCHEMES = ("before (tuned table)", "shipped", "v1 untuned", "v1 untuned+pf", "v2 untuned", "v3 untuned",
                 "v5 untuned", "shipped+co")
LEGACY_TABLE = ROOT / "tools" / "results" / "legacy_tuned_nvidia_h200.json"

WIDTHS = (1, 5, 9, 17)
QUICK_WIDTHS = (1, 17)


@dataclass(frozen=True)
class LinearShape:
    model: str
    name: str
    n: int
    k: int
    grouped: bool  # group-128 scales (Bonsai) or per-row / per-segment scales (BitNet)


LINEAR_SHAPES = (
    LinearShape("bitnet-2b", "wqkv", 3840, 2560, False),
    LinearShape("bitnet-2b", "wo", 2560, 2560, False),
    LinearShape("bitnet-2b", "w13 (gate+up)", 13824, 2560, False),
    LinearShape("bitnet-2b", "w2 (down)", 2560, 6912, False),
    LinearShape("bonsai-1.7b", "q / o", 2048, 2048, True),
    LinearShape("bonsai-1.7b", "k / v", 1024, 2048, True),
    LinearShape("bonsai-1.7b", "gate+up", 12288, 2048, True),
    LinearShape("bonsai-1.7b", "down", 2048, 6144, True),
    # the embedded trained model (hidden 512, 8/2 heads of 64, FFN 1408): its e2e runs use these
    LinearShape("bitmtp-27m", "wqkv", 768, 512, False),
    LinearShape("bitmtp-27m", "wo", 512, 512, False),
    LinearShape("bitmtp-27m", "w13 (gate+up)", 2816, 512, False),
    LinearShape("bitmtp-27m", "w2 (down)", 512, 1408, False),
)
QUICK_SHAPES = (LINEAR_SHAPES[2], LINEAR_SHAPES[7])
HEAD_V, HEAD_H = 128256, 2560  # BitNet-2B tied LM head
BITNET_HEADS = dict(hq=20, hkv=5, hd=128)
BITNET_SHAPE_NAMES = [s.name for s in LINEAR_SHAPES if s.model == "bitnet-2b"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def precompile_logged(jobs: list[tuple], workers: int, what: str) -> None:
    """``autotune.precompile`` with its time logged; a failure is logged, not raised: the
    timing run compiles what is missing itself."""
    t0 = time.time()
    try:
        precompile(jobs, workers)
    except Exception as e:  # noqa: BLE001
        log(f"precompile failed: {e!r}")
    log(f"{what}: {len(jobs)} launches precompiled in {time.time() - t0:.0f} s")


# --- timing --------------------------------------------------------------------------------

# Timing: the autotuner's GraphTimer (one CUDA graph replaying the calls), so the benchmark
# and the tuning table measure alike.


def n_copies(nbytes: int, rotate_mb: float, min_copies: int) -> int:
    return max(min_copies, math.ceil(rotate_mb * 1e6 / max(nbytes, 1)))


def copy_bandwidth_gbps(replays: int) -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (median of eager copies).

    Eager, not graph-captured: a captured memcpy becomes a copy-engine node, which is slower
    than the SM copy kernels an eager device-to-device copy uses.
    """
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(max(replays, 3)):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    src = dst = None
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times) / 1e9


# --- correctness checks (before timing) ------------------------------------------------------

def check_exact(out, ref, what):
    if not torch.equal(out, ref):
        bad = (out != ref).sum().item()
        raise AssertionError(f"{what}: {bad} of {out.numel()} values differ from the twin")


def check_close(out, ref, rtol, what):
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()
    if not err <= rtol:
        raise AssertionError(f"{what}: max error {err:.2e} of max|ref| > {rtol:.0e}")


# --- linears ---------------------------------------------------------------------------------

class LinearCase:
    """One shape's weights (rotating copies, built on the GPU) and one width's activations."""

    def __init__(self, shape: LinearShape, rotate_mb: float, min_copies: int, gen: torch.Generator):
        n, k = shape.n, shape.k
        self.shape, self.gen = shape, gen
        codes = torch.randint(-1, 2, (n, k), generator=gen, device="cuda", dtype=torch.int8)
        packed = pack_ternary(codes)
        if shape.grouped:
            w_scale = 0.5 + torch.rand(n, k // 128, generator=gen, device="cuda")
        else:  # per fused segment: three (QKV-like) distinct scales, as a per-row vector
            seg = torch.rand(3, generator=gen, device="cuda") + 0.5
            w_scale = seg[torch.arange(n, device="cuda") * 3 // n]
        copies = n_copies(packed.numel(), rotate_mb, min_copies)
        self.packed = [packed] + [packed.clone() for _ in range(copies - 1)]
        self.w_scale = [w_scale] + [w_scale.clone() for _ in range(copies - 1)]
        self.codes = codes
        self.set_width(1)

    def set_width(self, m: int) -> None:
        self.m = m
        x = torch.randn(m, self.shape.k, generator=self.gen, device="cuda") * 2
        self.x_bf16 = x.to(torch.bfloat16)
        self.a_int8, self.a_scale = quantize_activations(x)

    def bf16_weights(self, rotate_mb: float, min_copies: int):
        w = self.codes.to(torch.bfloat16)
        return [w] + [w.clone() for _ in range(n_copies(w.numel() * 2, rotate_mb, min_copies) - 1)]

    def bytes(self, variant: str) -> int:
        n, k, m = self.shape.n, self.shape.k, self.m
        if variant == "bf16 cuBLAS":
            return n * k * 2 + m * k * 2 + m * n * 2
        scales = self.w_scale[0].numel() * 4
        act = m * k * (1 if variant.startswith("w2a8") else 2) + 4 * m
        return n * k // 4 + scales + act + m * n * 2


def linear_variants(shape: LinearShape) -> list[str]:
    return ["w2a8-g128", "w2a16-g128"] if shape.grouped else ["w2a8"]


def linear_call(case: LinearCase, variant: str, i: int, config=None):
    from kernels_ampere.w2a8 import w2a8_linear
    from kernels_ampere.w2a16 import w2a16_linear

    packed, w_scale = case.packed[i], case.w_scale[i]
    if variant.startswith("w2a8"):
        return lambda: w2a8_linear(case.a_int8, case.a_scale, packed, w_scale, out_dtype=torch.bfloat16,
                                   config=config)
    return lambda: w2a16_linear(case.x_bf16, packed, w_scale, out_dtype=torch.bfloat16, config=config)


def check_linear(case: LinearCase, variant: str, config=None):
    from kernels_ampere.w2a8 import w2a8_linear_reference
    from kernels_ampere.w2a16 import w2a16_linear_reference

    out = linear_call(case, variant, 0, config)().float()
    if variant.startswith("w2a8"):
        ref = w2a8_linear_reference(case.a_int8, case.a_scale, case.packed[0], case.w_scale[0],
                                    out_dtype=torch.bfloat16).float()
        if case.shape.grouped:  # float32 group-sum order, then one bf16 rounding
            check_close(out, ref, 2**-7, variant)
        else:
            check_exact(out, ref, variant)
    else:
        ref = w2a16_linear_reference(case.x_bf16, case.packed[0], case.w_scale[0], out_dtype=torch.float32)
        check_close(out, ref, 2**-7, variant)


def tune_linear(case: LinearCase, variant: str, timer: GraphTimer) -> tuple[object, float, list[dict]]:
    tried = []
    best, best_us = None, float("inf")
    for cfg in tuning.linear_candidates(case.m, case.shape.n, case.shape.k, case.shape.grouped,
                                        weight_only=variant.startswith("w2a16")):
        try:
            check_linear(case, variant, cfg)
            us = timer([linear_call(case, variant, i, cfg) for i in range(len(case.packed))])
        except Exception as e:  # a candidate that fails to compile or to match is skipped
            tried.append({"config": asdict(cfg), "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        tried.append({"config": asdict(cfg), "us": round(us, 3)})
        if us < best_us:
            best, best_us = cfg, us
    return best, best_us, tried


# --- heads -----------------------------------------------------------------------------------

class HeadCase:
    """The LM head's int8 and bf16 weights (rotating copies) and one width's hidden states."""

    def __init__(self, rotate_mb: float, min_copies: int, gen: torch.Generator):
        self.gen = gen
        w = torch.randn(HEAD_V, HEAD_H, generator=gen, device="cuda") / HEAD_H ** 0.5
        w_int8, w_scale = quantize_rows_int8(w)
        c8 = n_copies(w_int8.numel(), rotate_mb, min_copies)
        self.w_int8 = [w_int8] + [w_int8.clone() for _ in range(c8 - 1)]
        self.w_scale = [w_scale] + [w_scale.clone() for _ in range(c8 - 1)]
        w_int4, w4_scale = quantize_rows_int4(w)
        c4 = n_copies(w_int4.numel(), rotate_mb, min_copies)
        self.w_int4 = [w_int4] + [w_int4.clone() for _ in range(c4 - 1)]
        self.w4_scale = [w4_scale] + [w4_scale.clone() for _ in range(c4 - 1)]
        w16 = w.to(torch.bfloat16)
        del w
        self.w16 = [w16] + [w16.clone() for _ in range(n_copies(w16.numel() * 2, rotate_mb, min_copies) - 1)]
        self.set_width(1)

    def set_width(self, m: int) -> None:
        self.m = m
        h = torch.randn(m, HEAD_H, generator=self.gen, device="cuda")
        self.h_int8, self.h_scale = quantize_activations(h)
        self.h16 = h.to(torch.bfloat16)

    def bytes(self, variant: str) -> int:
        if variant == "int4 head":
            return HEAD_V * ((HEAD_H + 1) // 2) + HEAD_V * 4
        return HEAD_V * HEAD_H * (1 if variant == "int8 head" else 2) + HEAD_V * (4 if variant == "int8 head" else 0)

    def calls(self, variant: str, config=None) -> list:
        from kernels_ampere.heads import f16_head_argmax, int4_head_argmax, int8_head_argmax

        if variant == "int8 head":
            return [lambda i=i: int8_head_argmax(self.h_int8, self.h_scale, self.w_int8[i], self.w_scale[i],
                                                 config=config) for i in range(len(self.w_int8))]
        if variant == "int4 head":
            return [lambda i=i: int4_head_argmax(self.h_int8, self.h_scale, self.w_int4[i], self.w4_scale[i],
                                                 config=config) for i in range(len(self.w_int4))]
        if variant == "bf16 head":
            return [lambda i=i: f16_head_argmax(self.h16, self.w16[i], config=config) for i in range(len(self.w16))]

        def torch_head(i):  # cuBLAS logits, then argmax and max-softmax: writes [M, V]
            logits = F.linear(self.h16, self.w16[i]).float()
            return logits.argmax(-1), torch.softmax(logits, -1).amax(-1)
        return [lambda i=i: torch_head(i) for i in range(len(self.w16))]

    def check(self, variant: str, config=None):
        from kernels_ampere.heads import (f16_head_argmax_reference, int4_head_argmax_reference,
                                          int8_head_argmax_reference)

        top1, conf = self.calls(variant, config)[0]()
        if variant == "int8 head":
            ref_top1, ref_conf = int8_head_argmax_reference(self.h_int8, self.h_scale, self.w_int8[0], self.w_scale[0])
            check_exact(top1, ref_top1, variant)
        elif variant == "int4 head":
            ref_top1, ref_conf = int4_head_argmax_reference(self.h_int8, self.h_scale, self.w_int4[0], self.w4_scale[0])
            check_exact(top1, ref_top1, variant)
        else:
            ref_top1, ref_conf = f16_head_argmax_reference(self.h16, self.w16[0])
            if not torch.equal(top1, ref_top1):  # allowed only at a float32 near-tie
                logits = self.h16.float() @ self.w16[0].float().t()
                gap = (logits.gather(1, ref_top1[:, None]) - logits.gather(1, top1[:, None])).abs().max().item()
                if gap > 1e-4 * logits.abs().max().item():
                    raise AssertionError(f"{variant}: top-1 differs from the twin by a logit gap of {gap}")
        check_close(conf, ref_conf, 1e-4, f"{variant} confidence")


# --- attention and quant ---------------------------------------------------------------------

def attention_case(m: int, capacity: int, hist: int, rotate_mb: float, min_copies: int, gen):
    hq, hkv, hd = BITNET_HEADS["hq"], BITNET_HEADS["hkv"], BITNET_HEADS["hd"]
    s = capacity + 17
    q = torch.randn(m, hq, hd, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(hkv, s, hd, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(hkv, s, hd, generator=gen, device="cuda").to(torch.bfloat16)
    mask = torch.ones(m, s, dtype=torch.bool)
    mask[:, capacity + m:] = False
    mask[:, capacity:capacity + m] = torch.tril(torch.ones(m, m, dtype=torch.bool))
    mask = mask.cuda()
    history_len = torch.tensor([hist], dtype=torch.int32, device="cuda")
    copies = n_copies(2 * k.numel() * 2, rotate_mb, min_copies)
    kv = [(k, v)] + [(k.clone(), v.clone()) for _ in range(copies - 1)]
    nbytes = 2 * hkv * (hist + m) * hd * 2 + q.numel() * 4
    return q, kv, mask, history_len, nbytes


# --- the run ---------------------------------------------------------------------------------

def merge_entries(old: list[dict], new: list[dict]) -> list[dict]:
    """The table after a --tune run: this run's winners replace entries of the same op and key."""
    fresh = {(e["op"], json.dumps(e["key"], sort_keys=True)) for e in new}
    return [e for e in old if (e["op"], json.dumps(e["key"], sort_keys=True)) not in fresh] + new


def write_scheme_tables(folder: Path, device_name: str, scheme_entries: dict[str, list[dict]]) -> None:
    """``folder/<scheme>/<gpu>.json``: this GPU's shipped table with the entries of each table
    scheme's stack launches in place of those of the same keys, so the model's replays can
    compare the schemes (``bench_replay_widths.py --tables``): the stack alone misranks
    launches for the step (tools/results/kernels.md, fused widths)."""
    name = tuning.gpu_table_name(device_name)
    base = list(tuning.load_table(device_name))
    for scheme, entries in scheme_entries.items():
        slug = scheme.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "_")
        tuning.save_table(folder / slug / f"{name}.json", device_name, merge_entries(base, entries),
                          {"created_from": f"bench_kernels stack scheme '{scheme}'"})
        log(f"scheme table '{scheme}': {folder / slug / (name + '.json')} ({len(entries)} entries)")


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kernels_ampere", "tools/bench_kernels.py"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return rev.stdout.strip() + ("+dirty" if dirty else "") if rev.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def table_entries(st: Stack, m: int, measured: dict, isolated: dict) -> list[dict]:
    """This GPU's table entries for the stack's shapes at width ``m``: the launches of the
    scheme whose *whole stack* ran fastest among those a table can hold (the per-shape sweep's
    picks, the previous table, the untuned defaults). Per-shape winners timed alone can lose
    in the stack (consecutive launches of different kernels interact), so the stack decides."""
    options = {sc: v for sc, v in measured.items() if sc in TABLE_SCHEMES}
    if not options:
        return []
    winner = min(options, key=lambda sc: options[sc][0])
    stack_us, cfgs = options[winner]
    out = []
    for name, n, k, g in st.shapes:
        key = tuning.linear_key(n, k, m, g)
        us = isolated.get((json.dumps(key, sort_keys=True), json.dumps(asdict(cfgs[name]), sort_keys=True)))
        out.append({**tuning.record("w2a8_linear", key, cfgs[name], us if us is not None else float("nan")),
                    "stack_scheme": winner, "stack_us": round(stack_us, 1)})
        if us is None:
            out[-1]["us"] = None  # not timed alone
    log(f"table M={m}: the launches of '{winner}' ({stack_us:.1f} us per stack step)")
    return out


class Run:
    def __init__(self, args):
        self.args = args
        self.timer = GraphTimer(args.reps, args.replays)
        self.tune_timer = GraphTimer(max(args.reps // 4, 16), 3)  # candidates: a cheaper look
        self.rows: list[dict] = []
        self.tuned: list[dict] = []  # winners, written as the table at the end
        self.chosen: dict[str, object] = {}  # the same winners, used by this run's benchmark
        self.tune_log: list[dict] = []
        self.scheme_entries: dict[str, list[dict]] = {}  # per table scheme: its launches of the stacks, as entries
        self.stack_rows: list[dict] = []
        self.meta: dict = {}
        self.save = lambda: None  # main() points it at the writer of kernels.json / .md
        self.gen = torch.Generator(device="cuda").manual_seed(args.seed)

    def floor(self):
        """µs per launch that no kernel body avoids (tools/kernel_probe.py)."""
        sms = tuning.sm_count(torch.device("cuda"))
        try:
            rows = floor_rows(GraphTimer(replays=self.args.replays), sms)
        except Exception as e:
            rows = [{"section": "floor", "what": "setup", "error": f"{type(e).__name__}: {e}"[:300]}]
        for r in rows:
            log(f"floor {r['what']:<34} pdl={r.get('pdl')}: " + (f"{r['us']:.3f} us" if "us" in r else r["error"]))
        self.stack_rows += rows

    def large(self, widths):
        """Single very large matrices: the kernels' sustained weights per SM-clock (tools/kernel_probe.py)."""
        a = self.args
        sms, mhz = tuning.sm_count(torch.device("cuda")), self.meta["sm_clock_mhz"]
        jobs = [("w2a8_linear", n, k, False, m, False, cfg) for _, n, k in LARGE_SHAPES for m in widths
                for _, cfg in large_candidates(m)]
        precompile_logged(jobs, a.jobs, "large shapes")
        self.stack_rows += large_rows(widths, GraphTimer(reps=32, replays=3), sms, mhz, log)
        self.save()

    def stack(self, models, widths):
        """The Orin proxy: whole stacks of ternary linears per scheme and width (tools/kernel_stack.py)."""
        a = self.args
        dev = torch.device("cuda")
        sms, mhz = tuning.sm_count(dev), self.meta["sm_clock_mhz"]
        legacy = tuple(json.loads(a.legacy_table.read_text())["entries"]) if a.legacy_table.is_file() else ()
        timer = GraphTimer(replays=a.replays)
        schemes = tuple(a.stack_schemes.split(",")) + (("tuned",) if a.sweep else ())
        best = best_large(self.stack_rows)
        for model in models:
            try:
                st = Stack(model, a.rotate_mb, seed=a.seed)
            except Exception as e:
                self.stack_rows.append({"section": "stack", "model": model, "error": repr(e)[:300]})
                continue
            jobs = []
            for m in widths:
                for name, n, k, g in st.shapes:
                    res = st.cases[name].residual
                    cfgs = {scheme_configs(st, sc, m, legacy, {})[name] for sc in schemes if sc != "tuned"}
                    if self.sweeps(m):
                        cfgs |= set(tuning.linear_candidates(m, n, k, g))
                    jobs += [("w2a8_linear", n, k, g, m, res, c) for c in cfgs]
            precompile_logged(jobs, a.jobs, model)
            chosen, isolated = {}, {}
            for m in widths:  # width by width: a run cut short keeps every width it finished
                if self.sweeps(m):
                    picked, _, tlog = sweep(st, (m,), self.tune_timer, log)
                    chosen.update(picked)
                    self.tune_log += tlog
                    isolated.update({(json.dumps(t["key"], sort_keys=True), json.dumps(c["config"], sort_keys=True)):
                                     c["us"] for t in tlog for c in t["tried"] if "us" in c})
                st.set_width(m)
                measured = {}
                for scheme in schemes:
                    fixed_split = scheme.endswith("+co")  # every W2A8 launch asks for the same L1 / shared split
                    cfgs = scheme_configs(st, scheme[:-3] if fixed_split else scheme, m, legacy, chosen)
                    shared_carveout(CARVEOUT_PERCENT if fixed_split else None)
                    try:
                        st.check(cfgs)
                        row = stack_row(st, scheme, m, st.time_us(timer, cfgs), self.meta["copy_gbps"], sms, mhz, cfgs)
                        fc = fixed_cost(row["us"], st.shapes, st.layers, m, best)
                        row["fixed_us_per_linear"] = round(fc, 2) if fc is not None else None
                        measured[scheme] = (row["us"], cfgs)
                        if scheme in TABLE_SCHEMES and (not a.scheme_table_widths or
                                                        str(m) in a.scheme_table_widths.split(",")):
                            self.scheme_entries.setdefault(scheme, []).extend(
                                {**tuning.record("w2a8_linear", tuning.linear_key(n, k, m, g), cfgs[name], 0.0),
                                 "us": None, "stack_scheme": scheme, "stack_us": row["us"]}
                                for name, n, k, g in st.shapes)
                    except Exception as e:
                        row = {"section": "stack", "model": model, "scheme": scheme, "M": m,
                               "error": f"{type(e).__name__}: {e}"[:300]}
                    finally:
                        shared_carveout(None)
                    self.stack_rows.append(row)
                    log(f"stack {model:<11} M={m:<3} {scheme:<21} " + (
                        f"{row['us']:9.1f} us {row['packed_gbps']:7.0f} GB/s {row['weights_per_sm_clock']} w/SM-clk"
                        if "us" in row else row["error"]))
                if self.sweeps(m):
                    self.tuned += table_entries(st, m, measured, isolated)
                def rate_of(name, n, k, m):  # the large-shape rate of the same K and width
                    big = best.get((2560 if k <= 4096 else 6912, m))
                    return big["weights_per_sm_clock"] if big else None
                if best:
                    self.stack_rows.append({"section": "projection", "model": model, "M": m,
                                            "large_weights_per_sm_clock": {
                                                name: rate_of(name, n, k, m) for name, n, k, _ in st.shapes},
                                            "boards": project(st, m, rate_of)})
                self.save()
            st = None
            torch.cuda.empty_cache()

    def sweeps(self, m: int) -> bool:
        """Whether ``--sweep`` tunes width ``m`` of the stack (``--sweep-widths``, default all)."""
        a = self.args
        return a.sweep and (not a.sweep_widths or m in {int(w) for w in a.sweep_widths.split(",")})

    def record(self, **row):
        self.rows.append(row)
        status = f"{row['us']:.2f} us" if row.get("us") is not None else f"FAILED: {row.get('error')}"
        extra = f"  {row['gbps']:.0f} GB/s" if row.get("gbps") else ""
        log(f"{row['op']:<22} {row.get('shape', ''):<28} M={row.get('M', ''):<3} {row['variant']:<14} {status}{extra}")

    def attempt(self, fn, **row):
        try:
            us, nbytes, config = fn()
            row.update(us=round(us, 3), gbps=round(nbytes / (us * 1e-6) / 1e9, 1), bytes=nbytes, ok=True,
                       config=asdict(config) if config is not None else None)
        except Exception as e:
            row.update(us=None, ok=False, error=f"{type(e).__name__}: {e}"[:500])
            if self.args.verbose:
                traceback.print_exc()
        self.record(**row)

    def linears(self, shapes, widths):
        a = self.args
        for shape in shapes:
            label = f"{shape.model} {shape.name} {shape.n}x{shape.k}"
            try:
                case = LinearCase(shape, a.rotate_mb, a.min_copies, self.gen)
            except Exception as e:
                self.record(op="linear", shape=label, M=0, variant="setup", error=repr(e))
                continue
            for m in widths:
                case.set_width(m)
                for variant in linear_variants(shape):
                    op = "w2a8_linear" if variant.startswith("w2a8") else "w2a16_linear"
                    key = tuning.linear_key(shape.n, shape.k, m, shape.grouped)
                    if a.tune:
                        try:
                            best, us, tried = tune_linear(case, variant, self.tune_timer)
                            self.tune_log.append({"op": op, "key": key, "tried": tried})
                            if best is not None:
                                self.tuned.append(tuning.record(op, key, best, us))
                                self.chosen[op + json.dumps(key)] = best
                                log(f"tuned {op} {key}: {best} {us:.2f} us ({len(tried)} tried)")
                        except Exception as e:
                            log(f"tuning {op} {key} failed: {e!r}")

                    def run_variant(variant=variant, op=op, key=key):
                        cfg = self.chosen.get(op + json.dumps(key)) or tuning.lookup(
                            op, key, torch.device("cuda")) or tuning.default_linear(
                            m, shape.grouped, weight_only=op == "w2a16_linear", n=shape.n, k=shape.k)
                        check_linear(case, variant, cfg)
                        us = self.timer([linear_call(case, variant, i, cfg) for i in range(len(case.packed))])
                        return us, case.bytes(variant), cfg
                    self.attempt(run_variant, op=op, shape=label, model=shape.model, name=shape.name,
                                 N=shape.n, K=shape.k, M=m, variant=variant)

                def run_cublas():
                    ws = case.bf16_weights(a.rotate_mb, a.min_copies)
                    us = self.timer([lambda w=w: F.linear(case.x_bf16, w) for w in ws])
                    return us, case.bytes("bf16 cuBLAS"), None
                self.attempt(run_cublas, op="F.linear", shape=label, model=shape.model, name=shape.name,
                             N=shape.n, K=shape.k, M=m, variant="bf16 cuBLAS")
            case = None
            torch.cuda.empty_cache()

    def heads(self, widths):
        a = self.args
        try:
            case = HeadCase(a.rotate_mb, a.min_copies, self.gen)
        except Exception as e:
            self.record(op="head", shape="", M=0, variant="setup", error=repr(e))
            return
        for m in widths:
            case.set_width(m)
            label = f"lm-head {HEAD_V}x{HEAD_H}"
            for variant, op in (("int8 head", "int8_head_argmax"), ("int4 head", "int4_head_argmax"),
                                ("bf16 head", "f16_head_argmax"), ("torch bf16", "F.linear+argmax")):
                key = {"V": HEAD_V, "H": HEAD_H, "M": m}
                if a.tune and variant != "torch bf16":
                    best, best_us, tried = None, float("inf"), []
                    for cfg in tuning.head_candidates(m):
                        try:
                            case.check(variant, cfg)
                            us = self.tune_timer(case.calls(variant, cfg))
                            tried.append({"config": asdict(cfg), "us": round(us, 3)})
                            if us < best_us:
                                best, best_us = cfg, us
                        except Exception as e:
                            tried.append({"config": asdict(cfg), "error": f"{type(e).__name__}: {e}"[:300]})
                    self.tune_log.append({"op": op, "key": key, "tried": tried})
                    if best is not None:
                        self.tuned.append(tuning.record(op, key, best, best_us))
                        self.chosen[op + json.dumps(key)] = best
                        log(f"tuned {op} {key}: {best} {best_us:.2f} us")

                def run_head(variant=variant, op=op, key=key):
                    cfg = None
                    if variant != "torch bf16":
                        cfg = self.chosen.get(op + json.dumps(key)) or tuning.lookup(
                            op, key, torch.device("cuda")) or tuning.default_head(m, variant == "int4 head")
                        case.check(variant, cfg)
                    us = self.timer(case.calls(variant, cfg))
                    return us, case.bytes(variant), cfg
                self.attempt(run_head, op=op, shape=label, M=m, variant=variant)
        case = None
        torch.cuda.empty_cache()

    def attention(self, widths, capacity=4096, hist=4000):
        from kernels_ampere.attention import small_width_attention, small_width_attention_reference

        a = self.args
        for m in widths:
            def run_attention(m=m):
                q, kv, mask, hl, nbytes = attention_case(m, capacity, hist, a.rotate_mb, a.min_copies, self.gen)
                out = small_width_attention(q, kv[0][0], kv[0][1], mask, hl, capacity=capacity)
                ref = small_width_attention_reference(q, kv[0][0], kv[0][1], mask, hl, capacity=capacity)
                check_close(out, ref, 2e-2, "attention")
                us = self.timer([lambda k=k, v=v: small_width_attention(q, k, v, mask, hl, capacity=capacity)
                                 for k, v in kv])
                rows = m * BITNET_HEADS["hq"] // BITNET_HEADS["hkv"]
                key = {"hd": BITNET_HEADS["hd"], "G": BITNET_HEADS["hq"] // BITNET_HEADS["hkv"], "M": m,
                       "capacity": capacity}
                cfg = tuning.lookup("small_width_attention", key, torch.device("cuda")) or tuning.default_attention(
                    BITNET_HEADS["hd"], rows, capacity, BITNET_HEADS["hkv"], tuning.sm_count(torch.device("cuda")))
                return us, nbytes, cfg
            self.attempt(run_attention, op="small_width_attention",
                         shape=f"Hq20/Hkv5/hd128 hist {hist}/{capacity}", M=m, variant="bf16")

    def quant(self, widths):
        from kernels_ampere.fused_quant import (relu2_mul_rmsnorm_quant, relu2_mul_rmsnorm_quant_reference,
                                                rmsnorm_quant, rmsnorm_quant_reference)

        for m in widths:
            for name, k in (("rmsnorm_quant", 2560), ("relu2_mul_rmsnorm_quant", 6912)):
                def run_quant(m=m, name=name, k=k):
                    x = (torch.randn(m, 2 * k, generator=self.gen, device="cuda") * 3).to(torch.bfloat16)
                    w = (0.5 + torch.rand(k, generator=self.gen, device="cuda")).to(torch.bfloat16)
                    if name == "rmsnorm_quant":
                        args, fn, ref_fn = (x[:, :k].contiguous(), w, 1e-5), rmsnorm_quant, rmsnorm_quant_reference
                    else:
                        args, fn, ref_fn = (x[:, :k], x[:, k:], w, 1e-5), relu2_mul_rmsnorm_quant, \
                            relu2_mul_rmsnorm_quant_reference
                    (q, _), (q_ref, _) = fn(*args), ref_fn(*args)
                    if (q.int() - q_ref.int()).abs().max().item() > 1:
                        raise AssertionError(f"{name}: int8 differs from the twin by more than 1")
                    us = self.timer([lambda: fn(*args)])
                    nbytes = m * k * (2 if name == "rmsnorm_quant" else 4) + m * k + 2 * k
                    return us, nbytes, None
                self.attempt(run_quant, op=name, shape=f"K={k}", M=m, variant="bf16 in")


def summarize(rows: list[dict], copy_gbps: float, stack_rows: list[dict] = (), shipped_is_table: bool = False) -> dict:
    """The issue's targets: the BitNet-2B stack (weights per SM-clock, flatness over M, untuned
    vs tuned) and the per-shape figures of the earlier report. ``shipped_is_table``: the GPU has a
    tuned table, so the ``shipped`` scheme is that table (and counts as tuned; without one it is
    the untuned default itself)."""

    def us(name, m, variant):
        for r in rows:
            if (r.get("model") == "bitnet-2b" and r.get("name") == name and r.get("M") == m
                    and r["variant"] == variant and r.get("us") is not None):
                return r["us"]
        return None

    out = {}
    stack = {(r["scheme"], r["M"]): r for r in stack_rows
             if r.get("section") == "stack" and r.get("model") == "bitnet-2b" and r.get("us")}
    for scheme in dict.fromkeys(sc for sc, _ in stack):
        got = {m: r for (sc, m), r in stack.items() if sc == scheme}
        if 1 not in got:
            continue
        tag = scheme.replace(" ", "_").replace("(", "").replace(")", "")
        out[f"2b_stack_{tag}_us"] = {m: got[m]["us"] for m in sorted(got)}
        rate = {m: got[m]["weights_per_sm_clock"] for m in sorted(got)}
        out[f"2b_stack_{tag}_weights_per_sm_clock"] = rate
        if all(v is not None for v in rate.values()):
            out[f"target_{tag}_ge_40_w_per_clk_M_le_16"] = all(v >= 40 for m, v in rate.items() if m <= 16)
            out[f"target_{tag}_ge_30_w_per_clk_M_le_80"] = all(v >= 30 for m, v in rate.items() if m <= 80)
        worst = max(got[m]["us"] / got[1]["us"] for m in got if m <= 80)
        out[f"2b_stack_{tag}_worst_M_over_M1"] = round(worst, 3)
        out[f"target_{tag}_every_M_within_1.5x_of_M1"] = worst <= 1.5
    # the untuned default (the default generation, no table) against the table: per width the
    # fastest stack of the schemes a table can hold (bench_kernels.table_entries)
    untuned_name = f"{tuning.W2A8_DEFAULT_GENERATION} untuned"
    tuned = {}
    for (sc, m), r in stack.items():
        is_table = sc in TABLE_SCHEMES or (shipped_is_table and sc == "shipped")
        if is_table and (m not in tuned or r["us"] < tuned[m]):
            tuned[m] = r["us"]
    if tuned:
        out["2b_stack_table_us"] = {m: tuned[m] for m in sorted(tuned)}
        out["2b_stack_table_worst_M_over_M1"] = round(max(v / tuned[1] for v in tuned.values()), 3) if 1 in tuned \
            else None
    untuned = {m: r["us"] for (sc, m), r in stack.items() if sc == untuned_name}
    common = sorted(set(tuned) & set(untuned))
    if common:
        worst = max(untuned[m] / tuned[m] for m in common)
        out["2b_untuned_over_tuned_worst"] = round(worst, 3)
        out["target_untuned_within_15pct_of_tuned"] = worst <= 1.15
    before = {m: r["us"] for (sc, m), r in stack.items() if sc == "before (tuned table)"}
    if before and tuned:
        out["2b_stack_speedup_table_vs_before"] = {m: round(before[m] / tuned[m], 2)
                                                  for m in sorted(set(before) & set(tuned))}
    if before and untuned:
        out["2b_stack_speedup_untuned_vs_before"] = {m: round(before[m] / untuned[m], 2)
                                                    for m in sorted(set(before) & set(untuned))}
    m1 = [us(n, 1, "w2a8") for n in BITNET_SHAPE_NAMES]
    if all(v is not None for v in m1):
        out["bitnet_w2a8_total_us_M1"] = round(sum(m1), 2)
    i8 = [r for r in rows if r["variant"] == "int8 head" and r.get("M") == 1 and r.get("us")]
    b16 = [r for r in rows if r["variant"] == "bf16 head" and r.get("M") == 1 and r.get("us")]
    if i8 and b16:
        out["int8_head_speedup_vs_bf16_head_M1"] = round(b16[0]["us"] / i8[0]["us"], 3)
        out["target_int8_head_ge_1.8x"] = b16[0]["us"] >= 1.8 * i8[0]["us"]
    heads = {(r["variant"], r["M"]): r["us"] for r in rows if r.get("op") in ("int8_head_argmax", "int4_head_argmax")
             and r.get("us")}
    ratios = {m: round(heads[("int8 head", m)] / heads[("int4 head", m)], 3)
              for (v, m) in heads if v == "int4 head" and ("int8 head", m) in heads}
    if ratios:
        out["int4_head_speedup_vs_int8_head"] = dict(sorted(ratios.items()))
    return out


def probe_markdown(meta: dict, stack_rows: list[dict]) -> list[str]:
    """The per-launch floor and the large-shape throughput (tools/kernel_probe.py)."""
    lines = []
    floor = [r for r in stack_rows if r.get("section") == "floor"]
    if floor:
        lines += ["", "## Per-launch floor", "",
                  "µs per launch, a chain of 256 launches replayed from one CUDA graph.", "",
                  "| launch | programmatic launch | µs |", "|---|---|---|"]
        lines += [f"| {r['what']} | {r.get('pdl')} | {r.get('us', r.get('error', ''))} |" for r in floor]
    large = [r for r in stack_rows if r.get("section") == "large"]
    if large:
        best = best_large(large)
        fams = list(dict.fromkeys(r["family"] for r in large))
        lines += ["", "## Large matrices: sustained throughput", "",
                  "One matrix of hundreds of waves per call, rotating over copies (weights from DRAM); each "
                  "family's fastest candidate of `kernel_probe.large_candidates`, weights per SM-clock "
                  f"(packed GB/s of {meta['copy_gbps']:.0f} copy); `+pf` = L2 prefetch before the wait.", "",
                  "| shape | M | " + " | ".join(fams) + " | best |", "|---|---|" + "---|" * (len(fams) + 1)]
        for label, n, k in LARGE_SHAPES:
            for m in sorted({r["M"] for r in large if r["K"] == k}):
                cells = []
                for f in fams:
                    r = best.get((k, m, f))
                    cells.append(f"{r['weights_per_sm_clock']} ({r['packed_gbps']:.0f})" if r else "")
                b = best.get((k, m))
                top = (f"{b['family']} {b['config']['block_n']}x{b['config']['block_kb']} w{b['config']['num_warps']}"
                       f" s{b['config']['num_stages']}: {b['us']} µs" if b else "")
                lines.append(f"| {label} | {m} | " + " | ".join(cells) + f" | {top} |")
    return lines


def stack_markdown(meta: dict, stack_rows: list[dict]) -> list[str]:
    if not any(r.get("section") == "stack" for r in stack_rows):
        return []
    lines = ["", "## Whole stacks of ternary linears (the Orin proxy)", "",
             f"One CUDA graph per (model, scheme, M): every layer's QKV, O, gate+up and down projections "
             f"(distinct weights, float32 out, residual fused into O and down), weights cold in L2. "
             f"Weights per SM-clock = ternary weights / (µs · {meta['sms']} SMs · {meta['sm_clock_mhz']:.0f} MHz). "
             "Bandwidth-bound needs: Orin NX 16GB ≈ 56, AGX Orin 64GB ≈ 39, Orin Nano 8GB ≈ 54, H200 ≈ 74.", "",
             "Fixed µs / linear = (µs / step − the stack's bytes at the large-matrix rate of the same K and M) "
             "/ linears: what each launch costs beyond streaming its weights.", "",
             "| model | scheme | M | µs / step | packed GB/s | % copy BW | weights / SM-clock | vs M = 1 | "
             "fixed µs / linear |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = {(r["model"], r["scheme"]): r["us"] for r in stack_rows if r.get("section") == "stack" and r.get("M") == 1
            and r.get("us")}
    for r in stack_rows:
        if r.get("section") != "stack":
            continue
        if not r.get("us"):
            lines.append(f"| {r['model']} | {r.get('scheme', '')} | {r.get('M', '')} | FAILED: "
                         f"{r.get('error', '')[:100]} | | | | |")
            continue
        b = base.get((r["model"], r["scheme"]))
        lines.append(f"| {r['model']} | {r['scheme']} | {r['M']} | {r['us']:.1f} | {r['packed_gbps']:.0f} | "
                     f"{r['pct_copy_bw']}% | {r['weights_per_sm_clock']} | {r['us'] / b:.2f}x | "
                     f"{r.get('fixed_us_per_linear', '')} |" if b else "")
    proj = [r for r in stack_rows if r.get("section") == "projection"]
    if proj:
        boards = list(BOARDS)
        lines += ["", "### Projected ternary-linear step on Jetson boards", "",
                  f"Per call `t = max(bytes / (0.8 · BW), weights / (r · SMs · f)) + {ORIN_LAUNCH_US:g} µs`, summed "
                  "over the stack; r = the weights per SM-clock the fastest kernel sustained on this GPU on a large "
                  "matrix of the same K and width (above: fixed cost amortised; a lower bound on the SM's rate where "
                  f"this GPU's DRAM was the limit); {ORIN_LAUNCH_US:g} µs = the assumed cost of one launch in a "
                  "replayed graph on an Orin (no programmatic launch on sm_87; not measured here); "
                  "0.8 = the share of DRAM bandwidth a streaming kernel reaches; boards: " + "; ".join(
                      f"{b} {sm} SMs {mhz} MHz {bw} GB/s" for b, (sm, mhz, bw) in BOARDS.items())
                  + ". Steps/s at M = 1 is the AR tok/s ceiling the ternary linears allow.", "",
                  "| model | M | " + " | ".join(f"{b} ms (steps/s; BW bound)" for b in boards) + " |",
                  "|---|---|" + "---|" * len(boards)]
        for r in proj:
            cells = [f"{r['boards'][b]['step_ms']} ({r['boards'][b]['steps_per_s']}; "
                     f"{r['boards'][b]['bandwidth_bound_steps_per_s']})" for b in boards]
            lines.append(f"| {r['model']} | {r['M']} | " + " | ".join(cells) + " |")
    return lines


def write_markdown(path: Path, meta: dict, rows: list[dict], summary: dict, stack_rows: list[dict] = ()) -> None:
    lines = [f"# Kernel benchmark — {meta['device']}", "",
             f"- date: {meta['date']}", f"- git commit: `{meta['git_commit']}`", f"- command: `{meta['command']}`",
             f"- torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}",
             f"- timing: CUDA-graph replay of {meta['reps']} calls rotating over weight copies of "
             f">= {meta['rotate_mb']} MB (cold L2), median of {meta['replays']} replays",
             f"- device copy bandwidth (read + write): **{meta['copy_gbps']:.0f} GB/s**; {meta['sms']} SMs at "
             f"{meta['sm_clock_mhz']:.0f} MHz (max SM clock): "
             f"{meta['copy_gbps'] * 1e3 / (meta['sms'] * meta['sm_clock_mhz']) if meta['sm_clock_mhz'] else 0:.1f} "
             "copied bytes per SM-clock", ""]
    lines += probe_markdown(meta, stack_rows)
    lines += stack_markdown(meta, stack_rows)
    if rows:
        lines += ["", "## Per-kernel rows", "",
                  "| op | shape | M | variant | µs | GB/s | % copy BW | bytes / SM-clock | vs bf16 cuBLAS |",
                  "|---|---|---|---|---|---|---|---|---|"]
    cublas = {(r.get("shape"), r.get("M")): r["us"] for r in rows if r["variant"] == "bf16 cuBLAS" and r.get("us")}
    for r in rows:
        if r.get("us") is None:
            lines.append(f"| {r['op']} | {r.get('shape', '')} | {r.get('M', '')} | {r['variant']} | "
                         f"FAILED: {r.get('error', '')[:120]} | | | | |")
            continue
        base = cublas.get((r.get("shape"), r.get("M")))
        speed = f"{base / r['us']:.2f}x" if base and r["variant"] != "bf16 cuBLAS" else ""
        pct = f"{100 * r['gbps'] / meta['copy_gbps']:.0f}%" if r.get("gbps") else ""
        per_clk = (f"{r['bytes'] / (r['us'] * meta['sms'] * meta['sm_clock_mhz']):.2f}"
                   if r.get("bytes") and meta["sm_clock_mhz"] else "")
        lines.append(f"| {r['op']} | {r.get('shape', '')} | {r.get('M', '')} | {r['variant']} | {r['us']:.2f} | "
                     f"{r.get('gbps', '')} | {pct} | {per_clk} | {speed} |")
    lines += ["", "## Targets (this GPU)", ""]
    lines += [f"- {k}: **{v}**" for k, v in summary.items()] or ["- (not enough rows to evaluate)"]
    path.write_text("\n".join(lines) + "\n")


def print_table(rows: list[dict], summary: dict) -> None:
    print()
    print(f"{'op':<24}{'shape':<34}{'M':>3}  {'variant':<13}{'us':>9}{'GB/s':>9}")
    for r in rows:
        us = f"{r['us']:.2f}" if r.get("us") is not None else "FAIL"
        print(f"{r['op']:<24}{str(r.get('shape', ''))[:33]:<34}{r.get('M', ''):>3}  {r['variant']:<13}{us:>9}"
              f"{r.get('gbps', '') or '':>9}")
    print()
    for k, v in summary.items():
        print(f"  {k}: {v}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: two shapes, M in {1, 17}, fewer reps")
    ap.add_argument("--tune", action="store_true", help="time candidate configs first and save the winners")
    ap.add_argument("--out", type=Path, default=ROOT / "tools" / "results", help="folder for kernels.json/.md")
    ap.add_argument("--tuned-dir", type=Path, default=tuning.TUNED_DIR, help="where --tune writes <gpu>.json")
    ap.add_argument("--scheme-tables", type=Path, default=None,
                    help="write FOLDER/<scheme>/<gpu>.json per table scheme of the stack: this GPU's table with "
                         "the stack's entries at its widths replaced by the scheme's launches (for "
                         "tools/bench_replay_widths.py --tables)")
    ap.add_argument("--scheme-table-widths", default=None,
                    help="comma list: the widths whose entries --scheme-tables replaces (default: every stack width)")
    ap.add_argument("--only", default="floor,large,stack,quant,attention,heads,linear",
                    help="comma list of sections to run")
    ap.add_argument("--stack-models", default=",".join(STACK_MODELS), help="models whose whole stack replays")
    ap.add_argument("--stack-widths", default=",".join(map(str, STACK_WIDTHS)), help="widths of the stack replays")
    ap.add_argument("--stack-schemes", default=",".join(STACK_SCHEMES),
                    help="comma list of launch schemes the stacks replay (tools/kernel_stack.scheme_configs)")
    ap.add_argument("--sweep-widths", default=None,
                    help="with --sweep: the stack widths to tune (default: every --stack-widths width)")
    ap.add_argument("--sweep", action="store_true",
                    help="tune the stacks' projections in this run (the 'tuned' scheme) and save the table")
    ap.add_argument("--legacy-table", type=Path, default=LEGACY_TABLE,
                    help="the previous release's tuned table (the 'before (tuned table)' scheme)")
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="compile processes")
    ap.add_argument("--models", default=None, help="comma list of models whose linear shapes run (default: all)")
    ap.add_argument("--widths", default=None, help="comma list of widths M (default 1,5,9,17)")
    ap.add_argument("--rotate-mb", type=float, default=320.0, help="weight copies per call site total (MB)")
    ap.add_argument("--min-copies", type=int, default=8, help="at least this many weight copies")
    ap.add_argument("--reps", type=int, default=None, help="calls per captured graph (default 200, quick 50)")
    ap.add_argument("--replays", type=int, default=None, help="timed graph replays (default 10, quick 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=os.environ.get("BITMTP_COMMIT"),
                    help="git commit to record when the tree has no .git (default: $BITMTP_COMMIT)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA device (run the CPU tests with pytest instead)", file=sys.stderr)
        return 2
    args.reps = args.reps or (50 if args.quick else 200)
    args.replays = args.replays or (3 if args.quick else 10)
    sections = set(args.only.split(","))
    widths = QUICK_WIDTHS if args.quick else WIDTHS
    if args.widths:
        widths = tuple(int(w) for w in args.widths.split(","))
    shapes = QUICK_SHAPES if args.quick else LINEAR_SHAPES
    if args.models:
        shapes = tuple(sh for sh in shapes if sh.model in args.models.split(","))
    import triton

    device_name = torch.cuda.get_device_name()
    run = Run(args)
    log(f"{device_name}, torch {torch.__version__}, triton {triton.__version__}")
    copy_gbps = copy_bandwidth_gbps(args.replays)
    log(f"device copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
    meta = {"device": device_name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "sms": tuning.sm_count(torch.device("cuda")), "sm_clock_mhz": sm_clock_mhz(),
            "git_commit": git_commit() if args.commit in (None, "", "unknown") else args.commit,
            "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "reps": args.reps, "replays": args.replays, "rotate_mb": args.rotate_mb, "copy_gbps": copy_gbps}
    run.meta = meta
    run.save = lambda: save()
    args.out.mkdir(parents=True, exist_ok=True)
    # `timeout` sends SIGTERM: turn it into an exception so the finally below still writes the files
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))

    def save():
        summary = summarize(run.rows, copy_gbps, run.stack_rows,
                            shipped_is_table=bool(tuning.load_table(torch.cuda.get_device_name())))
        (args.out / "kernels.json").write_text(json.dumps(
            {**meta, "summary": summary, "stack": run.stack_rows, "rows": run.rows, "tuning": run.tune_log},
            indent=1) + "\n")
        write_markdown(args.out / "kernels.md", meta, run.rows, summary, run.stack_rows)
        return summary

    try:
        if args.tune:  # tune and benchmark shape by shape; the table is written once at the end
            log("tuning: every benchmarked (op, shape, M) times its candidate list first")
        if "floor" in sections:
            run.floor()
        if "large" in sections:
            run.large(tuple(int(w) for w in args.stack_widths.split(",")))
        if "stack" in sections:  # the headline first
            run.stack(args.stack_models.split(","), tuple(int(w) for w in args.stack_widths.split(",")))
            save()
        # cheapest sections first, so a run cut short still covers every kernel
        if "quant" in sections:
            run.quant(widths)
        if "attention" in sections:
            run.attention((1,) if args.quick else widths)
        if "heads" in sections:
            run.heads((1,) if args.quick else widths)
            save()
        if "linear" in sections:
            run.linears(shapes, widths)
    finally:
        summary = save()
        if args.scheme_tables:
            write_scheme_tables(args.scheme_tables, device_name, run.scheme_entries)
        if (args.tune or args.sweep) and run.tuned:
            name = tuning.gpu_table_name(device_name)
            tmeta = {"triton": triton.__version__, "created": meta["date"], "command": meta["command"]}
            path = args.tuned_dir / f"{name}.json"
            entries = merge_entries(json.loads(path.read_text())["entries"] if path.is_file() else [], run.tuned)
            for folder in {args.tuned_dir, args.out}:
                tuning.save_table(folder / f"{name}.json", device_name, entries, tmeta)
            log(f"wrote {len(run.tuned)} tuned entries to {args.tuned_dir / (name + '.json')}")
    print_table(run.rows, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
