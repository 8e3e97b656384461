"""The monitoring sources: tegrastats, jtop, NVML, psutil; and ``auto`` selection.

* ``tegrastats`` (Jetson): we spawn our *own* child ``tegrastats --interval N`` and read its
  stdout; at close we terminate that child only. ``tegrastats --stop`` is never used: it
  kills every running instance, including other users' and other tools' loggers.
* ``jtop`` (Jetson, optional): jetson-stats is AGPL-3.0 and needs its root service
  (``/run/jtop.sock``), so it is imported lazily and used only when the service answers;
  it is the route inside containers, which lack the tegrastats binary.
* ``nvml`` (server/desktop GPUs): nvidia-ml-py imported lazily; GPU board power, temperature,
  clocks, memory, utilisation, plus host CPU/RAM from psutil.
* ``psutil``: CPU and RAM only; power is unknown and said so.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import threading
import time

import psutil

from bitmtp_edge.jetson.board import BoardInfo, detect_board
from bitmtp_edge.jetson.monitor.sample import PollingSource, Sample, Source, SourceUnavailable
from bitmtp_edge.jetson.monitor.tegrastats import TegrastatsParseError, TegrastatsSample, parse_tegrastats

SOURCE_KINDS = ("auto", "tegrastats", "jtop", "nvml", "psutil")
_MB = 1024 * 1024


def host_stats() -> dict:
    """CPU load / fastest clock and RAM from psutil, as Sample fields."""
    vm = psutil.virtual_memory()
    per_cpu = psutil.cpu_percent(percpu=True)  # since the previous call: prime once at open
    try:
        freq = psutil.cpu_freq()  # None, or raising, where cpufreq is hidden (some VMs/containers)
    except (OSError, NotImplementedError):
        freq = None
    return {
        "cpu_load_pct": sum(per_cpu) / len(per_cpu) if per_cpu else None,
        "cpu_freq_mhz": freq.current if freq else None,
        "ram_used_mb": (vm.total - vm.available) / _MB,
        "ram_total_mb": vm.total / _MB,
    }


def sample_from_tegrastats(ts: TegrastatsSample, t: float) -> Sample:
    freqs = [f for f in ts.cpu_freq_mhz if f is not None]
    return Sample(
        t=t,
        power_w=ts.total_power_mw / 1000 if ts.total_power_mw is not None else None,
        rails_w={k: v / 1000 for k, v in ts.power_mw.items()},
        temps_c=dict(ts.temps_c),
        cpu_load_pct=ts.cpu_load_avg,
        gpu_load_pct=ts.gpu_load_pct,
        cpu_freq_mhz=max(freqs) if freqs else None,
        gpu_freq_mhz=ts.gpu_freq_mhz,
        mem_freq_mhz=ts.emc_freq_mhz,
        ram_used_mb=ts.ram_used_mb,
        ram_total_mb=ts.ram_total_mb,
    )


# ----------------------------------------------------------------------------- tegrastats


class TegrastatsSource(Source):
    """Our own ``tegrastats --interval N`` child; one Sample per stdout line.

    Without root, JP6 lines lack EMC_FREQ and the GPU clock; ``sudo=True`` runs it through
    ``sudo -n`` (no password prompt: fails fast instead of hanging a benchmark).
    """

    name = "tegrastats"

    def __init__(self, interval_s: float = 0.1, executable: str | None = None, sudo: bool = False):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.executable = executable
        self.sudo = sudo
        self.skipped_lines = 0  # lines that were not tegrastats (warnings, banners)
        self.last_skipped: str | None = None
        # (monotonic time, line) of recent skipped lines, so a window can say it lost readings
        # instead of only "no samples"; bounded for long-lived services.
        self._skipped: collections.deque[tuple[float, str]] = collections.deque(maxlen=1000)
        self.exit_message: str | None = None  # stderr of a child that ended by itself
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._closing = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def argv(self) -> list[str]:
        exe = self.executable or shutil.which("tegrastats")
        if exe is None and os.path.exists("/usr/bin/tegrastats"):
            exe = "/usr/bin/tegrastats"
        if exe is None:
            raise SourceUnavailable(
                "tegrastats not found on PATH or at /usr/bin/tegrastats: it ships with L4T on the "
                "host and is missing in most containers; run on the host, or use source='jtop' "
                "with /run/jtop.sock mounted"
            )
        # Milliseconds, and a private instance: never --start/--stop (they are global).
        argv = [exe, "--interval", str(max(1, round(self.interval_s * 1000)))]
        return ["sudo", "-n", *argv] if self.sudo else argv

    def open(self) -> None:
        argv = self.argv()
        try:
            # errors="replace": one byte that is not UTF-8 (a kernel message, a locale) would
            # otherwise end the reader thread, and every reading after it, without a word.
            self._proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, errors="replace"
            )
        except OSError as e:
            raise SourceUnavailable(f"could not start {' '.join(argv)}: {e}") from e

    def read(self) -> Sample | None:
        proc = self._proc
        if proc is None or proc.stdout is None:
            return None
        while True:
            try:
                line = proc.stdout.readline()
            except (ValueError, OSError):  # pipe closed by close() from another thread
                return None
            if not line:
                self._note_exit(proc)
                return None
            t = time.monotonic()
            try:
                return sample_from_tegrastats(parse_tegrastats(line), t)
            except TegrastatsParseError:
                self.skipped_lines += 1
                self.last_skipped = line.strip()[:200]
                self._skipped.append((t, self.last_skipped))

    def window_notes(self, start: float, end: float) -> list[str]:
        # tuple() copies in one step: the reader thread may append meanwhile.
        lost = [line for t, line in tuple(self._skipped) if start <= t <= end]
        if not lost:
            return []
        return [
            f"{len(lost)} line(s) tegrastats printed during the window are not tegrastats samples "
            f"and were skipped (last: {lost[-1]!r}); no reading was taken from them"
        ]

    def _note_exit(self, proc: subprocess.Popen[str]) -> None:
        try:  # EOF comes a moment before the exit status
            code = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return
        if self.exit_message is not None or self._closing:  # we ended it: nothing to report
            return
        try:
            err = proc.stderr.read().strip() if proc.stderr else ""
        except (ValueError, OSError):
            err = ""
        self.exit_message = f"tegrastats exited with code {code}" + (f": {err[:300]}" if err else "")

    def close(self) -> None:
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            self._closing = True
            if proc.poll() is None:
                proc.terminate()  # our child only (sudo relays the signal to tegrastats)
                try:
                    proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=3)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    try:
                        pipe.close()
                    except OSError:
                        pass


# ----------------------------------------------------------------------------- jtop


class JtopSource(Source):
    """jetson-stats' client; needs ``jtop.service`` (root) and membership of group ``jtop``."""

    name = "jtop"

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self._jetson = None
        self._closed = threading.Event()

    def open(self) -> None:
        try:
            from jtop import JtopException, jtop  # AGPL-3.0, optional: imported only here
        except ImportError as e:
            raise SourceUnavailable(
                "jetson-stats is not installed: pip install 'bitmtp-edge[jetson]' and enable its "
                "service (sudo systemctl enable --now jtop)"
            ) from e
        jetson = jtop(interval=self.interval_s)
        try:
            jetson.start()
        except JtopException as e:
            raise SourceUnavailable(f"jtop service did not answer: {e}") from e
        self._jetson = jetson

    def read(self) -> Sample | None:
        jetson = self._jetson
        if jetson is None or self._closed.is_set() or not jetson.ok():
            return None
        return self._to_sample(jetson, time.monotonic())

    @staticmethod
    def _to_sample(jetson, t: float) -> Sample:
        stats = dict(jetson.stats)
        temps = {
            k[len("Temp ") :].lower(): float(v)
            for k, v in stats.items()
            if k.startswith("Temp ") and isinstance(v, (int, float)) and v > -200
        }
        rails: dict[str, float] = {}
        try:
            for name, rail in (jetson.power or {}).get("rail", {}).items():
                if "power" in rail and name != "NC":  # NC: an unconnected INA3221 channel
                    rails[name] = rail["power"] / 1000
        except (AttributeError, TypeError):
            pass
        cpus = [v for k, v in stats.items() if k.startswith("CPU") and isinstance(v, (int, float))]
        ram_used = ram_total = None
        try:
            ram = jetson.memory["RAM"]  # kB
            ram_used, ram_total = ram["used"] / 1024, ram["tot"] / 1024
        except (AttributeError, KeyError, TypeError):
            pass
        total = stats.get("Power TOT")
        gpu = stats.get("GPU")
        return Sample(
            t=t,
            power_w=total / 1000 if isinstance(total, (int, float)) else None,
            rails_w=rails,
            temps_c=temps,
            cpu_load_pct=sum(cpus) / len(cpus) if cpus else None,
            gpu_load_pct=float(gpu) if isinstance(gpu, (int, float)) else None,
            ram_used_mb=ram_used,
            ram_total_mb=ram_total,
        )

    def close(self) -> None:
        self._closed.set()
        jetson, self._jetson = self._jetson, None
        if jetson is not None:
            try:
                jetson.close()
            except Exception:  # noqa: BLE001 - a failing close must not hide the benchmark
                pass


