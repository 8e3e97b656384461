"""A background sampler and the statistics of one measured window (e.g. a decode loop).

Usage::

    with Sampler("auto", interval_s=0.1) as sampler:
        prefill(...)
        with sampler.window() as w:          # start/end taken with time.monotonic()
            tokens = decode(...)
    stats = w.stats                          # WindowStats: energy_j, avg_power_w, peaks, clocks
    stats.joules_per_token(len(tokens))

Energy is the trapezoidal integral of the instantaneous total power over exactly
[start, end]: power is linear between samples and interpolated at both window edges, so a
window shorter than the sampling interval is still charged only for its own duration. When
no sample brackets an edge (the window began before the first sample or ended after the
last) the nearest value is held, and ``notes`` says so.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from bitmtp_edge.jetson.monitor.sample import Sample, Source
from bitmtp_edge.jetson.monitor.sources import open_source

log = logging.getLogger(__name__)


def _interpolate(points: Sequence[tuple[float, float]], t: float) -> float:
    """Value at ``t`` of (t, value) points sorted by t: linear between, held beyond the ends."""
    i = bisect.bisect_left(points, t, key=lambda p: p[0])
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (t0, v0), (t1, v1) = points[i - 1], points[i]
    return v1 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def integrate_energy(points: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
    """Joules over [start, end] from (t seconds, watts) points sorted by t; None if no points.

    Linear between points, held constant beyond the first/last point.
    """
    if not points or end < start:
        return None
    knots = [start, *(t for t, _ in points if start < t < end), end]
    return sum(
        (b - a) * (_interpolate(points, a) + _interpolate(points, b)) / 2 for a, b in zip(knots, knots[1:])
    )


@dataclass(frozen=True)
class WindowStats:
    """What happened between ``start`` and ``end`` (time.monotonic() seconds)."""

    start: float
    end: float
    source: str
    n_samples: int  # samples inside [start, end]
    energy_j: float | None = None
    avg_power_w: float | None = None
    peak_power_w: float | None = None  # highest sample covering the window
    energy_counter_j: float | None = None  # NVML hardware counter, where present
    peak_temps_c: dict[str, float] = field(default_factory=dict)
    clocks_mhz: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (min, max)
    avg_gpu_load_pct: float | None = None
    peak_ram_used_mb: float | None = None
    peak_gpu_mem_used_mb: float | None = None
    notes: tuple[str, ...] = ()

    @property
    def duration_s(self) -> float:
        return self.end - self.start

    @property
    def max_temp_c(self) -> float | None:
        return max(self.peak_temps_c.values()) if self.peak_temps_c else None

    def joules_per_token(self, tokens: int) -> float | None:
        return self.energy_j / tokens if self.energy_j is not None and tokens > 0 else None

    def tokens_per_joule(self, tokens: int) -> float | None:
        return tokens / self.energy_j if self.energy_j else None

    def to_dict(self) -> dict:
        return {
            "start": self.start,
            "end": self.end,
            "duration_s": self.duration_s,
            "source": self.source,
            "n_samples": self.n_samples,
            "energy_j": self.energy_j,
            "avg_power_w": self.avg_power_w,
            "peak_power_w": self.peak_power_w,
            "energy_counter_j": self.energy_counter_j,
            "peak_temps_c": dict(self.peak_temps_c),
            "max_temp_c": self.max_temp_c,
            "clocks_mhz": {k: {"min": lo, "max": hi} for k, (lo, hi) in self.clocks_mhz.items()},
            "avg_gpu_load_pct": self.avg_gpu_load_pct,
            "peak_ram_used_mb": self.peak_ram_used_mb,
            "peak_gpu_mem_used_mb": self.peak_gpu_mem_used_mb,
            "notes": list(self.notes),
        }


def summarize_window(
    samples: Sequence[Sample], start: float, end: float, source: str = "", power_note: str | None = None
) -> WindowStats:
    """Statistics of ``samples`` (sorted by t) over [start, end]. Pure; the Sampler calls it."""
    if end < start:
        raise ValueError(f"window end {end} is before its start {start}")
    notes: list[str] = []
    inside = [s for s in samples if start <= s.t <= end]
    # A sample describes the interval that precedes it, so the first one after `end` still
    # covers the window's tail: peaks and clock ranges include it.
    after = next((s for s in samples if s.t > end), None)
    covering = inside + ([after] if after is not None else [])
    if not covering:
        before = [s for s in samples if s.t < start]
        covering = before[-1:]

    powered = [(s.t, s.power_w) for s in samples if s.power_w is not None]
    energy = avg = peak = None
    if powered:
        energy = integrate_energy(powered, start, end)
        dur = end - start
        avg = energy / dur if energy is not None and dur > 0 else None
        seen = [s.power_w for s in covering if s.power_w is not None]
        peak = max(seen) if seen else None
        if powered[0][0] > start or powered[-1][0] < end:
            notes.append(
                "power samples do not bracket the whole window: the nearest reading was held at "
                f"the edge (samples {powered[0][0]:.3f}..{powered[-1][0]:.3f}, window {start:.3f}..{end:.3f})"
            )
    elif power_note:
        notes.append(power_note)
    elif samples:
        notes.append(f"power unknown: the {source or 'monitoring'} source reported no power readings")
    if not samples:
        notes.append("no samples were recorded (did the sampler start before the window?)")

    # A cumulative counter (NVML): difference of its values interpolated at the two edges.
    counter = [(s.t, s.energy_j) for s in samples if s.energy_j is not None]
    energy_counter = None
    if counter and counter[0][0] <= start and counter[-1][0] >= end:
        energy_counter = _interpolate(counter, end) - _interpolate(counter, start)

    temps: dict[str, float] = {}
    for s in covering:
        for k, v in s.temps_c.items():
            temps[k] = max(v, temps.get(k, v))
    clocks: dict[str, tuple[float, float]] = {}
    for key, attr in (("cpu", "cpu_freq_mhz"), ("gpu", "gpu_freq_mhz"), ("mem", "mem_freq_mhz")):
        vals = [getattr(s, attr) for s in covering if getattr(s, attr) is not None]
        if vals:
            clocks[key] = (min(vals), max(vals))
    loads = [s.gpu_load_pct for s in covering if s.gpu_load_pct is not None]
    ram = [s.ram_used_mb for s in covering if s.ram_used_mb is not None]
    gmem = [s.gpu_mem_used_mb for s in covering if s.gpu_mem_used_mb is not None]
    return WindowStats(
        start=start,
        end=end,
        source=source,
        n_samples=len(inside),
        energy_j=energy,
        avg_power_w=avg,
        peak_power_w=peak,
        energy_counter_j=energy_counter,
        peak_temps_c=temps,
        clocks_mhz=clocks,
        avg_gpu_load_pct=sum(loads) / len(loads) if loads else None,
        peak_ram_used_mb=max(ram) if ram else None,
        peak_gpu_mem_used_mb=max(gmem) if gmem else None,
        notes=tuple(notes),
    )


class Window:
    """Handle yielded by :meth:`Sampler.window`; ``stats`` is filled when the block exits."""

    def __init__(self, start: float):
        self.start = start
        self.end: float | None = None
        self.stats: WindowStats | None = None


class Sampler:
    """Reads a :class:`Source` on a background thread into a bounded list of samples.

    ``source`` is an unopened Source or a kind: ``auto`` | ``tegrastats`` | ``jtop`` |
    ``nvml`` | ``psutil``. ``max_samples`` bounds memory in long-lived services (oldest
    samples are dropped first).
    """

    def __init__(
        self,
        source: Source | str = "auto",
        *,
        interval_s: float = 0.1,
        root: str | os.PathLike[str] = "/",
        max_samples: int = 100_000,
    ):
        self._requested = source
        self.interval_s = interval_s
        self.root = root
        self.source: Source | None = source if isinstance(source, Source) else None
        self.notes: list[str] = []  # why auto skipped sources, etc.
        self.error: BaseException | None = None  # what stopped the reader thread, if anything
        self._samples: collections.deque[Sample] = collections.deque(maxlen=max_samples)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._ended = False

    # -- lifecycle

    def start(self) -> Sampler:
        if self._thread is not None:
            raise RuntimeError("Sampler.start() called twice; make a new Sampler per run")
        if isinstance(self._requested, Source):
            self._requested.open()
        else:
            self.source, self.notes = open_source(self._requested, self.interval_s, root=self.root)
        self._thread = threading.Thread(target=self._run, name="bitmtp-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        assert self.source is not None
        try:
            while (s := self.source.read()) is not None:
                with self._cond:
                    self._samples.append(s)
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - reported through .error, not lost
            self.error = e
            log.warning("monitoring source %s failed: %s", self.source.name, e)
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def stop(self) -> None:
        """Close the source (ends our own child processes) and join the thread."""
        if self.source is not None:
            self.source.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                log.warning("monitoring thread did not stop within 5 s (source %s)", self.source_name)

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- reading

    @property
    def running(self) -> bool:
        """The reader thread is alive (False once the source ended or stop() ran)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def source_name(self) -> str:
        return self.source.name if self.source is not None else str(self._requested)

    @property
    def power_note(self) -> str | None:
        """Plain sentence when the source cannot measure power, else None."""
        return self.source.power_note if self.source is not None else None

    @property
    def samples(self) -> list[Sample]:
        with self._cond:
            return list(self._samples)

    def latest(self) -> Sample | None:
        with self._cond:
            return self._samples[-1] if self._samples else None

    def wait_for_sample(self, after: float, timeout_s: float) -> bool:
        """Block until a sample newer than ``after`` exists (True) or timeout/end (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not (self._samples and self._samples[-1].t > after):
                remaining = deadline - time.monotonic()
                if self._ended or remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    # -- windows

    def mark_window(self, start: float, end: float, *, wait_s: float | None = None) -> WindowStats:
        """Statistics over [start, end]. Waits (default 2.5 intervals) for the sample that
        closes the window, so the tail is interpolated rather than held."""
        wait = 2.5 * self._interval() if wait_s is None else wait_s
        got_tail = self.wait_for_sample(end, wait)
        stats = summarize_window(self.samples, start, end, self.source_name, self.power_note)
        extra = []
        if self.error is not None:
            extra.append(f"monitoring stopped early: {self.error}")
        exit_message = getattr(self.source, "exit_message", None)
        if exit_message:
            extra.append(exit_message)
        if self.source is not None:
            extra += self.source.window_notes(start, end)
        if not got_tail and stats.n_samples == 0 and self._ended:
            extra.append("the monitoring source ended before the window closed")
        if extra:
            stats = dataclasses.replace(stats, notes=stats.notes + tuple(extra))
        return stats

    @contextmanager
    def window(self) -> Iterator[Window]:
        w = Window(time.monotonic())
        try:
            yield w
        finally:
            w.end = time.monotonic()
            w.stats = self.mark_window(w.start, w.end)

    def _interval(self) -> float:
        return self.source.interval_s if self.source is not None else self.interval_s
