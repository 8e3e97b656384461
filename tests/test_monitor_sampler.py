"""The Sampler, its sources and window statistics, on CPU only.

The tegrastats path runs end to end against a fake ``tegrastats`` (a Python script,
tests/fixtures/jetson/bin/tegrastats) put first on PATH: it replays recorded tegrastats lines
at its ``--interval`` and logs how it was invoked, so the test can check that the Sampler
spawned its own child, killed only that child, and never ran ``tegrastats --stop``.
NVML and jtop are exercised through stand-in modules injected into ``sys.modules``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from bitmtp_edge.jetson.board import detect_board
from bitmtp_edge.jetson.monitor import (
    JtopSource,
    NvmlSource,
    Sample,
    Sampler,
    Source,
    SourceUnavailable,
    TegrastatsSource,
    integrate_energy,
    open_source,
    summarize_window,
)

FIXTURES = Path(__file__).parent / "fixtures" / "jetson"
NANO_LINES = FIXTURES / "tegrastats" / "orin_nano_jp6.txt"
# VDD_IN of the four lines in orin_nano_jp6.txt, in W
NANO_VDD_IN_W = {12.479, 4.824, 4.761, 6.626}


# --------------------------------------------------------------------------- pure maths


def test_integrate_energy_by_hand():
    points = [(0.0, 10.0), (1.0, 20.0), (2.0, 20.0), (3.0, 0.0)]
    # p(0.5) = 15, p(2.5) = 10: 0.5*(15+20)/2 + 1*(20+20)/2 + 0.5*(20+10)/2 = 8.75 + 20 + 7.5
    assert integrate_energy(points, 0.5, 2.5) == pytest.approx(36.25)
    assert integrate_energy(points, 0.0, 3.0) == pytest.approx(15 + 20 + 10)
    # a window inside one interval is charged for its own duration only: p(1.2)=p(1.4)=20
    assert integrate_energy(points, 1.2, 1.4) == pytest.approx(4.0)
    # beyond the samples the edge value is held
    assert integrate_energy(points, -1.0, 0.0) == pytest.approx(10.0)
    assert integrate_energy(points, 3.0, 4.0) == pytest.approx(0.0)
    assert integrate_energy([], 0, 1) is None
    assert integrate_energy(points, 2.0, 1.0) is None


class ReplaySource(Source):
    """Deterministic source: hands out prepared samples, then ends."""

    name = "replay"
    interval_s = 0.5

    def __init__(self, samples):
        self._samples = list(samples)
        self.closed = False

    def open(self):
        pass

    def read(self):
        return self._samples.pop(0) if self._samples and not self.closed else None

    def close(self):
        self.closed = True


def test_mark_window_on_a_deterministic_source():
    samples = [
        Sample(t=100.0, power_w=10.0, temps_c={"tj": 50.0}, gpu_freq_mhz=306, ram_used_mb=1000),
        Sample(t=100.5, power_w=20.0, temps_c={"tj": 61.5, "gpu": 58.0}, gpu_freq_mhz=1020, ram_used_mb=3000),
        Sample(t=101.0, power_w=20.0, temps_c={"tj": 60.0}, gpu_freq_mhz=1020, ram_used_mb=2500),
        Sample(t=101.5, power_w=0.0, temps_c={"tj": 70.0}, gpu_freq_mhz=612, ram_used_mb=1200),
        Sample(t=102.0, power_w=5.0, temps_c={"tj": 99.0}, gpu_freq_mhz=100, ram_used_mb=9999),
    ]
    sampler = Sampler(ReplaySource(samples)).start()
    sampler._thread.join(timeout=5)
    stats = sampler.mark_window(100.25, 101.25)
    sampler.stop()
    # p(100.25)=15, p(101.25)=10: 0.25*(15+20)/2 + 0.5*20 + 0.25*(20+10)/2 = 4.375 + 10 + 3.75
    assert stats.energy_j == pytest.approx(18.125)
    assert stats.avg_power_w == pytest.approx(18.125)  # the window is 1 s long
    assert stats.duration_s == pytest.approx(1.0)
    assert stats.n_samples == 2 and stats.source == "replay"
    assert stats.peak_power_w == 20.0
    # peaks include the first sample after the window (it covers the window's tail), not later ones
    assert stats.peak_temps_c == {"tj": 70.0, "gpu": 58.0} and stats.max_temp_c == 70.0
    assert stats.clocks_mhz == {"gpu": (612, 1020)}
    assert stats.peak_ram_used_mb == 3000
    assert stats.joules_per_token(29) == pytest.approx(18.125 / 29)
    assert stats.tokens_per_joule(29) == pytest.approx(29 / 18.125)
    assert stats.notes == ()
    assert stats.to_dict()["clocks_mhz"] == {"gpu": {"min": 612, "max": 1020}}


def test_window_without_power_says_so():
    samples = [Sample(t=1.0, cpu_load_pct=10.0, ram_used_mb=100), Sample(t=2.0, cpu_load_pct=30.0, ram_used_mb=150)]
    stats = summarize_window(samples, 1.0, 2.0, "psutil", "power unknown: no sensor")
    assert stats.energy_j is None and stats.avg_power_w is None and stats.joules_per_token(10) is None
    assert stats.notes == ("power unknown: no sensor",)
    assert summarize_window([], 0.0, 1.0, "x").notes[-1].startswith("no samples were recorded")
    edge = summarize_window([Sample(t=5.0, power_w=3.0)], 4.0, 6.0, "x")
    assert edge.energy_j == pytest.approx(6.0) and "do not bracket" in edge.notes[0]
    with pytest.raises(ValueError, match="before its start"):
        summarize_window(samples, 2.0, 1.0)


def test_nvml_energy_counter_over_window():
    samples = [Sample(t=t, power_w=100.0, energy_j=1000.0 + 100.0 * t) for t in (0.0, 1.0, 2.0, 3.0)]
    stats = summarize_window(samples, 1.0, 2.0, "nvml")
    assert stats.energy_j == pytest.approx(100.0) and stats.energy_counter_j == pytest.approx(100.0)
    # the counter is interpolated at the window's edges, not read at the nearest samples
    assert summarize_window(samples, 0.5, 2.25, "nvml").energy_counter_j == pytest.approx(175.0)
    assert summarize_window(samples, 0.5, 3.5, "nvml").energy_counter_j is None  # not bracketed


# --------------------------------------------------------------------------- fake tegrastats


def put_fake_tegrastats_on_path(tmp_path, monkeypatch) -> Path:
    """tests/fixtures/jetson/bin/tegrastats first on PATH (under tmp_path); returns its path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "tegrastats"
    script = (FIXTURES / "bin" / "tegrastats").read_text().split("\n", 1)[1]
    # This interpreter, whatever `python3` on PATH is; executable even if git lost the bit.
    exe.write_text(f"#!{sys.executable}\n{script}")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return exe