# ----------------------------------------------------------------------------- NVML


class NvmlSource(PollingSource):
    """One NVIDIA GPU through NVML. ``index`` is NVML's order (PCI bus), which matches
    CUDA's only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``."""

    name = "nvml"

    def __init__(self, interval_s: float = 0.1, index: int = 0):
        super().__init__(interval_s)
        self.index = index
        self.gpu_name: str | None = None
        self._nvml = None
        self._handle = None
        self._instant = False

    def open(self) -> None:
        try:
            import pynvml  # nvidia-ml-py, optional: imported only here
        except ImportError as e:
            raise SourceUnavailable("nvidia-ml-py is not installed: pip install 'bitmtp-edge[server]'") from e
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise SourceUnavailable(f"NVML did not initialise ({e}): no NVIDIA driver on this host") from e
        try:
            count = pynvml.nvmlDeviceGetCount()
            if self.index >= count:
                raise SourceUnavailable(f"NVML sees {count} GPU(s); index {self.index} does not exist")
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self.gpu_name = name.decode() if isinstance(name, bytes) else name
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        self._nvml = pynvml
        self._instant = self._instant_power_mw() is not None
        host_stats()  # psutil's cpu_percent measures since the previous call

    def _instant_power_mw(self) -> float | None:
        # nvmlDeviceGetPowerUsage is a 1 s moving average on recent GPUs (Ampere and later),
        # which lags a decode window's ramp; the instantaneous field, where the driver has
        # it, does not.
        nv = self._nvml
        field = getattr(nv, "NVML_FI_DEV_POWER_INSTANT", None)
        if field is None:
            return None
        try:
            value = nv.nvmlDeviceGetFieldValues(self._handle, [field])[0]
        except (nv.NVMLError, AttributeError, IndexError, TypeError):
            return None
        if getattr(value, "nvmlReturn", 1) != 0:
            return None
        mw = value.value.uiVal
        return float(mw) if mw else None

    def _get(self, fn, *args):
        # Each quantity may be unsupported on a given GPU (NVMLError_NotSupported): None.
        try:
            return fn(self._handle, *args)
        except self._nvml.NVMLError:
            return None

    def poll(self) -> Sample:
        nv = self._nvml
        t = time.monotonic()
        # The energy counter, where present, gives the window's energy independently of
        # the sampling (WindowStats.energy_counter_j).
        power = self._instant_power_mw() if self._instant else None
        if power is None:
            power = self._get(nv.nvmlDeviceGetPowerUsage)  # mW, averaged
        energy = self._get(nv.nvmlDeviceGetTotalEnergyConsumption)  # mJ since driver load
        temp = self._get(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)
        sm = self._get(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM)
        mem_clock = self._get(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM)
        mem = self._get(nv.nvmlDeviceGetMemoryInfo)
        util = self._get(nv.nvmlDeviceGetUtilizationRates)
        return Sample(
            t=t,
            power_w=power / 1000 if power is not None else None,
            temps_c={"gpu": float(temp)} if temp is not None else {},
            gpu_load_pct=float(util.gpu) if util is not None else None,
            gpu_freq_mhz=float(sm) if sm is not None else None,
            mem_freq_mhz=float(mem_clock) if mem_clock is not None else None,
            gpu_mem_used_mb=mem.used / _MB if mem is not None else None,
            gpu_mem_total_mb=mem.total / _MB if mem is not None else None,
            energy_j=energy / 1000 if energy is not None else None,
            **host_stats(),
        )

    def close(self) -> None:
        super().close()
        nv, self._nvml = self._nvml, None
        if nv is not None:
            try:
                nv.nvmlShutdown()
            except nv.NVMLError:
                pass


