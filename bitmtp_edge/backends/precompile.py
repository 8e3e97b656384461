"""Compile every Triton kernel variant the replay states launch, in parallel, before capture.

Without this, capture's warm-up runs compile each kernel variant on its first launch, one
after another: most of a cold start (BitNet-2B shape on the H200: over 33 s cold without this
pass, 9.3-9.7 s with it; warm 4.3 s with it, 7.0 s without).

Here each state's graph body runs once (its first layer only: every layer launches the
same kernel variants, ``FastModel.first_layers``) with every Triton launch turned into a
compile request: ``run(..., warmup=True)`` (compile, do not launch) under Triton's
``AsyncCompileMode``, which hands each compile to a thread pool and returns at once, so the
bodies keep requesting while earlier kernels compile (the threads overlap where Triton's
passes release the GIL and in ptxas, a subprocess; ``tools/bench_startup.py`` measures it,
and ``precompile_processes`` is the worker-process alternative). The request goes through Triton's own launch path,
so it computes the very specialisation key (constexprs, dtypes, divisibility by 16) the
real launch computes; Triton deduplicates by that key and keeps each kernel in the
function's in-process cache and on disk. Capture then finds every kernel compiled and
captures exactly the graphs it captures without this pass. By default capture does not wait
for all of them: it takes each state as soon as the compiles that state's body requested
are done (``CompileJob.wait``), while later states' kernels still compile.

Two things the first H200 measurement (Triton 3.6) showed, and what answers them:

* *Every request entered Triton's compile path.* Triton 3.6 files an asynchronous compile in
  the kernel's cache only when it finishes, so each later launch of the same variant (the
  same kernel in every layer of every state: 19,632 requests of 48 variants on the 2B
  shape) missed the cache and re-entered ``_do_compile``, which re-hashes the source before
  deduplicating: 15 s of requesting. ``filed_requests`` leaves the first request's result in
  the kernel's cache (what newer Triton does itself), so a repeat stops at the cache lookup.
* *Launchers were built in capture.* Triton 3.6 builds a C launcher (a C compiler run) per
  distinct kernel signature at the kernel's first launch, one after another in capture.
  ``build_launcher`` builds it in the compile thread or process right after the kernel, so
  capture only loads it from the disk cache.

The pass also tells capture which states need a warm-up run at all: Triton answers every
request of a variant with the same object, so ``variants`` lists each body's variants, and
a state whose every variant an earlier state's warm-up launched is captured with none
(``warm_up_plan``), inside ``first_launches_refused``: a launch that would compile or load
a kernel aborts that capture, and the state is warmed up and captured again.

A warm cache skips the pass: running the (full) bodies cost a start that compiles nothing
about 2.5 s (H200, 2B shape). After a load's capture succeeds, ``mark_warm`` leaves a marker in
Triton's cache folder named by the load's identity (``load_identity``: Triton, torch, GPU,
model, plan, options, replay states, the BITMTP_/TRITON_ switches, and a digest of the
kernels' and launchers' sources and tuned tables); a later load with that identity skips the
pass and capture loads every kernel from disk; the marker lists the states that load warmed
up (``warmed_up_states``), and the others are captured with none, guarded as above.
Anything else that changed a launch would only make capture compile that kernel itself, as
without the pass.

The bodies' torch ops run for real (cheap); a skipped kernel's output is left as allocated.
Graph bodies never read a device value on the host, so the launches they
request do not depend on those values; but a body may index with a kernel's output (the
fused step gathers the embedding rows of the step tokens a kernel wrote), so allocations
are zero-filled during the pass: index 0 is always in range.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "BITMTP_PRECOMPILE"  # "0": off; "1": on, automatic count; N > 1: N compile threads; unset: the option
MODE_ENV = "BITMTP_PRECOMPILE_MODE"  # "threads" (default) or "processes"
MODES = ("threads", "processes")
OVERLAP_ENV = "BITMTP_PRECOMPILE_OVERLAP"  # "0": wait for every compile before capturing
WORKER_MEMORY = 512 << 20  # what one compile thread may need at its peak (LLVM + a ptxas process)
PROCESS_MEMORY = 1 << 30  # a worker process: that, plus its own torch and Triton
MAX_WORKERS = 8  # more threads than this only contend (a compile's Python front end holds the GIL)


class PrecompileError(RuntimeError):
    """A kernel failed to compile, or compiling did not finish in time."""


@dataclass
class PrecompileReport:
    requested: int = 0  # Triton launches the bodies made (each became a compile request)
    compiled: int = 0  # kernel variants handed to the compile threads (new to this process)
    seconds: float = 0.0
    request_s: float = 0.0  # of ``seconds``: running the bodies (the rest: waiting for the compiles)
    workers: int = 0
    parallel: bool = True  # False: this Triton has no AsyncCompileMode, nothing was precompiled
    mode: str = "threads"
    kernels: dict[str, int] = field(default_factory=dict)  # kernel name -> variants compiled
    requests: dict[str, list[str]] = field(default_factory=dict)  # body label -> kernels it requested, in order
    # processes: (kernel, compile s, launcher s) of each variant, as its worker measured it
    timings: list[tuple[str, float, float]] = field(default_factory=list)

    def summary(self) -> str:
        if not self.parallel:
            return "precompile skipped (this Triton has no AsyncCompileMode; kernels compile during capture)"
        return (f"precompiled {self.compiled} kernel variants ({self.requested} launches requested) "
                f"in {self.seconds:.1f} s on {self.workers} {self.mode}")


def precompile_setting(enabled: bool, workers: int) -> tuple[bool, int]:
    """(on, workers; 0 = automatic) from the runtime option and ``BITMTP_PRECOMPILE``, which
    overrides it: ``0`` turns the pass off, ``N`` > 0 sets the thread count."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return enabled, workers
    try:
        n = int(value)
    except ValueError:
        n = -1  # refused below, as a negative count is
    if n < 0:
        raise ValueError(f"{ENV}={value!r}: use 0 (off), 1 (on) or the number of compile threads")
    if n == 0:
        return False, workers
    return True, (workers if n == 1 else n)


