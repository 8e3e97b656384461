"""Small pieces every kernel module shares: jit helpers and launcher checks.

Two helpers exist because the Triton interpreter (CPU CI) and the compiler disagree on
what they accept:

* ``dp4a``: on a GPU one PTX ``dp4a.s32.s32`` (four int8 products summed into int32, one
  instruction); the interpreter cannot run inline assembly, so there it is emulated with
  shifts. Kernels take ``USE_ASM: tl.constexpr``; launchers pass ``not is_interpreted(kernel)``.
* ``round_half_even``: ``libdevice.rint`` does not run under the interpreter. Adding and
  subtracting 1.5 * 2**23 rounds any float32 with |x| < 2**22 to the nearest integer,
  ties to even, exactly as ``torch.round`` does; our operands are at most 127.5.

Programmatic dependent launch (``pdl_options``, sm_90+): a decode step is ~350 small kernels
back to back, each paying launch and ramp-up before it can start. Launched with
``launch_pdl``, the next kernel is scheduled while this one runs and blocks in
``gdc_prologue`` until this one has finished and its writes are visible: the same data
dependencies, the launch latency hidden. Every kernel here runs the prologue before it reads
anything another kernel writes (it must run in every PDL-launched kernel: completion then
implies the predecessor's completion, so dependencies stay transitive); constants (weights,
their scales, norm weights) may be read before it, so their DRAM latency overlaps the
previous kernel. Orin (sm_87) has no PDL: there the option is off and the
kernels are unchanged.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl

from .packing import CHUNK_K, LANES, packed_width

def alignment_blind(*names: str) -> dict:
    """``triton.jit`` options under which the integer arguments ``names`` compile one variant
    whether or not they are divisible by 16. Triton otherwise compiles a second variant for
    the divisible values (a hint for vectorised access), one more compile at a cold start per
    such width: for row counts that only bound or index rows, where no access is vectorised
    along them, the hint buys nothing. The value 1 is still specialised. On a Triton without
    the option (before 3.2): {}, i.e. Triton's usual variants."""
    if "do_not_specialize_on_alignment" not in inspect.signature(triton.jit).parameters:
        return {}
    return {"do_not_specialize_on_alignment": list(names)}


# 1.5 * 2**23: float32 has no fraction bits left at this magnitude, so the add rounds.
_RINT_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def round_half_even(x):
    return (x + _RINT_MAGIC) - _RINT_MAGIC


@triton.jit
def dp4a(a, b, c, USE_ASM: tl.constexpr):
    """c + sum over the 4 bytes of (signed byte of a) * (signed byte of b); int32 tensors."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [a, b, c],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        acc = c
        for i in tl.static_range(4):
            # shift the byte to the top, then arithmetic-shift down: sign-extends it
            acc += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return acc


@triton.jit
def dp4a_unsigned(a, b, c, USE_ASM: tl.constexpr):
    """``dp4a`` with the bytes of ``a`` read as unsigned (0..255), those of ``b`` as signed:
    a lane mask of the packed codes in place (``word & 0xC0C0C0C0``) needs no shift."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [a, b, c],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        acc = c
        for i in tl.static_range(4):
            acc += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
        return acc


@triton.jit
def bf16_rne(x):
    """float32 rounded to the nearest bfloat16 (ties to even), still as float32.

    Casting the result to bfloat16 is then exact under any conversion mode: the Triton
    interpreter truncates float32 -> bfloat16 (the GPU rounds), this makes both agree."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def gdc_prologue(USE_GDC: tl.constexpr):
    """Wait for the previous kernel on the stream (all of its writes), then let the next one
    be scheduled. A no-op unless the kernel was launched with ``pdl_options``."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask, USE_ASM: tl.constexpr):
    """Ask the L2 for the 128-byte line of every address in ``ptrs`` where ``mask``: no
    register is written and nothing waits, so a kernel can start all of its weights' DRAM
    traffic at once. A no-op under the interpreter (no inline assembly there): the hint
    never changes a result."""
    if USE_ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
            "=r,l,r",
            [ptrs, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,  # no result is used: an impure statement is kept
            pack=1,
        )