# ----------------------------------------------------------------------------- psutil


class PsutilSource(PollingSource):
    """CPU and RAM only. Power is unknown here; never estimated."""

    name = "psutil"
    power_note = "power unknown: the psutil source reads CPU and RAM only (no power sensor on this host)"

    def open(self) -> None:
        host_stats()

    def poll(self) -> Sample:
        return Sample(t=time.monotonic(), temps_c=_psutil_temps(), **host_stats())


def _psutil_temps() -> dict[str, float]:
    read = getattr(psutil, "sensors_temperatures", None)  # absent on macOS/Windows
    if read is None:
        return {}
    try:
        chips = read()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for chip, entries in chips.items():
        for i, e in enumerate(entries):
            if e.current is not None:
                out[f"{chip}.{e.label or i}".lower()] = float(e.current)
    return out


# ----------------------------------------------------------------------------- selection


def make_source(kind: str, interval_s: float = 0.1) -> Source:
    """An unopened source of ``kind`` (tegrastats | jtop | nvml | psutil)."""
    if kind == "tegrastats":
        return TegrastatsSource(interval_s)
    if kind == "jtop":
        # The service runs one rate for all clients: if another client came first, its
        # interval wins (jetson-stats logs a warning), so samples may be sparser than asked.
        return JtopSource(interval_s)
    if kind == "nvml":
        return NvmlSource(interval_s)
    if kind == "psutil":
        return PsutilSource(interval_s)
    raise ValueError(f"unknown monitoring source {kind!r}; choose one of {', '.join(SOURCE_KINDS)}")


def open_source(
    kind: str = "auto",
    interval_s: float = 0.1,
    *,
    root: str | os.PathLike[str] = "/",
    board: BoardInfo | None = None,
) -> tuple[Source, list[str]]:
    """Open a source and return it with notes on what was tried.

    ``auto``: on a Jetson tegrastats, then jtop; elsewhere NVML; psutil as the last resort
    (power unknown). An explicit kind that cannot run raises SourceUnavailable.
    """
    if kind != "auto":
        src = make_source(kind, interval_s)
        src.open()
        return src, []
    board = board or detect_board(root)
    order = ["tegrastats", "jtop"] if board.on_jetson else ["nvml"]
    notes: list[str] = []
    for candidate in order:
        src = make_source(candidate, interval_s)
        try:
            src.open()
        except SourceUnavailable as e:
            notes.append(f"{candidate}: {e}")
            continue
        return src, notes
    src = make_source("psutil", interval_s)
    src.open()
    notes.append(PsutilSource.power_note)
    return src, notes