@pytest.fixture
def fake_tegrastats(tmp_path, monkeypatch):
    """Put the fake tegrastats first on PATH; returns (its path, its invocation log)."""
    exe = put_fake_tegrastats_on_path(tmp_path, monkeypatch)
    log = tmp_path / "tegrastats.log"
    monkeypatch.setenv("FAKE_TEGRASTATS_LOG", str(log))
    monkeypatch.setenv("FAKE_TEGRASTATS_LINES", str(NANO_LINES))
    return exe, log


def _wait_for(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def _hand_energy(samples, start, end):
    """Straight-line trapezoids over the samples, interpolating the two edge powers."""
    pts = [(s.t, s.power_w) for s in samples]
    before = max(i for i, (t, _) in enumerate(pts) if t <= start)
    after = min(i for i, (t, _) in enumerate(pts) if t >= end)
    (t0, p0), (t1, p1) = pts[before], pts[before + 1]
    p_start = p0 + (p1 - p0) * (start - t0) / (t1 - t0)
    (t0, p0), (t1, p1) = pts[after - 1], pts[after]
    p_end = p0 + (p1 - p0) * (end - t0) / (t1 - t0)
    inner = [(t, p) for t, p in pts if start < t < end]
    knots = [(start, p_start), *inner, (end, p_end)]
    return sum((tb - ta) * (pa + pb) / 2 for (ta, pa), (tb, pb) in zip(knots, knots[1:]))


def test_sampler_tegrastats_end_to_end_kills_only_its_own_child(fake_tegrastats):
    exe, log = fake_tegrastats
    # Someone else's tegrastats, already running: the Sampler must leave it alone.
    other = subprocess.Popen([str(exe), "--interval", "50"], stdout=subprocess.DEVNULL)
    try:
        sampler = Sampler("tegrastats", interval_s=0.02).start()
        assert isinstance(sampler.source, TegrastatsSource) and sampler.source.running
        ours = sampler.source.pid
        assert _wait_for(lambda: len(sampler.samples) >= 2), "no samples from tegrastats"
        with sampler.window() as w:
            time.sleep(0.15)
        sampler.stop()

        assert not sampler.source.running
        with pytest.raises(ProcessLookupError):
            os.kill(ours, 0)  # terminated and reaped
        assert other.poll() is None, "another user's tegrastats was killed"
        invocations = log.read_text().splitlines()
        assert f"{ours} --interval 20" in invocations
        assert not any("--stop" in line for line in invocations)

        samples = sampler.samples
        assert {s.power_w for s in samples} <= NANO_VDD_IN_W
        assert all(a.t < b.t for a, b in zip(samples, samples[1:]))
        first = samples[0]
        assert first.ram_total_mb == 7620 and first.rails_w["VDD_IN"] in NANO_VDD_IN_W
        assert first.temps_c["tj"] in {53.968, 50.25, 49.156, 50.562}

        stats = w.stats
        assert stats.source == "tegrastats" and stats.n_samples >= 3
        assert stats.energy_j == pytest.approx(_hand_energy(samples, w.start, w.end), rel=1e-9)
        assert 4.761 * stats.duration_s <= stats.energy_j <= 12.479 * stats.duration_s
        assert stats.avg_power_w == pytest.approx(stats.energy_j / (w.end - w.start))
        assert stats.peak_temps_c["tj"] <= 53.968 and stats.notes == ()
        assert set(stats.clocks_mhz) >= {"cpu"}
    finally:
        other.terminate()  # ours to clean up: started by this test
        other.wait(timeout=5)


def test_constant_power_gives_power_times_duration(fake_tegrastats, tmp_path, monkeypatch):
    lines = tmp_path / "constant.txt"
    lines.write_text(
        "NVPM WARN: something that is not a tegrastats line\n"
        "RAM 779/7620MB CPU [0%@1344,0%@1344] GR3D_FREQ 0% tj@50C VDD_IN 5000mW/5000mW VDD_SOC 1000mW/1000mW\n"
    )
    monkeypatch.setenv("FAKE_TEGRASTATS_LINES", str(lines))
    with Sampler("tegrastats", interval_s=0.01) as sampler:
        assert _wait_for(lambda: len(sampler.samples) >= 2)
        start = time.monotonic()
        time.sleep(0.1)
        end = time.monotonic()
        stats = sampler.mark_window(start, end)
    assert stats.energy_j == pytest.approx(5.0 * (end - start), rel=1e-9)
    assert stats.avg_power_w == pytest.approx(5.0)
    assert sampler.source.skipped_lines >= 1 and sampler.source.last_skipped.startswith("NVPM WARN")


def test_tegrastats_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    if os.path.exists("/usr/bin/tegrastats"):
        pytest.skip("a real tegrastats is installed")
    with pytest.raises(SourceUnavailable, match="tegrastats not found"):
        Sampler("tegrastats").start()


def test_tegrastats_that_dies_is_reported_in_the_window(fake_tegrastats, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TEGRASTATS_LINES", str(tmp_path / "does-not-exist.txt"))
    with Sampler("tegrastats", interval_s=0.01) as sampler:
        assert _wait_for(lambda: not sampler.running)  # the source ended by itself
        t = time.monotonic()
        stats = sampler.mark_window(t - 0.05, t)
    assert stats.energy_j is None
    assert any("tegrastats exited with code 1" in n for n in stats.notes)


def test_auto_picks_tegrastats_on_a_jetson_fixture(fake_tegrastats):
    root = FIXTURES / "boards" / "orin-nano-super" / "root"
    source, notes = open_source("auto", 0.02, root=root)
    try:
        assert isinstance(source, TegrastatsSource) and notes == []
    finally:
        source.close()
    assert not source.running


# --------------------------------------------------------------------------- this machine


def test_auto_on_this_machine_without_gpu_is_psutil_with_power_unknown():
    if detect_board().on_jetson:
        pytest.skip("this machine is a Jetson")
    with Sampler("auto", interval_s=0.02) as sampler:
        if sampler.source_name == "nvml":
            pytest.skip("this machine has an NVIDIA GPU")
        assert sampler.source_name == "psutil"
        assert _wait_for(lambda: len(sampler.samples) >= 2)
        with sampler.window() as w:
            time.sleep(0.05)
    s = sampler.samples[-1]
    assert s.power_w is None and s.ram_total_mb > 0 and s.cpu_load_pct is not None
    assert sampler.power_note.startswith("power unknown")
    assert any(n.startswith("nvml:") for n in sampler.notes)
    assert w.stats.energy_j is None and w.stats.notes[0].startswith("power unknown")
    assert w.stats.peak_ram_used_mb > 0


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown monitoring source 'tegra'"):
        Sampler("tegra").start()


# --------------------------------------------------------------------------- NVML / jtop stand-ins


def _fake_pynvml(fail_init=False):
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    m.NVMLError = NVMLError
    m.NVML_TEMPERATURE_GPU, m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM = 0, 1, 2
    m.calls = []

    def init():
        if fail_init:
            raise NVMLError("Driver Not Loaded")
        m.calls.append("init")

    def unsupported(h):
        raise NVMLError("Not Supported")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: 1
    m.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H200"
    m.nvmlDeviceGetPowerUsage = lambda h: 350_000
    m.nvmlDeviceGetTotalEnergyConsumption = unsupported
    m.nvmlDeviceGetTemperature = lambda h, kind: 61
    m.nvmlDeviceGetClockInfo = lambda h, kind: {1: 1980, 2: 3201}[kind]
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2 * 1024**3, total=141 * 1024**3)
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=97, memory=80)
    return m


