"""Power posture: which nvpmodel mode the Jetson is in and whether its clocks are locked.

The #1 reason a Jetson benchmark cannot be reproduced is a board that is not in its top
power mode or whose clocks float (docs/jetson.md §Power posture), so a run reads the posture first, warns
(or, under ``strict``, refuses) and records it in the result. It only *reads*: switching
modes can need a reboot and fails silently over SSH, so BitMTP never runs ``nvpmodel -m``
or a bare ``jetson_clocks``; it tells the user what to type.

Mode ids are not portable (MAXN_SUPER is id 2 on an Orin Nano Super but id 0 on an Orin
NX 16GB; id 0 on the Nano Super is 15W), so names are resolved from ``/etc/nvpmodel.conf``.

Sources, in order of preference:

* mode: ``nvpmodel -q`` (works without root on JP5/JP6), else ``/var/lib/nvpmodel/status``
  (``pmode:0002``, root-free), else the ``NV Power Mode:`` line of ``jetson_clocks --show``;
* clocks: sysfs ``scaling_min_freq == scaling_max_freq`` for every online CPU and devfreq
  ``min_freq == max_freq`` for the GPU (root-free, what jtop does); EMC from bpmp debugfs and
  ``jetson_clocks --show`` when readable (root only).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Sequence

from bitmtp_edge.jetson.board import (
    BoardInfo,
    CommandRunner,
    at_root,
    detect_board,
    read_int,
    read_text,
    run_command,
    tolerant,
)

log = logging.getLogger(__name__)

# The only invocations of board tools in this module: both are read-only. A bare
# `jetson_clocks` (no --show) would lock the clocks, which is exactly what we must not do.
NVPMODEL_QUERY = ("nvpmodel", "-q")
JETSON_CLOCKS_SHOW = ("jetson_clocks", "--show")

# Mode names that mean "top performance", best first.
MAX_MODE_NAMES = ("MAXN_SUPER", "MAXN")

# Devfreq nodes of the integrated GPU: "17000000.gpu" (JP6), "17000000.ga10b" (JP5),
# "gpu-gpc-0" (Thor), older gv11b/gp10b; jtop uses the same set.
GPU_DEVFREQ_SUFFIXES = frozenset({"gpu", "ga10b", "gv11b", "gp10b", "gb10b"})
GPU_DEVFREQ_PREFIX = "gpu-gpc-"


class PostureError(RuntimeError):
    """The board is not in a benchmark-ready posture and ``strict`` was asked for."""


# ----------------------------------------------------------------------------- nvpmodel


@dataclass(frozen=True)
class NvpmodelConf:
    """The mode table of ``/etc/nvpmodel.conf``: id -> name, and the boot default."""

    modes: dict[int, str]
    default_id: int | None = None

    def id_of(self, name: str) -> int | None:
        return next((i for i, n in self.modes.items() if n == name), None)

    def max_mode(self) -> tuple[int, str] | None:
        """The top-performance mode: MAXN_SUPER, else MAXN, else the highest ``NNW`` mode.

        The last case exists because pre-Super Orin Nano confs have only 15W and 7W.
        """
        for name in MAX_MODE_NAMES:
            if (i := self.id_of(name)) is not None:
                return i, name
        watts = [(int(m.group(1)), i, n) for i, n in self.modes.items() if (m := _WATTS_RE.search(n))]
        if watts:
            _, i, n = max(watts)
            return i, n
        return None


_CONF_MODE_RE = re.compile(r"<\s*POWER_MODEL\s+ID\s*=\s*(\d+)\s+NAME\s*=\s*([^\s>]+)")
_CONF_DEFAULT_RE = re.compile(r"<\s*PM_CONFIG\s+DEFAULT\s*=\s*(\d+)")
_QUERY_RE = re.compile(r"NV Power Mode:\s*(\S+)")
_STATUS_RE = re.compile(r"pmode:\s*(\d+)")
_WATTS_RE = re.compile(r"(\d+)W(?![A-Za-z0-9])")  # "15W", "MODE_30W", Xavier NX's "MODE_15W_6CORE"


def parse_nvpmodel_conf(text: str) -> NvpmodelConf:
    """Mode table of an nvpmodel.conf (``< POWER_MODEL ID=2 NAME=MAXN_SUPER >`` blocks)."""
    modes = {int(m.group(1)): m.group(2) for m in _CONF_MODE_RE.finditer(text)}
    m = _CONF_DEFAULT_RE.search(text)
    return NvpmodelConf(modes=modes, default_id=int(m.group(1)) if m else None)


def parse_nvpmodel_query(text: str) -> tuple[str | None, int | None]:
    """``nvpmodel -q`` -> (name, id). The id is the first integer line after the name line;
    JP5 may print ``NVPM WARN: ...`` lines first."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if m := _QUERY_RE.search(line):
            for nxt in lines[i + 1 :]:
                if nxt.strip().isdigit():
                    return m.group(1), int(nxt.strip())
                if nxt.strip():
                    break
            return m.group(1), None
    return None, None


