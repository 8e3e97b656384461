"""parse_tegrastats against every verbatim line of shared/reference/jetson.md §1.3.

Each line is copied here verbatim (so the test runs without shared/) with its expected
values written out by hand. A guard test re-reads jetson.md when it is present and fails if
it holds a tegrastats line that this file does not cover. Lines jetson.md withholds are
described only by its grammar table; the ``GRAMMAR_*`` lines below are constructed from that
table (not recordings) to pin each variant: runs of spaces, negative rails, JP7 three-value
power and cur/max temps, Thor's load-less GPU and EMC, unknown tokens.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmtp_edge.jetson.monitor import TegrastatsParseError, TegrastatsSample, parse_tegrastats

# --------------------------------------------------------------------------- verbatim lines

# A. Orin Nano 8GB, JP6, root (henrygd/beszel agent/gpu_test.go)
A_NANO_JP6_ROOT = "11-15-2024 08:38:09 RAM 6185/7620MB (lfb 8x2MB) SWAP 851/3810MB (cached 1MB) CPU [15%@729,11%@729,14%@729,13%@729,11%@729,8%@729] EMC_FREQ 43%@2133 GR3D_FREQ 63%@[621] NVDEC off NVJPG off NVJPG1 off VIC off OFA off APE 200 cpu@53.968C soc2@52.437C soc0@50.75C gpu@53.343C tj@53.968C soc1@51.656C VDD_IN 12479mW/12479mW VDD_CPU_GPU_CV 4667mW/4667mW VDD_SOC 2817mW/2817mW"
# B. Orin Nano 8GB, JP6, non-root
B_NANO_JP6_USER = "06-18-2025 11:25:24 RAM 3452/7620MB (lfb 25x4MB) SWAP 1518/16384MB (cached 174MB) CPU [1%@1420,2%@1420,0%@1420,2%@1420,2%@729,1%@729] GR3D_FREQ 0% cpu@50.031C soc2@49.031C soc0@50C gpu@49.031C tj@50.25C soc1@50.25C VDD_IN 4824mW/4824mW VDD_CPU_GPU_CV 518mW/518mW VDD_SOC 1475mW/1475mW"
# C. Orin Nano Super, 25W, idle: jetson_clocks off, then on
C1_NANO_SUPER_UNLOCKED = "04-27-2026 14:59:41 RAM 775/7620MB (lfb 3x4MB) SWAP 0/3810MB (cached 0MB) CPU [1%@729,0%@729,0%@729,0%@729,0%@729,0%@729] GR3D_FREQ 0% cpu@48.468C soc2@47.531C soc0@48.062C gpu@48.562C tj@49.156C soc1@49.156C VDD_IN 4761mW/4778mW VDD_CPU_GPU_CV 515mW/501mW VDD_SOC 1428mW/1428mW"
C2_NANO_SUPER_LOCKED = "04-27-2026 15:00:54 RAM 779/7620MB (lfb 2x4MB) SWAP 0/3810MB (cached 0MB) CPU [0%@1344,0%@1344,0%@1344,0%@1344,0%@1344,0%@1344] GR3D_FREQ 0% cpu@50.125C soc2@49.125C soc0@49.25C gpu@50.562C tj@50.562C soc1@50.437C VDD_IN 6626mW/6625mW VDD_CPU_GPU_CV 1228mW/1230mW VDD_SOC 2380mW/2380mW"
# D. Orin NX 16GB, JP6.2, non-root: idle, loaded
D1_NX_IDLE = "07-16-2026 13:03:45 RAM 1224/15656MB (lfb 8x4MB) SWAP 0/7828MB (cached 0MB) CPU [1%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729] GR3D_FREQ 0% cv0@41.156C cpu@45.843C soc2@39.593C soc0@42.562C cv1@42.156C gpu@43.406C tj@45.843C soc1@40.25C cv2@38.593C VDD_IN 4304mW/4304mW VDD_CPU_GPU_CV 573mW/573mW VDD_SOC 1218mW/1218mW"
D2_NX_LOADED = "08-21-2026 18:23:24 RAM 6238/15656MB (lfb 65x4MB) SWAP 3109/7828MB (cached 5MB) CPU [23%@1984,9%@1984,20%@1984,10%@1984,7%@1984,7%@1984,8%@1984,100%@1984] GR3D_FREQ 7% cv0@54.375C cpu@56.531C soc2@53.906C soc0@55.062C cv1@54.062C gpu@54C tj@56.531C soc1@56.281C cv2@54.343C VDD_IN 8820mW/8217mW VDD_CPU_GPU_CV 3159mW/3123mW VDD_SOC 2175mW/1933mW"
# E. Orin NX 16GB, JP5, root, 4 cores offline (DataDog voltageUnitSample)
E_NX_JP5 = "RAM 6334/15388MB (lfb 1770x4MB) SWAP 491/7694MB (cached 0MB) CPU [6%@729,9%@729,5%@729,16%@729,off,off,off,off] EMC_FREQ 0%@2133 GR3D_FREQ 0%@611 VIC_FREQ 729 APE 174 CV0@45.812C CPU@47.937C SOC2@46.093C SOC0@46.968C CV1@46.406C GPU@45.875C tj@48.875C SOC1@48.875C CV2@45.75C VDD_IN 5299mW/5299mW VDD_CPU_GPU_CV 773mW/773mW VDD_SOC 1424mW/1424mW"
# G. AGX Orin 64GB, root: JP5-style upper-case temps with GR3D array; then L4T R36.4.4
G1_AGX_JP5 = "04-11-2025 10:36:27 RAM 4321/62801MB (lfb 1759x4MB) SWAP 19/31400MB (cached 0MB) CPU [0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729] EMC_FREQ 0%@2133 GR3D_FREQ 0%@[0,0] VIC_FREQ 729 APE 174 CV0@-256C CPU@44.562C Tboard@32C SOC2@40.093C Tdiode@33C SOC0@41.093C CV1@-256C GPU@-256C tj@44.343C SOC1@41.25C CV2@-256C VDD_GPU_SOC 2340mW/2340mW VDD_CPU_CV 390mW/390mW VIN_SYS_5V0 4025mW/4025mW NC 0mW/0mW VDDQ_VDD2_1V8AO 301mW/301mW NC 0mW/0mW"
G2_AGX_R3644 = "05-09-2026 18:42:06 RAM 18207/62841MB (lfb 466x4MB) SWAP 86/31420MB (cached 0MB) CPU [14%@2188,5%@2112,8%@2035,14%@2201,46%@1267,47%@1267,2%@1267,10%@1267,4%@1036,5%@1036,6%@1036,10%@1036] EMC_FREQ 3%@2133 GR3D_FREQ 0%@[0,0] NVENC 79%@166 NVDEC off NVJPG off NVJPG1 off VIC 36%@115 OFA off NVDLA0 off NVDLA1 off PVA0_FREQ off APE 174 cpu@52.562C soc2@48.437C soc0@49.093C tj@52.562C soc1@49.656C VDD_GPU_SOC 2412mW/2412mW VDD_CPU_CV 1607mW/1607mW VIN_SYS_5V0 4707mW/4707mW"
# H. AGX Orin 64GB, JP6, non-root (DataDog orinSample)
H_AGX_JP6_USER = "RAM 2448/62840MB (lfb 2x4MB) SWAP 0/31420MB (cached 0MB) CPU [0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,0%@2201,0%@2201] GR3D_FREQ 0% cpu@42C soc2@37.843C soc0@39.187C gpu@37.75C tj@42C soc1@37.937C VDD_GPU_SOC 4940mW/4940mW VDD_CPU_CV 988mW/988mW VIN_SYS_5V0 4442mW/4442mW"
# I. jetson_stats emulator template: shell placeholders left in ($RAND_GPU, "...%@729 x12")
I_EMULATOR_TEMPLATE = "01-03-2023 16:07:54 RAM 2257/30536MB (lfb 5392x4MB) SWAP 0/15268MB (cached 0MB) CPU [...%@729 x12] EMC_FREQ 0%@204 GR3D_FREQ $RAND_GPU%@0 GR3D2_FREQ $RAND_GPU2%@0 NVJPG1 729 VIC_FREQ 115 APE 233 CV0@-256C CPU@41.437C Tboard@29C SOC2@39.062C Tdiode@30.75C SOC0@39.031C CV1@-256C GPU@-256C tj@41.656C SOC1@38.937C CV2@-256C VDD_GPU_SOC 2390mW/2390mW VDD_CPU_CV 796mW/796mW VIN_SYS_5V0 3522mW/3522mW NC 0mW/0mW VDDQ_VDD2_1V8AO 301mW/301mW NC 0mW/0mW"
# L. Older formats: TX2 (JP4, no unit on power) and Xavier NX
L1_TX2 = "RAM 2020/7852MB (lfb 1164x4MB) CPU [9%@345,21%@345,25%@345,3%@345,1%@345,1%@345] EMC_FREQ 0% GR3D_FREQ 0% PLL@42.5C MCPU@42.5C PMIC@100C Tboard@40C GPU@41C BCPU@42.5C thermal@41.9C Tdiode@41.25C VDD_SYS_GPU 153/158 VDD_SYS_SOC 536/547 VDD_4V0_WIFI 633/527 VDD_IN 3140/3208 VDD_SYS_CPU 536/590 VDD_SYS_DDR 557/601"
L2_XAVIER_NX = "RAM 4412/7772MB (lfb 237x4MB) SWAP 139/3886MB (cached 2MB) CPU [9%@1190,6%@1190,6%@1190,5%@1190,4%@1190,8%@1267] EMC_FREQ 10%@1600 GR3D_FREQ 62%@306 APE 150 MTS fg 0% bg 0% AO@41.5C GPU@43C PMIC@100C AUX@41.5C CPU@43.5C thermal@42.55C VDD_IN 4067/4067 VDD_CPU_GPU_CV 738/738 VDD_SOC 1353/1353"

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
}


def assert_fields(sample: TegrastatsSample, expected: dict) -> None:
    for name, want in expected.items():
        got = getattr(sample, name)
        assert got == want, f"{name}: got {got!r}, want {want!r}"


@pytest.mark.parametrize("line", list(EXPECTED), ids=lambda s: s[:40])
def test_verbatim_line(line):
    assert_fields(parse_tegrastats(line), EXPECTED[line])


def _jetson_md() -> Path | None:
    repo = Path(__file__).resolve().parents[1]
    for base in (repo / "shared", repo.parent / "shared"):
        if (base / "reference" / "jetson.md").is_file():
            return base / "reference" / "jetson.md"
    return None


def test_every_verbatim_line_in_jetson_md_is_covered():
    path = _jetson_md()
    if path is None:
        pytest.skip("shared/reference/jetson.md not present")
    pattern = re.compile(r"^(\d{2}-\d{2}-\d{4} \d{2}:\d{2}:\d{2} )?RAM \d+/\d+MB")
    lines = [ln for ln in path.read_text().splitlines() if pattern.match(ln)]
    assert len(lines) >= 13
    missing = [ln[:60] for ln in lines if ln not in EXPECTED]
    assert not missing, f"jetson.md lines without expected values here: {missing}"


# --------------------------------------------------------------------------- grammar variants
# Constructed from jetson.md §1.2's grammar table (NOT recordings): one line per variant.

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
def test_not_tegrastats_raises_a_value_error_subclass(text):
    with pytest.raises(TegrastatsParseError, match="not a tegrastats line") as info:
        parse_tegrastats(text)
    assert isinstance(info.value, ValueError)


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