@triton.jit
def prefetch_rows_l2(row_ptrs, mask_rows, nbytes, LINES: tl.constexpr, USE_ASM: tl.constexpr):
    """Prefetch into L2 the ``nbytes`` bytes that start at each of ``row_ptrs`` ([R] uint8
    pointers, one program's slice of R weight rows), LINES 128-byte lines per row and step.
    The last line of a row is asked for too when the slice does not start on a line."""
    rl = tl.arange(0, LINES) * 128
    for off in range(0, nbytes + 127, LINES * 128):
        o = off + rl
        prefetch_l2(row_ptrs[:, None] + tl.minimum(o, nbytes - 1)[None, :],
                    mask_rows[:, None] & ((o < nbytes + 127) & (nbytes > 0))[None, :], USE_ASM)


@triton.jit
def prefetch_share_l2(base_ptr, nbytes, LINES: tl.constexpr, USE_ASM: tl.constexpr):
    """This program's share of the ``nbytes`` bytes at ``base_ptr`` (uint8) asked of the L2:
    the lines are dealt out to the launch's programs in contiguous runs, LINES lines per
    step (one per thread). A launch calls it for the weights of the kernel that runs after
    it (``next_weights_l2``): those loads then start a whole launch early."""
    pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    lines = tl.cdiv(nbytes, 128)
    per = tl.cdiv(lines, programs)
    lo = pid * per
    hi = tl.minimum(lo + per, lines)
    rl = tl.arange(0, LINES)
    for line in range(lo, hi, LINES):
        idx = line + rl
        prefetch_l2(base_ptr + idx * 128, idx < hi, USE_ASM)


# --- the next launch's weights, asked of the L2 during this one ------------------------------
# A decode step is a chain of launches whose weights are known before the step starts. Each
# W2A8 launch may ask the L2 for the weights of the projection that runs after it, so the next
# launch finds them there: its first loads are L2 round trips, not DRAM ones, and the DRAM
# works through the launch gaps and the other kernels in between. At most a quarter of the
# L2 is asked for ahead (the current launch's own lines must stay): a 2B model's largest
# projection (8.8 MB) on an H200 (50 MB of L2), the first 1 MB of it on an Orin (4 MB).
_PREFETCH_NEXT = [os.environ.get("BITMTP_PREFETCH_NEXT", "1") != "0"]
NEXT_L2_SHARE = 4  # ask for at most 1 / NEXT_L2_SHARE of the L2 ahead


def prefetch_next(enabled: bool | None = None) -> bool:
    """Process-wide switch for asking the L2 for the next launch's weights (default on;
    ``BITMTP_PREFETCH_NEXT=0`` turns it off). A CUDA graph keeps the setting it was
    captured with. -> the setting."""
    if enabled is not None:
        _PREFETCH_NEXT[0] = bool(enabled)
    return _PREFETCH_NEXT[0]


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0))


