"""Launch configurations tuned offline and shipped as one JSON table per GPU model.

Launchers only *read* this table (a dictionary lookup, no timing, no compilation of
alternatives), so they are safe to call while a CUDA graph is being captured.
``bitmtp tune`` (``python -m kernels_ampere.autotune``; ``tools/bench_kernels.py --sweep``
on the H200) times the small candidate lists below on the device, chooses a model's
projections as a layer, and writes ``kernels_ampere/tuned/<gpu>.json``, where ``<gpu>`` is the CUDA device name
lower-cased with every non-alphanumeric run replaced by ``_`` ("NVIDIA H200" ->
``nvidia_h200.json``, a Jetson "Orin" -> ``orin.json``).

Lookup order for one call: the exact shape key in this GPU's table; else the same shape
at the nearest tuned width M of the same padded row tile (16, 32, 64, 128), else at the
nearest tuned width; else the fallback heuristic (``default_*``), which is also
what the CPU interpreter and unseen GPUs get (sized by the device's SM count).

Table format (a list of records, so it stays readable in a diff)::

    {"gpu": "NVIDIA H200", "triton": "3.6.0", "created": "...", "command": "...",
     "entries": [{"op": "w2a8_linear", "key": {"N": 3840, "K": 2560, "M": 1, "scales": "row"},
                  "config": {"kernel": "gemv", "block_n": 8, ...}, "us": 2.9}, ...]}
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

TUNED_DIR = Path(__file__).parent / "tuned"

GEMV = "gemv"  # packed words decoded in registers, dp4a (int8) or FMA (16-bit), no tensor cores
DOT = "dot"  # tiles unpacked to int8/16-bit and fed to tl.dot (tensor cores), M padded to 16
ROWS = "rows"  # gemv over up to 16 activation rows per program (w2a8 only): weights decoded once
LANES = "lanes"  # w2a8: dp4a on lanes masked in place, all rows (<= 8) per program, decode once
MMA = "mma"  # w2a8: int8 tensor cores, one AND per four weights, all rows (<= 128) per tile
W2A8_ONLY = (ROWS, LANES, MMA)


@dataclass(frozen=True)
class LinearConfig:
    """One launch of a packed ternary linear (``w2a8_linear`` / ``w2a16_linear``)."""

    kernel: str  # GEMV, DOT, or (w2a8 only) ROWS, LANES, MMA
    block_n: int  # output rows per program
    block_kb: int  # packed bytes of one row read per K step: a multiple of 32 (one 128-chunk)
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1  # K slices run by separate programs, summed in order (in the kernel or by a second launch)
    prefetch: bool = False  # W2A8: each program asks the L2 for its weights before waiting (PDL)
    block_m: int = 0  # W2A8 ``mma``: activation rows per tile (16, 32, 64, 128); 0 = the whole width (<= 128)
    asum_by_dot: bool = False  # W2A8 ``mma``: the activation sums on the tensor cores, not dp4a over the words
    fold_lanes: bool = False  # W2A8 ``mma``: the four lanes in one accumulator (a quarter of the registers)
    tail_m: int = 0  # W2A8 folded ``mma``: a second tile of rows after block_m's (16, 32, 64; < block_m); 0 = none
    chains: int = 1  # W2A8 folded ``mma``: K steps in flight at once, each with its own accumulator (1 or 2)

    def __post_init__(self):
        if self.kernel not in (GEMV, DOT, ROWS, LANES, MMA):
            raise ValueError(f"LinearConfig.kernel must be one of {(GEMV, DOT, ROWS, LANES, MMA)}, got {self.kernel!r}")
        if self.block_kb % 32 or self.block_kb & (self.block_kb - 1):
            raise ValueError(f"LinearConfig.block_kb={self.block_kb}: need a power of two >= 32")
        if self.block_m not in (0, 16, 32, 64, 128):
            raise ValueError(f"LinearConfig.block_m={self.block_m}: need 0 (the whole width) or 16, 32, 64, 128")
        if self.fold_lanes and self.kernel != MMA:
            raise ValueError(f"LinearConfig.fold_lanes: only the 'mma' kernel folds its lanes, got {self.kernel!r}")
        if self.tail_m:
            if self.kernel != MMA or not self.fold_lanes:
                raise ValueError(f"LinearConfig.tail_m={self.tail_m}: only the folded 'mma' kernel takes a tail tile "
                                 f"(kernel='mma', fold_lanes=True), got kernel={self.kernel!r}, "
                                 f"fold_lanes={self.fold_lanes}")
            if self.tail_m not in (16, 32, 64) or not self.tail_m < self.block_m:
                raise ValueError(f"LinearConfig.tail_m={self.tail_m}: need 0 (no tail) or 16, 32, 64 rows, fewer "
                                 f"than the main tile's block_m={self.block_m} (which must be set: 32, 64 or 128)")
        if self.chains not in (1, 2):
            raise ValueError(f"LinearConfig.chains={self.chains}: need 1 or 2 K steps in flight")
        if self.chains > 1 and (self.kernel != MMA or not self.fold_lanes or self.tail_m):
            raise ValueError(f"LinearConfig.chains={self.chains}: only the folded 'mma' kernel without a tail tile "
                             f"runs two K steps at once (kernel='mma', fold_lanes=True, tail_m=0), got "
                             f"kernel={self.kernel!r}, fold_lanes={self.fold_lanes}, tail_m={self.tail_m}")


@dataclass(frozen=True)
class HeadConfig:
    """One launch of a fused head matmul + argmax (``int8_head_argmax`` / ``f16_head_argmax``)."""

    block_v: int  # vocabulary rows per program
    block_h: int  # hidden features per K step
    num_warps: int = 4
    num_stages: int = 2
    combine_block: int = 1024  # partials folded per step of the second pass


@dataclass(frozen=True)
class AttentionConfig:
    """One launch of ``small_width_attention``."""

    block_s: int  # key slots per inner step
    split_slots: int  # history slots owned by one split program (flash-decoding)
    num_warps: int = 4
    num_stages: int = 2


_CONFIG_TYPES = {
    "w2a8_linear": LinearConfig,
    "w2a16_linear": LinearConfig,
    "int8_head_argmax": HeadConfig,
    "int4_head_argmax": HeadConfig,
    "f16_head_argmax": HeadConfig,
    "small_width_attention": AttentionConfig,
}


def gpu_table_name(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)


@functools.lru_cache(maxsize=None)
def load_table(device_name: str) -> tuple[dict, ...]:
    """The shipped entries for one GPU model (empty when none were tuned)."""
    path = TUNED_DIR / f"{gpu_table_name(device_name)}.json"
    if not path.is_file():
        return ()
    data = json.loads(path.read_text())
    return tuple(data.get("entries", ()))


# ``lookup``'s answers per table: every launch asks (a capture at load, ~9,000 times for the 2B
# shape: ~0.3 s of scanning the table on the H200's host, more on a board's). Keyed by the
# table tuple itself, which the memo holds, so a reloaded table (``load_table.cache_clear``,
# another TUNED_DIR) starts a fresh memo rather than matching a recycled id.
_LOOKUPS: dict[str, tuple[tuple[dict, ...], dict]] = {}


def lookup(op: str, key: dict[str, Any], device: torch.device):
    """The tuned config for ``op`` at ``key`` on ``device``'s GPU model, or None."""
    name = _device_name(device)
    entries = load_table(name)
    table, answers = _LOOKUPS.get(name, ((), {}))
    if table is not entries:
        answers = {}
        _LOOKUPS[name] = (entries, answers)
    memo_key = (op, tuple(sorted(key.items())))
    if memo_key not in answers:
        answers[memo_key] = find_config(entries, op, key)
    return answers[memo_key]