def precompile_mode(mode: str) -> str:
    """The runtime option's mode, or ``BITMTP_PRECOMPILE_MODE`` when set."""
    value = os.environ.get(MODE_ENV, "").strip() or mode
    if value not in MODES:
        source = f"{MODE_ENV}={value!r}" if os.environ.get(MODE_ENV, "").strip() else f"precompile_mode={value!r}"
        raise ValueError(f"{source}: choose one of {', '.join(MODES)}")
    return value


def precompile_overlap(overlap: bool) -> bool:
    """The runtime option, or ``BITMTP_PRECOMPILE_OVERLAP`` (0 or 1) when set."""
    value = os.environ.get(OVERLAP_ENV, "").strip()
    if not value:
        return overlap
    if value not in ("0", "1"):
        raise ValueError(f"{OVERLAP_ENV}={value!r}: use 1 (capture while later kernels compile) or 0 (wait first)")
    return value == "1"


def default_workers(cpu_count: int | None = None, available_bytes: int | None = None, processes: bool = False) -> int:
    """Compile threads for this machine: one per CPU core, at most ``MAX_WORKERS``, and no
    more than the available memory holds at ``WORKER_MEMORY`` each (a Jetson shares its
    memory with the GPU, where the weights and KV already sit). Worker processes share no
    GIL: one per core, as memory allows at ``PROCESS_MEMORY`` each."""
    cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    if available_bytes is None:
        try:
            import psutil

            available_bytes = psutil.virtual_memory().available
        except ImportError:
            available_bytes = MAX_WORKERS * WORKER_MEMORY
    if processes:
        return max(1, min(cpus, available_bytes // PROCESS_MEMORY))
    return max(1, min(cpus, MAX_WORKERS, available_bytes // WORKER_MEMORY))


def timeout_error(timeout_s: float, still_compiling: list[str]) -> PrecompileError:
    """The error when compiles outlast ``timeout_s``; ``still_compiling``: "kernel for body" each."""
    shown = ", ".join(still_compiling[:6]) + (" ..." if len(still_compiling) > 6 else "")
    return PrecompileError(
        f"compiling the Triton kernels did not finish within {timeout_s:.0f} s; still compiling "
        f"{len(still_compiling)}: {shown}. Raise RuntimeOptions.precompile_timeout_s, or set {ENV}=0 "
        f"to compile during capture instead")


def run_bodies(bodies: Sequence[tuple[str, Callable[[], None]]], label: list[str]) -> None:
    """Run each ``(label, body)``, keeping the running body's label in ``label[0]`` (the
    request hooks file what they see under it); a body's error names the body."""
    for label[0], body in bodies:
        try:
            body()
        except Exception as e:  # e.g. a kernel's launcher rejecting its arguments
            raise PrecompileError(f"requesting the kernels of {label[0]} failed: {type(e).__name__}: {e}") from e


def note_variant(variants: dict[str, list], label: str, result) -> None:
    """Add what a request returned to ``variants[label]`` unless there: Triton returns one
    object per kernel variant (the future kernel filed at its first request, the compiled
    kernel, or the handle ``record_variants`` filed), so the objects name the variants."""
    if result is None:
        return
    seen = variants.setdefault(label, [])
    if not any(v is result for v in seen):
        seen.append(result)


def warm_up_plan(labels: Sequence[str], variants: dict[str, list]) -> dict[str, int]:
    """Warm-up runs before capturing each body, in capture order (``labels``): 1 where the
    body launches a variant no earlier body launched (its first launch compiles or loads it,
    which must not happen inside capture), 0 where an earlier body's warm-up already
    launched every variant it launches; 1 for a body ``variants`` has no record of."""
    launched: set[int] = set()
    plan = {}
    for label in labels:
        mine = variants.get(label)
        ids = {id(v) for v in mine} if mine else None
        plan[label] = 0 if ids is not None and ids <= launched else 1
        launched |= ids or set()
    return plan


class FirstLaunch(RuntimeError):
    """A launch inside ``first_launches_refused`` would have compiled or loaded a kernel."""


def can_refuse_first_launches() -> bool:
    """Whether this Triton has the two places ``first_launches_refused`` watches."""
    try:
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return callable(getattr(CompiledKernel, "_init_handles", None)) and callable(getattr(JITFunction, "_do_compile", None))


@contextlib.contextmanager
def first_launches_refused() -> Iterator[None]:
    """Inside: a Triton launch that would be a kernel variant's first in this process raises
    ``FirstLaunch`` before it does anything: one that is not in the kernel's cache (Triton
    would compile it, or load it from the disk cache) or whose module is not loaded yet
    (Triton would load it and build its launcher). A graph captured without a warm-up run
    is captured inside this: a first launch aborts that capture instead of entering it.
    Needs ``can_refuse_first_launches()``."""
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction

    def refuse_compile(original):
        def _do_compile(self, *args, **kwargs):
            raise FirstLaunch(f"{kernel_name(self)}: a variant not compiled in this process")

        return _do_compile

    def refuse_load(original):
        def _init_handles(self):
            if getattr(self, "module", None) is None:
                raise FirstLaunch(f"{getattr(self, 'name', self)}: its module is not loaded yet")
            return original(self)

        return _init_handles

    with _methods_replaced([JITFunction], "_do_compile", refuse_compile), \
            _methods_replaced([CompiledKernel], "_init_handles", refuse_load):
        yield


class _NotLaunched:
    """What a compile request returns instead of a launched kernel (``function`` None: launchers
    that set per-kernel attributes after a launch, e.g. ``common.apply_carveout``, skip it)."""

    function = None


NOT_LAUNCHED = _NotLaunched()


def kernel_classes() -> list[type]:
    """The Triton classes whose ``run`` a ``kernel[grid](...)`` launch goes through."""
    classes = []
    try:
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
    except ImportError:
        pass
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    return classes


def kernel_name(kernel) -> str:
    fn = getattr(kernel, "fn", None)
    return getattr(fn, "__name__", None) or getattr(kernel, "__name__", type(kernel).__name__)


@contextlib.contextmanager
def _methods_replaced(classes: Sequence[type], name: str, patched: Callable) -> Iterator[None]:
    """Inside: each class's method ``name`` is ``patched(original)``; after, each class has its
    own again (or inherits it again, where it had none of its own)."""
    own = {cls: cls.__dict__.get(name) for cls in classes}  # None: inherited
    for cls in classes:
        setattr(cls, name, patched(getattr(cls, name)))
    try:
        yield
    finally:
        for cls, original in own.items():
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


@contextlib.contextmanager
def compile_only_launches(on_request: Callable[[object], None], classes: Sequence[type] | None = None,
                          on_result: Callable[[object], None] | None = None) -> Iterator[None]:
    """Inside: every ``kernel[grid](...)`` calls ``on_request(kernel)``, then Triton's own
    ``run(..., warmup=True)`` (compile, no launch), hands what that returned (a compiled
    kernel, or under ``AsyncCompileMode`` a future one) to ``on_result``, and returns
    ``NOT_LAUNCHED``."""
    classes = list(classes if classes is not None else kernel_classes())

    def patched(original):
        def run(self, *args, grid, warmup, **kwargs):
            on_request(self)
            result = original(self, *args, grid=grid, warmup=True, **kwargs)
            if on_result is not None:
                on_result(result)
            return NOT_LAUNCHED

        return run

    with _methods_replaced(classes, "run", patched):
        yield


class _Skipped:
    """What ``filed_requests`` files for a variant whose compile the cache hook skipped
    (processes mode): a marker that makes repeats stop at the cache lookup, removed after."""


SKIPPED = _Skipped()


@contextlib.contextmanager
def filed_requests(filed: list, classes: Sequence[type] | None = None,
                   skipped: Callable[[], object] = lambda: SKIPPED) -> Iterator[None]:
    """Inside: the first request of a kernel variant leaves what Triton's ``_do_compile``
    returned (a future kernel; ``skipped()``, by default ``SKIPPED``, when the cache hook
    skipped the compile) in the kernel's own cache under Triton's specialisation key, so the
    variant's later requests stop at Triton's cache lookup. Appends ``(cache, key, value)`` to ``filed`` for each:
    ``unfile`` takes back what never became a compiled kernel. Classes without
    ``_do_compile`` and a per-device cache (the interpreter) are left alone."""
    classes = [cls for cls in (classes if classes is not None else kernel_classes())
               if callable(getattr(cls, "_do_compile", None))]

    def patched(original):
        def _do_compile(self, key, signature, device, *args, **kwargs):
            result = original(self, key, signature, device, *args, **kwargs)
            value = skipped() if result is None else result
            caches = getattr(self, "device_caches", None)
            if caches is not None:
                cache = caches[device][0]
                if key not in cache:  # newer Triton files its future kernel itself
                    cache[key] = value
                    filed.append((cache, key, value))
            return value

        return _do_compile

    with _methods_replaced(classes, "_do_compile", patched):
        yield


def unfile(filed: list) -> None:
    """Remove the ``filed_requests`` entries still in place that are not compiled kernels: the
    ``SKIPPED`` markers, and future kernels that failed or were abandoned (a finished one was
    replaced by its kernel when Triton finalised it). A later launch then compiles as usual."""
    for cache, key, value in filed:
        if cache.get(key) is value and (isinstance(value, _Skipped) or getattr(value, "kernel", None) is None):
            del cache[key]
    filed.clear()


def build_launcher(kernel) -> None:
    """Build a compiled kernel's launcher now, in this compile thread or process. Triton 3.6
    builds one (a C compiler run, kept in the disk cache) per distinct kernel signature at the
    kernel's first launch; capture then finds it on disk. Best effort: a Triton without such a
    launcher, or a failure here, leaves it to the first launch as before."""
    try:
        from triton.runtime.driver import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception as e:  # noqa: BLE001 - the first launch builds it (and reports any error) instead
        log.debug("launcher of %s not prebuilt: %s: %s", getattr(kernel, "name", kernel), type(e).__name__, e)


def compiled_with_launcher(compile_fn: Callable[[], object]) -> Callable[[], object]:
    """``compile_fn``, then ``build_launcher`` on what it returned, in the same worker."""
    def run():
        kernel = compile_fn()
        build_launcher(kernel)
        return kernel

    return run


@contextlib.contextmanager
def zeroed_allocations() -> Iterator[None]:
    """Inside: ``torch.empty`` / ``torch.empty_like`` return zero-filled tensors (see the module
    docstring: a skipped kernel's output may be used as an index)."""
    empty, empty_like = torch.empty, torch.empty_like

    def zeroed_empty(*args, **kwargs):
        return empty(*args, **kwargs).zero_()

    def zeroed_empty_like(*args, **kwargs):
        return empty_like(*args, **kwargs).zero_()

    torch.empty, torch.empty_like = zeroed_empty, zeroed_empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


class _LabelledPool(ThreadPoolExecutor):
    """A thread pool that remembers which body and kernel each compile was submitted for."""

    def __init__(self, workers: int):
        super().__init__(workers, thread_name_prefix="triton-precompile")
        self.current = ("", "")  # (body label, kernel name) of the request being made
        self.jobs: list[tuple[Future, str, str]] = []
        self._lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = super().submit(compiled_with_launcher(lambda: fn(*args, **kwargs)))
        with self._lock:
            self.jobs.append((future, *self.current))
        return future


def _async_compile_mode():
    try:
        from triton.runtime import _async_compile
    except ImportError:
        return None
    return _async_compile


def _deactivate(ac) -> None:
    """Leave Triton's async compile mode without waiting for its compiles (``__exit__`` waits)."""
    if hasattr(ac.active_mode, "set"):  # a ContextVar (newer Triton)
        ac.active_mode.set(None)
    else:  # a module global (older Triton)
        ac.active_mode = None


class CompileJob:
    """The compiles ``start_precompile`` requested, running in its thread pool.

    ``wait(label)`` returns once the kernels that body needs are compiled (capture may then
    capture it while later bodies' kernels still compile); ``finish()`` once all are, and
    files them; ``abort()`` leaves without waiting. Each raises ``PrecompileError`` naming the
    kernel and body of a failed compile, or what is still compiling past the timeout."""

    def __init__(self, ac, mode, pool: _LabelledPool, report: PrecompileReport, t0: float, timeout_s: float):
        self.ac, self.mode, self.pool, self.report, self.t0, self.timeout_s = ac, mode, pool, report, t0, timeout_s
        self.needs: dict[str, list[Future]] = {}  # body label -> the compiles its launches wait for
        self.variants: dict[str, list] = {}  # body label -> the variants it launches (``note_variant``)
        self.filed: list = []  # what the requests left in the kernels' caches (``filed_requests``)
        self.wait_s = 0.0  # time spent in wait()
        self.open = True

    def _remaining(self) -> float:
        return max(self.timeout_s - (time.perf_counter() - self.t0), 0.0)

    def _check(self, futures: list[Future]) -> None:
        t0 = time.perf_counter()
        _, pending = wait(futures, timeout=self._remaining())
        self.wait_s += time.perf_counter() - t0
        if pending:
            self.abort()
            raise timeout_error(self.timeout_s, sorted({f"{kernel} for {label}" for future, label, kernel
                                                        in self.pool.jobs if future in pending}))
        wanted = set(futures)
        failed = [(label, kernel, future.exception()) for future, label, kernel in self.pool.jobs
                  if future in wanted and future.exception() is not None]
        if failed:
            if all(job[0].done() for job in self.pool.jobs):
                self._exit()  # nothing left running: leave cleanly (drops the failed placeholders)
            self.abort()
            label, kernel, error = failed[0]
            raise PrecompileError(
                f"Triton could not compile {kernel} (requested by {label}; {len(failed)} compile(s) failed): "
                f"{type(error).__name__}: {str(error)[:1500]}") from error

    def wait(self, label: str) -> None:
        self._check(self.needs.get(label, []))

    def finish(self) -> PrecompileReport:
        self._check([job[0] for job in self.pool.jobs])
        self._exit()
        report = self.report
        report.compiled = len(self.pool.jobs)
        for _, _, kernel in self.pool.jobs:
            report.kernels[kernel] = report.kernels.get(kernel, 0) + 1
        report.seconds = time.perf_counter() - self.t0
        log.info(report.summary())
        return report

    def _exit(self) -> None:
        """Every compile is done: leave Triton's async mode, which files the kernels."""
        if self.open:
            self.open = False
            self.mode.ignore_errors = True
            try:
                self.mode.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - a Triton that re-raises a failed compile here (reported by _check)
                pass
            unfile(self.filed)
            self.pool.shutdown()

    def abort(self) -> None:
        """Leave Triton's async mode and the pool without waiting for compiles that may never end."""
        if self.open:
            self.open = False
            _deactivate(self.ac)
            unfile(self.filed)
            self.pool.shutdown(wait=False, cancel_futures=True)


def start_precompile(bodies: Sequence[tuple[str, Callable[[], None]]], workers: int, timeout_s: float,
                     classes: Sequence[type] | None = None) -> CompileJob | None:
    """Run each ``(label, body)`` with its Triton launches turned into compile requests, which
    Triton's ``AsyncCompileMode`` hands to ``workers`` threads; -> the running job (None:
    this Triton has no ``AsyncCompileMode``). Triton's async mode stays on until the job
    finishes: a launch of a kernel still compiling waits for it."""
    report = PrecompileReport(workers=max(1, workers))
    ac = _async_compile_mode()
    if ac is None:
        report.parallel = False
        log.info(report.summary())
        return None
    t0 = time.perf_counter()
    pool = _LabelledPool(report.workers)
    job = CompileJob(ac, ac.AsyncCompileMode(pool), pool, report, t0, timeout_s)
    label = [""]

    def on_request(kernel) -> None:
        report.requested += 1
        pool.current = (label[0], kernel_name(kernel))
        report.requests.setdefault(label[0], []).append(pool.current[1])

    def on_result(result) -> None:  # a kernel still compiling: this body's capture waits for it
        note_variant(job.variants, label[0], result)
        future = getattr(result, "future", None) if isinstance(result, ac.FutureKernel) else None
        needs = job.needs.setdefault(label[0], [])
        if future is not None and future not in needs:
            needs.append(future)

    job.mode.__enter__()
    try:
        with compile_only_launches(on_request, classes, on_result), filed_requests(job.filed, classes), \
                zeroed_allocations():
            run_bodies(bodies, label)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except BaseException:
        job.abort()
        raise
    report.request_s = time.perf_counter() - t0
    return job


def precompile(bodies: Sequence[tuple[str, Callable[[], None]]], workers: int, timeout_s: float,
               classes: Sequence[type] | None = None) -> PrecompileReport:
    """``start_precompile``, then wait until every kernel variant is compiled."""
    job = start_precompile(bodies, workers, timeout_s, classes)
    if job is None:
        return PrecompileReport(workers=max(1, workers), parallel=False)
    return job.finish()


# -- a warm cache: skip the pass -------------------------------------------------------------------

MARKER_FOLDER = "bitmtp-precompiled"  # in Triton's cache folder: a file per load whose kernels the cache holds
IDENTITY_ENV_PREFIXES = ("BITMTP_", "TRITON_")  # switches that may change which kernels a load launches
IDENTITY_ENV_IGNORED = (ENV, MODE_ENV, OVERLAP_ENV, "TRITON_CACHE_DIR")


def triton_cache_dir() -> Path:
    """Triton's disk cache folder (``TRITON_CACHE_DIR``, default ``~/.triton/cache``)."""
    try:
        from triton import knobs

        folder = knobs.cache.dir
    except (ImportError, AttributeError):
        folder = None
    return Path(folder or os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def source_digest(folders: Sequence[Path]) -> str:
    """sha256 over every ``.py`` and ``.json`` file under ``folders`` (path and content): the
    kernels and the code that chooses their launches (tuned tables included)."""
    h = hashlib.sha256()
    for folder in folders:
        for path in sorted(p for p in Path(folder).rglob("*") if p.suffix in (".py", ".json") and p.is_file()):
            h.update(str(path.relative_to(folder)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def load_identity(fields: dict, folders: Sequence[Path]) -> dict:
    """What decides the kernel variants a load launches: ``fields`` (versions, GPU, model,
    plan, options, states), the switches in the environment, and the source digest."""
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(IDENTITY_ENV_PREFIXES) and k not in IDENTITY_ENV_IGNORED}
    return {**fields, "env": env, "source": source_digest(folders)}


def warm_marker(identity: dict, cache_dir: Path | None = None) -> Path:
    """The file whose presence says a load with ``identity`` has compiled every kernel it
    launches into this Triton cache (``mark_warm`` writes it after capture)."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return (cache_dir or triton_cache_dir()) / MARKER_FOLDER / f"{digest}.json"


def mark_warm(marker: Path, identity: dict, warmed_up: Sequence[str] | None = None) -> None:
    """Write ``marker`` atomically (best effort: a read-only cache just keeps running the pass),
    with ``warmed_up``: the states captured after a warm-up run (``warmed_up_states``)."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        record = {"identity": identity, "warmed_up": None if warmed_up is None else list(warmed_up)}
        tmp.write_text(json.dumps(record, sort_keys=True, indent=1, default=str))
        os.replace(tmp, marker)
    except OSError as e:
        log.warning("could not record the warm Triton cache in %s: %s", marker, e)


def warmed_up_states(marker: Path) -> list[str] | None:
    """The states ``marker`` says its load captured after a warm-up run (each launched a
    variant no earlier state had; the others, and so a later load's, need none); None when
    the marker does not say (then every state gets one)."""
    try:
        states = json.loads(marker.read_text()).get("warmed_up")
    except (OSError, ValueError, AttributeError):
        return None
    return states if isinstance(states, list) and all(isinstance(s, str) for s in states) else None


# -- processes: record the variants, compile them in worker processes -----------------------------

class _Recorded(_Skipped):
    """``filed_requests``' entry for a variant recorded for a worker process: the handle of its
    compile, so that every body launching the variant waits for it (``needs``)."""

    def __init__(self, handle):
        self.handle = handle


def record_variants(bodies: Sequence[tuple[str, Callable[[], None]]], report: PrecompileReport,
                    classes: Sequence[type] | None = None, submit: Callable[[str, str, str, str], object] | None = None,
                    needs: dict[str, list] | None = None,
                    launched: dict[str, list] | None = None) -> dict[str, tuple[str, str, str]]:
    """Run the bodies with their launches as compile requests that Triton's ``jit_cache_hook``
    answers "skip": -> {specialisation data (Triton's JSON): (module, kernel, body label)}
    for every variant this process has not compiled. ``submit(module, kernel, data, label)``,
    when given, is called at each variant's first request (a worker starts compiling it while
    the bodies still run) and returns a handle; ``needs`` then gets, per body label, the
    handles of every variant that body launches, and ``launched`` (``note_variant``) the
    variants themselves."""
    from triton import knobs

    variants: dict[str, tuple[str, str, str]] = {}
    handles: dict[str, object] = {}
    label, current = [""], [None]

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        data = compile["specialization_data"]
        if data not in variants:
            variants[data] = (fn.module, fn.name, label[0])
            handles[data] = submit(fn.module, fn.name, data, label[0]) if submit is not None else None
        current[0] = handles[data]
        return True  # skip the compile here: a worker process compiles it

    def on_request(kernel) -> None:
        report.requested += 1
        report.requests.setdefault(label[0], []).append(kernel_name(kernel))

    def on_result(result) -> None:
        if launched is not None:
            note_variant(launched, label[0], result)
        if needs is not None and isinstance(result, _Recorded) and result.handle is not None:
            wanted = needs.setdefault(label[0], [])
            if result.handle not in wanted:
                wanted.append(result.handle)

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    filed: list = []  # a variant's repeats stop at the cache lookup; removed before capture
    try:
        with compile_only_launches(on_request, classes, on_result), \
                filed_requests(filed, classes, skipped=lambda: _Recorded(current[0])), zeroed_allocations():
            run_bodies(bodies, label)
    finally:
        knobs.runtime.jit_cache_hook = previous
        unfile(filed)
    return variants


def compile_variant(module: str, kernel: str, specialization: str) -> tuple[float, float]:
    """In a worker process: compile one recorded variant, and its launcher, into Triton's disk
    cache -> (compile s, launcher s)."""
    import importlib

    t0 = time.perf_counter()
    compiled = getattr(importlib.import_module(module), kernel).preload(specialization)
    t1 = time.perf_counter()
    if compiled is not None:
        build_launcher(compiled)
    return t1 - t0, time.perf_counter() - t1


def prepare_worker() -> None:
    """A worker process's start, while the main process still records: the imports and the
    Triton driver every compile needs (seconds of the worker's start-up)."""
    try:
        import torch  # noqa: F401 - imported for its start-up cost, before the first compile
        from triton.runtime.driver import driver

        driver.active.get_current_target()
    except Exception as e:  # noqa: BLE001 - no GPU here (a dry run): the compiles say what is missing
        log.debug("worker start: %s: %s", type(e).__name__, e)


def start_workers(workers: int):
    """``workers`` spawned processes, starting (``prepare_worker``) at once."""
    import multiprocessing as mp

    return mp.get_context("spawn").Pool(workers, initializer=prepare_worker)


class ProcessJob:
    """Compiles running in worker processes: ``CompileJob``'s interface (``wait(label)``,
    ``finish()``, ``abort()``) over a process pool. Capture loads each kernel from the disk
    cache, where its worker wrote it."""

    def __init__(self, pool, report: PrecompileReport, t0: float, timeout_s: float,
                 compile_fn: Callable[[str, str, str], object] = compile_variant):
        self.pool, self.report, self.t0, self.timeout_s, self.compile_fn = pool, report, t0, timeout_s, compile_fn
        self.jobs: list[tuple[object, str, str]] = []  # (AsyncResult, kernel, body label)
        self.needs: dict[str, list] = {}  # body label -> the compiles its launches wait for
        self.variants: dict[str, list] = {}  # body label -> the variants it launches (``note_variant``)
        self.wait_s = 0.0
        self.open = True

    def submit(self, module: str, kernel: str, data: str, label: str):
        result = self.pool.apply_async(self.compile_fn, (module, kernel, data))
        self.jobs.append((result, kernel, label))
        return result

    def _check(self, results: list) -> list:
        import multiprocessing as mp

        t0, values = time.perf_counter(), []
        try:
            for result in results:
                remaining = max(self.timeout_s - (time.perf_counter() - self.t0), 0.0)
                kernel, label = next((k, lb) for r, k, lb in self.jobs if r is result)
                try:
                    values.append((kernel, result.get(remaining)))
                except mp.TimeoutError:
                    waiting = sorted({f"{k} for {lb}" for r, k, lb in self.jobs if not r.ready()})
                    self.abort()
                    raise timeout_error(self.timeout_s, waiting) from None
                except Exception as e:  # noqa: BLE001 - the worker's compile error, re-raised here
                    self.abort()
                    raise PrecompileError(f"Triton could not compile {kernel} (requested by {label}) in a worker "
                                          f"process: {type(e).__name__}: {str(e)[:1500]}") from e
        finally:
            self.wait_s += time.perf_counter() - t0
        return values

    def wait(self, label: str) -> None:
        self._check(self.needs.get(label, []))

    def finish(self) -> PrecompileReport:
        values = self._check([r for r, _, _ in self.jobs])
        self.abort()  # all done: stop the workers
        report = self.report
        report.compiled = len(self.jobs)
        for kernel, value in values:
            report.kernels[kernel] = report.kernels.get(kernel, 0) + 1
            if isinstance(value, tuple) and len(value) == 2:
                report.timings.append((kernel, *value))
        report.seconds = time.perf_counter() - self.t0
        log.info(report.summary())
        return report

    def abort(self) -> None:
        if self.open:
            self.open = False
            self.pool.terminate()
            self.pool.join()


def compile_in_processes(variants: dict[str, tuple[str, str, str]], workers: int, timeout_s: float,
                         compile_fn: Callable[[str, str, str], object] = compile_variant, pool=None) -> list:
    """Compile ``variants`` (``record_variants``) in ``workers`` spawned processes sharing the
    disk cache (or in ``pool``, from ``start_workers``) -> [(kernel, what ``compile_fn``
    returned)]; a failure or the timeout stops every worker and raises ``PrecompileError``.
    The pool is closed either way."""
    import multiprocessing as mp

    pool = pool if pool is not None else mp.get_context("spawn").Pool(workers)
    job = ProcessJob(pool, PrecompileReport(workers=workers, mode="processes"), time.perf_counter(), timeout_s,
                     compile_fn)
    try:
        for data, (module, kernel, label) in variants.items():
            job.submit(module, kernel, data, label)
        return job._check([r for r, _, _ in job.jobs])
    finally:
        job.abort()


def start_precompile_processes(bodies: Sequence[tuple[str, Callable[[], None]]], workers: int, timeout_s: float,
                               classes: Sequence[type] | None = None,
                               compile_fn: Callable[[str, str, str], object] = compile_variant) -> ProcessJob:
    """``start_precompile`` with worker processes instead of threads: each variant is handed
    to a worker at its first request (nothing compiles in this process) -> the running job;
    capture waits per state (``ProcessJob.wait``) and loads the kernels from the disk cache.
    The workers start before the bodies run, so their imports (Python, torch, Triton:
    seconds; no model) overlap the recording. A script that loads an engine this way needs
    the ``if __name__ == "__main__":`` guard (the workers are spawned)."""
    t0 = time.perf_counter()
    report = PrecompileReport(workers=max(1, workers), mode="processes")
    job = ProcessJob(start_workers(report.workers), report, t0, timeout_s, compile_fn)
    try:
        record_variants(bodies, report, classes, submit=job.submit, needs=job.needs, launched=job.variants)
    except BaseException:
        job.abort()
        raise
    report.request_s = time.perf_counter() - t0
    return job


def precompile_processes(bodies: Sequence[tuple[str, Callable[[], None]]], workers: int, timeout_s: float,
                         classes: Sequence[type] | None = None) -> PrecompileReport:
    """``start_precompile_processes``, then wait until every variant is compiled."""
    return start_precompile_processes(bodies, workers, timeout_s, classes).finish()


__all__ = ["ENV", "MODES", "MODE_ENV", "NOT_LAUNCHED", "OVERLAP_ENV", "CompileJob", "PrecompileError",
           "PrecompileReport", "ProcessJob", "compile_in_processes", "compile_only_launches", "default_workers", "kernel_classes",
           "precompile", "precompile_mode", "precompile_overlap", "precompile_processes", "precompile_setting",
           "SKIPPED", "FirstLaunch", "build_launcher", "can_refuse_first_launches", "filed_requests",
           "first_launches_refused", "load_identity", "mark_warm", "note_variant", "record_variants",
           "source_digest", "start_precompile", "start_precompile_processes", "start_workers", "triton_cache_dir", "unfile",
           "warm_marker", "warm_up_plan", "warmed_up_states",
           "zeroed_allocations"]
