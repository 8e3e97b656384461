"""Parse one line of ``tegrastats`` output into a :class:`TegrastatsSample`.

The format changed at every JetPack (docs/jetson.md §tegrastats); one line can look like any of::

    JP4   RAM 2586/7846MB (lfb 1x1MB) CPU [9%@345,...] EMC_FREQ 10%@1600 GR3D_FREQ 62%@306
          GPU@43C VDD_IN 4067/4067                                  (mW without a unit)
    JP5   01-03-2023 16:07:54 RAM ... CPU [1%@729,...,off] GR3D_FREQ 45%@0 CPU@41.375C
          CV0@-256C VDD_GPU_SOC 2390mW/2390mW                       (cur/avg, upper-case temps)
    JP6   ... EMC_FREQ 43%@2133 GR3D_FREQ 63%@[621] cpu@53.968C VDD_IN 12479mW/12479mW
    JP7   ... GR3D_FREQ 12%@[1300,1300] cpu@52.968C/52.968C VDD_GPU_SOC 5139mW/5139mW/5139mW
    Thor  ... CPU [0%,5%,off]@2601 EMC_FREQ @4266 GR3D_FREQ @[1574,1574,1574] VIN 28906mW/...

So the parser does not walk tokens in order (order is not guaranteed and unknown tokens
appear, e.g. ``NVENC0_FREQ @1691`` or future engines); it searches for each field it knows,
each regex anchored on whitespace so runs of spaces are harmless. Fields it does not find
stay None/empty. A line with none of RAM, ``CPU [..]`` or ``GR3D_FREQ`` is not tegrastats and
raises :class:`TegrastatsParseError`.

Conventions: temperatures keep tegrastats' sensor names lower-cased (``CPU@`` on JP5 and
``cpu@`` on JP6 are one sensor); ``-256C`` marks an offline sensor and is left out, as is
``PMIC@100C`` (a constant placeholder). The second JP7 temperature and the third JP7 power
value are running maxima; the second power value is tegrastats' average since *its* start,
not over our window, so energy is integrated from the instantaneous values instead.
``NC`` (not connected) INA3221 channels are dropped. Total power is ``VDD_IN`` (Orin
Nano/NX, Xavier NX), ``VIN`` (Thor) or ``POM_5V_IN`` (Nano), else the sum of the rails
(AGX Orin and AGX Xavier have no input rail; jtop sums the same way). All rails are
module-only: carrier, fan and peripherals are not included.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

# Input rails that measure the whole module; first match wins.
TOTAL_RAILS = ("VDD_IN", "VIN", "POM_5V_IN")
NOT_CONNECTED = "NC"
# tegrastats prints -256C for a thermal zone that is offline (e.g. gated DLA/GPU zones).
OFFLINE_BELOW_C = -200.0
# Sensors that are placeholders, not measurements: PMIC always prints 100C (TX2, Xavier);
# jtop skips it too. Kept out so "peak temperature" means something.
PLACEHOLDER_SENSORS = frozenset({"pmic"})

_NUM = r"-?\d+(?:\.\d+)?"
_END = r"(?!\S)"  # a field ends at whitespace or end of line
_TIMESTAMP = re.compile(r"^\s*(\d{2}-\d{2}-\d{4}\s+\d{2}:\d{2}:\d{2})")
_RAM = re.compile(r"(?<!\S)RAM\s+(\d+)\s*/\s*(\d+)\s*MB")
_SWAP = re.compile(r"(?<!\S)SWAP\s+(\d+)\s*/\s*(\d+)\s*MB(?:\s*\(\s*cached\s+(\d+)\s*MB\s*\))?")
_CPU = re.compile(r"(?<!\S)CPU\s+\[([^\]]*)\](?:@(\d+))?")
_CPU_CORE = re.compile(rf"^({_NUM})%(?:@(\d+))?$")
_EMC = re.compile(rf"(?<!\S)EMC_FREQ\s+(?:({_NUM})%)?(?:@(\d+))?{_END}")
_GR3D = re.compile(rf"(?<!\S)GR3D_FREQ\s+(?:({_NUM})%)?(?:@(?:\[([\d,\s]*)\]|(\d+)))?{_END}")
_TEMP = re.compile(rf"(?<!\S)([A-Za-z][A-Za-z0-9_-]*)@({_NUM})C(?:/({_NUM})C)?{_END}")
_POWER = re.compile(
    rf"(?<!\S)([A-Z][A-Z0-9_]*)\s+({_NUM})(?:mW)?\s*/\s*({_NUM})(?:mW)?(?:\s*/\s*({_NUM})(?:mW)?)?{_END}"
)
# Memory fields are never rails. "CPU" is not listed: on AGX Xavier it *is* a rail
# ("GPU 0/0 CPU 311/311 SOC 932/932 ..."), and the core list "CPU [..]" cannot match
# _POWER anyway (a rail value starts with a digit).
_NOT_RAILS = frozenset({"RAM", "SWAP", "IRAM"})


class TegrastatsParseError(ValueError):
    """The text is not a tegrastats line."""


def _num(text: str) -> int | float:
    return float(text) if "." in text else int(text)


@dataclass
class TegrastatsSample:
    """One tegrastats line. Units are in the field names; None means "not in this line"."""

    timestamp: str | None = None  # "MM-DD-YYYY HH:MM:SS" as printed (JP5+), board clock
    ram_used_mb: int | None = None
    ram_total_mb: int | None = None
    swap_used_mb: int | None = None
    swap_total_mb: int | None = None
    swap_cached_mb: int | None = None
    cpu_load: list[int | float | None] = field(default_factory=list)  # %, None = offline core
    cpu_freq_mhz: list[int | None] = field(default_factory=list)
    emc_load_pct: int | float | None = None  # % of bandwidth at the current EMC clock
    emc_freq_mhz: int | None = None  # absent without root on JP5/JP6
    gpu_load_pct: int | float | None = None  # absent on Thor (GR3D_FREQ @[...])
    gpu_freq_mhz: int | None = None  # max over GPCs; absent without root on JP6
    gpu_gpc_freq_mhz: list[int] = field(default_factory=list)  # per GPC (AGX Orin 2, Thor 3)
    temps_c: dict[str, float] = field(default_factory=dict)  # lower-case names, offline left out
    temps_max_c: dict[str, float] = field(default_factory=dict)  # JP7 running max
    power_mw: dict[str, int | float] = field(default_factory=dict)  # instantaneous, per rail
    power_avg_mw: dict[str, int | float] = field(default_factory=dict)  # since tegrastats start
    power_max_mw: dict[str, int | float] = field(default_factory=dict)  # JP7 running max
    total_power_mw: int | float | None = None
    total_power_avg_mw: int | float | None = None
    total_power_rail: str | None = None  # "VDD_IN", "VIN", ... or "sum" of the rails

    @property
    def cpu_load_avg(self) -> float | None:
        """Mean load over online cores."""
        online = [x for x in self.cpu_load if x is not None]
        return sum(online) / len(online) if online else None

    @property
    def max_temp_c(self) -> float | None:
        return max(self.temps_c.values()) if self.temps_c else None

    def to_dict(self) -> dict:
        return asdict(self)


def _parse_cpu(s: TegrastatsSample, line: str) -> bool:
    m = _CPU.search(line)
    if not m:
        return False
    shared_freq = int(m.group(2)) if m.group(2) else None  # "CPU [X%,Y%]@Z" form
    for token in m.group(1).split(","):
        token = token.strip()
        if not token:
            continue
        core = _CPU_CORE.match(token)
        if core is None:  # "off", or anything we do not understand: no reading
            s.cpu_load.append(None)
            s.cpu_freq_mhz.append(None)
            continue
        s.cpu_load.append(_num(core.group(1)))
        s.cpu_freq_mhz.append(int(core.group(2)) if core.group(2) else shared_freq)
    return True


def _parse_power(s: TegrastatsSample, line: str) -> None:
    for m in _POWER.finditer(line):
        name = m.group(1)
        if name in _NOT_RAILS or name == NOT_CONNECTED:
            continue
        s.power_mw[name] = _num(m.group(2))
        s.power_avg_mw[name] = _num(m.group(3))
        if m.group(4) is not None:
            s.power_max_mw[name] = _num(m.group(4))
    total = next((r for r in TOTAL_RAILS if r in s.power_mw), None)
    if total is not None:
        s.total_power_rail = total
        s.total_power_mw = s.power_mw[total]
        s.total_power_avg_mw = s.power_avg_mw[total]
    elif s.power_mw:
        s.total_power_rail = "sum"
        s.total_power_mw = sum(s.power_mw.values())
        s.total_power_avg_mw = sum(s.power_avg_mw.values())


def parse_tegrastats(line: str | bytes) -> TegrastatsSample:
    """Parse one tegrastats line (any JetPack 4-7 format). Raises TegrastatsParseError."""
    if isinstance(line, bytes):
        line = line.decode(errors="replace")
    line = line.strip()
    s = TegrastatsSample()
    found = False

    if m := _TIMESTAMP.match(line):
        s.timestamp = " ".join(m.group(1).split())
    if m := _RAM.search(line):
        s.ram_used_mb, s.ram_total_mb = int(m.group(1)), int(m.group(2))
        found = True
    if m := _SWAP.search(line):
        s.swap_used_mb, s.swap_total_mb = int(m.group(1)), int(m.group(2))
        s.swap_cached_mb = int(m.group(3)) if m.group(3) else None
    found |= _parse_cpu(s, line)
    if m := _EMC.search(line):
        s.emc_load_pct = _num(m.group(1)) if m.group(1) else None
        s.emc_freq_mhz = int(m.group(2)) if m.group(2) else None
    if m := _GR3D.search(line):
        found = True
        s.gpu_load_pct = _num(m.group(1)) if m.group(1) else None
        if m.group(2) is not None:  # per-GPC array "@[621]" / "@[305,305]"
            s.gpu_gpc_freq_mhz = [int(x) for x in m.group(2).replace(" ", "").split(",") if x]
            s.gpu_freq_mhz = max(s.gpu_gpc_freq_mhz) if s.gpu_gpc_freq_mhz else None
        elif m.group(3) is not None:
            s.gpu_freq_mhz = int(m.group(3))
    for m in _TEMP.finditer(line):
        cur, name = float(m.group(2)), m.group(1).lower()
        if cur <= OFFLINE_BELOW_C or name in PLACEHOLDER_SENSORS:
            continue
        s.temps_c[name] = cur
        if m.group(3) is not None:
            s.temps_max_c[name] = float(m.group(3))
    _parse_power(s, line)

    if not found:
        shown = line if len(line) <= 80 else line[:77] + "..."
        raise TegrastatsParseError(
            f"not a tegrastats line (no 'RAM a/bMB', 'CPU [..]' or 'GR3D_FREQ' field): {shown!r}. "
            "Expected output of `tegrastats --interval N`, one sample per line."
        )
    return s
