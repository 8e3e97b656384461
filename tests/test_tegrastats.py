"""parse_tegrastats against every recorded line of tests/fixtures/jetson/tegrastats/.

Each recorded line (public sources in that folder's README.md) is checked against its
expected values, written out by hand below; a guard test fails when a file there holds a
line without expected values here. Variants no recording covers are pinned by ``GRAMMAR_*``
lines constructed from the format description in docs/jetson.md §tegrastats (not
recordings): runs of spaces, negative rails, JP7 three-value power and cur/max temps,
Thor's load-less GPU and EMC, unknown tokens.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmtp_edge.jetson.monitor import TegrastatsParseError, TegrastatsSample, parse_tegrastats

# --------------------------------------------------------------------------- recorded lines

RECORDINGS = Path(__file__).parent / "fixtures" / "jetson" / "tegrastats"


def recorded_lines(name: str) -> list[str]:
    """The lines of one recording file (blank and '#' lines are comments, as bin/tegrastats reads them)."""
    text = (RECORDINGS / name).read_text()
    return [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


A_NANO_JP6_ROOT, B_NANO_JP6_USER, C1_NANO_SUPER_UNLOCKED, C2_NANO_SUPER_LOCKED = recorded_lines("orin_nano_jp6.txt")
D1_NX_IDLE, D2_NX_LOADED = recorded_lines("orin_nx_16gb_jp6.txt")
(E_NX_JP5,) = recorded_lines("orin_nx_16gb_jp5.txt")
(G1_AGX_JP5,) = recorded_lines("agx_orin_64gb_jp5.txt")
G2_AGX_R3644, H_AGX_JP6_USER = recorded_lines("agx_orin_64gb_jp6.txt")
(I_EMULATOR_TEMPLATE,) = recorded_lines("agx_orin_32gb_jp5_emulator.txt")  # shell placeholders left in
(L1_TX2,) = recorded_lines("tx2_jp4.txt")
(L2_XAVIER_NX,) = recorded_lines("xavier_nx_jp4.txt")
(L3_AGX_XAVIER,) = recorded_lines("agx_xavier_jp4.txt")
(L4_NANO,) = recorded_lines("nano_jp4.txt")

NANO_TEMPS_A = {"cpu": 53.968, "soc2": 52.437, "soc0": 50.75, "gpu": 53.343, "tj": 53.968, "soc1": 51.656}

# line -> every field of TegrastatsSample that the line determines, written out by hand.
EXPECTED: dict[str, dict] = {
    A_NANO_JP6_ROOT: dict(
        timestamp="11-15-2024 08:38:09", ram_used_mb=6185, ram_total_mb=7620,
        swap_used_mb=851, swap_total_mb=3810, swap_cached_mb=1,
        cpu_load=[15, 11, 14, 13, 11, 8], cpu_freq_mhz=[729] * 6,
        emc_load_pct=43, emc_freq_mhz=2133, gpu_load_pct=63, gpu_freq_mhz=621, gpu_gpc_freq_mhz=[621],
        temps_c=NANO_TEMPS_A, temps_max_c={},
        power_mw={"VDD_IN": 12479, "VDD_CPU_GPU_CV": 4667, "VDD_SOC": 2817},
        power_avg_mw={"VDD_IN": 12479, "VDD_CPU_GPU_CV": 4667, "VDD_SOC": 2817}, power_max_mw={},
        total_power_mw=12479, total_power_avg_mw=12479, total_power_rail="VDD_IN",
    ),
    B_NANO_JP6_USER: dict(
        timestamp="06-18-2025 11:25:24", ram_used_mb=3452, ram_total_mb=7620,
        swap_used_mb=1518, swap_total_mb=16384, swap_cached_mb=174,
        cpu_load=[1, 2, 0, 2, 2, 1], cpu_freq_mhz=[1420, 1420, 1420, 1420, 729, 729],
        emc_load_pct=None, emc_freq_mhz=None,  # non-root: no EMC_FREQ
        gpu_load_pct=0, gpu_freq_mhz=None, gpu_gpc_freq_mhz=[],  # non-root: no GPU clock
        temps_c={"cpu": 50.031, "soc2": 49.031, "soc0": 50.0, "gpu": 49.031, "tj": 50.25, "soc1": 50.25},
        power_mw={"VDD_IN": 4824, "VDD_CPU_GPU_CV": 518, "VDD_SOC": 1475},
        power_avg_mw={"VDD_IN": 4824, "VDD_CPU_GPU_CV": 518, "VDD_SOC": 1475},
        total_power_mw=4824, total_power_rail="VDD_IN",
    ),
    C1_NANO_SUPER_UNLOCKED: dict(
        timestamp="04-27-2026 14:59:41", ram_used_mb=775, ram_total_mb=7620,
        swap_used_mb=0, swap_total_mb=3810, swap_cached_mb=0,
        cpu_load=[1, 0, 0, 0, 0, 0], cpu_freq_mhz=[729] * 6,
        emc_load_pct=None, emc_freq_mhz=None, gpu_load_pct=0, gpu_freq_mhz=None,
        temps_c={"cpu": 48.468, "soc2": 47.531, "soc0": 48.062, "gpu": 48.562, "tj": 49.156, "soc1": 49.156},
        power_mw={"VDD_IN": 4761, "VDD_CPU_GPU_CV": 515, "VDD_SOC": 1428},
        power_avg_mw={"VDD_IN": 4778, "VDD_CPU_GPU_CV": 501, "VDD_SOC": 1428},
        total_power_mw=4761, total_power_avg_mw=4778, total_power_rail="VDD_IN",
    ),
    C2_NANO_SUPER_LOCKED: dict(
        timestamp="04-27-2026 15:00:54", ram_used_mb=779, ram_total_mb=7620,
        cpu_load=[0] * 6, cpu_freq_mhz=[1344] * 6, gpu_load_pct=0, gpu_freq_mhz=None,
        temps_c={"cpu": 50.125, "soc2": 49.125, "soc0": 49.25, "gpu": 50.562, "tj": 50.562, "soc1": 50.437},
        power_mw={"VDD_IN": 6626, "VDD_CPU_GPU_CV": 1228, "VDD_SOC": 2380},
        power_avg_mw={"VDD_IN": 6625, "VDD_CPU_GPU_CV": 1230, "VDD_SOC": 2380},
        total_power_mw=6626, total_power_avg_mw=6625, total_power_rail="VDD_IN",
    ),
    D1_NX_IDLE: dict(
        timestamp="07-16-2026 13:03:45", ram_used_mb=1224, ram_total_mb=15656,
        swap_used_mb=0, swap_total_mb=7828, swap_cached_mb=0,
        cpu_load=[1, 0, 0, 0, 0, 0, 0, 0], cpu_freq_mhz=[729] * 8,
        emc_freq_mhz=None, gpu_load_pct=0, gpu_freq_mhz=None,
        temps_c={"cv0": 41.156, "cpu": 45.843, "soc2": 39.593, "soc0": 42.562, "cv1": 42.156,
                 "gpu": 43.406, "tj": 45.843, "soc1": 40.25, "cv2": 38.593},
        power_mw={"VDD_IN": 4304, "VDD_CPU_GPU_CV": 573, "VDD_SOC": 1218},
        total_power_mw=4304, total_power_rail="VDD_IN",
    ),
    D2_NX_LOADED: dict(
        timestamp="08-21-2026 18:23:24", ram_used_mb=6238, ram_total_mb=15656,
        swap_used_mb=3109, swap_total_mb=7828, swap_cached_mb=5,
        cpu_load=[23, 9, 20, 10, 7, 7, 8, 100], cpu_freq_mhz=[1984] * 8,
        gpu_load_pct=7, gpu_freq_mhz=None,
        temps_c={"cv0": 54.375, "cpu": 56.531, "soc2": 53.906, "soc0": 55.062, "cv1": 54.062,
                 "gpu": 54.0, "tj": 56.531, "soc1": 56.281, "cv2": 54.343},
        power_mw={"VDD_IN": 8820, "VDD_CPU_GPU_CV": 3159, "VDD_SOC": 2175},
        power_avg_mw={"VDD_IN": 8217, "VDD_CPU_GPU_CV": 3123, "VDD_SOC": 1933},
        total_power_mw=8820, total_power_avg_mw=8217, total_power_rail="VDD_IN",
    ),
    E_NX_JP5: dict(
        timestamp=None, ram_used_mb=6334, ram_total_mb=15388, swap_used_mb=491, swap_total_mb=7694,
        cpu_load=[6, 9, 5, 16, None, None, None, None],
        cpu_freq_mhz=[729, 729, 729, 729, None, None, None, None],
        emc_load_pct=0, emc_freq_mhz=2133, gpu_load_pct=0, gpu_freq_mhz=611, gpu_gpc_freq_mhz=[],
        temps_c={"cv0": 45.812, "cpu": 47.937, "soc2": 46.093, "soc0": 46.968, "cv1": 46.406,
                 "gpu": 45.875, "tj": 48.875, "soc1": 48.875, "cv2": 45.75},
        power_mw={"VDD_IN": 5299, "VDD_CPU_GPU_CV": 773, "VDD_SOC": 1424},
        total_power_mw=5299, total_power_rail="VDD_IN",
    ),
    G1_AGX_JP5: dict(
        timestamp="04-11-2025 10:36:27", ram_used_mb=4321, ram_total_mb=62801,
        swap_used_mb=19, swap_total_mb=31400, swap_cached_mb=0,
        cpu_load=[0] * 12, cpu_freq_mhz=[729] * 12,
        emc_load_pct=0, emc_freq_mhz=2133, gpu_load_pct=0, gpu_freq_mhz=0, gpu_gpc_freq_mhz=[0, 0],
        # CV0/CV1/CV2/GPU at -256C are offline and left out
        temps_c={"cpu": 44.562, "tboard": 32.0, "soc2": 40.093, "tdiode": 33.0, "soc0": 41.093,
                 "tj": 44.343, "soc1": 41.25},
        # the two NC channels are dropped; no VDD_IN on AGX Orin: total is the sum
        power_mw={"VDD_GPU_SOC": 2340, "VDD_CPU_CV": 390, "VIN_SYS_5V0": 4025, "VDDQ_VDD2_1V8AO": 301},
        total_power_mw=2340 + 390 + 4025 + 301, total_power_avg_mw=7056, total_power_rail="sum",
    ),
    G2_AGX_R3644: dict(
        timestamp="05-09-2026 18:42:06", ram_used_mb=18207, ram_total_mb=62841,
        swap_used_mb=86, swap_total_mb=31420,
        cpu_load=[14, 5, 8, 14, 46, 47, 2, 10, 4, 5, 6, 10],
        cpu_freq_mhz=[2188, 2112, 2035, 2201, 1267, 1267, 1267, 1267, 1036, 1036, 1036, 1036],
        emc_load_pct=3, emc_freq_mhz=2133, gpu_load_pct=0, gpu_freq_mhz=0, gpu_gpc_freq_mhz=[0, 0],
        temps_c={"cpu": 52.562, "soc2": 48.437, "soc0": 49.093, "tj": 52.562, "soc1": 49.656},
        power_mw={"VDD_GPU_SOC": 2412, "VDD_CPU_CV": 1607, "VIN_SYS_5V0": 4707},
        total_power_mw=2412 + 1607 + 4707, total_power_rail="sum",
    ),
    H_AGX_JP6_USER: dict(
        timestamp=None, ram_used_mb=2448, ram_total_mb=62840, swap_used_mb=0, swap_total_mb=31420,
        cpu_load=[0] * 12, cpu_freq_mhz=[2201] * 12,
        emc_load_pct=None, emc_freq_mhz=None, gpu_load_pct=0, gpu_freq_mhz=None,
        temps_c={"cpu": 42.0, "soc2": 37.843, "soc0": 39.187, "gpu": 37.75, "tj": 42.0, "soc1": 37.937},
        power_mw={"VDD_GPU_SOC": 4940, "VDD_CPU_CV": 988, "VIN_SYS_5V0": 4442},
        total_power_mw=4940 + 988 + 4442, total_power_rail="sum",
    ),
    I_EMULATOR_TEMPLATE: dict(
        timestamp="01-03-2023 16:07:54", ram_used_mb=2257, ram_total_mb=30536,
        swap_used_mb=0, swap_total_mb=15268,
        cpu_load=[None], cpu_freq_mhz=[None],  # "...%@729 x12" is a placeholder, not a reading
        emc_load_pct=0, emc_freq_mhz=204,
        gpu_load_pct=None, gpu_freq_mhz=None,  # "$RAND_GPU%@0" is not a number
        temps_c={"cpu": 41.437, "tboard": 29.0, "soc2": 39.062, "tdiode": 30.75, "soc0": 39.031,
                 "tj": 41.656, "soc1": 38.937},
        power_mw={"VDD_GPU_SOC": 2390, "VDD_CPU_CV": 796, "VIN_SYS_5V0": 3522, "VDDQ_VDD2_1V8AO": 301},
        total_power_mw=2390 + 796 + 3522 + 301, total_power_rail="sum",
    ),
    L1_TX2: dict(
        timestamp=None, ram_used_mb=2020, ram_total_mb=7852, swap_used_mb=None, swap_total_mb=None,
        cpu_load=[9, 21, 25, 3, 1, 1], cpu_freq_mhz=[345] * 6,
        emc_load_pct=0, emc_freq_mhz=None, gpu_load_pct=0, gpu_freq_mhz=None,
        # PMIC@100C is a constant placeholder and left out
        temps_c={"pll": 42.5, "mcpu": 42.5, "tboard": 40.0, "gpu": 41.0, "bcpu": 42.5,
                 "thermal": 41.9, "tdiode": 41.25},
        power_mw={"VDD_SYS_GPU": 153, "VDD_SYS_SOC": 536, "VDD_4V0_WIFI": 633, "VDD_IN": 3140,
                  "VDD_SYS_CPU": 536, "VDD_SYS_DDR": 557},
        power_avg_mw={"VDD_SYS_GPU": 158, "VDD_SYS_SOC": 547, "VDD_4V0_WIFI": 527, "VDD_IN": 3208,
                      "VDD_SYS_CPU": 590, "VDD_SYS_DDR": 601},
        total_power_mw=3140, total_power_avg_mw=3208, total_power_rail="VDD_IN",
    ),
    L2_XAVIER_NX: dict(
        ram_used_mb=4412, ram_total_mb=7772, swap_used_mb=139, swap_total_mb=3886, swap_cached_mb=2,
        cpu_load=[9, 6, 6, 5, 4, 8], cpu_freq_mhz=[1190, 1190, 1190, 1190, 1190, 1267],
        emc_load_pct=10, emc_freq_mhz=1600, gpu_load_pct=62, gpu_freq_mhz=306,
        temps_c={"ao": 41.5, "gpu": 43.0, "aux": 41.5, "cpu": 43.5, "thermal": 42.55},
        power_mw={"VDD_IN": 4067, "VDD_CPU_GPU_CV": 738, "VDD_SOC": 1353},
        total_power_mw=4067, total_power_rail="VDD_IN",
    ),
    L3_AGX_XAVIER: dict(
        ram_used_mb=721, ram_total_mb=31927, swap_used_mb=0, swap_total_mb=15963, swap_cached_mb=0,
        cpu_load=[2, 0, 0, 0, None, None, None, None], cpu_freq_mhz=[1190] * 4 + [None] * 4,
        emc_load_pct=0, emc_freq_mhz=665, gpu_load_pct=0, gpu_freq_mhz=318,
        temps_c={"ao": 37.5, "gpu": 37.5, "tdiode": 40.0, "aux": 36.0, "cpu": 37.5, "thermal": 36.9, "tboard": 37.0},
        # "CPU 311/311" is a rail here (not the core list): dropping it under-counted the total
        power_mw={"GPU": 0, "CPU": 311, "SOC": 932, "CV": 0, "VDDRQ": 621, "SYS5V": 1482},
        total_power_mw=311 + 932 + 621 + 1482, total_power_avg_mw=3346, total_power_rail="sum",
    ),
    L4_NANO: dict(
        ram_used_mb=534, ram_total_mb=3964, swap_used_mb=5, swap_total_mb=1982, swap_cached_mb=1,
        cpu_load=[16, 9, 0, 0], cpu_freq_mhz=[204] * 4,
        emc_load_pct=0, emc_freq_mhz=204, gpu_load_pct=0, gpu_freq_mhz=76,
        temps_c={"pll": 34.0, "cpu": 36.5, "gpu": 36.0, "ao": 39.5, "thermal": 36.25},  # no PMIC
        power_mw={"POM_5V_IN": 1022, "POM_5V_GPU": 0, "POM_5V_CPU": 204},
        total_power_mw=1022, total_power_avg_mw=1022, total_power_rail="POM_5V_IN",
    ),
}


def assert_fields(sample: TegrastatsSample, expected: dict) -> None:
    for name, want in expected.items():
        got = getattr(sample, name)
        assert got == want, f"{name}: got {got!r}, want {want!r}"


@pytest.mark.parametrize("line", list(EXPECTED), ids=lambda s: s[:40])
def test_verbatim_line(line):
    assert_fields(parse_tegrastats(line), EXPECTED[line])


def test_every_recorded_line_has_expected_values():
    files = sorted(RECORDINGS.glob("*.txt"))
    assert len(files) >= 8, f"recordings missing from {RECORDINGS}"
    lines = [ln for f in files for ln in recorded_lines(f.name)]
    assert len(lines) >= 13
    missing = [ln[:60] for ln in lines if ln not in EXPECTED]
    assert not missing, f"recorded lines without expected values in this file: {missing}"


# --------------------------------------------------------------------------- grammar variants
# Constructed from the format table in docs/jetson.md §tegrastats (NOT recordings): one line per variant.

GRAMMAR_AGX_JP6_MULTISPACE = (
    "05-09-2026 18:42:06 RAM 2448/30536MB (lfb 2x4MB)  SWAP 0/15268MB (cached 0MB) "
    "CPU [1%@1267,0%@1267,off,off,2%@1267,0%@1267,0%@1267,0%@1267]  EMC_FREQ 0%@2133  "
    "GR3D_FREQ 0%@[305,305]  NVENC off NVDEC off VIC off APE 174  cpu@43.5C  soc2@40C gpu@-256C  tj@43.5C "
    "VDD_GPU_SOC 1194mW/1194mW  VDD_CPU_CV 397mW/397mW VIN_SYS_5V0 2621mW/2621mW   "
    "NC 0mW/0mW VDDQ_VDD2_1V8AO 302mW/302mW NC 0mW/0mW"
)
GRAMMAR_AGX_NEGATIVE_RAIL = (
    "RAM 2448/62840MB (lfb 2x4MB) CPU [3%@2201,1%@2201] GR3D_FREQ 0% tj@42C "
    "VDD_GPU_SOC 4940mW/4940mW VDD_CPU_CV -39mW/-12mW VIN_SYS_5V0 4442mW/4442mW"
)
GRAMMAR_AGX_JP7 = (
    "03-02-2026 10:00:00 RAM 5120/62841MB (lfb 1x2MB) SWAP 0/31420MB (cached 0MB) "
    "CPU [12%@2201,8%@2201,off,off] EMC_FREQ 3%@3199 GR3D_FREQ 12%@[1300,1300] "
    "NVENC0 off NVDEC0 off PVA0_FREQ off APE 174 cpu@52.968C/52.968C soc2@48.1C/49.2C "
    "cv0@-256C/-256C tj@53.5C/54C VDD_GPU_SOC 5139mW/5139mW/5139mW VDD_CPU_CV 1607mW/1500mW/1700mW "
    "VIN_SYS_5V0 4707mW/4707mW/4707mW"
)
GRAMMAR_THOR = (
    "03-02-2026 10:00:00 RAM 9000/125749MB (lfb 1x2MB) CPU [0%,5%,off]@2601 EMC_FREQ @4266 "
    "GR3D_FREQ @[1574,1574,1574] NVENC0_FREQ @1691 cpu@51C/55.5C gpu@48C/60C tj@52C/61C "
    "VDD_GPU 37939mW/8660mW/37939mW VDD_CPU_SOC_MSS 9000mW/8000mW/9500mW VIN_SYS_5V0 5000mW/5000mW/5000mW "
    "VIN 28906mW/14453mW/28906mW FUTURE_TOKEN value"
)


def test_runs_of_spaces_and_nc_rails():
    s = parse_tegrastats(GRAMMAR_AGX_JP6_MULTISPACE)
    assert_fields(s, dict(
        ram_used_mb=2448, ram_total_mb=30536, swap_total_mb=15268,
        cpu_load=[1, 0, None, None, 2, 0, 0, 0], emc_load_pct=0, emc_freq_mhz=2133,
        gpu_load_pct=0, gpu_freq_mhz=305, gpu_gpc_freq_mhz=[305, 305],
        temps_c={"cpu": 43.5, "soc2": 40.0, "tj": 43.5},
        power_mw={"VDD_GPU_SOC": 1194, "VDD_CPU_CV": 397, "VIN_SYS_5V0": 2621, "VDDQ_VDD2_1V8AO": 302},
        total_power_mw=1194 + 397 + 2621 + 302, total_power_rail="sum",
    ))


def test_negative_rail_reading():
    s = parse_tegrastats(GRAMMAR_AGX_NEGATIVE_RAIL)
    assert s.power_mw == {"VDD_GPU_SOC": 4940, "VDD_CPU_CV": -39, "VIN_SYS_5V0": 4442}
    assert s.power_avg_mw["VDD_CPU_CV"] == -12
    assert s.total_power_mw == 4940 - 39 + 4442
    assert s.swap_total_mb is None  # SWAP may be absent


def test_jp7_three_value_power_and_cur_max_temps():
    s = parse_tegrastats(GRAMMAR_AGX_JP7)
    assert_fields(s, dict(
        cpu_load=[12, 8, None, None], emc_load_pct=3, emc_freq_mhz=3199,
        gpu_load_pct=12, gpu_freq_mhz=1300, gpu_gpc_freq_mhz=[1300, 1300],
        temps_c={"cpu": 52.968, "soc2": 48.1, "tj": 53.5},
        temps_max_c={"cpu": 52.968, "soc2": 49.2, "tj": 54.0},
        power_mw={"VDD_GPU_SOC": 5139, "VDD_CPU_CV": 1607, "VIN_SYS_5V0": 4707},
        power_avg_mw={"VDD_GPU_SOC": 5139, "VDD_CPU_CV": 1500, "VIN_SYS_5V0": 4707},
        power_max_mw={"VDD_GPU_SOC": 5139, "VDD_CPU_CV": 1700, "VIN_SYS_5V0": 4707},
        total_power_mw=5139 + 1607 + 4707, total_power_rail="sum",
    ))


def test_thor_loadless_gpu_shared_cpu_clock_vin_total_and_unknown_tokens():
    s = parse_tegrastats(GRAMMAR_THOR)
    assert_fields(s, dict(
        ram_used_mb=9000, ram_total_mb=125749, swap_used_mb=None,
        cpu_load=[0, 5, None], cpu_freq_mhz=[2601, 2601, None],
        emc_load_pct=None, emc_freq_mhz=4266,
        gpu_load_pct=None, gpu_freq_mhz=1574, gpu_gpc_freq_mhz=[1574, 1574, 1574],
        temps_c={"cpu": 51.0, "gpu": 48.0, "tj": 52.0},
        temps_max_c={"cpu": 55.5, "gpu": 60.0, "tj": 61.0},
        total_power_mw=28906, total_power_avg_mw=14453, total_power_rail="VIN",
    ))
    assert s.power_mw["VDD_GPU"] == 37939 and s.power_avg_mw["VDD_GPU"] == 8660
    assert "FUTURE_TOKEN" not in s.power_mw


@pytest.mark.parametrize(
    "fragment, field_name, want",
    [
        ("RAM 1/2MB GR3D_FREQ 53%@140", "gpu_freq_mhz", 140),  # JP4
        ("RAM 1/2MB GR3D_FREQ 45%@1300", "gpu_load_pct", 45),
        ("RAM 1/2MB GR3D_FREQ 0%@[0,0]", "gpu_freq_mhz", 0),
        ("RAM 1/2MB CPU [10%,20%]@1500", "cpu_freq_mhz", [1500, 1500]),  # JP4 shared clock
        ("RAM 1/2MB EMC_FREQ 0%", "emc_freq_mhz", None),
        ("RAM 2586/7846MB (lfb 1x1MB) VDD_IN 3177/3177", "total_power_mw", 3177),  # no unit
        ("RAM 1/2MB POM_5V_IN 2000/1900 POM_5V_GPU 100/90", "total_power_rail", "POM_5V_IN"),
        ("RAM 1/2MB GPU@39C", "temps_c", {"gpu": 39.0}),
        ("RAM 1/2MB\r\n", "ram_total_mb", 2),
        (b"RAM 1/2MB", "ram_used_mb", 1),
    ],
)
def test_grammar_fragments(fragment, field_name, want):
    assert getattr(parse_tegrastats(fragment), field_name) == want


@pytest.mark.parametrize(
    "text",
    ["", "   ", "hello world", "NV Power Mode: MAXN_SUPER", "VDD_IN 4761mW/4778mW",
     '{"ram": 1}', "Error: Run this script(/usr/bin/jetson_clocks) as a root user"],
)
def test_not_tegrastats_names_the_missing_fields_and_quotes_the_text(text):
    with pytest.raises(TegrastatsParseError) as info:
        parse_tegrastats(text)
    message = str(info.value)
    # What is wrong (none of the fields that make a line tegrastats), what was given, what to feed.
    assert message.startswith("not a tegrastats line")
    for field_name in ("RAM a/bMB", "CPU [..]", "GR3D_FREQ"):
        assert field_name in message
    assert repr(text.strip()) in message
    assert "tegrastats --interval N" in message


def test_parse_error_is_caught_as_value_error():
    # Callers (the tegrastats source, the CLI) catch ValueError for any unusable input.
    assert issubclass(TegrastatsParseError, ValueError)


def test_a_valid_line_followed_by_noise_is_not_rejected():
    # Only a line with none of the known fields is an error: unknown tokens never are.
    s = parse_tegrastats(E_NX_JP5 + " SOMETHING_NEW 7%@[1,2] ###")
    assert s.ram_used_mb == 6334 and s.total_power_mw == 5299


def test_derived_values():
    s = parse_tegrastats(E_NX_JP5)
    assert s.cpu_load_avg == pytest.approx((6 + 9 + 5 + 16) / 4)  # offline cores excluded
    assert s.max_temp_c == 48.875
    assert s.to_dict()["power_mw"]["VDD_IN"] == 5299


# --------------------------------------------------------------------------- properties

_A_TOKENS_STABLE = A_NANO_JP6_ROOT.split(" ", 2)[2]  # without the timestamp


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), spaces=st.lists(st.integers(1, 4), min_size=64, max_size=64))
def test_field_order_and_spacing_do_not_matter(seed, spaces):
    # Split into fields (a field name plus its value tokens), shuffle, rejoin with random runs
    # of spaces, and append an unknown token: every value must survive.
    fields = re.findall(
        r"RAM \S+ \(lfb \S+\)|SWAP \S+ \(cached \S+\)|CPU \[[^\]]*\]|EMC_FREQ \S+|GR3D_FREQ \S+|"
        r"NV\w+ off|VIC off|OFA off|APE \d+|\w+@[-\d.]+C|VDD_\w+ \S+",
        _A_TOKENS_STABLE,
    )
    random.Random(seed).shuffle(fields)
    fields.append("SOMETHING_NEW 7%@[1,2]")
    line = "".join(f + " " * spaces[i % len(spaces)] for i, f in enumerate(fields))
    s = parse_tegrastats(line)
    want = dict(EXPECTED[A_NANO_JP6_ROOT])
    want["timestamp"] = None
    assert_fields(s, want)