def next_weights_l2(kernel, weights: torch.Tensor | None, num_warps: int, unused: torch.Tensor) -> dict:
    """Launch arguments that make ``kernel``'s programs ask the L2 for ``weights`` (the next
    projection's packed bytes; the first ``L2 / NEXT_L2_SHARE`` of them), or that ask for
    nothing (``unused``, any tensor of the launch, stands in for the pointer): no tensor, the
    switch off, the interpreter (no inline assembly), a CPU tensor."""
    if weights is None or not _PREFETCH_NEXT[0] or is_interpreted(kernel) or weights.device.type != "cuda":
        return {"next_ptr": unused, "next_bytes": 0}
    cap = _l2_bytes(weights.device.index if weights.device.index is not None else torch.cuda.current_device())
    nbytes = weights.numel() * weights.element_size()
    nbytes = min(nbytes, cap // NEXT_L2_SHARE // 128 * 128) if cap else nbytes
    return {"next_ptr": weights, "next_bytes": nbytes, "PREFETCH_NEXT": nbytes > 0, "NEXT_LINES": 32 * num_warps}


# --- the L1 / shared-memory split ------------------------------------------------------------
# An SM changes its L1 / shared-memory split ("carveout") only when idle: a chain of kernels
# that want different splits (a gemv with no shared memory, then a pipelined tensor-core
# kernel) drains the SM between them, which also defeats programmatic launch. A fixed split
# for every W2A8 launch (``shared_carveout(percent)``, or ``BITMTP_SMEM_CARVEOUT``) removes
# the switches; None leaves the choice to the driver.
_CARVEOUT = [int(os.environ["BITMTP_SMEM_CARVEOUT"]) if os.environ.get("BITMTP_SMEM_CARVEOUT") else None]
_CARVEOUT_SET: dict[int, int] = {}  # CUfunction handle -> the preference it was given
_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # CUfunction_attribute (cuda.h)


def shared_carveout(percent: int | None | str = "get") -> int | None:
    """Process-wide shared-memory carveout (percent of the unified L1) the W2A8 launches ask
    for; None: the driver's choice. Called without an argument: the setting."""
    if percent != "get":
        if percent is not None and not 0 <= int(percent) <= 100:
            raise ValueError(f"shared_carveout: percent must be 0..100 or None, got {percent!r}")
        _CARVEOUT[0] = None if percent is None else int(percent)
    return _CARVEOUT[0]


@functools.lru_cache(maxsize=1)
def _libcuda():
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


def apply_carveout(compiled) -> None:
    """Give the launched kernel (Triton's CompiledKernel) the process-wide carveout preference;
    it holds from the next launch on (a CUDA graph's warm-up launch sets it before capture)."""
    function = getattr(compiled, "function", None)
    if function is None:  # the interpreter
        return
    want = -1 if _CARVEOUT[0] is None else _CARVEOUT[0]  # -1: CU_SHAREDMEM_CARVEOUT_DEFAULT
    if _CARVEOUT_SET.get(function, -1) == want:
        return
    import ctypes

    err = _libcuda().cuFuncSetAttribute(ctypes.c_void_p(function), _FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                        ctypes.c_int(want))
    if err:
        raise RuntimeError(f"cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT={want}) failed with CUresult {err}")
    _CARVEOUT_SET[function] = want


_PDL_ENABLED = [os.environ.get("BITMTP_PDL", "1") != "0"]


def programmatic_launch(enabled: bool | None = None) -> bool:
    """Process-wide switch for programmatic dependent launch (default on; ``BITMTP_PDL=0``
    turns it off). A CUDA graph keeps the setting it was captured with. -> the setting."""
    if enabled is not None:
        _PDL_ENABLED[0] = bool(enabled)
    return _PDL_ENABLED[0]


@functools.lru_cache(maxsize=None)
def _pdl_unsupported(index: int) -> str | None:
    """Why CUDA device ``index`` cannot launch with PDL, or None when it can."""
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < (9, 0):
        return f"sm_{major}{minor} has none; sm_90+"
    try:  # launch_pdl and the gdc ops are recent (Triton 3.6 on the H200 has both)
        from triton.backends.nvidia.compiler import CUDAOptions

        if "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait"):
            return None
    except (ImportError, AttributeError):
        pass
    return "this Triton cannot launch it"


def programmatic_launch_ready() -> bool:
    """Whether a compiled kernel launched now on the current CUDA device launches
    programmatically: the switch on, sm_90+, a Triton with PDL.

    Per launch, so the checks are cheap: a compiled kernel launches on a CUDA device, whose
    capability check is cached (``pdl_status``'s ``torch.cuda.is_available`` asks the driver
    for the device count each time: ~20,000 launches at a 2B model's load)."""
    if not _PDL_ENABLED[0]:
        return False
    try:
        device = torch.cuda.current_device()
    except (AssertionError, RuntimeError):  # no CUDA here (a CPU build, no driver): a plain launch
        return False
    return _pdl_unsupported(device) is None


def pdl_status() -> tuple[bool, str]:
    """(on, why) for the current CUDA device: what ``bitmtp doctor`` reports."""
    if not _PDL_ENABLED[0]:
        return False, "off (BITMTP_PDL=0)"
    if not torch.cuda.is_available():
        return False, "off (no CUDA device)"
    why = _pdl_unsupported(torch.cuda.current_device())
    return (False, f"off ({why})") if why else (True, "on")


def pdl_options(kernel) -> dict:
    """Launch keywords for ``kernel``: programmatic dependent launch where it is compiled and
    ``programmatic_launch_ready``; the plain launch otherwise."""
    if is_interpreted(kernel) or not programmatic_launch_ready():
        return {"USE_GDC": False}
    return {"USE_GDC": True, "launch_pdl": True}


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (runs on the CPU)."""
    return type(kernel).__name__ == "InterpretedFunction"


def bf16_dot_upcast(kernel, t: torch.Tensor) -> bool:
    """True where a kernel must upcast bfloat16 tiles to float32 before ``tl.dot``.

    The Triton interpreter (3.9, CPU CI) multiplies bfloat16 tiles in ``tl.dot`` as raw
    bit patterns; upcasting first is exact (a bf16 value is a float32 value) and leaves the
    compiled path on bf16 tensor cores.
    """
    return is_interpreted(kernel) and t.dtype == torch.bfloat16


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check_launchable(kernel, *tensors: torch.Tensor) -> None:
    """All tensors on one device; CPU tensors only when Triton runs in interpreter mode."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"kernel inputs are on different devices: {sorted(map(str, devices))}")
    if next(iter(devices)).type == "cpu" and not is_interpreted(kernel):
        raise RuntimeError(
            "Triton kernels got CPU tensors but the interpreter is off. Set TRITON_INTERPRET=1 "
            "before triton is first imported (Triton decorates its own library at import), "
            "move the tensors to CUDA, or call the *_reference twin instead."
        )


