"""The kernel precompile pass before capture (``backends/precompile.py``).

On the CPU nothing compiles (the interpreter runs kernels as Python), so the orchestration
is tested with a kernel class that follows Triton's ``JITFunction.run`` protocol under
``AsyncCompileMode`` (a specialisation key, the in-process cache, ``mode.submit``), and the
graph backend's pass with the real kernels under the interpreter: every replay state's body
requests exactly the launches its eager run makes. The GPU test checks that capture then
compiles nothing and decodes the same tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bitmtp_edge.backends import precompile as pc
from bitmtp_edge.backends.graph import RuntimeOptions
from tests.helpers import fast_backend, needs_gpu, random_model

triton_async = pytest.importorskip("triton.runtime._async_compile")
knobs = pytest.importorskip("triton").knobs


class FakeKernel:
    """A kernel whose ``run`` does what Triton's does: look the specialisation up in its own
    cache, else compile (through ``AsyncCompileMode`` when one is active), then launch
    unless ``warmup``."""

    def __init__(self, name: str, compile_fn=None):
        self.__name__, self.cache, self.launched = name, {}, []
        self.compile_fn = compile_fn or (lambda key: f"binary{key}")
        self.compile_threads = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def _compile(self, key):
        self.compile_threads.append(threading.current_thread().name)
        return self.compile_fn(key)

    def run(self, *args, grid, warmup, **kwargs):
        key = (tuple(a.dtype if isinstance(a, torch.Tensor) else a % 16 == 0 for a in args), tuple(sorted(kwargs.items())))
        kernel = self.cache.get(key)
        hook = knobs.runtime.jit_cache_hook
        if kernel is None and hook is not None and hook(
                key=key, repr=self.__name__, fn=SimpleNamespace(module="fake_module", name=self.__name__),
                compile={"key": key, "specialization_data": json.dumps([self.__name__, repr(key)])},
                is_manual_warmup=warmup, already_compiled=False):
            return None  # the hook asked Triton to skip the compile
        if kernel is None:
            mode = triton_async.active_mode.get()
            if mode is not None:
                def finalize(k, key=key):
                    self.cache[key] = k

                kernel = mode.submit((self.__name__, key), lambda: self._compile(key), finalize,
                                     lambda fk, key=key: self.cache.pop(key, None))
            else:
                kernel = self._compile(key)
            self.cache[key] = kernel
        if not warmup:
            self.launched.append(key)
        return kernel


def test_every_body_requests_and_each_variant_compiles_once_in_the_pool():
    a, b = FakeKernel("a"), FakeKernel("b")
    x32, x16 = torch.zeros(4), torch.zeros(4, dtype=torch.float16)
    bodies = [("s1", lambda: (a[(1,)](x32, 16, BLOCK=8), b[(1,)](x16, 3))),
              ("s2", lambda: (a[(2,)](x32, 32, BLOCK=8), a[(2,)](x32, 5, BLOCK=16))),  # 32: same variant as 16
              ("s3", lambda: b[(1,)](x16, 7))]  # same variant as s1's b
    report = pc.precompile(bodies, workers=3, timeout_s=30, classes=[FakeKernel])
    assert report.requests == {"s1": ["a", "b"], "s2": ["a", "a"], "s3": ["b"]}
    assert report.requested == 5 and report.compiled == 3 and report.kernels == {"a": 2, "b": 1}
    assert a.launched == [] and b.launched == []  # requests compile, they never launch
    assert all(name.startswith("triton-precompile") for name in a.compile_threads + b.compile_threads)
    # filed in the kernels' own caches: a later launch finds them compiled
    assert sorted(map(str, a.cache.values())) == sorted(f"binary{k}" for k in a.cache)
    a[(1,)](x32, 16, BLOCK=8)
    assert len(a.compile_threads) == 2 and len(a.launched) == 1
    assert FakeKernel.run.__name__ == "run" and FakeKernel.__dict__["run"] is RUN  # restored


RUN = FakeKernel.__dict__["run"]


class Triton36Kernel:
    """A kernel with Triton 3.6's launch protocol: ``run`` looks the specialisation key up in
    ``device_caches[device][0]``, else enters ``_do_compile`` (the hook, then a submit to the
    active ``AsyncCompileMode`` whose future is filed in the cache only when finalised); a
    launch of a future kernel waits for its result."""

    def __init__(self, name: str, compile_fn=None, module: str = "fake_module"):
        self.__name__, self.launched, self.do_compile_calls, self.compile_threads = name, [], 0, []
        self.device_caches, self.module = {0: ({},)}, module
        self.compile_fn = compile_fn or (lambda key: f"binary{key}")

    @property
    def cache(self):
        return self.device_caches[0][0]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args, grid, warmup, **kwargs):
        key = (tuple(a.dtype if isinstance(a, torch.Tensor) else a % 16 == 0 for a in args), tuple(sorted(kwargs.items())))
        kernel = self.cache.get(key)
        if kernel is None:
            kernel = self._do_compile(key, "signature", 0, {}, None, {}, warmup)
            if kernel is None:
                return None
        if not warmup:
            if hasattr(kernel, "result"):
                kernel = kernel.result()
            self.launched.append(key)
        return kernel

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        self.do_compile_calls += 1
        cache = self.device_caches[device][0]
        hook = knobs.runtime.jit_cache_hook
        if hook is not None and hook(key=key, repr=self.__name__,
                                     fn=SimpleNamespace(module=self.module, name=self.__name__),
                                     compile={"key": key, "specialization_data": json.dumps([self.__name__, repr(key)])},
                                     is_manual_warmup=warmup, already_compiled=False):
            return None

        def compile_now():
            self.compile_threads.append(threading.current_thread().name)
            return self.compile_fn(key)

        mode = triton_async.active_mode.get()
        if mode is None:
            cache[key] = compile_now()
            return cache[key]

        def finalize(kernel):
            cache[key] = kernel

        extra = (lambda fk: None,) if len(inspect.signature(mode.submit).parameters) == 4 else ()  # newer Triton
        return mode.submit((self.__name__, key), compile_now, finalize, *extra)


def test_repeated_requests_of_a_variant_enter_tritons_compile_once():
    """Triton 3.6 files a future kernel only when it is finalised: without the pass filing the
    first request, every repeat (the same kernel in every layer) re-entered ``_do_compile``."""
    release = threading.Event()
    a = Triton36Kernel("a", lambda key: release.wait(30) and f"binary{key}")
    x = torch.zeros(4)
    bodies = [(f"s{i}", lambda: [a[(1,)](x, n) for n in (1, 16) * 25]) for i in range(3)]  # two variants
    job = pc.start_precompile(bodies, workers=2, timeout_s=60, classes=[Triton36Kernel])
    try:
        assert job.report.requested == 150 and a.do_compile_calls == 2
        futures = list(a.cache.values())
        assert len(futures) == 2 and all(isinstance(f, triton_async.FutureKernel) for f in futures)
        assert all(len(job.needs[f"s{i}"]) == 2 for i in range(3))
        release.set()
        a[(1,)](x, 1)  # a launch (capture, overlapped) waits for the future, then finds the kernel
        report = job.finish()
    finally:
        release.set()
        job.abort()
    assert report.compiled == 2 and a.do_compile_calls == 2 and len(a.launched) == 1
    assert sorted(a.cache.values()) == sorted(f"binary{k}" for k in a.cache)  # compiled kernels, no futures left
    assert Triton36Kernel.__dict__["_do_compile"] is DO_COMPILE  # restored


DO_COMPILE = Triton36Kernel.__dict__["_do_compile"]


@pytest.mark.parametrize("how", ["fails", "times out"])
def test_a_failed_or_abandoned_compile_leaves_no_filed_future(how):
    release = threading.Event()

    def compile_fn(key):
        if how == "fails":
            raise RuntimeError("PassManager::run failed")
        release.wait(30)
        return "binary"

    bad = Triton36Kernel("bad", compile_fn)
    try:
        with pytest.raises(pc.PrecompileError, match="could not compile bad" if how == "fails" else "did not finish"):
            pc.precompile([("s0", lambda: [bad[(1,)](torch.zeros(2), 1) for _ in range(3)])], workers=1,
                          timeout_s=30 if how == "fails" else 0.3, classes=[Triton36Kernel])
    finally:
        release.set()
        for thread in threading.enumerate():  # the abandoned compile finishes (and builds its
            if thread.name.startswith("triton-precompile"):  # launcher) now, not in a later test
                thread.join(10)
    assert bad.cache == {} and bad.do_compile_calls == 1  # a later launch compiles (and reports) again
    assert triton_async.active_mode.get() is None


def test_each_compiled_kernels_launcher_is_built_in_its_compile_thread(monkeypatch):
    built = []
    monkeypatch.setattr(pc, "build_launcher", lambda kernel: built.append((kernel, threading.current_thread().name)))
    a = Triton36Kernel("a")
    report = pc.precompile([("s0", lambda: [a[(1,)](torch.zeros(2), n) for n in (1, 16, 1, 16)])], workers=2,
                           timeout_s=30, classes=[Triton36Kernel])
    assert report.compiled == 2
    assert sorted(k for k, _ in built) == sorted(a.cache.values())
    assert all(name.startswith("triton-precompile") for _, name in built)


def test_build_launcher_makes_tritons_launcher_and_never_raises(monkeypatch):
    import sys

    import triton.runtime.driver  # noqa: F401 - the module (``triton.runtime.driver`` names its object)

    triton_driver = sys.modules["triton.runtime.driver"]
    made = []
    kernel = SimpleNamespace(src="src", metadata="metadata", name="k")
    monkeypatch.setattr(triton_driver, "driver", SimpleNamespace(active=SimpleNamespace(
        launcher_cls=lambda src, metadata: made.append((src, metadata)))))
    pc.build_launcher(kernel)
    assert made == [("src", "metadata")]

    def broken(src, metadata):
        raise RuntimeError("gcc: not found")

    monkeypatch.setattr(triton_driver, "driver", SimpleNamespace(active=SimpleNamespace(launcher_cls=broken)))
    pc.build_launcher(kernel)  # left to the kernel's first launch, which reports it


def test_requests_do_not_wait_for_compiles():
    """Every body has requested its kernels before the first compile finishes: compiles are
    asynchronous (a request that waited would never see the last body run)."""
    all_requested = threading.Event()
    seen = []

    def compile_fn(key):
        seen.append(all_requested.wait(10))
        return "binary"

    kernels = [FakeKernel(f"k{i}", compile_fn) for i in range(4)]
    bodies = [(f"s{i}", lambda k=k: k[(1,)](torch.zeros(2), 1)) for i, k in enumerate(kernels)]
    bodies.append(("last", all_requested.set))
    report = pc.precompile(bodies, workers=2, timeout_s=30, classes=[FakeKernel])
    assert report.compiled == 4 and seen == [True] * 4


def test_a_failing_compile_names_the_kernel_and_the_state():
    def broken(key):
        raise RuntimeError("PassManager::run failed")

    good, bad = FakeKernel("good"), FakeKernel("_w2a8_mma_kernel", broken)
    bodies = [("(M=1, σ=0, verify)", lambda: good[(1,)](torch.zeros(2), 1)),
              ("(M=9, σ=0, draft)", lambda: bad[(1,)](torch.zeros(2), 1))]
    with pytest.raises(pc.PrecompileError, match=r"_w2a8_mma_kernel \(requested by \(M=9, σ=0, draft\).*"
                                                 r"PassManager::run failed"):
        pc.precompile(bodies, workers=2, timeout_s=30, classes=[FakeKernel])
    assert triton_async.active_mode.get() is None and FakeKernel.__dict__["run"] is RUN
    assert not bad.cache  # the failed placeholder is gone: a later launch compiles (and reports) again


def test_a_compile_past_the_timeout_is_reported_without_waiting_for_it():
    release = threading.Event()
    slow = FakeKernel("slow_kernel", lambda key: release.wait(30) and "binary")
    try:
        with pytest.raises(pc.PrecompileError, match=r"did not finish within 0 s; still compiling 1: slow_kernel "
                                                     r"for s0.*BITMTP_PRECOMPILE=0"):
            pc.precompile([("s0", lambda: slow[(1,)](torch.zeros(2), 1))], workers=1, timeout_s=0.2,
                          classes=[FakeKernel])
        assert triton_async.active_mode.get() is None
    finally:
        release.set()


def test_a_body_that_fails_names_its_state():
    def body():
        raise ValueError("kernel inputs are on different devices")

    with pytest.raises(pc.PrecompileError, match=r"requesting the kernels of \(M=3, σ=1, draft\) failed: ValueError"):
        pc.precompile([("(M=3, σ=1, draft)", body)], workers=1, timeout_s=30, classes=[FakeKernel])
    assert triton_async.active_mode.get() is None


def test_requests_return_not_launched_and_allocations_are_zeroed_inside_only():
    k = FakeKernel("k")
    got = []
    with pc.compile_only_launches(lambda kernel: got.append(kernel), [FakeKernel]), pc.zeroed_allocations():
        assert k[(1,)](torch.zeros(2), 1) is pc.NOT_LAUNCHED
        assert torch.count_nonzero(torch.empty(1 << 16)) == 0
        assert torch.count_nonzero(torch.empty_like(torch.ones(1 << 16))) == 0
    assert got == [k] and k.launched == []
    assert torch.empty is torch._C._VariableFunctions.empty or torch.empty.__name__ == "empty"
    assert k[(1,)](torch.zeros(2), 1) is not pc.NOT_LAUNCHED and len(k.launched) == 1


# -- processes ------------------------------------------------------------------------------------

def test_record_variants_collects_each_uncompiled_variant_once_and_compiles_nothing():
    a, b = FakeKernel("a"), FakeKernel("b")
    x = torch.zeros(4)
    bodies = [("s1", lambda: (a[(1,)](x, 16), b[(1,)](x, 3))), ("s2", lambda: (a[(1,)](x, 32), a[(1,)](x, 5)))]
    report = pc.PrecompileReport(mode="processes")
    variants = pc.record_variants(bodies, report, classes=[FakeKernel])
    assert sorted((kernel, label) for _, kernel, label in variants.values()) == [("a", "s1"), ("a", "s2"), ("b", "s1")]
    assert {module for module, _, _ in variants.values()} == {"fake_module"}
    assert report.requests == {"s1": ["a", "b"], "s2": ["a", "a"]}
    assert a.compile_threads == [] and b.compile_threads == [] and a.launched == []
    assert knobs.runtime.jit_cache_hook is None and FakeKernel.__dict__["run"] is RUN


def test_record_variants_asks_the_hook_once_per_variant_and_leaves_no_marker():
    a = Triton36Kernel("a")
    x = torch.zeros(4)
    report = pc.PrecompileReport(mode="processes")
    variants = pc.record_variants([("s1", lambda: [a[(1,)](x, n) for n in (1, 16) * 20])], report,
                                  classes=[Triton36Kernel])
    assert len(variants) == 2 and report.requested == 40 and a.do_compile_calls == 2
    assert a.cache == {} and a.compile_threads == []  # the SKIPPED markers are gone: capture compiles or loads


def write_marker(module: str, kernel: str, data: str) -> None:
    """A stand-in compile in the worker processes: a file per variant (or a failure)."""
    if kernel == "broken":
        raise RuntimeError("ptxas fatal: Unresolved extern function")
    if kernel == "slow":
        time.sleep(60)
    Path(module, f"{kernel}-{json.loads(data)}").write_text("compiled")


def touch_variant(module: str, kernel: str, data: str) -> tuple[float, float]:
    """A stand-in worker compile: a file per variant in the folder named as the module."""
    import hashlib

    if kernel == "broken":
        raise RuntimeError("ptxas fatal: Unresolved extern function")
    Path(module, f"{kernel}-{hashlib.sha1(data.encode()).hexdigest()[:8]}").write_text(data)
    return 0.25, 0.125


def test_processes_compile_each_variant_as_it_is_recorded_and_each_state_waits_for_its_own(tmp_path):
    a, b = Triton36Kernel("a", module=str(tmp_path)), Triton36Kernel("b", module=str(tmp_path))
    x = torch.zeros(4)
    bodies = [("s1", lambda: [a[(1,)](x, n) for n in (1, 16) * 10]),
              ("s2", lambda: [(a[(1,)](x, 16), b[(1,)](x, 3)) for _ in range(10)])]  # a(16) again, b new
    job = pc.start_precompile_processes(bodies, workers=2, timeout_s=120, classes=[Triton36Kernel],
                                        compile_fn=touch_variant)
    try:
        assert job.report.requested == 40 and a.do_compile_calls == 2 and b.do_compile_calls == 1
        assert len(job.jobs) == 3 and [len(job.needs[s]) for s in ("s1", "s2")] == [2, 2]
        assert a.cache == {} and b.cache == {}  # markers gone before capture: capture loads from disk
        job.wait("s2")
        assert all(r.ready() for r in job.needs["s2"])
        report = job.finish()
    finally:
        job.abort()
    assert report.compiled == 3 and report.kernels == {"a": 2, "b": 1} and report.mode == "processes"
    assert report.timings == [("a", 0.25, 0.125), ("a", 0.25, 0.125), ("b", 0.25, 0.125)]
    assert len(list(tmp_path.iterdir())) == 3


def test_a_failing_worker_compile_fails_the_state_that_waits_for_it(tmp_path):
    good, bad = Triton36Kernel("good", module=str(tmp_path)), Triton36Kernel("broken", module=str(tmp_path))
    bodies = [("(M=1, σ=0, verify)", lambda: good[(1,)](torch.zeros(2), 1)),
              ("(M=9, σ=0, draft)", lambda: bad[(1,)](torch.zeros(2), 1))]
    job = pc.start_precompile_processes(bodies, workers=1, timeout_s=120, classes=[Triton36Kernel],
                                        compile_fn=touch_variant)
    job.wait("(M=1, σ=0, verify)")
    with pytest.raises(pc.PrecompileError, match=r"could not compile broken \(requested by \(M=9, σ=0, draft\)\) "
                                                 r"in a worker process: RuntimeError: ptxas fatal"):
        job.wait("(M=9, σ=0, draft)")
    assert not job.open  # the workers are stopped


def test_worker_processes_compile_every_variant(tmp_path):
    variants = {json.dumps(i): (str(tmp_path), f"k{i % 2}", f"s{i}") for i in range(4)}
    results = pc.compile_in_processes(variants, workers=2, timeout_s=120, compile_fn=write_marker)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["k0-0", "k0-2", "k1-1", "k1-3"]
    assert results == [("k0", None), ("k1", None), ("k0", None), ("k1", None)]  # in the variants' order


def test_a_failing_worker_compile_names_the_kernel_and_the_state(tmp_path):
    variants = {"1": (str(tmp_path), "broken", "(M=17, σ=0, fused)")}
    with pytest.raises(pc.PrecompileError, match=r"could not compile broken \(requested by \(M=17, σ=0, fused\)\) "
                                                 r"in a worker process: RuntimeError: ptxas fatal"):
        pc.compile_in_processes(variants, workers=1, timeout_s=120, compile_fn=write_marker)


def test_worker_processes_past_the_timeout_are_stopped(tmp_path):
    variants = {"1": (str(tmp_path), "slow", "s0")}
    t0 = time.perf_counter()
    with pytest.raises(pc.PrecompileError, match=r"did not finish within 3 s; still compiling 1: slow for s0"):
        pc.compile_in_processes(variants, workers=1, timeout_s=3, compile_fn=write_marker)
    assert time.perf_counter() - t0 < 50  # terminated, not waited for (the compile sleeps 60 s)


@pytest.mark.parametrize("env, option, expected", [("", "threads", "threads"), ("processes", "threads", "processes"),
                                                   ("", "processes", "processes")])
def test_the_mode_switch(monkeypatch, env, option, expected):
    monkeypatch.setenv(pc.MODE_ENV, env)
    assert pc.precompile_mode(option) == expected


def test_a_bad_mode_names_its_source(monkeypatch):
    monkeypatch.setenv(pc.MODE_ENV, "fork")
    with pytest.raises(ValueError, match=r"BITMTP_PRECOMPILE_MODE='fork': choose one of threads, processes"):
        pc.precompile_mode("threads")
    monkeypatch.delenv(pc.MODE_ENV)
    with pytest.raises(ValueError, match=r"precompile_mode='fork'"):
        pc.precompile_mode("fork")


@pytest.mark.parametrize("value, expected", [("", (True, 0)), ("1", (True, 0)), ("0", (False, 0)), ("6", (True, 6))])
def test_the_environment_switch(monkeypatch, value, expected):
    monkeypatch.setenv(pc.ENV, value)
    assert pc.precompile_setting(True, 0) == expected
    assert pc.precompile_setting(False, 3) == ((False, 3) if value in ("", "0") else (True, expected[1] or 3))


@pytest.mark.parametrize("value", ["yes", "-2"])
def test_a_bad_environment_value_says_what_to_use(monkeypatch, value):
    monkeypatch.setenv(pc.ENV, value)
    with pytest.raises(ValueError, match=rf"BITMTP_PRECOMPILE={value!r}: use 0 \(off\), 1 \(on\)"):
        pc.precompile_setting(True, 0)


def test_default_workers_follow_cores_and_memory():
    assert pc.default_workers(cpu_count=16, available_bytes=64 << 30) == pc.MAX_WORKERS
    assert pc.default_workers(cpu_count=6, available_bytes=64 << 30) == 6  # an Orin Nano's cores
    assert pc.default_workers(cpu_count=8, available_bytes=3 * pc.WORKER_MEMORY + 1) == 3  # memory-bound
    assert pc.default_workers(cpu_count=8, available_bytes=0) == 1
    assert pc.default_workers() >= 1


# -- the graph backend's pass, with the real kernels under the interpreter --------------------

def _run_body_with(backend, state, launch, context=contextlib.nullcontext) -> None:
    """One eager run of ``state``'s body with every interpreted Triton launch going through
    ``launch(original_run, fn, *args, **kwargs)``, inside ``context()``; the static inputs
    are restored afterwards."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.__dict__["run"]
    mutable = backend.static.mutable()
    saved = [t.clone() for t in mutable]
    InterpretedFunction.run = lambda self, *args, **kwargs: launch(run, self, *args, **kwargs)
    try:
        backend.static.history_len.fill_(1)
        with context():
            backend._body(state)()
    finally:
        InterpretedFunction.run = run
        for t, s in zip(mutable, saved):
            t.copy_(s)