LINEAR_OPS = ("w2a8_linear", "w2a16_linear")  # their widths pad to row tiles (the heads' do not)


def row_tile(m: int) -> int:
    """The rows a width pads to in a tensor-core tile (16, 32, 64 or 128): the widths that
    share one are the same launch, whatever the table's entry was tuned at."""
    return min(max(16, 1 << max(m - 1, 0).bit_length()), 128)


def find_config(entries, op: str, key: dict[str, Any]):
    """Exact key first; else the entry that differs only in ``M`` with the nearest M (ties:
    smaller M) among the tuned widths of the same row tile (``row_tile``; linears), else among all.

    A launch tuned for one tile height runs another one badly: the 2B stack at M = 33 took
    M = 27's 32-row ``mma`` entries on 64 padded rows, 1955 µs, against 1591 µs with entries
    of its own (tools/results/kernels.md); within a tile the nearest width is the same work."""
    entries = [e for e in entries if e["op"] == op]
    for e in entries:
        if e["key"] == key:
            return _CONFIG_TYPES[op](**e["config"])
    if "M" in key:
        rest = {k: v for k, v in key.items() if k != "M"}
        same_shape = [e for e in entries if {k: v for k, v in e["key"].items() if k != "M"} == rest]
        same_tile = [e for e in same_shape if op in LINEAR_OPS and row_tile(e["key"]["M"]) == row_tile(key["M"])]
        if same_shape:
            best = min(same_tile or same_shape, key=lambda e: (abs(e["key"]["M"] - key["M"]), e["key"]["M"]))
            return _CONFIG_TYPES[op](**best["config"])
    return None


def save_table(path: Path, device_name: str, entries: list[dict], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"gpu": device_name, **meta, "entries": entries}
    path.write_text(json.dumps(data, indent=1) + "\n")


def record(op: str, key: dict[str, Any], config, us: float) -> dict:
    return {"op": op, "key": key, "config": asdict(config), "us": round(us, 3)}


# --- fallbacks (unseen GPUs, the interpreter) and the candidate lists --tune times -------