@dataclass(frozen=True)
class PowerMode:
    name: str | None
    id: int | None
    source: str  # where it was read from
    note: str | None = None  # a disagreement worth a warning


def read_power_mode(
    root: str | os.PathLike[str], runner: CommandRunner, conf: NvpmodelConf | None
) -> tuple[PowerMode | None, list[str]]:
    """Current mode, resolving name <-> id through the conf. Returns (mode, notes)."""
    notes: list[str] = []
    res = runner(list(NVPMODEL_QUERY))
    if res is not None and res.returncode == 0:
        name, mode_id = parse_nvpmodel_query(res.stdout)
        if name is not None:
            if conf is not None and mode_id is None:
                mode_id = conf.id_of(name)
            note = None
            if conf is not None and mode_id in conf.modes and conf.modes[mode_id] != name:
                # e.g. a container with another board's conf mounted: mode ids from the conf
                # (and the suggested `nvpmodel -m` id) cannot be trusted then.
                note = (
                    f"`nvpmodel -q` reports {name} (id {mode_id}) but /etc/nvpmodel.conf names id "
                    f"{mode_id} '{conf.modes[mode_id]}': is the conf from this board? Trusting nvpmodel"
                )
            return PowerMode(name, mode_id, "nvpmodel -q", note), notes
    why = "not found" if res is None else f"exit {res.returncode}: {res.stderr.strip()[:120]}"
    notes.append(f"`nvpmodel -q` unavailable ({why})")

    status = read_text(root, "/var/lib/nvpmodel/status")
    if status is not None and (m := _STATUS_RE.search(status)):
        mode_id = int(m.group(1))
        name = conf.modes.get(mode_id) if conf is not None else None
        return PowerMode(name, mode_id, "/var/lib/nvpmodel/status"), notes
    return None, notes


# ----------------------------------------------------------------------------- clocks


@dataclass(frozen=True)
class ClockState:
    """Whether CPU, GPU and EMC clocks are pinned (min == max). None = could not read."""

    cpu_locked: bool | None
    gpu_locked: bool | None
    emc_locked: bool | None
    source: str
    details: tuple[str, ...] = ()  # what was seen, for messages: "cpu0 729600..1728000 kHz"

    @property
    def locked(self) -> bool | None:
        """False if anything floats; True if CPU and GPU are pinned and EMC is not seen
        floating (EMC needs root to read); None when CPU or GPU could not be read."""
        known = [v for v in (self.cpu_locked, self.gpu_locked, self.emc_locked) if v is not None]
        if any(v is False for v in known):
            return False
        if self.cpu_locked is None or self.gpu_locked is None:
            return None
        return True

    def to_dict(self) -> dict:
        return {
            "locked": self.locked,
            "cpu_locked": self.cpu_locked,
            "gpu_locked": self.gpu_locked,
            "emc_locked": self.emc_locked,
            "source": self.source,
            "details": list(self.details),
        }