def test_nvml_source_maps_readings(monkeypatch):
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    src = NvmlSource(interval_s=0.01)
    src.open()
    s = src.poll()
    src.close()
    assert src.gpu_name == "NVIDIA H200" and fake.calls == ["init", "shutdown"]
    assert s.power_w == 350.0 and s.temps_c == {"gpu": 61.0} and s.gpu_load_pct == 97.0
    assert (s.gpu_freq_mhz, s.mem_freq_mhz) == (1980.0, 3201.0)
    assert s.gpu_mem_used_mb == 2048.0 and s.gpu_mem_total_mb == 141 * 1024
    assert s.energy_j is None  # unsupported on this "GPU": None, not an error
    assert s.ram_total_mb > 0  # host RAM from psutil
    assert src.read() is None  # closed


def test_nvml_prefers_instantaneous_power_field(monkeypatch):
    # GetPowerUsage is a 1 s average on recent GPUs; the POWER_INSTANT field is used when present.
    fake = _fake_pynvml()
    fake.NVML_FI_DEV_POWER_INSTANT = 186
    value = types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(uiVal=410_000))
    fake.nvmlDeviceGetFieldValues = lambda h, fields: [value] if fields == [186] else []
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    src = NvmlSource()
    src.open()
    assert src.poll().power_w == 410.0
    value.nvmlReturn = 3  # NVML_ERROR_NOT_SUPPORTED at some later poll: fall back to the average
    assert src.poll().power_w == 350.0
    src.close()


