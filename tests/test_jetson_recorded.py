"""Recorded Jetson output through the path `bitmtp bench` uses: tegrastats line -> Sample
(W, MB, MHz, °C) -> window statistics and notes.

tests/test_tegrastats.py pins every field the parser reads from each recorded line; this
file checks the units of what the sampler hands to the benchmark report, and that output the
parser cannot read is named in the window's notes instead of vanishing. All lines are
verbatim recordings (sources in tests/fixtures/jetson/tegrastats/README.md, or next to them).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bitmtp_edge.jetson.monitor import Sampler, parse_tegrastats
from bitmtp_edge.jetson.monitor.sources import sample_from_tegrastats
from tests.test_monitor_sampler import _wait_for, put_fake_tegrastats_on_path

FIXTURES = Path(__file__).parent / "fixtures" / "jetson"
RECORDINGS = FIXTURES / "tegrastats"


def recorded(name: str, index: int = 0) -> str:
    lines = [ln for ln in (RECORDINGS / name).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return lines[index]


# tegrastats' own help text, as quoted in a public Rust source comment (docs/jetson.md §tegrastats
# flags; repository not recorded): what a tegrastats that rejects its arguments prints instead of samples.
TEGRASTATS_USAGE = """\
   Usage: tegrastats [-option]
   Options:
       --help                  : print this help screen
       --interval <millisec>   : sample the information in <milliseconds>
       --logfile  <filename>   : dump the output of tegrastats to <filename>
       --load_cfg <filename>   : load the information from <filename>
       --readall               : collect all stats including performance intensive stats
       --save_cfg <filename>   : save the information to <filename>
       --start                 : run tegrastats as a daemon process in the background
       --stop                  : stop any running instances of tegrastats
       --verbose               : print verbose message