def check_dtype(t: torch.Tensor, allowed: tuple[torch.dtype, ...], name: str) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {t.dtype} not supported, expected one of {allowed}")


def check_packed_weight(packed: torch.Tensor, w_scale: torch.Tensor, k: int, name: str) -> tuple[int, bool]:
    """Validate ``packed`` [N, ceil(K/128)*32] uint8 and ``w_scale`` ([N], [1], [] or [N, ceil(K/128)])
    -> (N, grouped). K need not be a multiple of 128: the packed rows end in zero-weight padding."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.stride(1) != 1:
        raise TypeError(f"{name}: packed must be a 2-D uint8 [N, K/4] tensor with contiguous rows, "
                        f"got {packed.dtype} {tuple(packed.shape)} strides {packed.stride()}")
    n = packed.shape[0]
    if k < 1 or packed.shape[1] != packed_width(k):
        raise ValueError(f"{name}: packed is [{n}, {packed.shape[1]}] (K={packed.shape[1] * LANES}, whole "
                         f"128-chunks) but the activations have K={k}, which needs {packed_width(k)} bytes per row")
    check_dtype(w_scale, (torch.float32,), f"{name}: w_scale")
    groups = -(-k // CHUNK_K)
    if w_scale.dim() == 2:
        if tuple(w_scale.shape) != (n, groups):
            raise ValueError(f"{name}: group scales must be [N, ceil(K/128)] = [{n}, {groups}], "
                             f"got {tuple(w_scale.shape)}")
        return n, True
    if w_scale.dim() > 1 or (w_scale.dim() == 1 and w_scale.shape[0] not in (1, n)):
        raise ValueError(f"{name}: w_scale must be [N]={n} per output row (or one per-tensor scale, [1] or 0-d, "
                         f"or [N, ceil(K/128)]), got {tuple(w_scale.shape)}")
    return n, False


def check_residual(residual: torch.Tensor | None, m: int, n: int, out_dtype: torch.dtype, name: str) -> None:
    if residual is None:
        return
    if out_dtype != torch.float32 or residual.dtype != torch.float32:
        raise TypeError(f"{name}: a fused residual needs float32 output and a float32 residual, got "
                        f"out_dtype={out_dtype}, residual {residual.dtype}")
    if residual.shape != (m, n) or residual.stride(1) != 1:
        raise ValueError(f"{name}: residual must be [M, N] = [{m}, {n}] with contiguous rows, "
                         f"got {tuple(residual.shape)}")


def scale_strides(w_scale: torch.Tensor, grouped: bool) -> tuple[int, int]:
    if grouped:
        return w_scale.stride(0), w_scale.stride(1)
    return (0 if w_scale.numel() == 1 else w_scale.stride(0)), 0  # one per-tensor scale: [1] or 0-d


# --- split-K: partial sums per K slice, then one ordered reduction ----------------------------
#
# The reduction runs in the last program of each output tile to finish its slice
# (``last_slice`` / ``sum_slices``, the W2A8 kernels) or, where no arrival counts can be had,
# as a launch of its own (``split_k_reduce``). Either adds the slices in slice order, so the
# bits are the same; in the kernel it saves the launch and the wait on the whole grid that a
# wide decode step paid 90 times (the 2B shape's split projections).

SPLIT_COUNTS = 1 << 14  # output tiles one split launch may have (int32 counts, 64 KiB a device)
_split_counts: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's arrival counts for ``last_slice``: zeros between launches, since the last
    program of every tile puts its count back to zero (and a launch's programs read them only
    after the previous kernel on the stream has finished, ``gdc_prologue``). Made once per
    device, outside any CUDA graph capture (a capture holds the pointer; the tensor lives as
    long as the process). None where there are too many tiles, or in a capture before any
    launch outside it made them: the caller reduces by a launch of its own then. Kernels on
    one device share the counts, so split launches must not run concurrently on two streams
    (the runtime decodes on one)."""
    if tiles > SPLIT_COUNTS:
        return None
    counts = _split_counts.get(device)
    if counts is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        counts = _split_counts[device] = torch.zeros(SPLIT_COUNTS, dtype=torch.int32, device=device)
    return counts


