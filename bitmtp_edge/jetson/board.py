"""What board are we on: Jetson or not, which module, which L4T and JetPack.

Everything is read from files (no root, no subprocess) so that detection is cheap and
works inside containers that bind-mount ``/etc/nv_tegra_release``:

* ``/proc/device-tree/compatible`` (NUL-separated) names carrier+module+SoC, e.g.
  ``nvidia,p3768-0000+p3767-0005 / nvidia,p3767-0005 / nvidia,tegra234``. The module
  P-number is the reliable identity; ``/proc/device-tree/model`` is carrier-dependent free
  text, kept for display only. A Super devkit still reports ``p3767-0005``: "Super" is a
  power mode and firmware, not a module.
* ``/etc/nv_tegra_release`` first line ``# R36 (release), REVISION: 4.7, ...`` gives L4T
  36.4.7. JetPack comes from a table (docs/jetson.md §Which board: `board.py`); sources disagree on some patch
  releases, so only the major (R35=JP5, R36=JP6, R38/R39=JP7) is fully reliable.

Every path is resolved under an injectable ``root`` so tests run on fixture trees, and the
one command we may run (``dpkg-query``, a fallback for the L4T version) goes through an
injectable :data:`CommandRunner`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

# ----------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class CommandResult:
    """What a command printed. ``returncode`` 0 means success."""

    returncode: int
    stdout: str
    stderr: str = ""


# A runner takes argv and returns the result, or None when the executable does not exist.
# Tests pass a function that replays recorded output; nothing else in this package spawns
# board tools, so a runner is the single choke point for "never change the board".
CommandRunner = Callable[[Sequence[str]], "CommandResult | None"]


def tolerant(runner: CommandRunner) -> CommandRunner:
    """Wrap a runner so callers may hand in looser ones: returning stdout as ``str``, a
    ``subprocess.CompletedProcess``, or raising OSError for a missing executable."""

    def call(argv: Sequence[str]) -> CommandResult | None:
        try:
            res = runner(argv)
        except OSError:
            return None
        if res is None or isinstance(res, CommandResult):
            return res
        if isinstance(res, (str, bytes)):
            return CommandResult(0, res.decode(errors="replace") if isinstance(res, bytes) else res)
        out, err = getattr(res, "stdout", "") or "", getattr(res, "stderr", "") or ""
        return CommandResult(
            int(getattr(res, "returncode", 0)),
            out.decode(errors="replace") if isinstance(out, bytes) else out,
            err.decode(errors="replace") if isinstance(err, bytes) else err,
        )

    return call


def run_command(argv: Sequence[str], timeout_s: float = 10.0) -> CommandResult | None:
    """Run ``argv`` read-only and capture its output; None when the executable is missing."""
    exe = shutil.which(argv[0])
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, *argv[1:]], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return CommandResult(returncode=-1, stdout="", stderr=f"{argv[0]}: {e}")
    return CommandResult(done.returncode, done.stdout, done.stderr)


# ----------------------------------------------------------------------------- paths


def at_root(root: str | os.PathLike[str], path: str) -> Path:
    """``/etc/x`` under ``root`` (``root='/'`` is the real system)."""
    return Path(root) / path.lstrip("/")


def read_text(root: str | os.PathLike[str], path: str) -> str | None:
    """File text under ``root``, or None when missing/unreadable (a normal case off-Jetson)."""
    try:
        return at_root(root, path).read_text(errors="replace")
    except OSError:
        return None


def read_int(root: str | os.PathLike[str], path: str) -> int | None:
    """Integer sysfs attribute, or None when missing, unreadable or not an integer."""
    text = read_text(root, path)
    if text is None:
        return None
    try:
        return int(text.strip().split()[0])
    except (ValueError, IndexError):
        return None


# ----------------------------------------------------------------------------- tables

# P-number -> module name (rbonghi/jetson_stats MODULE_NAME_TABLE, trimmed to the modules
# this SDK targets plus the older ones users still run, so "what is this" never goes blank).
MODULES: dict[str, str] = {
    "p3767-0000": "Jetson Orin NX 16GB",
    "p3767-0001": "Jetson Orin NX 8GB",
    "p3767-0003": "Jetson Orin Nano 8GB",
    "p3767-0004": "Jetson Orin Nano 4GB",
    "p3767-0005": "Jetson Orin Nano 8GB (devkit)",
    "p3701-0000": "Jetson AGX Orin",
    "p3701-0004": "Jetson AGX Orin 32GB",
    "p3701-0005": "Jetson AGX Orin 64GB",
    "p3701-0008": "Jetson AGX Orin Industrial 64GB",
    "p3701-0002": "NVIDIA IGX Orin",
    "p3834-0008": "Jetson AGX Thor (T5000)",
    "p3668-0000": "Jetson Xavier NX (devkit)",
    "p3668-0001": "Jetson Xavier NX",
    "p2888-0001": "Jetson AGX Xavier",
    "p3448-0000": "Jetson Nano (devkit)",
    "p3448-0002": "Jetson Nano",
}

# Module board number -> family; the family decides rail names and export presets.
FAMILIES: dict[str, str] = {
    "p3767": "orin-nx-nano",
    "p3701": "agx-orin",
    "p3834": "agx-thor",
    "p3668": "xavier-nx",
    "p2888": "agx-xavier",
    "p3448": "nano",
}

# Module -> `bitmtp-export --board` preset (segments.DEVICE_KV_BUDGET_MIB). Only presets that exist there.
EXPORT_PRESETS: dict[str, str] = {
    "p3767-0000": "orin-nx-16gb",
    "p3767-0001": "orin-nx-8gb",
    "p3767-0003": "orin-nano-8gb",
    "p3767-0004": "orin-nano-4gb",
    "p3767-0005": "orin-nano-8gb",
    "p3701-0000": "agx-orin",
    "p3701-0004": "agx-orin",
    "p3701-0005": "agx-orin",
    "p3701-0008": "agx-orin",
}

# L4T -> JetPack, from rbonghi/jetson_stats NVIDIA_JETPACK (docs/jetson.md §Which board: `board.py`) plus the R32
# releases. jetson-containers disagrees for 39.x and 36.5.0; treat the patch as indicative.
L4T_TO_JETPACK: dict[str, str] = {
    "39.2.0": "7.2",
    "39.1.0": "7.2",
    "39.0.0": "7.2 EA",
    "38.4.0": "7.1",
    "38.2.2": "7.0",
    "38.2.1": "7.0",
    "38.2.0": "7.0",
    "36.5.0": "6.2.2",
    "36.4.7": "6.2.1",
    "36.4.4": "6.2.1",
    "36.4.3": "6.2",
    "36.4.2": "6.1",
    "36.4.0": "6.1",
    "36.3.0": "6.0",
    "36.2.0": "6.0 DP",
    "35.6.4": "5.1.6",
    "35.6.3": "5.1.5",
    "35.6.2": "5.1.5",
    "35.6.1": "5.1.5",
    "35.6.0": "5.1.4",
    "35.5.0": "5.1.3",
    "35.4.1": "5.1.2",
    "35.3.1": "5.1.1",
    "35.2.1": "5.1",
    "35.1.0": "5.0.2",
    "32.7.6": "4.6.6",
    "32.7.5": "4.6.5",
    "32.7.4": "4.6.4",
    "32.7.3": "4.6.3",
    "32.7.2": "4.6.2",
    "32.7.1": "4.6.1",
    "32.6.1": "4.6",
    "32.5.1": "4.5.1",
    "32.5.0": "4.5",
}
L4T_MAJOR_TO_JETPACK_MAJOR: dict[int, int] = {32: 4, 34: 5, 35: 5, 36: 6, 38: 7, 39: 7}

_RELEASE_RE = re.compile(r"^#\s*R(\d+)\s*\(release\),\s*REVISION:\s*(\d+)\.(\d+)")
_DPKG_L4T_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)")
_PNUMBER_RE = re.compile(r"^nvidia,(p\d{4}-\d{4})$")
_SOC_RE = re.compile(r"^nvidia,(tegra\d+)$")


def parse_nv_tegra_release(text: str) -> str | None:
    """``# R36 (release), REVISION: 4.7, ...`` -> ``"36.4.7"``; None if not that format."""
    for line in text.splitlines():
        m = _RELEASE_RE.match(line.strip())
        if m:
            return f"{m.group(1)}.{m.group(2)}.{m.group(3)}"
    return None