def parse_cpu_list(text: str) -> list[int]:
    """``0-3,6`` -> [0, 1, 2, 3, 6] (the sysfs cpu list format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part.strip():
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _gpu_devfreq_nodes(root: str | os.PathLike[str]) -> list[str]:
    base = at_root(root, "/sys/class/devfreq")
    try:
        names = sorted(p.name for p in base.iterdir())
    except OSError:
        return []
    return [
        n
        for n in names
        if n.rsplit(".", 1)[-1] in GPU_DEVFREQ_SUFFIXES or n.startswith(GPU_DEVFREQ_PREFIX)
    ]


def read_clocks_sysfs(root: str | os.PathLike[str]) -> ClockState:
    """Root-free lock check: online CPUs' cpufreq and the GPU's devfreq (and EMC if root)."""
    details: list[str] = []
    cpu_locked: bool | None = None
    online = read_text(root, "/sys/devices/system/cpu/online")
    cpus = parse_cpu_list(online) if online else []
    ranges: dict[int, tuple[int, int]] = {}
    for c in cpus:
        lo = read_int(root, f"/sys/devices/system/cpu/cpu{c}/cpufreq/scaling_min_freq")
        hi = read_int(root, f"/sys/devices/system/cpu/cpu{c}/cpufreq/scaling_max_freq")
        if lo is not None and hi is not None:
            ranges[c] = (lo, hi)
    if ranges:
        cpu_locked = all(lo == hi for lo, hi in ranges.values())
        details += _cpu_details(ranges, "scaling_min_freq {lo} != scaling_max_freq {hi} kHz")

    gpu_locked: bool | None = None
    gpu_pinned: list[bool] = []
    for node in _gpu_devfreq_nodes(root):
        lo = read_int(root, f"/sys/class/devfreq/{node}/min_freq")
        hi = read_int(root, f"/sys/class/devfreq/{node}/max_freq")
        if lo is None or hi is None:
            continue
        gpu_pinned.append(lo == hi)
        if lo != hi:
            details.append(f"GPU devfreq {node} min_freq {lo} != max_freq {hi} Hz")
    if gpu_pinned:
        gpu_locked = all(gpu_pinned)

    # bpmp debugfs is root-only; jetson_clocks sets mrq_rate_locked=1 and rate=max_rate.
    emc_locked: bool | None = None
    emc = "/sys/kernel/debug/bpmp/debug/clk/emc"
    rate, max_rate = read_int(root, f"{emc}/rate"), read_int(root, f"{emc}/max_rate")
    mrq = read_int(root, f"{emc}/mrq_rate_locked")
    if rate is not None and max_rate is not None:
        emc_locked = rate == max_rate and mrq in (None, 1)
        if not emc_locked:
            details.append(f"EMC rate {rate} Hz, max_rate {max_rate} Hz, mrq_rate_locked {mrq}")
    return ClockState(cpu_locked, gpu_locked, emc_locked, "sysfs", tuple(details))


_SHOW_CPU_RE = re.compile(r"^cpu(\d+):.*?MinFreq=(\d+)\s+MaxFreq=(\d+)")
_SHOW_GPU_RE = re.compile(r"^GPU\s+MinFreq=(\d+)\s+MaxFreq=(\d+)")
_SHOW_EMC_RE = re.compile(r"^EMC\s+MinFreq=(\d+)\s+MaxFreq=(\d+)\s+CurrentFreq=(\d+)(?:.*FreqOverride=(\d))?")


def parse_jetson_clocks_show(text: str) -> tuple[ClockState, str | None]:
    """``jetson_clocks --show`` (root) -> (clock state, power mode name or None).

    CPU/GPU locked when MinFreq == MaxFreq; EMC locked when ``FreqOverride=1`` where the
    line has it, else when CurrentFreq == MaxFreq. Offline CPUs (``Online=0``) are skipped.
    """
    details: list[str] = []
    cpu: dict[int, tuple[int, int]] = {}
    gpu: list[bool] = []
    emc: bool | None = None
    mode = None
    for raw in text.splitlines():
        line = raw.strip()
        if m := _SHOW_CPU_RE.match(line):
            if "Online=0" not in line:
                cpu[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
        elif m := _SHOW_GPU_RE.match(line):
            lo, hi = int(m.group(1)), int(m.group(2))
            gpu.append(lo == hi)
            if lo != hi:
                details.append(f"GPU MinFreq {lo} != MaxFreq {hi} Hz")
        elif m := _SHOW_EMC_RE.match(line):
            hi, cur, override = int(m.group(2)), int(m.group(3)), m.group(4)
            emc = override == "1" if override is not None else cur == hi
            if not emc:
                flag = f", FreqOverride={override}" if override is not None else ""
                details.append(f"EMC CurrentFreq {cur} < MaxFreq {hi} Hz{flag}")
        elif m := _QUERY_RE.search(line):
            mode = m.group(1)
    details = _cpu_details(cpu, "MinFreq {lo} != MaxFreq {hi} kHz") + details
    state = ClockState(
        cpu_locked=all(lo == hi for lo, hi in cpu.values()) if cpu else None,
        gpu_locked=all(gpu) if gpu else None,
        emc_locked=emc,
        source="jetson_clocks --show",
        details=tuple(details),
    )
    return state, mode


def _cpu_details(ranges: dict[int, tuple[int, int]], template: str) -> list[str]:
    """One line per distinct unpinned (min, max): "cpu0-5 <template>" rather than six lines."""
    groups: dict[tuple[int, int], list[int]] = {}
    for c, (lo, hi) in sorted(ranges.items()):
        if lo != hi:
            groups.setdefault((lo, hi), []).append(c)
    return [f"{_cpu_names(cs)} {template.format(lo=lo, hi=hi)}" for (lo, hi), cs in groups.items()]


def _cpu_names(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "cpu0-2,5"."""
    spans: list[str] = []
    start = prev = cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        spans.append(f"{start}-{prev}" if prev != start else f"{start}")
        if c is not None:
            start = prev = c
    return "cpu" + ",".join(spans)