def linear_key(n: int, k: int, m: int, grouped: bool) -> dict[str, Any]:
    return {"N": n, "K": k, "M": m, "scales": "group128" if grouped else "row"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


LANES_MAX_M = 2  # widths the untuned default runs on ``lanes`` (dp4a); wider ones go to ``mma``
MMA_MAX_M = 32  # v3: widths in one tile of the pipelined tensor-core kernel; wider ones in 32-row tiles
CHAINS_MAX_M = 16  # widths the tuner also times with two K steps in flight (``LinearConfig.chains``)
# K steps (bytes per row, pipeline stages) the tuner also tries on every folded launch of a layer
# at once (``layer_step_variant``, ``autotune.tune_layer``): under programmatic launch each
# launch's first step is in flight before it waits for the previous kernel, so how much of a
# layer's weights that is depends on all of its launches together. H200, 2B stack, every folded
# launch at 256 bytes in one stage: M = 9 788 -> 682 µs, 16 838 -> 734 (128 bytes, one stage:
# M = 24 1012 -> 949); one projection changed alone was slower in every case; the decode replays
# gained 3-5% (tools/results/kernels.md, "Two chains, and longer K steps").
LAYER_STEP_VARIANTS = ((128, 1), (128, 2), (256, 1), (256, 2))
# Which W2A8 kernels the untuned default picks (BITMTP_W2A8_KERNELS):
# "v1" = gemv (M <= 2) / dot; "v2" = lanes / mma without software pipelining;
# "v3" = what the H200 measured fastest per width (tools/results/kernels.md: single large
# matrices and the whole 2B stack): gemv at M <= 2 (at M = 1 with the weights' L2 prefetch
# before the programmatic-launch wait), ``mma`` pipelined over three stages for
# M = 3..MMA_MAX_M (2-2.5x ``dot`` on large matrices there), and beyond in 32-row tiles
# (``block_m``): at M = 33..64 the M <= 32 launch (the same K slices) twice side by side,
# from M = 65 with K sliced only where the tiles leave half the SMs idle (the 2B stack's
# table at M = 80 holds them for three of its four projections, 1.13x faster than ``dot``).
# M = 33..64 took ``dot`` until the 2B-shape replays measured the 32-row tiles 12% faster at
# widths 33 and 40 (tools/results/kernels.md, fused widths; the stack of linears alone had
# them even: its launches run back to back, not between the model's other kernels).
# "v4" = v3 up to M = 16; wider widths on ``mma`` too, cut into 16-row tiles (``block_m``)
# that share each weight tile through the L2. Measured slower than v3 on the 2B stack at
# M = 27-40 (1551 / 1730 / 1740 against 1310 / 1591 / 1626 µs), faster at M = 80 (2742 vs
# 2814 with ``dot``); kept as an option, not the default.
# "v5" = v3 with every ``mma`` launch of M = 3..128 folded (``fold_lanes``: the
# four lanes in one accumulator, a quarter of the registers, one dot per lane per K step, half
# the tensor-core waits at two chunks per step): M = 3..16 v3's tiles; M = 17..64 the whole
# width in one tile of 128 weight rows over 8 warps (half the activation reads per weight of
# 64-row tiles, each weight tile decoded once for the width); M = 65..128 32-row tiles of 64
# weight rows side by side; K sliced as for 64-row tiles throughout (what was measured).
# The H200, the BitNet-2B stack against v3 / the previous table (µs per step, one run,
# tools/results/kernels.md "Wide widths, session 8"): M = 9 894 vs 1018 / 985, 16 946 vs
# 1067 / 1027, 27 1211 vs 1307 / 1295, 33 1529 vs 1708 / 1714, 40 1594 vs 1722 / 1728,
# 80 2206 vs 3094 / 2341; the 2B-shape replays at widths 32 / 33 / 40 1892 / 2141 / 2185
# against the previous table's 2082 / 2368 / 2489. At 33 and 40 the stack alone ranks 32-row
# folded tiles first (1342 / 1378) but the replays put them 3-4% behind the 128-row tiles.
# "v6" = v5, except that a GPU of few SMs (a Jetson Orin's 4-16) runs M = 1 and
# M = 2 on v5's M = 3 launch (folded ``mma``, one program per 64 weight rows, no K slice)
# instead of gemv, which decodes every weight once per activation row (its grid is one
# program per row: M = 2 costs twice M = 1). Measured on N SMs of the H200 (a CUDA green
# context, ``tools/sm_partition_stack.py``, the BitNet-2B stack in one graph, µs per step,
# gemv vs mma; tools/results/kernels.md "An Orin's SM count on the H200"): 8 SMs M = 1
# 4139 vs 3427 (mma.sync, an Orin's instruction: 4154 vs 3526), M = 2 7953 vs 3480; 16 SMs
# M = 1 2189 vs 2025, M = 2 4053 vs 2038; 32 SMs M = 1 1231 vs 2123 (gemv wins), M = 2 2155
# vs 1894; 64 SMs M = 2 1229 vs 944; 128 SMs M = 2 758 vs 762. Group-128 weights keep gemv
# (their ``mma`` steps one chunk at a time; not measured at these widths).
# "v7" = v6, except that on a GPU of few SMs (up to ``TAIL_MAX_SMS``) the folded
# whole-width launches of M = 33..48 take a tail tile (``tail_config``: 32 + 16 rows, each
# decoded weight tile multiplied by both, instead of the width padded to 64). The BitNet-2B
# stack, mma.sync (an Orin's instruction), µs per step, v6 vs v7 (session 14; sm_partition_stack
# --tail): 8 SMs M = 33 11636 vs 9151, 40 11859 vs 9370, 48 12162 vs 9672 (M = 32 unchanged,
# 6901 vs 6897); 16 SMs M = 33 6553 vs 5199, 40 6681 vs 5337. Larger GPUs keep v6 (not measured).
# "v8" = v7, except that on a GPU of few SMs (up to ``BOARD_MAX_SMS``) every folded
# launch runs 4 warps of 32 or 64 weight rows each (two or four independent tensor-core tiles per
# warp and lane, and fewer activation reads per weight): M = 1..64 in 128 weight rows (M = 17..64
# kept v7's 128 rows on 8 warps; M <= 16 had 64 rows), M = 65..128 (32-row tiles of the width
# side by side) in 256 (were 64) — where those programs still cover the SMs (else v7's launch:
# the embedded model's 512-row projections on 8 SMs at M <= 16). Measured on 8 SMs of the H200
# (mma.sync, no programmatic launch: an Orin's; ``sm_partition_stack.py --vary``, the BitNet-2B
# stack in one graph, µs per step, v7 vs v8, session 16): M = 1 3543 vs 3066, 9 3911 vs 3218,
# 16 4589 vs 3294, 32 6849 vs 5239, 33 9135 vs 7894, 40 9382 vs 8007, 48 9645 vs 8865, 64 12902
# vs 10058, 80 18071 vs 12529; 16 SMs M = 1 2116 vs 1952, 9 2300 vs 2059, 16 2624 vs 2109; the
# embedded model's stack on 8 SMs M = 1 122 vs 117, 32 201 vs 184. Of the launch variants swept
# (64 / 128 / 256 weight rows, 2 / 4 / 8 warps, 2-5 stages, one to eight chunks per step, K in
# one or two slices: 96 at M <= 32, 6 at 24-80), these were the fastest at every width measured
# but M = 24 (a tie with v7's 8 warps, 4928 vs 4915) and M = 33..64, where 256 rows lost. At
# M <= 16 a projection whose 128-row programs leave their last wave part empty (``wave_fill``
# below 0.9: the 2B O and down projections' 20 programs, 0.83 on 8 SMs and 0.63 on 16) has K
# sliced until it is full (8 SMs: 2 slices, 16 SMs: 3): swept per projection (``--vary-only``),
# the 2B stack at M = 1 / 9 / 16 on 8 SMs 3066 / 3216 / 3307 → 3000 / 3168 / 3221 µs, on 16 SMs
# 1960 / 2073 / 2131 → 1733 / 1847 / 1910; slicing the QKV projection's 30 programs (fill 0.94)
# was 1-3% slower on 8 and on 16 SMs.
# "v9" = v8, except that on a GPU of more SMs than ``BOARD_MAX_SMS`` whose launches
# are programmatic (``programmatic``: sm_90+, Triton with launch_pdl, BITMTP_PDL on) every folded
# launch without a tail tile takes a layer-wide K step (``layer_step_variant``): 256 bytes in
# one stage at M = 3..16, 128 bytes in one stage at M = 17..24 (``LAYER_STEPS``). Each launch
# then has more of its weights in flight before it waits for the previous kernel. Measured on the
# H200, the BitNet-2B stack, all launches changed together (session 21, the table's entries):
# M = 9 788 -> 682 µs, 16 838 -> 734, 24 1012 -> 949; at M = 32 256 bytes in one stage won on the
# stack (1125 -> 1024) but lost 1.5% in the decode replays, so wider widths keep v8's. A board (no
# programmatic launch on sm_87; longer steps measured 5-40% slower on 8 SMs in session 16) keeps v8.
#
# v10 (issue 15, the untuned default within 15% of the table): v9, plus on more than
# ``BOARD_MAX_SMS`` SMs the folded whole-width launch of M = 17..64 (128 weight rows over two warp
# groups) slices K by *its* tiles' count. v5 sliced that launch as if its tiles were 64 rows high
# ("until 64-row weight tiles would cover the SMs once"), so its programs covered about half of an
# H200's SMs: the 2B stack at M = 24 ran 18% slower than the table, whose M = 24-40 entries slice
# the same launches 4-6 ways where v9 slices them 1-4 (session 22). Measured on the H200 (session
# 23, one run, untuned / table): v10 1.02 / 1.00 / 1.00 / 0.98 / 0.90 at M = 17 / 24 / 32 / 40 / 64,
# v9 1.22 / 1.17 / 1.07 / 1.21 / 1.05; the decode replay of width 24 untuned 1529 -> 1469 µs.
W2A8_GENERATIONS = ("v1", "v2", "v3", "v4", "v5", "v6", "v7", "v8", "v9", "v10")
W2A8_DEFAULT_GENERATION = os.environ.get("BITMTP_W2A8_KERNELS", "v10")
LAYER_STEPS = ((16, 256, 1), (24, 128, 1))  # v9: (up to M, bytes per K step, stages) under programmatic launch
BOARD_MAX_SMS = 16  # v8: the board tiles up to this many SMs (measured on 8 and 16)
BOARD_WAVE_FILL = 0.9  # v8 at M <= 16: K sliced until the programs fill their waves this well
TAIL_MAX_SMS = 16  # v7: tail tiles up to this many SMs (measured on 8 and 16)
MMA_M1_MAX_SMS = 16  # v6: M = 1 on the tensor cores up to this many SMs (gemv won at 32)
MMA_M2_MAX_SMS = 64  # v6: M = 2 likewise (even at 128)
MMA_TILED_MAX_M = 128  # v4: widths on 16-row ``mma`` tiles; wider ones as v3
TILED_MIN_M = 64  # v3: wider widths on 32-row ``mma`` tiles with K sliced by the tiles' count
WIDE_BLOCK_M = 16


def wave_fill(programs: int, sms: int) -> float:
    """How full the waves of ``programs`` equal programs over ``sms`` SMs are: 1.0 when every SM
    runs as many; 20 programs on 8 SMs 0.83 (the last wave half empty), on 16 SMs 0.625."""
    return programs / (sms * _cdiv(programs, sms))


def group_k_slices(k: int) -> int:
    """The number of K slices (split-K) of a group-128 linear, from K alone and whatever the
    launch configuration: the float32 sum over the groups then runs in the same order at
    every width and on every kernel (one 128-chunk at a time, in K order, within a slice;
    slices added in order), which is what makes a row's bits independent of its call's width
    (``w2a8_linear_reference`` follows the same slices). From 32 chunks (K > 3968) on, one
    slice per 16 chunks (2048 inputs), at most 4: long-K projections (a Qwen3 down_proj)
    still spread over a large GPU's SMs, while K <= 3968 pays no reduction launch."""
    chunks = _cdiv(k, 128)
    return max(1, min(chunks // 16, 4)) if chunks >= 32 else 1


def default_linear(m: int, grouped: bool, *, weight_only: bool = False, n: int | None = None,
                   k: int | None = None, sms: int | None = None, generation: str | None = None,
                   programmatic: bool | None = None) -> LinearConfig:
    """The launch of a packed linear on a GPU without a tuned entry, from the shape and the
    device's SM count (``sms``; None: sized as for a large GPU). ``n`` and ``k`` (when
    known) size the tiles and the split-K so that the programs cover every SM a few times:
    an Orin's 8-16 SMs get wide tiles and no split, an H200's 132 get narrow ones and slices.
    ``generation`` (``W2A8_GENERATIONS``, W2A8 only): the kernels, default ``W2A8_DEFAULT_GENERATION``.

    How the SM count enters (v3): at M <= 2 every program streams 8 weight rows, so a GPU of
    any size gets ~N/8 programs per row, hundreds of waves on an Orin and a few on an H200;
    from M = 3 the tensor-core tiles are 64 rows wide and K is sliced until the tiles cover
    the SMs once (an H200's 132 SMs slice the 2B shapes 1-4 ways, an Orin's 8-16 never),
    each slice keeping five chunks at least for the three-stage software pipeline (at
    M = 33..64 that launch runs in two 32-row tiles); from M = 65 the width's 32-row tiles
    multiply the programs, and K is sliced only where they still leave half the SMs idle.
    v5 slices K the same way at every M = 3..128 (as for 64-row weight tiles), so an Orin
    gets the folded whole-width tiles unsliced. v6 is v5 with M = 1 (up to 16
    SMs) and M = 2 (up to 64) on the M = 3 launch: on few SMs a launch spans many waves and
    decoding each weight once for the width beats gemv's once per row. v7 is v6
    with a tail tile at M = 33..48 on up to 16 SMs (32 + 16 rows instead of 64, ``tail_config``).
    v8 is v7 with every folded launch on up to 16 SMs on 4 warps of 128 weight rows
    (256 at M = 65..128), where those programs still give each SM one at least, and at M <= 16 K
    sliced until they fill their waves to ``BOARD_WAVE_FILL``. v9 is v8 with, on more
    than ``BOARD_MAX_SMS`` SMs and ``programmatic`` launches (None: whether the current CUDA device
    launches W2A8 kernels programmatically), the folded launches of M <= 24 in ``LAYER_STEPS``.
    v10 (the default) is v9 with, on more than ``BOARD_MAX_SMS`` SMs, the whole-width 128-row launch
    of M = 17..64 sliced by its own tiles' count (v5-v9 counted 64-row tiles: half the SMs covered).
    """
    chunks = _cdiv(k, 128) if k else 0
    sms = sms or 132
    generation = generation or W2A8_DEFAULT_GENERATION
    if generation not in W2A8_GENERATIONS:
        raise ValueError(f"W2A8 kernel generation must be one of {W2A8_GENERATIONS} (BITMTP_W2A8_KERNELS), "
                         f"got {generation!r}")
    if not weight_only and generation == "v10":
        cfg = default_linear(m, grouped, n=n, k=k, sms=sms, generation="v9", programmatic=programmatic)
        # (v5's launch there: no row tiles, and tails only on boards)
        wide_tile = MMA_MAX_M // 2 < m <= TILED_MIN_M and cfg.kernel == MMA and cfg.block_n == 128
        if sms <= BOARD_MAX_SMS or grouped or not wide_tile or not (n and chunks):
            return cfg
        # K slices until the 128-row tiles cover the SMs once, five chunks per slice at least (as v5)
        return replace(cfg, split_k=max(1, min(_cdiv(sms, _cdiv(n, cfg.block_n)), chunks // 5, 8)))
    if not weight_only and generation == "v9":
        cfg = default_linear(m, grouped, n=n, k=k, sms=sms, generation="v8")
        if programmatic is None:
            from .common import programmatic_launch_ready  # common imports triton: only when asked

            programmatic = programmatic_launch_ready()  # what w2a8_linear's launch will be
        if sms <= BOARD_MAX_SMS or not programmatic or grouped or cfg.tail_m:
            return cfg
        for max_m, block_kb, num_stages in LAYER_STEPS:
            if m <= max_m:
                return layer_step_variant(cfg, block_kb, num_stages)
        return cfg
    if not weight_only and generation == "v8":
        cfg = default_linear(m, grouped, n=n, k=k, sms=sms, generation="v7")
        if sms > BOARD_MAX_SMS or m > MMA_TILED_MAX_M or cfg.kernel != MMA or not cfg.fold_lanes or grouped:
            return cfg
        block_n = 128 if m <= TILED_MIN_M else 256  # beyond: the width's 32-row tiles side by side
        programs = _cdiv(n, block_n) * (_cdiv(m, cfg.block_m) if m > TILED_MIN_M else 1) if n else sms
        if not (cfg.block_n == block_n or programs >= sms):  # too few programs to cover the SMs
            return cfg
        split = 1
        if m <= MMA_MAX_M // 2 and chunks:  # K slices until the last wave of programs is nearly full
            while (wave_fill(programs * split, sms) < BOARD_WAVE_FILL and split < 4
                   and chunks // (split + 1) >= 5):  # five chunks per slice at least, as everywhere
                split += 1
        return replace(cfg, block_n=block_n, num_warps=4, split_k=max(split, cfg.split_k))
    if not weight_only and generation == "v7":
        cfg = default_linear(m, grouped, n=n, k=k, sms=sms, generation="v6")
        return tail_config(cfg, m) if sms <= TAIL_MAX_SMS and m <= 48 else cfg
    if not weight_only and generation == "v6":
        if not grouped and ((m == 1 and sms <= MMA_M1_MAX_SMS) or (m == 2 and sms <= MMA_M2_MAX_SMS)):
            return default_linear(3, grouped, n=n, k=k, sms=sms, generation="v5")
        generation = "v5"
    if not weight_only and generation == "v4" and MMA_MAX_M // 2 < m <= MMA_TILED_MAX_M:
        # 16-row tiles side by side: K slices until the tiles of all rows cover the SMs once
        m_tiles = _cdiv(m, WIDE_BLOCK_M)
        split = 1
        if n and chunks:
            split = max(1, min(_cdiv(sms, _cdiv(n, 64) * m_tiles), chunks // 5, 8))
        return LinearConfig(MMA, block_n=64, block_kb=64, num_warps=4, num_stages=3, split_k=split,
                            block_m=WIDE_BLOCK_M)
    if not weight_only and generation == "v5" and 3 <= m <= MMA_TILED_MAX_M:
        if m <= MMA_MAX_M // 2:  # v3's tiles, folded
            return replace(default_linear(m, grouped, n=n, k=k, sms=sms, generation="v3"), fold_lanes=True)
        # K slices until 64-row weight tiles would cover the SMs once, five chunks per slice at least
        split = max(1, min(_cdiv(sms, _cdiv(n, 64)), chunks // 5, 8)) if n and chunks else 1
        if m <= TILED_MIN_M:  # the whole width per program, 128 weight rows over two warp groups
            return LinearConfig(MMA, block_n=128, block_kb=64, num_warps=8, num_stages=3, split_k=split,
                                fold_lanes=True)
        return LinearConfig(MMA, block_n=64, block_kb=64, num_warps=4, num_stages=3, split_k=split, block_m=32,
                            fold_lanes=True)
    if not weight_only and generation in ("v3", "v4", "v5"):  # v5 beyond 128 rows
        if m <= 2:  # a whole row per step; the weights' L2 prefetch (at M = 1 only: it measured slower
            # at M = 2, where two programs ask for the same rows) runs only under programmatic launch
            step = min(32, max(8, 1 << (chunks - 1).bit_length())) if chunks else 16
            return LinearConfig(GEMV, block_n=8, block_kb=32 * step, num_warps=4, prefetch=m == 1)
        if m <= TILED_MIN_M:  # K slices until the 64-row weight tiles cover the SMs once, five chunks per
            # slice at least; past 32 rows the width in two 32-row tiles, each the M <= 32 launch
            split = 1
            if n and chunks:
                split = max(1, min(_cdiv(sms, _cdiv(n, 64)), chunks // 5, 8))
            return LinearConfig(MMA, block_n=64, block_kb=64, num_warps=4, num_stages=3, split_k=split,
                                block_m=32 if m > MMA_MAX_M else 0)
        # 32-row tiles side by side; K sliced only where the tiles leave half the SMs idle
        tiles = _cdiv(n, 64) * _cdiv(m, 32) if n else sms
        split = max(1, min(_cdiv(sms, tiles), chunks // 5, 8)) if chunks and 2 * tiles < sms else 1
        return LinearConfig(MMA, block_n=64, block_kb=64, num_warps=4, num_stages=3, split_k=split, block_m=32)
    if not weight_only and generation == "v1":
        # gemv with dp4a at M <= 2 (a whole row per step), the int8 dot otherwise; K slices
        # until the N tiles cover the SMs (the previous H200 rule used 128 for every GPU)
        if m <= 2:
            step = min(32, max(8, 1 << (chunks - 1).bit_length())) if chunks else 16
            return LinearConfig(GEMV, block_n=8, block_kb=32 * step, num_warps=4)
        split = 1
        if n and chunks:
            split = max(1, min(_cdiv(sms, _cdiv(n, 64)), chunks // 4, 8))
        return LinearConfig(DOT, block_n=64, block_kb=64, num_warps=4, num_stages=3, split_k=split)
    if weight_only:
        # 16-bit: every weight costs a convert and an FMA per row, so only M = 1 stays on gemv.
        if m <= 1:  # a whole row (up to 32 chunks) per step: all loads in flight at once
            step = min(32, max(8, 1 << (chunks - 1).bit_length())) if chunks else 16  # chunks, a power of two
            return LinearConfig(GEMV, block_n=8, block_kb=32 * step, num_warps=4)
        split = 1
        if n and chunks:  # too few N tiles to fill a GPU: slice K as well, two steps per slice at least
            split = max(1, min(_cdiv(128, _cdiv(n, 64)), chunks // 4, 8))
        return LinearConfig(DOT, block_n=64, block_kb=64, num_warps=4, num_stages=3, split_k=split)
    if m <= LANES_MAX_M:
        # dp4a, decode once for the rows: 16 weight rows x 8 chunks per step (the densest loop,
        # tools/kernel_sass.py); 8 rows where 16 would leave SMs idle; no K split (its reduce
        # launch costs more than a small GPU gains)
        block_n = 16 if not n or _cdiv(n, 16) >= 2 * sms else 8
        step = min(8, 1 << max(chunks - 1, 0).bit_length()) if chunks else 8
        return LinearConfig(LANES, block_n=block_n, block_kb=32 * step, num_warps=4, num_stages=1)
    # mma: 64 weight rows per program up to 32 activation rows (the densest loop); from 64
    # rows the four int32 accumulators need 32 weight rows to stay in registers. K slices
    # until the tiles cover the SMs twice, two chunks per slice at least.
    block_n = 64 if m <= 32 else 32
    m_tiles = _cdiv(m, 128)
    split = 1
    if n and chunks:
        split = max(1, min(_cdiv(2 * sms, _cdiv(n, block_n) * m_tiles), chunks // 2, 8))
    return LinearConfig(MMA, block_n=block_n, block_kb=64, num_warps=4, num_stages=1, split_k=split)


def tail_config(cfg: LinearConfig, m: int) -> LinearConfig:
    """``cfg`` with a tail tile (``LinearConfig.tail_m``) at width ``m``, where that pads fewer
    rows; else ``cfg`` itself. A folded ``mma`` launch that takes the whole width in one
    program pads it to a power of two P: split into a main tile of P/2 rows and a tail of the
    smallest power of two (>= 16) that holds the rest, when the tail is the smaller tile:
    M = 33..48 -> 32 + 16 rows instead of 64, 65..80 -> 64 + 16 and 81..96 -> 64 + 32 instead
    of 128. Other kernels, launches already tiled below the width (``block_m``) or with two
    chains (``chains``: no tail in that loop), and the widths
    where no tail is smaller (M <= 32, 49..64, 97..) keep ``cfg``. The untuned defaults take it
    at M = 33..48 on up to ``TAIL_MAX_SMS`` SMs (generation v7, where it was measured)."""
    if cfg.kernel != MMA or not cfg.fold_lanes or cfg.tail_m or cfg.chains > 1 or not 32 < m <= 128:
        return cfg
    whole = 1 << (m - 1).bit_length()  # the rows one program pads the width to
    if cfg.block_m and cfg.block_m < whole:
        return cfg
    main = whole // 2
    tail = max(16, 1 << (m - main - 1).bit_length())
    return replace(cfg, block_m=main, tail_m=tail) if tail < main else cfg


def layer_step_variant(cfg: LinearConfig, block_kb: int, num_stages: int) -> LinearConfig:
    """``cfg`` with K steps of ``block_kb`` packed bytes over ``num_stages`` pipeline stages where it
    is a folded ``mma`` launch (``LAYER_STEP_VARIANTS``); any other launch as it is."""
    if cfg.kernel != MMA or not cfg.fold_lanes:
        return cfg
    return replace(cfg, block_kb=block_kb, num_stages=num_stages)


def linear_candidates(m: int, n: int, k: int, grouped: bool, weight_only: bool = False) -> list[LinearConfig]:
    """What the tuner times for one (N, K, M). W2A8: gemv (with and without the L2
    prefetch) and ``lanes`` up to M = 2, the pipelined ``mma`` over the whole width up to
    M = 48 and in 16- / 32-row tiles for M = 17..128, the same with folded lanes (and 128
    weight rows over 8 warps) for M = 1..128, the folded whole-width launches also with a tail
    tile where one pads fewer rows (``tail_config``: M = 33..48, 65..96), ``dot`` from M = 2;
    W2A16: gemv at M <= 2, the 16-bit dot always."""
    chunks = _cdiv(k, 128)
    out = []
    if weight_only:
        if m <= 2:
            for bn in (4, 8, 16):
                for kb in (256, 512, 1024):
                    step = kb // 32
                    if step > 2 * chunks:
                        continue
                    for sk in (1, 2, 4):
                        if sk > 1 and chunks / sk < step / 2:  # slices much shorter than a step waste lanes
                            continue
                        out.append(LinearConfig(GEMV, bn, kb, num_warps=4, num_stages=1, split_k=sk))
        for bn in (32, 64):
            for kb in (64, 128):
                for sk in (1, 2, 4, 8):
                    if sk > 1 and (_cdiv(n, bn) >= 264 or chunks / sk < kb // 32):
                        continue
                    out.append(LinearConfig(DOT, bn, kb, num_warps=4, num_stages=3, split_k=sk))
        return out
    step = min(32, max(8, 1 << (chunks - 1).bit_length()))
    if m <= 2:  # dp4a; past two rows the tensor cores win on every shape measured (kernels.md)
        out += [LinearConfig(GEMV, 8, 32 * step), LinearConfig(GEMV, 16, 32 * step),
                LinearConfig(GEMV, 8, 32 * step, prefetch=True), LinearConfig(LANES, 16, 256)]
    tiles = []
    if m <= 48:  # the pipelined tensor-core kernel (three stages), each weight tile decoded once for the width
        tiles += [(MMA, 64, 64, 4, 3, sk, 0, False) for sk in (1, 2, 3, 4)] + [
            (MMA, 32, 64, 4, 3, 1, 0, False), (MMA, 32, 64, 4, 3, 2, 0, False), (MMA, 64, 128, 4, 2, 1, 0, False)]
    if 3 <= m <= 16:  # more of the weights in flight: a deeper pipeline, the L2 prefetch before the wait
        tiles += [(MMA, 64, 64, 4, 4, sk, 0, False) for sk in (2, 4)] + [(MMA, 64, 64, 4, 3, 4, 0, True)]
    if 16 < m <= 128:  # wide: the width in 16- or 32-row tiles that share each weight tile through the L2
        for bm in (16, 32):
            if bm < m:
                tiles += [(MMA, 64, 64, 4, 3, sk, bm, False) for sk in (1, 2, 4)] + [(MMA, 32, 64, 4, 3, 1, bm, False)]
        if m <= 64:  # the whole width in one tile over 8 warps: half the accumulator registers per thread
            tiles += [(MMA, 64, 64, 8, 3, sk, 0, False) for sk in (1, 2)]
        # deeper pipeline / the weights' L2 prefetch before the wait: more of the weights in flight
        tiles += [(MMA, 64, 64, 4, 4, 2, 16, False), (MMA, 64, 64, 4, 3, 2, 16, True)]
    tiles = [t + (False,) for t in tiles]
    if 3 <= m <= 128:  # no K split (no reduction launch), some with the activation sums on the tensor cores:
        # narrow weight tiles for parallelism, four chunks per step over four stages for bytes in flight
        bm = 0 if m <= 16 else 16
        tiles += [(MMA, 32, 128, 4, 4, 1, bm, False, False), (MMA, 32, 128, 4, 4, 1, bm, False, True),
                  (MMA, 16, 128, 2, 4, 1, bm, False, True), (MMA, 32, 128, 4, 4, 1, bm, True, True),
                  (MMA, 64, 64, 4, 3, 2, bm, False, True)]
    if m >= 2:
        tiles += [(DOT, 64, 64, 4, 3, sk, 0, False, False) for sk in (1, 2, 4)]
        tiles += [(DOT, 128, 64, 8, 3, 1, 0, False, False)]
    for kind, bn, kb, warps, stages, sk, bm, pf, asum in tiles:
        if grouped and kind == MMA:
            kb = 32  # one chunk per step: its group scale applies to that chunk's exact sum
        if grouped:  # the launcher's slices for group scales whatever the config; sums on the tensor cores anyway
            sk, asum = group_k_slices(k), False
        if sk > 1 and chunks / sk < 2 * kb // 32:  # slices of at least two steps
            continue
        cfg = LinearConfig(kind, bn, kb, num_warps=warps, num_stages=stages, split_k=sk, prefetch=pf, block_m=bm,
                           asum_by_dot=asum)
        if cfg not in out:
            out.append(cfg)
    if m <= MMA_TILED_MAX_M:  # the lanes folded into one accumulator (a quarter of the registers): v3's
        # tiles (at M <= 2 too: on a GPU of few SMs they beat gemv); from 17 rows the whole width
        # (or 32-row tiles) per program, 128 weight rows over 8 warps
        folded = [(64, 4, sk, 0) for sk in (1, 2, 3, 4)]
        if m <= TILED_MIN_M:  # v8's board launch: 128 weight rows over 4 warps (two tiles per warp)
            folded += [(128, 4, sk, 0) for sk in (1, 2, 3)]
        if m > 16:
            folded += [(64, 4, sk, 32) for sk in (1, 2, 4)] + [(128, 8, sk, 0) for sk in (1, 2, 3, 4)]
        if m > TILED_MIN_M:  # v8's board launch beyond: 256 weight rows over 4 warps, 32-row tiles
            folded += [(256, 4, sk, 32) for sk in (1, 2)]
        for bn, warps, sk, bm in folded:
            sk = group_k_slices(k) if grouped else sk
            if sk > 1 and chunks / sk < 4:
                continue
            cfg = LinearConfig(MMA, bn, 64, num_warps=warps, num_stages=3, split_k=sk, block_m=bm, fold_lanes=True)
            # the whole width: with a tail where it pads fewer rows; up to 16 rows also two K steps
            # in flight (``chains``: on a large GPU with Ampere's ``mma.sync`` the 2B stack 8% faster at
            # M = 9, 3% at 16; slower with Hopper's ``wgmma`` and on 8 SMs, tools/results/kernels.md)
            for c in (cfg, tail_config(cfg, m)) + ((replace(cfg, chains=2),) if m <= CHAINS_MAX_M else ()):
                if c not in out:
                    out.append(c)
    return out


def default_head(m: int, int4: bool = False) -> HeadConfig:
    # int4: the same 128 bytes of each weight row per step as the others (256 columns)
    return HeadConfig(block_v=128, block_h=256 if int4 else 128, num_warps=4, num_stages=3)


def head_candidates(m: int) -> list[HeadConfig]:
    return [HeadConfig(bv, bh, w, s) for bv, bh, w, s in
            ((64, 128, 4, 3), (128, 128, 4, 3), (128, 256, 4, 3), (256, 128, 8, 3), (128, 64, 4, 4))]


SM_COUNT_ENV = "BITMTP_SM_COUNT"


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The SMs the untuned defaults are sized for: the device's, or ``BITMTP_SM_COUNT`` (a
    benchmark confined to part of a GPU by a green context, or a board's defaults tried on a
    large GPU; read once per device)."""
    if device.type != "cuda":
        return 1
    given = os.environ.get(SM_COUNT_ENV, "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"{SM_COUNT_ENV}={given!r}: give a positive whole number of SMs (the untuned "
                             "launch defaults are sized for it), or unset it")
        return int(given)
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_attention(head_dim: int, rows: int, capacity: int, kv_heads: int, sms: int) -> AttentionConfig:
    """Split the history so that ``kv_heads * splits`` programs cover the GPU about twice.

    ``rows`` = M * (Hq / Hkv) is the query tile height: tall tiles get more warps (registers).
    Splits never go below 256 slots: past that the partials and the combine launch cost more
    than they spread (a 256-slot segment in one split saves the combine: ~1 µs a layer).
    """
    block_s = 64 if head_dim <= 128 else 32
    splits = max(1, min(_cdiv(2 * sms, kv_heads), _cdiv(capacity, 256)))
    split_slots = max(block_s, _cdiv(_cdiv(max(capacity, 1), splits), block_s) * block_s)
    return AttentionConfig(block_s=block_s, split_slots=split_slots, num_warps=8 if rows > 64 else 4, num_stages=2)