def jetpack_for_l4t(l4t: str | None) -> str | None:
    """JetPack release for an L4T version: exact table entry, else ``"<major>.x"``."""
    if not l4t:
        return None
    if l4t in L4T_TO_JETPACK:
        return L4T_TO_JETPACK[l4t]
    try:
        major = int(l4t.split(".")[0])
    except ValueError:
        return None
    jp = L4T_MAJOR_TO_JETPACK_MAJOR.get(major)
    return f"{jp}.x" if jp is not None else None


def parse_compatible(raw: bytes | str) -> tuple[str, ...]:
    """``/proc/device-tree/compatible`` (NUL-separated) -> its entries, in order."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return tuple(s.strip() for s in text.split("\0") if s.strip())


def module_from_compatible(entries: Sequence[str]) -> tuple[str | None, str | None]:
    """-> (module P-number such as ``p3767-0005``, SoC such as ``tegra234``)."""
    pnumber = soc = None
    for entry in entries:
        if m := _PNUMBER_RE.match(entry):
            # The first bare P-number that is a known module family wins; carrier boards
            # (p3768, p3737, p4071) appear only inside "carrier+module" entries.
            if pnumber is None and m.group(1).split("-")[0] in FAMILIES:
                pnumber = m.group(1)
        elif m := _SOC_RE.match(entry):
            soc = soc or m.group(1)
    if pnumber is None:
        for entry in entries:  # "nvidia,p3768-0000+p3767-0005": module after the '+'
            if "+" in entry:
                tail = "nvidia," + entry.split("+", 1)[1]
                if m := _PNUMBER_RE.match(tail):
                    pnumber = m.group(1)
                    break
    return pnumber, soc


# ----------------------------------------------------------------------------- board


@dataclass(frozen=True)
class BoardInfo:
    """Identity of the machine. Off a Jetson every Jetson field is None."""

    on_jetson: bool
    model: str | None = None  # /proc/device-tree/model, display only
    compatible: tuple[str, ...] = ()
    soc: str | None = None  # tegra234 (Orin), tegra264 (Thor)
    module_pnumber: str | None = None  # p3767-0005
    module: str | None = None  # "Jetson Orin Nano 8GB (devkit)"
    family: str | None = None  # orin-nx-nano | agx-orin | agx-thor | ...
    l4t: str | None = None  # "36.4.7"
    jetpack: str | None = None  # "6.2.1"
    ram_total_mb: int | None = None
    notes: tuple[str, ...] = field(default=())  # how values were found, when not obvious

    @property
    def jetpack_major(self) -> int | None:
        if self.l4t is None:
            return None
        return L4T_MAJOR_TO_JETPACK_MAJOR.get(int(self.l4t.split(".")[0]))

    @property
    def export_board(self) -> str | None:
        """The ``bitmtp-export --board`` preset for this module, when one exists."""
        return EXPORT_PRESETS.get(self.module_pnumber or "")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["compatible"] = list(self.compatible)
        d["notes"] = list(self.notes)
        d["jetpack_major"] = self.jetpack_major
        d["export_board"] = self.export_board
        return d


def _meminfo_total_mb(root: str | os.PathLike[str]) -> int | None:
    text = read_text(root, "/proc/meminfo")
    if text is None:
        return None
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(m.group(1)) // 1024 if m else None


def _l4t_from_dpkg(runner: CommandRunner) -> str | None:
    # nvidia-l4t-core's version is "36.4.7-20250918154033"; only used when the release
    # file is missing (some minimal containers).
    res = runner(["dpkg-query", "--showformat=${Version}", "--show", "nvidia-l4t-core"])
    if res is None or res.returncode != 0:
        return None
    m = _DPKG_L4T_RE.match(res.stdout.strip())
    return f"{m.group(1)}.{m.group(2)}.{m.group(3)}" if m else None


def detect_board(
    root: str | os.PathLike[str] = "/", runner: CommandRunner | None = None
) -> BoardInfo:
    """Identify the board under ``root``. Never raises for missing files; never needs root.

    Jetson = ``/etc/nv_tegra_release`` exists or the device tree says ``nvidia,tegra*``.
    ``runner`` (default: real subprocess) is consulted only on a Jetson whose release file
    is missing, for ``dpkg-query``.
    """
    compat_path = at_root(root, "/proc/device-tree/compatible")
    try:
        compatible = parse_compatible(compat_path.read_bytes())
    except OSError:
        compatible = ()
    pnumber, soc = module_from_compatible(compatible)
    release = read_text(root, "/etc/nv_tegra_release")
    on_jetson = release is not None or soc is not None
    ram = _meminfo_total_mb(root)
    if not on_jetson:
        return BoardInfo(on_jetson=False, compatible=compatible, ram_total_mb=ram)

    notes: list[str] = []
    l4t = parse_nv_tegra_release(release) if release is not None else None
    if release is not None and l4t is None:
        notes.append("/etc/nv_tegra_release has no '# R<major> (release), REVISION: x.y' line")
    if l4t is None:
        l4t = _l4t_from_dpkg(tolerant(runner or run_command))
        if l4t is not None:
            notes.append("L4T version from dpkg-query nvidia-l4t-core")
    model_text = read_text(root, "/proc/device-tree/model")
    model = model_text.replace("\0", "").strip() if model_text else None
    family = FAMILIES.get(pnumber.split("-")[0]) if pnumber else None
    return BoardInfo(
        on_jetson=True,
        model=model or None,
        compatible=compatible,
        soc=soc,
        module_pnumber=pnumber,
        module=MODULES.get(pnumber or "", f"unknown Jetson module {pnumber}" if pnumber else None),
        family=family,
        l4t=l4t,
        jetpack=jetpack_for_l4t(l4t),
        ram_total_mb=ram,
        notes=tuple(notes),
    )