def test_nvml_without_driver_falls_back_to_psutil_in_auto(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_init=True))
    source, notes = open_source("auto", 0.02, root=tmp_path)  # empty root: not a Jetson
    source.close()
    assert source.name == "psutil"
    assert notes[0] == "nvml: NVML did not initialise (Driver Not Loaded): no NVIDIA driver on this host"
    with pytest.raises(SourceUnavailable, match="Driver Not Loaded"):
        open_source("nvml")


def _fake_jtop(service_up=True):
    m = types.ModuleType("jtop")

    class JtopException(Exception):
        pass

    class jtop:  # noqa: N801 - the real class name
        def __init__(self, interval=1.0):
            self.interval = interval
            self.closed = False

        def start(self):
            if not service_up:
                raise JtopException("The jtop.service is not active. Please run:\nsudo jtop --install-service")

        def ok(self, spin=False):
            return not self.closed

        def close(self):
            self.closed = True

        stats = {"CPU1": 10, "CPU2": 30, "CPU3": "OFF", "GPU": 55.5, "Temp tj": 48.5, "Temp cv0": -256,
                 "Power TOT": 7200, "RAM": 0.4}
        power = {"rail": {"VDD_IN": {"power": 7200}, "VDD_SOC": {"power": 1500}, "NC": {"power": 0}},
                 "tot": {"power": 7200}}
        memory = {"RAM": {"used": 3_000_000, "tot": 7_800_000}}

    m.jtop, m.JtopException = jtop, JtopException
    return m


def test_jtop_source_maps_stats(monkeypatch):
    monkeypatch.setitem(sys.modules, "jtop", _fake_jtop())
    src = JtopSource(interval_s=0.5)
    src.open()
    s = src.read()
    src.close()
    assert s.power_w == 7.2 and s.rails_w == {"VDD_IN": 7.2, "VDD_SOC": 1.5}
    assert s.temps_c == {"tj": 48.5} and s.gpu_load_pct == 55.5 and s.cpu_load_pct == 20.0
    assert s.ram_used_mb == pytest.approx(3_000_000 / 1024)
    assert src.read() is None


def test_jtop_service_down_is_unavailable_and_auto_moves_on(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "jtop", _fake_jtop(service_up=False))
    monkeypatch.setenv("PATH", str(tmp_path))  # no tegrastats either (a container)
    if os.path.exists("/usr/bin/tegrastats"):
        pytest.skip("a real tegrastats is installed")
    with pytest.raises(SourceUnavailable, match="jtop service did not answer"):
        JtopSource().open()
    root = FIXTURES / "boards" / "orin-nx-16gb" / "root"
    source, notes = open_source("auto", 0.02, root=root)
    source.close()
    assert source.name == "psutil"
    assert [n.split(":")[0] for n in notes] == ["tegrastats", "jtop", "power unknown"]
