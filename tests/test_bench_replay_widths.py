"""tools/bench_replay_widths.py's argument handling, on the CPU (the timing needs a GPU)."""

from __future__ import annotations

import pytest

from bitmtp_edge.runtime.replay import ReplayState
from kernels_ampere import tuning
from tools.bench_replay_widths import parse_tables, states


def test_widths_map_to_the_ar_and_fused_replay_states():
    # D = 8: fused widths 8 + 8c after a hit, 9 + 8c after a draft step
    assert states(8, [1, 16, 32, 33, 40]) == [ReplayState(1, 0, "verify")] + [
        ReplayState(w, 0, "fused") for w in (16, 32, 33, 40)]
    with pytest.raises(SystemExit, match="width 20"):
        states(8, [20])


def test_tables_are_named_folders(tmp_path):
    assert parse_tables(f"before={tmp_path},after=shipped") == {"before": tmp_path, "after": tuning.TUNED_DIR}
    with pytest.raises(SystemExit, match="name=folder"):
        parse_tables("before")
    with pytest.raises(SystemExit, match="not a folder"):
        parse_tables(f"x={tmp_path / 'missing'}")