"""


# --------------------------------------------------------------------------- units of a Sample

# (file, line index) -> what the benchmark reads from the Sample, in its units, by hand.
SAMPLE_UNITS = {
    # Orin Nano JP6 root: VDD_IN is the total; 12479 mW is 12.479 W
    ("orin_nano_jp6.txt", 0): dict(power_w=12.479,
                                   rails_w={"VDD_IN": 12.479, "VDD_CPU_GPU_CV": 4.667, "VDD_SOC": 2.817},
                                   gpu_freq_mhz=621, mem_freq_mhz=2133, cpu_freq_mhz=729, gpu_load_pct=63,
                                   ram_used_mb=6185, ram_total_mb=7620),
    # Orin NX JP5, four cores off: load averages the online cores only
    ("orin_nx_16gb_jp5.txt", 0): dict(power_w=5.299, cpu_load_pct=(6 + 9 + 5 + 16) / 4, cpu_freq_mhz=729,
                                      gpu_freq_mhz=611, mem_freq_mhz=2133, ram_total_mb=15388),
    # AGX Orin JP6 non-root: no input rail (sum of rails), no EMC / GPU clock
    ("agx_orin_64gb_jp6.txt", 1): dict(power_w=4.940 + 0.988 + 4.442, mem_freq_mhz=None, gpu_freq_mhz=None,
                                       cpu_freq_mhz=2201, ram_total_mb=62840),
    # TX2 JP4: power printed without a unit is still mW
    ("tx2_jp4.txt", 0): dict(power_w=3.140, mem_freq_mhz=None, cpu_freq_mhz=345, ram_total_mb=7852),
    # AGX Xavier JP4: "CPU 311/311" is a rail and part of the total
    ("agx_xavier_jp4.txt", 0): dict(power_w=0.311 + 0.932 + 0.621 + 1.482,
                                    rails_w={"GPU": 0.0, "CPU": 0.311, "SOC": 0.932, "CV": 0.0,
                                             "VDDRQ": 0.621, "SYS5V": 1.482},
                                    cpu_freq_mhz=1190, gpu_freq_mhz=318, mem_freq_mhz=665),
    # Nano JP4: IRAM 0/252kB must not be read as RAM; POM_5V_IN is the total
    ("nano_jp4.txt", 0): dict(power_w=1.022, ram_used_mb=534, ram_total_mb=3964, cpu_freq_mhz=204),
}


@pytest.mark.parametrize("key", list(SAMPLE_UNITS), ids=lambda k: f"{k[0]}:{k[1]}")
def test_sample_units_from_recorded_lines(key):
    s = sample_from_tegrastats(parse_tegrastats(recorded(*key)), t=1.0)
    for name, want in SAMPLE_UNITS[key].items():
        got = getattr(s, name)
        if isinstance(want, dict):
            assert got == pytest.approx(want), name
        elif want is None:
            assert got is None, name
        else:
            assert got == pytest.approx(want), name


def test_peak_temperature_leaves_out_offline_and_placeholder_sensors():
    # AGX Orin JP5 root: CV0/CV1/CV2/GPU at -256C are offline; TX2's PMIC@100C is a constant
    agx = sample_from_tegrastats(parse_tegrastats(recorded("agx_orin_64gb_jp5.txt")), t=0.0)
    assert max(agx.temps_c.values()) == 44.562 and "gpu" not in agx.temps_c
    tx2 = sample_from_tegrastats(parse_tegrastats(recorded("tx2_jp4.txt")), t=0.0)
    assert max(tx2.temps_c.values()) == 42.5 and "pmic" not in tx2.temps_c


# --------------------------------------------------------------------------- unreadable output


@pytest.fixture
def fake_tegrastats(tmp_path, monkeypatch):
    """tests/fixtures/jetson/bin/tegrastats first on PATH; returns a function that sets what it replays."""
    put_fake_tegrastats_on_path(tmp_path, monkeypatch)

    def replay(text: str | bytes) -> None:
        lines = tmp_path / "lines.txt"
        lines.write_bytes(text if isinstance(text, bytes) else text.encode())
        monkeypatch.setenv("FAKE_TEGRASTATS_LINES", str(lines))

    return replay


def test_window_of_unreadable_output_says_what_was_skipped(fake_tegrastats):
    # Nothing parseable: the window used to say only "did the sampler start before the window?"
    fake_tegrastats(TEGRASTATS_USAGE)
    with Sampler("tegrastats", interval_s=0.01) as sampler:
        assert _wait_for(lambda: sampler.source.skipped_lines >= 3)
        start = time.monotonic()
        time.sleep(0.1)
        stats = sampler.mark_window(start, time.monotonic(), wait_s=0.05)
    assert stats.n_samples == 0 and stats.energy_j is None
    skipped = [n for n in stats.notes if "not tegrastats samples" in n]
    assert len(skipped) == 1, stats.notes
    usage = [ln.strip() for ln in TEGRASTATS_USAGE.splitlines()]
    assert "were skipped (last: " in skipped[0]
    assert any(repr(ln) in skipped[0] for ln in usage), skipped[0]  # quotes the line it could not read


def test_unreadable_lines_between_samples_are_named_and_energy_still_counts(fake_tegrastats):
    # One real Orin Nano sample (VDD_IN 12479 mW) between the usage text lines, cycling.
    fake_tegrastats(TEGRASTATS_USAGE + recorded("orin_nano_jp6.txt") + "\n")
    with Sampler("tegrastats", interval_s=0.01) as sampler:
        assert _wait_for(lambda: len(sampler.samples) >= 2)
        start = time.monotonic()
        time.sleep(0.15)
        end = time.monotonic()
        stats = sampler.mark_window(start, end)
    assert any("not tegrastats samples and were skipped" in n for n in stats.notes), stats.notes
    assert stats.energy_j == pytest.approx(12.479 * (end - start), rel=1e-9)  # constant power held


def test_a_window_without_skipped_lines_has_no_such_note(fake_tegrastats):
    fake_tegrastats(recorded("orin_nano_jp6.txt") + "\n")
    with Sampler("tegrastats", interval_s=0.01) as sampler:
        assert _wait_for(lambda: len(sampler.samples) >= 2)
        start = time.monotonic()
        time.sleep(0.05)
        stats = sampler.mark_window(start, time.monotonic())
    assert not any("skipped" in n for n in stats.notes), stats.notes


def test_a_byte_that_is_not_utf8_is_one_skipped_line_not_the_end_of_the_readings(fake_tegrastats):
    # A reader decoding strictly died on the first such byte, silently: no sample after it.
    fake_tegrastats(b"kernel: \xff\xfe garbled\n" + recorded("orin_nano_jp6.txt").encode() + b"\n")
    with Sampler("tegrastats", interval_s=0.01) as sampler:
        assert _wait_for(lambda: len(sampler.samples) >= 3), "the reader stopped at the undecodable byte"
        assert sampler.source.skipped_lines >= 1