def _component(detail: str) -> str:
    return "cpu" if detail.startswith("cpu") else "gpu" if detail.startswith("GPU") else "emc"


def _merge(first: ClockState, second: ClockState) -> ClockState:
    """``first`` wins where it knows; ``second`` fills gaps (sysfs first, --show adds EMC)."""
    pick = lambda a, b: a if a is not None else b  # noqa: E731
    known = {"cpu": first.cpu_locked, "gpu": first.gpu_locked, "emc": first.emc_locked}
    filled = tuple(d for d in second.details if known[_component(d)] is None)
    return ClockState(
        cpu_locked=pick(first.cpu_locked, second.cpu_locked),
        gpu_locked=pick(first.gpu_locked, second.gpu_locked),
        emc_locked=pick(first.emc_locked, second.emc_locked),
        source=f"{first.source} + {second.source}",
        details=first.details + filled,
    )


# ----------------------------------------------------------------------------- posture


@dataclass
class PowerPosture:
    """Everything a benchmark records about how the board was set up. JSON-ready."""

    on_jetson: bool
    model: str | None = None
    module: str | None = None
    module_pnumber: str | None = None
    soc: str | None = None
    l4t: str | None = None
    jetpack: str | None = None
    power_mode_name: str | None = None
    power_mode_id: int | None = None
    power_mode_source: str | None = None
    max_mode_name: str | None = None  # the top mode on this module, from the conf
    max_mode_id: int | None = None
    clocks_locked: bool | None = None
    clocks: ClockState | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def at_max_mode(self) -> bool | None:
        if self.power_mode_name is None:
            return None
        if self.max_mode_name is not None:
            return self.power_mode_name == self.max_mode_name
        return self.power_mode_name in MAX_MODE_NAMES

    @property
    def ready(self) -> bool:
        """On a Jetson, in its top mode, with clocks locked: numbers are comparable."""
        return bool(self.on_jetson and self.at_max_mode and self.clocks_locked)

    def to_dict(self) -> dict:
        return {
            "on_jetson": self.on_jetson,
            "model": self.model,
            "module": self.module,
            "module_pnumber": self.module_pnumber,
            "soc": self.soc,
            "l4t": self.l4t,
            "jetpack": self.jetpack,
            "power_mode_name": self.power_mode_name,
            "power_mode_id": self.power_mode_id,
            "power_mode_source": self.power_mode_source,
            "max_mode_name": self.max_mode_name,
            "max_mode_id": self.max_mode_id,
            "at_max_mode": self.at_max_mode,
            "clocks_locked": self.clocks_locked,
            "clocks": self.clocks.to_dict() if self.clocks is not None else None,
            "ready": self.ready,
            "warnings": list(self.warnings),
        }


NOT_JETSON_MESSAGE = (
    "not a Jetson (no /etc/nv_tegra_release, no nvidia,tegra* in /proc/device-tree/compatible): "
    "power-mode and clock checks skipped"
)