def _eager_launches(backend, state) -> list[str]:
    """The Triton kernels one eager run of ``state``'s body launches, in order."""
    launched = []

    def recording(run, fn, *args, **kwargs):
        launched.append(pc.kernel_name(fn))
        return run(fn, *args, **kwargs)

    _run_body_with(backend, state, recording)
    return launched


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path (CPU)")
def test_each_state_requests_exactly_the_launches_its_body_makes():
    backend = fast_backend(random_model(0, layers=1), block_size=3, max_context=64, smallest=32, kernels=True,
                           head_dtype=torch.float16,
                           options=RuntimeOptions(graphs=False, kv_dtype=torch.float32, precompile=True))
    states = backend.states()
    assert {s.role for s in states} == {"verify", "draft", "fused"} and len({s.segment for s in states}) == 2
    before = [t.clone() for t in backend.static.mutable()]
    kv = (backend.kv.k.clone(), backend.kv.v.clone())
    job = backend.precompile(states)  # overlap on: the running job, which capture would wait on per state
    report = job.finish()
    # the pass leaves the static inputs and the KV store as it found them (no kernel ran)
    assert all(torch.equal(a, b) for a, b in zip(before, backend.static.mutable()))
    assert torch.equal(kv[0], backend.kv.k) and torch.equal(kv[1], backend.kv.v)
    assert list(report.requests) == [str(s) for s in states]
    for s in states[:len(states) // 2]:  # one segment's states (the other's bodies are the same code)
        assert report.requests[str(s)] == _eager_launches(backend, s), s
    assert all("_attention_split_kernel" in r and "_w2a8_" in " ".join(r) for r in report.requests.values())


def _launch_variants(backend, state, layers: int | None = None) -> list[tuple[str, str]]:
    """(kernel, specialisation) of each Triton launch one run of ``state``'s body makes (its
    first ``layers`` layers only, when given): the key Triton's launch path computes for an
    sm_90 target, from the very arguments, with no GPU (the binder every launch runs). No
    kernel runs (allocations zero-filled, as in the pass)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target, binders, seen = CUDABackend(GPUTarget("cuda", 90, 32)), {}, []

    def recording(run, fn, *args, grid, warmup, **kwargs):
        if id(fn) not in binders:
            jit = JITFunction(fn.fn, **{n: v for n, v in fn.kwargs.items() if n.startswith("do_not_specialize") and v})
            binders[id(fn)] = create_function_from_signature(jit.signature, jit.params, target)
        _, specialization, options = binders[id(fn)](*args, **kwargs)
        seen.append((pc.kernel_name(fn), repr((specialization, sorted(options.items())))))
        return pc.NOT_LAUNCHED  # as in the pass: the key needs the arguments only, not the results

    @contextlib.contextmanager
    def first_layers_zeroed():
        with backend.fast.first_layers(layers) if layers else contextlib.nullcontext(), pc.zeroed_allocations():
            yield

    _run_body_with(backend, state, recording, first_layers_zeroed)
    return seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path (CPU)")
def test_every_layer_launches_the_variants_the_first_one_launches():
    """What lets the pass request one layer's launches: running all layers launches no
    kernel variant (Triton's specialisation key, from the real arguments) that running the
    first one does not, in every replay state; layers only repeat them."""
    backend = fast_backend(random_model(0, layers=3), block_size=3, max_context=64, smallest=32, kernels=True,
                           head_dtype=torch.float16,
                           options=RuntimeOptions(graphs=False, kv_dtype=torch.float32, precompile=True))
    states = backend.states()
    assert {s.role for s in states} == {"verify", "draft", "fused"} and len(backend.fast.layers) == 3
    for state in states:
        every, first = _launch_variants(backend, state), _launch_variants(backend, state, layers=1)
        assert set(every) == set(first) and len(every) > len(first), state
    assert len(backend.fast.layers) == 3
    with pytest.raises(ValueError, match="n must be >= 1"), backend.fast.first_layers(0):
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path (CPU)")
@pytest.mark.parametrize("how", ["option", "env"])
def test_the_pass_can_be_turned_off(monkeypatch, how):
    opts = RuntimeOptions(graphs=False, kv_dtype=torch.float32, precompile=how != "option")
    if how == "env":
        monkeypatch.setenv(pc.ENV, "0")
    backend = fast_backend(random_model(0, layers=1), block_size=3, max_context=64, kernels=True, options=opts,
                           head_dtype=torch.float16)
    assert backend.precompile(backend.states()) is None
    assert backend.precompile_report is None and backend.precompile_s == 0.0


def test_twins_skip_the_pass():
    backend = fast_backend(random_model(0), block_size=3, max_context=64)
    assert backend.precompile(backend.states()) is None
    assert backend.precompile_report is None


class RecordingJob:
    def __init__(self, events, fail_at=None):
        self.events, self.fail_at, self.wait_s = events, fail_at, 0.0

    def wait(self, label):
        self.events.append(("wait", label))
        if label == self.fail_at:
            raise pc.PrecompileError(f"Triton could not compile k (requested by {label})")

    def finish(self):
        self.events.append(("finish",))
        return pc.PrecompileReport()

    def abort(self):
        self.events.append(("abort",))


@pytest.mark.parametrize("overlap", [False, True])
def test_capture_all_precompiles_every_state_before_capturing_it(monkeypatch, overlap):
    backend = fast_backend(random_model(0), block_size=3, max_context=64, smallest=32)
    events = []

    def precompile(states):
        events.append(("precompile", list(states)))
        return RecordingJob(events) if overlap else None

    monkeypatch.setattr(backend, "precompile", precompile)
    monkeypatch.setattr(backend, "_capture", lambda state, warmups: events.append(("capture", state)))
    backend.capture_all()
    states = backend.states()
    if overlap:  # each state waits for its own kernels, then is captured; the job finishes last
        expected = [e for s in states for e in (("wait", str(s)), ("capture", s))] + [("finish",)]
    else:
        expected = [("capture", s) for s in states]
    assert events == [("precompile", states)] + expected


@pytest.mark.parametrize("pass_ran, warm, expected", [(True, False, 1), (False, True, 1), (False, False, 2)])
def test_a_state_whose_kernels_were_precompiled_is_captured_after_one_warm_up_run(monkeypatch, pass_ran, warm,
                                                                                  expected):
    """Two runs before capture only where capture itself compiles (the pass off, or it could
    not run): the pass's load, or a load a warm cache let skip it, takes one (``_capture``)."""
    backend = fast_backend(random_model(0), block_size=3, max_context=64, smallest=32)
    captured = []

    def precompile(states):
        backend.precompile_report = pc.PrecompileReport() if pass_ran else None
        backend.precompile_warm = warm
        return None

    monkeypatch.setattr(backend, "precompile", precompile)
    monkeypatch.setattr(backend, "_capture", lambda state, warmups: captured.append(warmups))
    backend.capture_all()
    assert captured == [expected] * len(backend.states()) and backend.capture_warmups == expected


def test_capture_refuses_a_negative_warm_up_count():
    backend = fast_backend(random_model(0), block_size=3, max_context=64, smallest=32)
    with pytest.raises(ValueError, match="warmups must be >= 0"):
        backend._capture(backend.states()[0], warmups=-1)


# -- no warm-up run where an earlier state's launched every variant --------------------------

def test_the_warm_up_plan_warms_up_only_states_with_a_variant_no_earlier_state_launched():
    a, b, c = object(), object(), object()
    variants = {"s1": [a, b], "s2": [b], "s3": [a, c], "s4": [c, b, a], "s6": []}
    plan = pc.warm_up_plan(["s1", "s2", "s3", "s4", "s5", "s6"], variants)
    assert plan == {"s1": 1, "s2": 0, "s3": 1, "s4": 0, "s5": 1, "s6": 1}  # s5, s6: no record
    assert pc.warm_up_plan(["s2", "s1"], variants) == {"s2": 1, "s1": 1}  # order decides


def test_the_pass_names_each_bodys_variants_one_object_each():
    """Triton returns the same object for every request of a variant (the future kernel filed
    at its first request): ``job.variants`` lists each body's variants once, shared between
    bodies that launch the same variant, so ``warm_up_plan`` can compare them."""
    a, b = Triton36Kernel("a"), Triton36Kernel("b")
    x = torch.zeros(4)
    bodies = [("s1", lambda: [a[(1,)](x, n) for n in (1, 16) * 3]),
              ("s2", lambda: [a[(1,)](x, 16), a[(1,)](x, 1)]),
              ("s3", lambda: [a[(1,)](x, 1), b[(1,)](x, 1)])]
    job = pc.start_precompile(bodies, workers=2, timeout_s=60, classes=[Triton36Kernel])
    try:
        v = job.variants
        assert [len(v[s]) for s in ("s1", "s2", "s3")] == [2, 2, 2]
        assert {id(k) for k in v["s2"]} == {id(k) for k in v["s1"]} and v["s3"][0] is v["s1"][0]
        assert pc.warm_up_plan(["s1", "s2", "s3"], v) == {"s1": 1, "s2": 0, "s3": 1}
        job.finish()
    finally:
        job.abort()
    variants: dict = {}
    pc.record_variants(bodies, pc.PrecompileReport(), classes=[Triton36Kernel], launched=variants)  # processes
    assert pc.warm_up_plan(["s1", "s2", "s3"], variants) == {"s1": 1, "s2": 0, "s3": 1}


def test_first_launches_are_refused_inside_only(monkeypatch):
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction

    assert pc.can_refuse_first_launches()
    loaded, calls = [], []
    monkeypatch.setattr(CompiledKernel, "_init_handles", lambda self: calls.append(self.name))
    monkeypatch.setattr(JITFunction, "_do_compile", lambda self, *a, **k: "compiled")
    init, do_compile = CompiledKernel.__dict__["_init_handles"], JITFunction.__dict__["_do_compile"]
    fresh = SimpleNamespace(name="fresh", module=None)
    ready = SimpleNamespace(name="ready", module="loaded module")
    kernel = SimpleNamespace(fn=SimpleNamespace(__name__="my_kernel"))
    with pc.first_launches_refused():
        with pytest.raises(pc.FirstLaunch, match="my_kernel: a variant not compiled"):
            JITFunction._do_compile(kernel, "key", "sig", 0)
        with pytest.raises(pc.FirstLaunch, match="fresh: its module is not loaded"):
            CompiledKernel._init_handles(fresh)
        CompiledKernel._init_handles(ready)  # loaded: Triton's own (here: recorded)
        loaded.append("ready")
    assert calls == ["ready"] and loaded == ["ready"]
    assert CompiledKernel.__dict__["_init_handles"] is init and JITFunction.__dict__["_do_compile"] is do_compile
    assert JITFunction._do_compile(kernel, "key") == "compiled"
    CompiledKernel._init_handles(fresh)
    assert calls == ["ready", "fresh"]


def test_capture_all_follows_the_plan_and_the_warm_marker_keeps_it(monkeypatch, tmp_path):
    """A cold load captures the states the pass saw launch a new variant after one run and
    the others after none; a first launch that still comes (a guarded capture falls back)
    makes its state warm up; the warm marker lists the states that warmed up, and a warm
    load (the pass skipped) warms up exactly those."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))

    def backend():
        b = fast_backend(random_model(0), block_size=3, max_context=64, smallest=32)
        states = [str(s) for s in b.states()]
        shared = [object() for _ in range(3)]
        variants = {label: [shared[i % 3]] for i, label in enumerate(states)}  # states 0-2 new, the rest not
        identity = {"load": "x"}

        def precompile(_):
            marker = pc.warm_marker(identity)
            if marker.exists():
                b.precompile_warm, b._warmed_up = True, pc.warmed_up_states(marker)
            else:
                b.precompile_report, b._variants = pc.PrecompileReport(), variants
                b._warm_marker = (marker, identity)

        captured = []

        def capture(state, warmups):
            if warmups == 0 and str(state) == states[4]:  # a first launch the plan did not foresee
                b.capture_fallbacks += 1
            captured.append(warmups)

        monkeypatch.setattr(b, "precompile", precompile)
        monkeypatch.setattr(b, "_capture", capture)
        monkeypatch.setattr(pc, "can_refuse_first_launches", lambda: True)
        b.capture_all()
        return b, captured, states

    cold, captured, states = backend()
    assert len(states) > 5 and captured == [1, 1, 1] + [0] * (len(states) - 3)
    assert cold.captured_without_warmup == len(states) - 3 and cold.capture_fallbacks == 1
    assert pc.warmed_up_states(pc.warm_marker({"load": "x"})) == states[:3] + [states[4]]
    warm, captured, _ = backend()
    assert warm.precompile_warm and captured == [1, 1, 1, 0, 1] + [0] * (len(states) - 5)


def test_a_marker_that_does_not_say_warms_every_state_up(tmp_path):
    marker = tmp_path / "m.json"
    for text in ("not json", json.dumps({"identity": {}}), json.dumps(["a"]), json.dumps({"warmed_up": [1]})):
        marker.write_text(text)
        assert pc.warmed_up_states(marker) is None
    pc.mark_warm(marker, {"x": 1}, warmed_up=["(M=1)"])
    assert pc.warmed_up_states(marker) == ["(M=1)"]


def test_a_compile_failing_during_an_overlapped_capture_aborts_the_job(monkeypatch):
    backend = fast_backend(random_model(0), block_size=3, max_context=64, smallest=32)
    states, events = backend.states(), []
    monkeypatch.setattr(backend, "precompile", lambda _: RecordingJob(events, fail_at=str(states[2])))
    monkeypatch.setattr(backend, "_capture", lambda state, warmups: events.append(("capture", state)))
    with pytest.raises(pc.PrecompileError, match=r"could not compile k \(requested by \(M="):
        backend.capture_all()
    assert events[-2:] == [("wait", str(states[2])), ("abort",)]
    assert [e for e in events if e[0] == "capture"] == [("capture", s) for s in states[:2]]


def test_a_body_waits_only_for_its_own_kernels():
    """Overlap: the first body's kernels are ready while the second's still compile."""
    release = threading.Event()
    fast, slow = FakeKernel("fast"), FakeKernel("slow", lambda key: release.wait(30) and "binary")
    job = pc.start_precompile([("s1", lambda: fast[(1,)](torch.zeros(2), 1)),
                               ("s2", lambda: slow[(1,)](torch.zeros(2), 1))], workers=2, timeout_s=60,
                              classes=[FakeKernel])
    try:
        job.wait("s1")
        assert len(job.needs["s2"]) == 1 and not job.needs["s2"][0].done()
        release.set()
        job.wait("s2")
        report = job.finish()
    finally:
        release.set()
        job.abort()
    assert report.compiled == 2 and triton_async.active_mode.get() is None
    assert [type(k).__name__ for k in slow.cache.values()] == ["str"]  # filed: the compiled kernel, not a future


@pytest.mark.parametrize("value, expected", [("", True), ("1", True), ("0", False)])
def test_the_overlap_switch(monkeypatch, value, expected):
    monkeypatch.setenv(pc.OVERLAP_ENV, value)
    assert pc.precompile_overlap(True) == expected
    monkeypatch.setenv(pc.OVERLAP_ENV, "maybe")
    with pytest.raises(ValueError, match="BITMTP_PRECOMPILE_OVERLAP='maybe'"):
        pc.precompile_overlap(True)


# -- fewer variants ----------------------------------------------------------------------------

def _specialization(kernel, **ints):
    """The specialisation key Triton's launch path computes for ``kernel`` (every integer
    argument 7 unless given, constexprs 4): the binder every launch runs, with no GPU."""
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(kernel, JITFunction):  # the interpreter keeps the jit options aside
        kernel = JITFunction(kernel.fn, **{n: v for n, v in kernel.kwargs.items()
                                           if n.startswith("do_not_specialize") and v})
    args = {p.name: 4 if p.is_constexpr else ints.get(p.name, 7) for p in kernel.params}
    return create_function_from_signature(kernel.signature, kernel.params, None)(**args)[1]


@pytest.mark.parametrize("module, kernel, rows, other", [
    ("attention", "_attention_combine_kernel", "MH", "HD"),
    ("attention", "_attention_split_kernel", "M", "HD"),
    ("common", "_split_k_reduce_kernel", "M", "N"),
])
def test_row_counts_compile_one_variant_divisible_by_16_or_not(module, kernel, rows, other):
    """Widths 12 and 16 (M·Hq = 240, 320 at Hq = 20) used to compile a variant of their own
    for the divisibility alone; width 1 stays specialised, other integers keep the hint."""
    import triton

    if "do_not_specialize_on_alignment" not in inspect.signature(triton.jit).parameters:
        pytest.skip("this Triton has no do_not_specialize_on_alignment (before 3.2)")
    fn = getattr(__import__(f"kernels_ampere.{module}", fromlist=[kernel]), kernel)
    plain = _specialization(fn, **{rows: 20})
    assert all(_specialization(fn, **{rows: m}) == plain for m in (16, 21, 48, 240, 320))
    assert _specialization(fn, **{rows: 1}) != plain  # the value 1 is still a variant of its own
    assert _specialization(fn, **{rows: 20, other: 128}) != plain  # an unmarked integer still specialises


# -- on the GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
def test_gpu_capture_after_precompile_compiles_nothing_and_decodes_the_same_tokens(tmp_path, monkeypatch):
    from triton.runtime.jit import JITFunction

    from bitmtp_edge import Engine
    from bitmtp_edge.backends.graph import GraphBackend
    from tests.helpers import write_test_artifact

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # no earlier load's warm marker
    model = random_model(9, vocab=256, hidden=256, heads=(8, 2))
    art = write_test_artifact(model, tmp_path / "art", block_size=8, max_context=256, smallest=16)
    prompt = [3, 14, 15, 92, 65, 35]
    compiled, do_compile, precompile = [], JITFunction.__dict__["_do_compile"], GraphBackend.precompile

    def counting(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return do_compile(self, *args, **kwargs)

    def then_count(self, states):  # the pass, then count what capture compiles
        job = precompile(self, states)
        JITFunction._do_compile = counting
        return job

    tokens = {}
    for on in (True, False):
        GraphBackend.precompile = then_count
        try:
            eng = Engine.load(art, backend="ampere", device="cuda", runtime=RuntimeOptions(precompile=on))
        finally:
            JITFunction._do_compile, GraphBackend.precompile = do_compile, precompile
        if on:
            assert eng.backend.precompile_report is not None and eng.startup["precompile_s"] > 0
            assert compiled == [], f"capture compiled {compiled} after the precompile pass"
        tokens[on] = [eng.generate(prompt, max_new_tokens=64, policy=p, tau=0.3, min_prefix=2).token_ids
                      for p in ("ar", "speculative", "fused")]
        del eng
    assert tokens[True] == tokens[False]


def test_engine_reports_the_startup_split(tmp_path):
    from bitmtp_edge import Engine
    from tests.helpers import write_test_artifact

    art = write_test_artifact(random_model(0, layers=1), tmp_path / "art", block_size=3, max_context=64)
    split = Engine.load(art, backend="reference", device="cpu").startup
    assert set(split) == {"total_s", "load_s", "precompile_s", "capture_s", "step_costs_s", "kernels_precompiled",
                          "compile_wait_s", "load_parts"}
    assert split["total_s"] > 0 and split["load_s"] == split["total_s"]  # no graphs, no pass on the reference
    assert split["precompile_s"] == split["capture_s"] == split["step_costs_s"] == 0.0
    assert split["kernels_precompiled"] == 0
    parts = split["load_parts"]  # the checksums ran beside reading and building
    assert set(parts) == {"read_s", "build_s", "checksums_s", "checksums_wait_s"}
    assert all(v >= 0 for v in parts.values()) and parts["checksums_s"] > 0
    assert parts["read_s"] + parts["build_s"] + parts["checksums_wait_s"] <= split["load_s"]


# -- a warm cache skips the pass ---------------------------------------------------------------

def test_the_identity_follows_sources_switches_and_fields_not_the_precompile_switches(monkeypatch, tmp_path):
    src = tmp_path / "kernels"
    src.mkdir()
    (src / "k.py").write_text("BLOCK = 16\n")
    (src / "tuned.json").write_text("{}")
    (src / "notes.txt").write_text("not code")
    for name in [k for k in __import__("os").environ if k.startswith(("BITMTP_", "TRITON_"))]:
        monkeypatch.delenv(name)
    base = pc.warm_marker(pc.load_identity({"states": ["(M=1, σ=0, verify)"]}, [src]), tmp_path)
    assert base.parent == tmp_path / pc.MARKER_FOLDER
    monkeypatch.setenv(pc.ENV, "4")  # how the pass runs changes no kernel
    monkeypatch.setenv(pc.MODE_ENV, "processes")
    assert pc.warm_marker(pc.load_identity({"states": ["(M=1, σ=0, verify)"]}, [src]), tmp_path) == base
    (src / "notes.txt").write_text("edited")  # neither .py nor .json
    assert pc.warm_marker(pc.load_identity({"states": ["(M=1, σ=0, verify)"]}, [src]), tmp_path) == base
    changed = []
    monkeypatch.setenv("BITMTP_PDL", "0")
    changed.append(pc.load_identity({"states": ["(M=1, σ=0, verify)"]}, [src]))
    monkeypatch.delenv("BITMTP_PDL")
    (src / "tuned.json").write_text('{"h200": 1}')
    changed.append(pc.load_identity({"states": ["(M=1, σ=0, verify)"]}, [src]))
    changed.append(pc.load_identity({"states": ["(M=9, σ=0, verify)"]}, [src]))
    markers = {pc.warm_marker(identity, tmp_path) for identity in changed}
    assert len(markers) == 3 and base not in markers


def test_mark_warm_writes_atomically_and_survives_a_read_only_cache(tmp_path, caplog):
    marker = tmp_path / pc.MARKER_FOLDER / "abc.json"
    pc.mark_warm(marker, {"states": ["s"], "env": {}}, warmed_up=["s"])
    assert json.loads(marker.read_text()) == {"identity": {"states": ["s"], "env": {}}, "warmed_up": ["s"]}
    assert [p.name for p in marker.parent.iterdir()] == ["abc.json"]  # no temporary left
    blocked = tmp_path / "file"
    blocked.write_text("")
    pc.mark_warm(blocked / "sub" / "m.json", {})  # cannot create the folder: logged, not raised
    assert "could not record the warm Triton cache" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path (CPU)")
def test_a_load_after_a_completed_one_skips_the_pass_until_something_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))

    def backend():
        b = fast_backend(random_model(0, layers=1), block_size=3, max_context=32, smallest=32, kernels=True,
                         head_dtype=torch.float16,
                         options=RuntimeOptions(graphs=False, kv_dtype=torch.float32, precompile=True))
        monkeypatch.setattr(b, "_capture", lambda state, warmups: None)  # capture itself needs CUDA
        return b

    first = backend()
    first.capture_all()
    assert first.precompile_report is not None and not first.precompile_warm
    assert len(list((tmp_path / "triton" / pc.MARKER_FOLDER).iterdir())) == 1
    second = backend()
    second.capture_all()
    assert second.precompile_warm and second.precompile_report is None and second.precompile_s == 0.0
    monkeypatch.setenv("BITMTP_SMEM_CARVEOUT", "50")  # a switch that may change the launches
    third = backend()
    third.capture_all()
    assert not third.precompile_warm and third.precompile_report is not None
    assert len(list((tmp_path / "triton" / pc.MARKER_FOLDER).iterdir())) == 2


def test_a_failed_capture_leaves_no_marker(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    b = fast_backend(random_model(0), block_size=3, max_context=64, smallest=32)
    b._warm_marker = (pc.warm_marker({"x": 1}), {"x": 1})  # as a pass that ran would leave it
    monkeypatch.setattr(b, "precompile", lambda states: None)

    def capture(state, warmups):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(b, "_capture", capture)
    with pytest.raises(RuntimeError, match="out of memory"):
        b.capture_all()
    assert not (tmp_path / "triton" / pc.MARKER_FOLDER).exists()
