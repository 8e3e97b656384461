"""Power, thermal, clock and memory monitoring behind one interface.

* :func:`parse_tegrastats` — one tegrastats line (JetPack 4 to 7) -> :class:`TegrastatsSample`.
* :class:`Sampler` — background thread over a source (``auto`` | ``tegrastats`` | ``jtop`` |
  ``nvml`` | ``psutil``) producing timestamped :class:`Sample` s; :meth:`Sampler.window` /
  :meth:`Sampler.mark_window` give a :class:`WindowStats` (energy J, average power W, peak
  temperatures, clock ranges, peak memory) over exactly a decode window.

Nothing is imported or started at import time beyond the standard library and psutil;
jtop and NVML are imported only when their source is opened.
"""

from bitmtp_edge.jetson.monitor.sample import PollingSource, Sample, Source, SourceUnavailable
from bitmtp_edge.jetson.monitor.sampler import Sampler, Window, WindowStats, integrate_energy, summarize_window
from bitmtp_edge.jetson.monitor.sources import (
    SOURCE_KINDS,
    JtopSource,
    NvmlSource,
    PsutilSource,
    TegrastatsSource,
    make_source,
    open_source,
)
from bitmtp_edge.jetson.monitor.tegrastats import TegrastatsParseError, TegrastatsSample, parse_tegrastats

__all__ = [
    "SOURCE_KINDS",
    "JtopSource",
    "NvmlSource",
    "PollingSource",
    "PsutilSource",
    "Sample",
    "Sampler",
    "Source",
    "SourceUnavailable",
    "TegrastatsParseError",
    "TegrastatsSample",
    "TegrastatsSource",
    "Window",
    "WindowStats",
    "integrate_energy",
    "make_source",
    "open_source",
    "parse_tegrastats",
    "summarize_window",
]