def read_posture(
    root: str | os.PathLike[str] = "/",
    runner: CommandRunner | None = None,
    board: BoardInfo | None = None,
) -> PowerPosture:
    """Read the posture under ``root``; never raises for a missing file or tool.

    Off a Jetson: ``on_jetson=False`` and ``warnings`` holds one plain sentence saying so.
    """
    runner = tolerant(runner or run_command)
    board = board or detect_board(root, runner)
    if not board.on_jetson:
        return PowerPosture(on_jetson=False, warnings=[NOT_JETSON_MESSAGE])

    conf_text = read_text(root, "/etc/nvpmodel.conf")
    conf = parse_nvpmodel_conf(conf_text) if conf_text else None
    if conf is not None and not conf.modes:
        conf = None
    mode, mode_notes = read_power_mode(root, runner, conf)

    clocks = read_clocks_sysfs(root)
    show = runner(list(JETSON_CLOCKS_SHOW))
    if show is not None and show.returncode == 0 and "MaxFreq=" in show.stdout:
        shown, shown_mode = parse_jetson_clocks_show(show.stdout)
        clocks = _merge(clocks, shown)
        if mode is None and shown_mode is not None:
            mode = PowerMode(shown_mode, conf.id_of(shown_mode) if conf else None, "jetson_clocks --show")

    top = conf.max_mode() if conf is not None else None
    posture = PowerPosture(
        on_jetson=True,
        model=board.model,
        module=board.module,
        module_pnumber=board.module_pnumber,
        soc=board.soc,
        l4t=board.l4t,
        jetpack=board.jetpack,
        power_mode_name=mode.name if mode else None,
        power_mode_id=mode.id if mode else None,
        power_mode_source=mode.source if mode else None,
        max_mode_name=top[1] if top else None,
        max_mode_id=top[0] if top else None,
        clocks_locked=clocks.locked,
        clocks=clocks,
    )
    posture.warnings = _posture_warnings(posture, mode_notes, conf is not None)
    if mode is not None and mode.note:
        posture.warnings.insert(0, mode.note)
    return posture


def _posture_warnings(p: PowerPosture, mode_notes: Sequence[str], have_conf: bool) -> list[str]:
    out: list[str] = []
    target = p.max_mode_name or "MAXN / MAXN_SUPER"
    switch = f"`sudo nvpmodel -m {p.max_mode_id}`" if p.max_mode_id is not None else (
        "`sudo nvpmodel -m <id of MAXN_SUPER or MAXN in /etc/nvpmodel.conf>`"
    )
    if p.power_mode_name is None and p.power_mode_id is None:
        out.append(
            "could not read the power mode (" + "; ".join(mode_notes) + "; no /var/lib/nvpmodel/status): "
            "check with `sudo nvpmodel -q`"
        )
    elif p.power_mode_name is None:
        out.append(
            f"power mode id {p.power_mode_id} has no name: /etc/nvpmodel.conf "
            + ("does not list it" if have_conf else "is missing")
            + "; mode ids differ between modules, so it cannot be judged. Check with `sudo nvpmodel -q`"
        )
    elif not p.at_max_mode:
        out.append(
            f"power mode is {p.power_mode_name} (id {p.power_mode_id}), not {target}"
            + (f" (id {p.max_mode_id} on this module)" if p.max_mode_id is not None else "")
            + f": decode will be slower than published numbers. Switch with {switch} "
            "(it may ask to reboot), then `sudo jetson_clocks`"
        )
    if p.clocks_locked is False:
        shown = "; ".join(p.clocks.details[:3]) if p.clocks else ""
        more = len(p.clocks.details) - 3 if p.clocks else 0
        out.append(
            f"clocks are not locked ({shown}{f'; +{more} more' if more > 0 else ''}): "
            "run `sudo jetson_clocks` for repeatable numbers (it resets at reboot)"
        )
    elif p.clocks_locked is None:
        out.append(
            "could not tell whether clocks are locked (no readable cpufreq scaling_min/max_freq or "
            "GPU devfreq min/max_freq under /sys): check with `sudo jetson_clocks --show`"
        )
    return out


def check_posture(
    strict: bool = False,
    *,
    root: str | os.PathLike[str] = "/",
    runner: CommandRunner | None = None,
    board: BoardInfo | None = None,
) -> PowerPosture:
    """Read the posture, log its warnings, and under ``strict`` refuse a Jetson that is not
    at MAXN / MAXN_SUPER with locked clocks (or whose posture cannot be confirmed).

    Off a Jetson nothing is refused: the posture says so and the run carries on.
    """
    posture = read_posture(root, runner, board)
    for w in posture.warnings:
        (log.warning if posture.on_jetson else log.info)("power posture: %s", w)
    if strict and posture.on_jetson and not posture.ready:
        raise PostureError(
            "power posture is not benchmark-ready, and strict mode refuses to measure:\n"
            + "\n".join(f"  - {w}" for w in posture.warnings)
            + "\nFix the above (BitMTP never changes the board's settings itself), "
            "or drop --strict to measure anyway and record the posture."
        )
    return posture