@triton.jit
def last_slice(count_ptr, SLICES: tl.constexpr):
    """True in the last of an output tile's ``SLICES`` programs (``program_id(2)``, the K slices)
    to call this after storing its partial sums; that one then reads them all and has set the
    tile's count back to zero. The barrier puts every thread's stores before the single
    thread's release (the atomic), the acquire puts the other slices' stores before the reads
    that follow (CUTLASS's semaphore pattern; read them with ``sum_slices``, past the L1)."""
    tl.debug_barrier()
    count = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    last = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == SLICES - 1
    if last:
        tl.store(count, 0)
    return last


@triton.jit
def sum_slices(part_ptr, offs, mask, slice_stride, SLICES: tl.constexpr):
    """``sum_s part[s]`` at ``offs`` in slice order (float32 partials: the order of
    ``split_k_reduce``, so the same bits), read from the L2 (``.cg``: another SM wrote them)."""
    total = tl.load(part_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
    for s in tl.static_range(1, SLICES):
        total += tl.load(part_ptr + s * slice_stride + offs, mask=mask, other=0, cache_modifier=".cg")
    return total


@triton.jit(**alignment_blind("M"))  # M: the row index's bound and stride (one variant at width 16 too)
def _split_k_reduce_kernel(
    part_ptr,  # [S, M, N] int32 or float32 partial sums
    a_scale_ptr,  # [M] float32 (HAS_A_SCALE)
    w_scale_ptr,  # [N] float32 (HAS_W_SCALE), row stride stride_sn
    res_ptr,  # [M, N] float32 residual (RESIDUAL)
    out_ptr,  # [M, N]
    M, N, stride_sn, stride_rm, stride_om,
    S: tl.constexpr, HAS_A_SCALE: tl.constexpr, HAS_W_SCALE: tl.constexpr, RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # launched with pdl_options (common.py)
):
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rn < N
    if HAS_W_SCALE:  # the weights' scales are constants: read before waiting for the partials
        w_scale = tl.load(w_scale_ptr + rn * stride_sn, mask=mask, other=0.0)
    gdc_prologue(USE_GDC)
    # slices are added in order, so the result does not depend on scheduling; int32 partials
    # stay exact until the single float conversion
    tot = tl.load(part_ptr + m * N + rn, mask=mask, other=0)
    for s in tl.static_range(1, S):
        tot += tl.load(part_ptr + (s * M + m) * N + rn, mask=mask, other=0)
    y = tot.to(tl.float32)
    if HAS_A_SCALE:
        y = y * tl.load(a_scale_ptr + m)
    if HAS_W_SCALE:
        y = y * w_scale
    if RESIDUAL:
        y = tl.load(res_ptr + m * stride_rm + rn, mask=mask, other=0.0) + y
    tl.store(out_ptr + m * stride_om + rn, y.to(out_ptr.dtype.element_ty), mask=mask)


def split_k_reduce(part: torch.Tensor, out: torch.Tensor, a_scale: torch.Tensor | None,
                   w_scale: torch.Tensor | None, stride_sn: int, residual: torch.Tensor | None = None) -> None:
    """out[m, n] = (sum_s part[s, m, n]) [* a_scale[m]] [* w_scale[n]] [+ residual], the twin's order."""
    s, m, n = part.shape
    block_n = min(1024, next_pow2(n))
    res = residual if residual is not None else out
    compiled = _split_k_reduce_kernel[(m, triton.cdiv(n, block_n))](
        part, part if a_scale is None else a_scale, part if w_scale is None else w_scale, res, out,
        m, n, stride_sn, res.stride(0), out.stride(0),
        S=s, HAS_A_SCALE=a_scale is not None, HAS_W_SCALE=w_scale is not None, RESIDUAL=residual is not None,
        BLOCK_N=block_n, num_warps=4, enable_fp_fusion=False,  # round the scaled sum before the residual add
        **pdl_options(_split_k_reduce_kernel),
    )
    apply_carveout(compiled)


def split_k_chunks(n_chunks: int, split_k: int, chunks_per_step: int) -> tuple[int, int]:
    """(chunks per K slice rounded to whole steps, number of non-empty slices)."""
    per = triton.cdiv(triton.cdiv(n_chunks, max(split_k, 1)), chunks_per_step) * chunks_per_step
    return per, triton.cdiv(n_chunks, per)
