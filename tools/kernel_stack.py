"""The Orin proxy of ``bench_kernels.py``: a model's whole stack of ternary linears, replayed.

For one model (every layer's fused QKV, O, gate+up and down projections, distinct weights per
layer, float32 output with the residual fused into O and down as the runtime runs them) and
one width M, the stack is captured in one CUDA graph and replayed; the weights of all layers
(copies of the stack where it is smaller than ``--rotate-mb``) exceed the L2, so every call
reads its weights from DRAM, as a decode step does. Reported per (scheme, M):

* µs per model step, packed GB/s (the packed weights' bytes / time) and % of the device's
  copy bandwidth (read + write of a 2 GiB copy, the same run);
* **weights per SM-clock** = ternary weights / (time · SMs · SM clock): the rate a kernel must
  sustain to be bandwidth-bound on a GPU whose bytes per SM-clock are known (4 weights per
  byte): Orin NX 16GB ≈ 56, AGX Orin 64GB ≈ 39, Orin Nano 8GB ≈ 54, H200 ≈ 74;
* schemes (``scheme_configs``): ``before (tuned table)`` (the previous release's table),
  ``shipped`` (what a call without a config launches now), ``vN untuned`` (generation N's
  SM-count defaults), ``tuned`` (this run's per-shape ``--sweep`` picks); a ``+pf`` suffix
  turns on the L2 prefetch, ``+co`` (bench_kernels) one fixed L1/shared split.

Orin projection (``project``): per call ``t = max(bytes / (η · BW), weights / (r · SMs · f)) + o``
summed over the stack, where BW, SMs and f are the board's, η = 0.8 the share of the DRAM
bandwidth a streaming kernel reaches (Orin copy kernels measure ~80% of the spec), r the
weights per SM-clock the fastest kernel sustained on this GPU on a *large* matrix of the same
K at the same width (``kernel_probe``: hundreds of waves, weights from DRAM, so the per-launch
cost is amortised; where this GPU's DRAM is the limit, r is a lower bound on what an SM can
do; Ampere and Hopper SMs issue the same integer and int8 MMA instructions at about the same
per-clock rate per SM sub-partition), and o = 3 µs the cost
of one kernel in a replayed CUDA graph on an Orin (graph node + launch, no programmatic
launch on sm_87). tok/s of the ternary linears = 1 / (step time) at M = 1; at M > 1 the
projection is the step time a draft / verify step of that width pays.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess

import torch

from kernels_ampere import tuning
from kernels_ampere.autotune import MODEL_LAYERS, MODEL_SHAPES, GraphTimer, LinearBench, tune_shape
from kernels_ampere.tuning import DOT, GEMV, MMA, LinearConfig

STACK_WIDTHS = (1, 2, 9, 16, 27, 40, 80)
STACK_MODELS = ("bitnet-2b", "bitmtp-27m")
# (SMs, max GPU clock MHz, DRAM GB/s): Jetson module data sheets (JetPack 5/6 maximum power mode)
BOARDS = {
    "Orin NX 16GB": (8, 918, 102.4),
    "AGX Orin 64GB": (16, 1300, 204.8),
    "Orin Nano 8GB": (8, 625, 68.0),
}
DRAM_EFFICIENCY = 0.8
ORIN_LAUNCH_US = 3.0
RESIDUAL_SHAPES = ("wo", "w2 (down)")  # the runtime adds the residual in these projections' epilogue
# scheme suffixes: the scheme's launches with one choice changed
SCHEME_VARIANTS = {
    "+pf": lambda cfg: dataclasses.replace(cfg, prefetch=True),  # the L2 prefetch before the wait
    "+bm32": lambda cfg: dataclasses.replace(cfg, block_m=32) if cfg.fold_lanes else cfg,  # 32-row tiles
    "+bn128": lambda cfg: dataclasses.replace(cfg, block_n=128, num_warps=8) if cfg.fold_lanes else cfg,
    "+fold": lambda cfg: dataclasses.replace(cfg, fold_lanes=True) if cfg.kernel == MMA else cfg,  # every mma launch
}


def legacy_default(m: int, n: int, k: int) -> LinearConfig:
    """The untuned launch of the previous release (gemv at M <= 2, dot otherwise)."""
    chunks = -(-k // 128)
    if m <= 2:
        step = min(32, max(8, 1 << (chunks - 1).bit_length()))
        return LinearConfig(GEMV, block_n=8, block_kb=32 * step, num_warps=4)
    split = max(1, min(-(-128 // -(-n // 64)), chunks // 4, 8))
    return LinearConfig(DOT, block_n=64, block_kb=64, num_warps=4, num_stages=3, split_k=split)


def sm_clock_mhz() -> float:
    """The GPU's maximum SM clock (nvidia-smi), which a busy GPU runs at; 0 if unknown."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits",
                              "-i", str(torch.cuda.current_device())], capture_output=True, text=True, timeout=20)
        return float(out.stdout.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return 0.0


class Stack:
    """Every ternary projection of ``model``'s layers, on the GPU, with distinct weights."""

    def __init__(self, model: str, rotate_mb: float, seed: int = 0):
        self.model = model
        self.layers = MODEL_LAYERS[model]
        self.shapes = MODEL_SHAPES[model]
        per_layer = sum(n * (-(-k // 128) * 32) for _, n, k, _ in self.shapes)
        # whole copies of the stack until it exceeds rotate_mb: the L2 never holds a layer's weights
        self.copies = max(1, math.ceil(rotate_mb * 1e6 / (per_layer * self.layers)))
        self.instances = self.layers * self.copies
        self.cases = {name: LinearBench("w2a8_linear", n, k, g, rotate_mb=0.0, seed=seed + i,
                                        residual=name in RESIDUAL_SHAPES, min_copies=self.instances)
                      for i, (name, n, k, g) in enumerate(self.shapes)}
        self.packed_bytes = per_layer * self.layers  # one model step
        self.weights = sum(n * k for _, n, k, _ in self.shapes) * self.layers

    def set_width(self, m: int) -> None:
        for case in self.cases.values():
            case.set_width(m)

    def check(self, configs: dict) -> None:
        for name, case in self.cases.items():
            case.check(configs.get(name))

    def time_us(self, timer: GraphTimer, configs: dict, ahead: bool = False) -> float:
        """µs per model step: the whole stack (layer by layer, projection by projection) in one graph.
        ``ahead``: each launch asks the L2 for the next one's weights, as the runtime's do
        (``common.next_weights_l2``; the last asks for the first's)."""
        order = [(i, name) for i in range(self.instances) for name in self.cases]
        after = order[1:] + order[:1]
        calls = [self.cases[name].call(i, configs.get(name),
                                       self.cases[nxt].packed[j] if ahead else None)
                 for (i, name), (j, nxt) in zip(order, after)]
        return timer(calls, reps=len(calls)) * len(calls) / self.copies

    def time_hot_step_us(self, timer: GraphTimer, configs: dict) -> float:
        """µs per model step with every weight in the L2: the first layer's launches repeated
        once per layer (one layer's weights: 17 MB of BitNet-2B). What launches that never
        wait for DRAM cost; a floor for asking the L2 ahead."""
        calls = [case.call(0, configs.get(name)) for name, case in self.cases.items()]
        return timer(calls, reps=len(calls) * self.layers) * len(calls) * self.layers

    def time_hot_us(self, timer: GraphTimer, name: str, config) -> float:
        """µs per call of one projection with one weight copy (in L2 after the first call)."""
        return timer([self.cases[name].call(0, config)], reps=64)


def scheme_configs(stack: Stack, scheme: str, m: int, legacy_table: tuple, chosen: dict) -> dict:
    """The launch configuration of every projection of ``stack`` at width ``m`` under ``scheme``.

    ``shipped``: what ``w2a8_linear`` launches with no config (this GPU's table, else the
    default generation's defaults); ``v1 untuned`` / ``v2 untuned``: one generation's
    SM-count defaults; a suffix of ``SCHEME_VARIANTS`` changes one choice of the scheme's launches
    (``+pf``: the L2 prefetch before the wait; ``+bm32`` / ``+bn128``: folded tiles of 32 rows
    of the width / of 128 weight rows over 8 warps; ``+fold``: every ``mma`` launch folded)."""
    dev = torch.device("cuda")
    for suffix, change in SCHEME_VARIANTS.items():
        if scheme.endswith(suffix):
            return {name: change(cfg) for name, cfg in
                    scheme_configs(stack, scheme[:-len(suffix)], m, legacy_table, chosen).items()}
    out = {}
    for name, n, k, g in stack.shapes:
        key = tuning.linear_key(n, k, m, g)
        if scheme == "shipped":
            out[name] = tuning.lookup("w2a8_linear", key, dev) or tuning.default_linear(
                m, g, n=n, k=k, sms=tuning.sm_count(dev))
        elif scheme in tuple(f"{g} untuned" for g in tuning.W2A8_GENERATIONS):
            out[name] = tuning.default_linear(m, g, n=n, k=k, sms=tuning.sm_count(dev),
                                              generation=scheme.removesuffix(" untuned"))
        elif scheme == "before (tuned table)":
            out[name] = tuning.find_config(legacy_table, "w2a8_linear", key) or legacy_default(m, n, k)
        elif scheme == "before (untuned)":
            out[name] = legacy_default(m, n, k)
        elif scheme == "untuned":  # the new kernels' defaults, whatever the shipped default generation
            out[name] = tuning.default_linear(m, g, n=n, k=k, sms=tuning.sm_count(dev), generation="v2")
        else:  # tuned: this run's sweep, else this GPU's table, else the default
            out[name] = chosen.get((name, m)) or tuning.lookup("w2a8_linear", key, dev) or tuning.default_linear(
                m, g, n=n, k=k, sms=tuning.sm_count(dev), generation="v2")
    return out


def sweep(stack: Stack, widths, timer: GraphTimer, log) -> tuple[dict, list[dict], list[dict]]:
    """Tune every projection of ``stack`` at every width -> (chosen, table entries, tune log)."""
    chosen, entries, tune_log = {}, [], []
    for name, n, k, g in stack.shapes:
        case = stack.cases[name]
        for m in widths:
            best, us, tried = tune_shape(case, m, timer)
            key = tuning.linear_key(n, k, m, g)
            tune_log.append({"op": "w2a8_linear", "key": key, "tried": tried})
            if best is not None:
                chosen[(name, m)] = best
                entries.append(tuning.record("w2a8_linear", key, best, us))
                log(f"tuned {stack.model} {name} M={m}: {best} {us:.2f} us ({len(tried)} tried)")
    return chosen, entries, tune_log


def stack_row(stack: Stack, scheme: str, m: int, us: float, copy_gbps: float, sms: int, mhz: float,
              configs: dict) -> dict:
    gbps = stack.packed_bytes / (us * 1e-6) / 1e9
    return {"section": "stack", "model": stack.model, "scheme": scheme, "M": m, "us": round(us, 2),
            "packed_gbps": round(gbps, 1), "pct_copy_bw": round(100 * gbps / copy_gbps, 1) if copy_gbps else None,
            "weights_per_sm_clock": round(stack.weights / (us * 1e-6 * sms * mhz * 1e6), 2) if mhz else None,
            "configs": {k: v.__dict__ for k, v in configs.items()}}


def project(stack: Stack, m: int, rate_of) -> dict:
    """Projected step time (ms) and steps/s of the stack's ternary linears on each board.

    ``rate_of(name, n, k, m)``: the weights per SM-clock the kernels sustain on that shape
    and width (the large-shape rate of the same K: ``kernel_probe``), or None (bytes only)."""
    out = {}
    for board, (sms, mhz, bw) in BOARDS.items():
        total = 0.0
        bound = 0.0
        for name, n, k, _ in stack.shapes:
            nbytes = n * (-(-k // 128) * 32)
            mem = nbytes / (DRAM_EFFICIENCY * bw * 1e9)
            rate = rate_of(name, n, k, m)
            compute = n * k / (rate * sms * mhz * 1e6) if rate else 0.0
            total += stack.layers * (max(mem, compute) + ORIN_LAUNCH_US * 1e-6)
            bound += stack.layers * mem
        out[board] = {"step_ms": round(total * 1e3, 3), "steps_per_s": round(1 / total, 1),
                      "bandwidth_bound_steps_per_s": round(1 / bound, 1)}
    return out
