"""Board detection and power posture on recorded fixture trees (tests/fixtures/jetson/boards).

Each board directory has ``root/`` (what /etc, /proc, /sys, /var look like on that board) and
``commands/`` (recorded stdout of ``nvpmodel -q`` and ``jetson_clocks --show``; a missing file
means the tool is not installed). tests/fixtures/jetson/README.md says which files are
recorded and which were written to match the format docs/jetson.md describes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import pytest

from bitmtp_edge.jetson.board import (
    CommandResult,
    detect_board,
    jetpack_for_l4t,
    module_from_compatible,
    parse_compatible,
    parse_nv_tegra_release,
)
from bitmtp_edge.jetson.posture import (
    NvpmodelConf,
    PostureError,
    check_posture,
    parse_cpu_list,
    parse_jetson_clocks_show,
    parse_nvpmodel_conf,
    parse_nvpmodel_query,
    read_posture,
)

BOARDS = Path(__file__).parent / "fixtures" / "jetson" / "boards"


class FixtureRunner:
    """Replays commands/<argv joined by '_'>.out (.rc, .err); records every call."""

    def __init__(self, board: Path, extra: dict[tuple[str, ...], CommandResult] | None = None):
        self.dir = board / "commands"
        self.extra = extra or {}
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str]) -> CommandResult | None:
        key = tuple(argv)
        self.calls.append(key)
        if key in self.extra:
            return self.extra[key]
        stem = self.dir / "_".join(argv)
        out = stem.with_suffix(".out")
        if not out.exists():
            return None
        rc = stem.with_suffix(".rc")
        err = stem.with_suffix(".err")
        return CommandResult(
            returncode=int(rc.read_text()) if rc.exists() else 0,
            stdout=out.read_text(),
            stderr=err.read_text() if err.exists() else "",
        )


def board(name: str) -> tuple[Path, FixtureRunner]:
    return BOARDS / name / "root", FixtureRunner(BOARDS / name)


def assert_read_only(runner: FixtureRunner) -> None:
    # Never a mode switch, never a bare jetson_clocks (that would lock the clocks).
    for argv in runner.calls:
        assert argv in {("nvpmodel", "-q"), ("jetson_clocks", "--show")} or argv[0] == "dpkg-query", argv


# --------------------------------------------------------------------------- parsers


def test_nv_tegra_release_recorded_lines():
    assert parse_nv_tegra_release(
        "# R36 (release), REVISION: 4.7, GCID: 42132812, BOARD: generic, EABI: aarch64, DATE: Thu Sep 18 22:54:44 UTC 2025\n"
        "# KERNEL_VARIANT: oot\n"
    ) == "36.4.7"
    assert parse_nv_tegra_release(
        "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: Tue Aug  1 19:57:35 UTC 2023"
    ) == "35.4.1"
    assert parse_nv_tegra_release(
        "# R38 (release), REVISION: 2.0, GCID: 41844464, BOARD: generic, EABI: aarch64, DATE: Fri Aug 22 00:55:42 UTC 2025"
    ) == "38.2.0"
    assert parse_nv_tegra_release("Ubuntu 22.04") is None


@pytest.mark.parametrize(
    "l4t, jetpack",
    [("36.4.7", "6.2.1"), ("36.4.4", "6.2.1"), ("36.4.3", "6.2"), ("36.3.0", "6.0"), ("35.4.1", "5.1.2"),
     ("38.2.0", "7.0"), ("39.2.0", "7.2"), ("36.9.9", "6.x"), ("32.7.4", "4.6.4"), ("99.0.0", None), (None, None)],
)
def test_jetpack_for_l4t(l4t, jetpack):
    assert jetpack_for_l4t(l4t) == jetpack


@pytest.mark.parametrize(
    "raw, pnumber, soc",
    [
        (b"nvidia,p3768-0000+p3767-0005\0nvidia,p3767-0005\0nvidia,tegra234\0", "p3767-0005", "tegra234"),
        (b"nvidia,p3737-0000+p3701-0005\0nvidia,p3701-0005\0nvidia,tegra234\0", "p3701-0005", "tegra234"),
        (b"nvidia,p4071-0000+p3834-0008\0nvidia,p3834-0008\0nvidia,tegra264\0", "p3834-0008", "tegra264"),
        (b"nvidia,p3768-0000+p3767-0000\0nvidia,tegra234\0", "p3767-0000", "tegra234"),  # module only after '+'
        (b"raspberrypi,5-model-b\0brcm,bcm2712\0", None, None),
    ],
)
def test_module_from_compatible(raw, pnumber, soc):
    assert module_from_compatible(parse_compatible(raw)) == (pnumber, soc)


def test_nvpmodel_query_recorded_outputs():
    assert parse_nvpmodel_query("NV Power Mode: MAXN_SUPER\n2\n") == ("MAXN_SUPER", 2)
    assert parse_nvpmodel_query("NV Power Mode: 15W\n0\n") == ("15W", 0)
    assert parse_nvpmodel_query("--- current nvpmodel mode ---\nNV Power Mode: 25W\n1\n") == ("25W", 1)
    assert parse_nvpmodel_query("NV Power Mode: 120W\n1\n") == ("120W", 1)
    assert parse_nvpmodel_query("NVPM WARN: fan mode is not set!\nNV Power Mode: MAXN\n0\n") == ("MAXN", 0)
    assert parse_nvpmodel_query("NV Power Mode: MAXN\n") == ("MAXN", None)
    assert parse_nvpmodel_query("NVPM ERROR: failed\n") == (None, None)


def test_nvpmodel_conf_names_are_per_module():
    nano = parse_nvpmodel_conf((BOARDS / "orin-nano-super/root/etc/nvpmodel.conf").read_text())
    nx = parse_nvpmodel_conf((BOARDS / "orin-nx-16gb/root/etc/nvpmodel.conf").read_text())
    assert nano.modes == {0: "15W", 1: "25W", 2: "MAXN_SUPER", 3: "7W"} and nano.default_id == 1
    assert nx.modes == {0: "MAXN_SUPER", 1: "10W", 2: "15W", 3: "25W", 4: "40W"}
    assert nano.modes[0] == "15W" and nx.modes[0] == "MAXN_SUPER"  # id 0 is not portable
    assert nano.max_mode() == (2, "MAXN_SUPER") and nx.max_mode() == (0, "MAXN_SUPER")
    # pre-Super Orin Nano conf has no MAXN: the top mode is the highest wattage
    assert NvpmodelConf({0: "15W", 1: "7W"}, 0).max_mode() == (0, "15W")
    assert NvpmodelConf({0: "MAXN", 1: "MODE_15W", 2: "MODE_30W"}).max_mode() == (0, "MAXN")
    # Xavier NX names its modes by wattage and cores (no MAXN before JetPack 5's 20 W modes)
    xavier_nx = NvpmodelConf({0: "MODE_15W_2CORE", 1: "MODE_15W_4CORE", 2: "MODE_15W_6CORE", 3: "MODE_10W_2CORE",
                              8: "MODE_20W_6CORE"})
    assert xavier_nx.max_mode() == (8, "MODE_20W_6CORE")
    snippet = "< POWER_MODEL ID=0 NAME=15W >\n< POWER_MODEL ID=1 NAME=25W >\n< POWER_MODEL ID=2 NAME=MAXN_SUPER >\n< POWER_MODEL ID=3 NAME=7W >\n< PM_CONFIG DEFAULT=2 >"
    assert parse_nvpmodel_conf(snippet) == NvpmodelConf({0: "15W", 1: "25W", 2: "MAXN_SUPER", 3: "7W"}, 2)


def test_jetson_clocks_show_pre_super_15w_not_locked():
    # recorded (Orin Nano 8GB pre-Super, 15W; '...' lines dropped; format: docs/jetson.md §Clocks)
    text = (
        "SOC family:tegra234  Machine:NVIDIA Jetson Orin Nano Developer Kit\n"
        "Online CPUs: 0-5\n"
        "cpu0:  Online=1 Governor=ondemand MinFreq=729600 MaxFreq=1510400 CurrentFreq=960000 IdleStates: WFI=1 c7=1\n"
        "GPU MinFreq=306000000 MaxFreq=624750000 CurrentFreq=306000000\n"
        "Active GPU TPCs: 4\n"
        "EMC MinFreq=204000000 MaxFreq=2133000000 CurrentFreq=665600000 FreqOverride=0\n"
        "FAN Dynamic Speed Control=kernel hwmon0_pwm1=88\n"
    )
    state, mode = parse_jetson_clocks_show(text)
    assert (state.cpu_locked, state.gpu_locked, state.emc_locked, state.locked) == (False, False, False, False)
    assert mode is None


def test_jetson_clocks_show_agx_and_nx_cpu_lines():
    agx = "cpu0: Online=1 Governor=schedutil MinFreq=729600 MaxFreq=2201600 CurrentFreq=2201600 IdleStates: WFI=1 c7=1"
    nx = "cpu0:  Online=1 Governor=schedutil MinFreq=729600 MaxFreq=1984000 CurrentFreq=1728000 IdleStates: WFI=1 c7=1"
    for line in (agx, nx):
        state, _ = parse_jetson_clocks_show(line)
        assert state.cpu_locked is False and state.gpu_locked is None and state.locked is False
    offline = "cpu4: Online=0 Governor=schedutil MinFreq=729600 MaxFreq=1984000 CurrentFreq=0"
    assert parse_jetson_clocks_show(offline)[0].cpu_locked is None


def test_parse_cpu_list():
    assert parse_cpu_list("0-5\n") == [0, 1, 2, 3, 4, 5]
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("") == []


# --------------------------------------------------------------------------- boards


@pytest.mark.parametrize(
    "name, pnumber, module, soc, l4t, jetpack, ram_mb, export_board",
    [
        ("orin-nano-super", "p3767-0005", "Jetson Orin Nano 8GB (devkit)", "tegra234", "36.4.7", "6.2.1", 7620, "orin-nano-8gb"),
        ("orin-nx-16gb", "p3767-0000", "Jetson Orin NX 16GB", "tegra234", "36.4.3", "6.2", 15656, "orin-nx-16gb"),
        ("agx-orin-64gb", "p3701-0005", "Jetson AGX Orin 64GB", "tegra234", "36.4.7", "6.2.1", 62841, "agx-orin"),
        ("agx-thor", "p3834-0008", "Jetson AGX Thor (T5000)", "tegra264", "38.2.0", "7.0", 125749, None),
    ],
)
def test_detect_board(name, pnumber, module, soc, l4t, jetpack, ram_mb, export_board):
    root, runner = board(name)
    b = detect_board(root, runner)
    assert b.on_jetson
    assert (b.module_pnumber, b.module, b.soc, b.l4t, b.jetpack) == (pnumber, module, soc, l4t, jetpack)
    assert b.ram_total_mb == ram_mb and b.export_board == export_board
    assert b.model and "\0" not in b.model
    assert runner.calls == []  # detection reads files only
    json.dumps(b.to_dict())


def test_detect_board_falls_back_to_dpkg_when_release_file_is_missing(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(BOARDS / "agx-orin-64gb" / "root", root)
    (root / "etc" / "nv_tegra_release").unlink()
    runner = FixtureRunner(
        BOARDS / "agx-orin-64gb",
        {("dpkg-query", "--showformat=${Version}", "--show", "nvidia-l4t-core"): CommandResult(0, "36.4.4-20250616085344")},
    )
    b = detect_board(root, runner)
    assert b.on_jetson and b.l4t == "36.4.4" and b.jetpack == "6.2.1"
    assert any("dpkg-query" in n for n in b.notes)


@pytest.mark.parametrize("pnumber, module, preset", [
    ("p3767-0001", "Jetson Orin NX 8GB", "orin-nx-8gb"),
    ("p3767-0004", "Jetson Orin Nano 4GB", "orin-nano-4gb"),
])
def test_every_orin_nx_and_nano_module_has_an_export_preset(tmp_path, pnumber, module, preset):
    """The 8 GB NX and the 4 GB Nano were detected but had no --board preset: the doctor's
    hint and detect_board().export_board came back empty on exactly the smallest boards."""
    from bitmtp_edge.format.segments import DEVICE_KV_BUDGET_MIB

    root = tmp_path / "root"
    shutil.copytree(BOARDS / "orin-nx-16gb" / "root", root)
    (root / "proc" / "device-tree" / "compatible").write_bytes(
        f"nvidia,p3768-0000+{pnumber}\0nvidia,{pnumber}\0nvidia,tegra234\0".encode())
    b = detect_board(root, FixtureRunner(BOARDS / "orin-nx-16gb"))
    assert (b.module_pnumber, b.module, b.export_board) == (pnumber, module, preset)
    assert preset in DEVICE_KV_BUDGET_MIB
    # the smaller board never gets a larger KV budget than its bigger sibling
    bigger = {"orin-nx-8gb": "orin-nx-16gb", "orin-nano-4gb": "orin-nano-8gb"}[preset]
    assert DEVICE_KV_BUDGET_MIB[preset] <= DEVICE_KV_BUDGET_MIB[bigger]


def test_every_export_preset_of_a_module_is_a_board_the_exporter_knows():
    from bitmtp_edge.jetson.board import EXPORT_PRESETS
    from bitmtp_edge.format.segments import DEVICE_KV_BUDGET_MIB

    assert set(EXPORT_PRESETS.values()) <= set(DEVICE_KV_BUDGET_MIB)


def test_posture_orin_nano_super_maxn_super_locked_is_ready():
    root, runner = board("orin-nano-super")
    p = check_posture(strict=True, root=root, runner=runner)
    assert p.on_jetson and p.ready and p.warnings == []
    assert (p.power_mode_name, p.power_mode_id, p.power_mode_source) == ("MAXN_SUPER", 2, "nvpmodel -q")
    assert (p.max_mode_name, p.max_mode_id) == ("MAXN_SUPER", 2)
    assert p.clocks_locked is True
    assert (p.clocks.cpu_locked, p.clocks.gpu_locked, p.clocks.emc_locked) == (True, True, True)
    assert p.clocks.source == "sysfs + jetson_clocks --show"  # root: EMC known from --show
    assert_read_only(runner)
    d = p.to_dict()
    json.dumps(d)
    assert d["module"] == "Jetson Orin Nano 8GB (devkit)" and d["jetpack"] == "6.2.1" and d["ready"] is True


def test_posture_orin_nano_super_25w_unlocked_warns_and_strict_refuses():
    root, runner = board("orin-nano-super-25w")
    p = check_posture(strict=False, root=root, runner=runner)
    assert (p.power_mode_name, p.power_mode_id) == ("25W", 1)
    assert p.clocks_locked is False and not p.ready
    assert len(p.warnings) == 2
    mode_warning, clock_warning = p.warnings
    assert "25W (id 1), not MAXN_SUPER (id 2 on this module)" in mode_warning
    assert "sudo nvpmodel -m 2" in mode_warning  # the id from this module's conf, not "-m 0"
    assert "clocks are not locked" in clock_warning and "sudo jetson_clocks" in clock_warning
    assert "cpu0-5 scaling_min_freq 729600 != scaling_max_freq 1344000 kHz" in clock_warning
    assert "EMC CurrentFreq 665600000 < MaxFreq 3199000000 Hz" in clock_warning  # from --show (root)
    with pytest.raises(PostureError) as info:
        check_posture(strict=True, root=root, runner=runner)
    msg = str(info.value)
    assert "strict" in msg and "25W" in msg and "clocks are not locked" in msg and "--strict" in msg
    assert_read_only(runner)


def test_posture_orin_nx_in_a_container_reads_mode_from_status_file():
    # no nvpmodel binary: pmode:0000 resolves to MAXN_SUPER through *this* module's conf
    root, runner = board("orin-nx-16gb")
    p = check_posture(strict=True, root=root, runner=runner)
    assert (p.power_mode_name, p.power_mode_id, p.power_mode_source) == (
        "MAXN_SUPER", 0, "/var/lib/nvpmodel/status"
    )
    assert p.ready and p.warnings == []
    assert p.clocks.source == "sysfs" and p.clocks.emc_locked is None  # EMC needs root
    assert_read_only(runner)


def test_same_mode_id_means_different_modes_on_different_modules(tmp_path):
    # pmode:0000 on an Orin Nano Super is 15W, not max: the conf decides, not the id
    root = tmp_path / "root"
    shutil.copytree(BOARDS / "orin-nano-super" / "root", root)
    (root / "var/lib/nvpmodel/status").write_text("pmode:0000 fmode:fan_mode_quiet\n")
    p = read_posture(root, FixtureRunner(tmp_path))  # no recorded commands: tools missing
    assert (p.power_mode_name, p.power_mode_id) == ("15W", 0)
    assert not p.at_max_mode and "15W (id 0), not MAXN_SUPER (id 2" in p.warnings[0]


def test_posture_agx_orin_maxn_but_clocks_floating():
    root, runner = board("agx-orin-64gb")
    p = check_posture(root=root, runner=runner)
    assert (p.power_mode_name, p.power_mode_id, p.max_mode_name) == ("MAXN", 0, "MAXN")
    assert p.at_max_mode and p.clocks_locked is False
    assert len(p.warnings) == 1 and "clocks are not locked" in p.warnings[0]
    assert "cpu0-11 scaling_min_freq 729600 != scaling_max_freq 2201600 kHz" in p.warnings[0]  # one line, 12 CPUs
    assert "17000000.gpu min_freq 306000000 != max_freq 1300500000" in p.warnings[0]
    with pytest.raises(PostureError):
        check_posture(strict=True, root=root, runner=runner)


def test_posture_thor_default_120w_and_gpc_devfreq():
    root, runner = board("agx-thor")
    p = check_posture(root=root, runner=runner)
    assert (p.power_mode_name, p.power_mode_id, p.max_mode_name, p.max_mode_id) == ("120W", 1, "MAXN", 0)
    assert p.clocks.gpu_locked is False  # gpu-gpc-0 devfreq found
    assert any("gpu-gpc-0" in d for d in p.clocks.details)
    assert not any("gpu-nvd-0" in d for d in p.clocks.details)  # the video engine is not the GPU
    assert len(p.warnings) == 2 and "sudo nvpmodel -m 0" in p.warnings[0]


def test_posture_cannot_be_confirmed_when_nothing_is_readable(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "nv_tegra_release").write_text(
        "# R36 (release), REVISION: 4.7, GCID: 42132812, BOARD: generic, EABI: aarch64, DATE: Thu Sep 18 22:54:44 UTC 2025\n"
    )
    p = read_posture(root, FixtureRunner(tmp_path))
    assert p.on_jetson and p.power_mode_name is None and p.clocks_locked is None
    assert any("could not read the power mode" in w for w in p.warnings)
    assert any("could not tell whether clocks are locked" in w for w in p.warnings)
    with pytest.raises(PostureError):
        check_posture(strict=True, root=root, runner=FixtureRunner(tmp_path))


def test_nvpmodel_name_disagreeing_with_conf_trusts_nvpmodel():
    root, _ = board("orin-nano-super")
    runner = FixtureRunner(
        BOARDS / "orin-nano-super",
        {("nvpmodel", "-q"): CommandResult(0, "NV Power Mode: MAXN_SUPER\n0\n")},
    )
    p = read_posture(root, runner)
    assert (p.power_mode_name, p.power_mode_id) == ("MAXN_SUPER", 0)
    assert "names id 0 '15W'" in p.warnings[0] and "is the conf from this board?" in p.warnings[0]


# --------------------------------------------------------------------------- off a Jetson


def test_off_jetson_on_this_machine_says_so_and_carries_on():
    b = detect_board()
    if b.on_jetson:
        pytest.skip("this machine is a Jetson")
    calls: list = []
    p = check_posture(strict=True, runner=lambda argv: calls.append(argv))  # does not raise
    assert p.on_jetson is False and not p.ready
    assert len(p.warnings) == 1 and p.warnings[0].startswith("not a Jetson")
    assert p.power_mode_name is None and p.clocks_locked is None
    assert calls == []  # no board tools are run off a Jetson
    assert json.loads(json.dumps(p.to_dict()))["on_jetson"] is False


def test_off_jetson_fixture_root(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal:       32768000 kB\n")
    b = detect_board(tmp_path, FixtureRunner(tmp_path))
    assert not b.on_jetson and b.module is None and b.l4t is None and b.ram_total_mb == 32000


def test_runner_may_return_completed_process_or_str_or_raise():
    import subprocess

    root, _ = board("agx-orin-64gb")

    def runner(argv):
        if argv[0] == "nvpmodel":
            return subprocess.CompletedProcess(argv, 0, stdout=b"NV Power Mode: MAXN\n0\n", stderr=b"")
        raise FileNotFoundError(argv[0])

    p = read_posture(root, runner)
    assert (p.power_mode_name, p.power_mode_id) == ("MAXN", 0)
    p = read_posture(root, lambda argv: "NV Power Mode: MODE_30W\n2\n" if argv[0] == "nvpmodel" else None)
    assert (p.power_mode_name, p.power_mode_id, p.at_max_mode) == ("MODE_30W", 2, False)

