"""tools/bench_replay_widths.py's argument handling, on the CPU (the timing needs a GPU)."""

from __future__ import annotations

import pytest

from bitmtp_edge.runtime.replay import ReplayState
from kernels_ampere import tuning
from tools.bench_replay_widths import parse_tables, states


def test_widths_map_to_the_ar_fused_draft_and_verify_replay_states():
    # D = 8: fused widths 8 + 8c (after a hit and after a draft step alike); drafts 9..16, verify 9
    assert states(8, ["1", "16", "32", "40", "72"]) == {"1": ReplayState(1, 0, "verify"), **{
        str(w): ReplayState(w, 0, "fused") for w in (16, 32, 40, 72)}}
    assert states(8, ["d9", "d16", "v9", "16"]) == {
        "d9": ReplayState(9, 0, "draft"), "d16": ReplayState(16, 0, "draft"), "v9": ReplayState(9, 0, "verify"),
        "16": ReplayState(16, 0, "fused")}
    for bad in ("20", "33", "80", "d8", "d17", "v16", "x9", "d"):
        with pytest.raises(SystemExit, match=f"width '{bad}'"):
            states(8, [bad])


def test_tables_are_named_folders(tmp_path):
    assert parse_tables(f"before={tmp_path},after=shipped") == {"before": tmp_path, "after": tuning.TUNED_DIR}
    with pytest.raises(SystemExit, match="name=folder"):
        parse_tables("before")
    with pytest.raises(SystemExit, match="not a folder"):
        parse_tables(f"x={tmp_path / 'missing'}")


def test_table_none_is_an_empty_folder_so_every_launch_takes_the_defaults():
    folder = parse_tables("board=none")["board"]
    assert folder.is_dir() and not any(folder.iterdir())


def test_sms_is_checked_before_any_gpu_work(monkeypatch, capsys):
    from tools import bench_replay_widths as brw

    with pytest.raises(SystemExit, match="--sms -1"):
        brw.main(["--sms", "-1"])
    monkeypatch.setattr(brw.torch.cuda, "is_available", lambda: False)
    assert brw.main(["--sms", "8"]) == 2 and "needs a CUDA device" in capsys.readouterr().err


def test_sm_count_follows_bitmtp_sm_count(monkeypatch):
    """The untuned defaults can be sized for part of a GPU (a green context) or a board."""
    import torch

    cuda = torch.device("cuda")
    monkeypatch.setenv(tuning.SM_COUNT_ENV, "8")
    tuning.sm_count.cache_clear()
    try:
        assert tuning.sm_count(cuda) == 8  # read before any device query: no GPU needed
        assert tuning.sm_count(torch.device("cpu")) == 1
        for bad in ("0", "-3", "eight", "8.5"):
            monkeypatch.setenv(tuning.SM_COUNT_ENV, bad)
            tuning.sm_count.cache_clear()
            with pytest.raises(ValueError, match=f"BITMTP_SM_COUNT='{bad}'"):
                tuning.sm_count(cuda)
    finally:
        monkeypatch.delenv(tuning.SM_COUNT_ENV)
        tuning.sm_count.cache_clear()
