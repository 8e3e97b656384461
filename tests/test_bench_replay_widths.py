"""tools/bench_replay_widths.py's argument handling, on the CPU (the timing needs a GPU)."""

from __future__ import annotations

import pytest

from bitmtp_edge.runtime.replay import ReplayState
from kernels_ampere import tuning
from tools.bench_replay_widths import parse_tables, states


def test_widths_map_to_the_ar_fused_draft_and_verify_replay_states():
    # D = 8: fused widths 8 + 8c after a hit, 9 + 8c after a draft step; drafts 9..16, verify 9
    assert states(8, ["1", "16", "32", "33", "40"]) == {"1": ReplayState(1, 0, "verify"), **{
        str(w): ReplayState(w, 0, "fused") for w in (16, 32, 33, 40)}}
    assert states(8, ["d9", "d16", "v9", "16"]) == {
        "d9": ReplayState(9, 0, "draft"), "d16": ReplayState(16, 0, "draft"), "v9": ReplayState(9, 0, "verify"),
        "16": ReplayState(16, 0, "fused")}
    for bad in ("20", "d8", "d17", "v16", "x9", "d"):
        with pytest.raises(SystemExit, match=f"width '{bad}'"):
            states(8, [bad])


def test_tables_are_named_folders(tmp_path):
    assert parse_tables(f"before={tmp_path},after=shipped") == {"before": tmp_path, "after": tuning.TUNED_DIR}
    with pytest.raises(SystemExit, match="name=folder"):
        parse_tables("before")
    with pytest.raises(SystemExit, match="not a folder"):
        parse_tables(f"x={tmp_path / 'missing'}")
