"""The one record every monitoring source produces, and the interface a source implements.

A source is opened, read repeatedly from the sampler's thread (each ``read`` blocks until
the next reading and returns None once the source has ended), and closed from any thread;
closing unblocks a pending ``read``. Timestamps are ``time.monotonic()`` at the moment the
reading reached us, so they compare directly with the timestamps a benchmark takes around
its decode loop.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field


class SourceUnavailable(RuntimeError):
    """A monitoring source cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class Sample:
    """One reading. None = this source cannot measure it (said plainly, never guessed)."""

    t: float  # time.monotonic(), seconds
    power_w: float | None = None  # total: module input (Jetson) or GPU board power (NVML)
    rails_w: dict[str, float] = field(default_factory=dict)  # per rail, W
    temps_c: dict[str, float] = field(default_factory=dict)
    cpu_load_pct: float | None = None  # mean over online cores
    gpu_load_pct: float | None = None
    cpu_freq_mhz: float | None = None  # fastest online core
    gpu_freq_mhz: float | None = None
    mem_freq_mhz: float | None = None  # EMC on Jetson, memory clock on NVML
    ram_used_mb: float | None = None  # host RAM (on Jetson also the GPU's: memory is unified)
    ram_total_mb: float | None = None
    gpu_mem_used_mb: float | None = None  # discrete GPUs only
    gpu_mem_total_mb: float | None = None
    energy_j: float | None = None  # NVML's cumulative energy counter, where the GPU has one

    def to_dict(self) -> dict:
        return asdict(self)


class Source(ABC):
    """A stream of :class:`Sample`. Subclasses set ``name`` and say whether power is known."""

    name: str = "source"
    interval_s: float = 0.1
    # Plain sentence when this source cannot measure power; None when it can.
    power_note: str | None = None

    @abstractmethod
    def open(self) -> None:
        """Acquire the device/process. Raises SourceUnavailable with the reason."""

    @abstractmethod
    def read(self) -> Sample | None:
        """Block until the next sample; None once the source has ended or was closed."""

    @abstractmethod
    def close(self) -> None:
        """Release everything this source started; idempotent, callable from any thread."""

    def describe(self) -> str:
        return f"{self.name} every {self.interval_s * 1000:.0f} ms"

    def window_notes(self, start: float, end: float) -> list[str]:
        """Plain sentences about [start, end] that only the source knows (e.g. output it could
        not read); the sampler adds them to the window's notes. Empty by default."""
        return []


class PollingSource(Source):
    """A source read by polling a library at a fixed interval (NVML, psutil, jtop)."""

    def __init__(self, interval_s: float = 0.1) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._closed = threading.Event()
        self._next: float | None = None

    @abstractmethod
    def poll(self) -> Sample:
        """Take one reading now."""

    def read(self) -> Sample | None:
        now = time.monotonic()
        if self._next is None:  # first reading at once: it is the window's baseline
            self._next = now
        if self._closed.wait(max(0.0, self._next - now)):
            return None
        # Ticks missed while the caller was slow are skipped, not replayed in a burst.
        self._next = max(self._next + self.interval_s, time.monotonic())
        return self.poll()

    def close(self) -> None:
        self._closed.set()
