"""``tools/bench_kernels.py``'s summary of the 2B stack: the untuned default against the table."""

from __future__ import annotations

from kernels_ampere import tuning
from tools.bench_kernels import summarize


def stack_rows(us: dict[str, dict[int, float]]) -> list[dict]:
    return [{"section": "stack", "model": "bitnet-2b", "scheme": scheme, "M": m, "us": t, "weights_per_sm_clock": 1.0}
            for scheme, widths in us.items() for m, t in widths.items()]


def test_the_shipped_table_counts_as_tuned_only_where_the_gpu_has_one():
    untuned = f"{tuning.W2A8_DEFAULT_GENERATION} untuned"
    rows = stack_rows({"shipped": {1: 500.0, 24: 900.0}, untuned: {1: 480.0, 24: 1080.0}})
    with_table = summarize([], 4000.0, rows, shipped_is_table=True)
    assert with_table["2b_untuned_over_tuned_worst"] == 1.2  # 1080 / 900 at M = 24
    assert with_table["target_untuned_within_15pct_of_tuned"] is False
    # without a table "shipped" is the default itself: nothing to compare
    assert "2b_untuned_over_tuned_worst" not in summarize([], 4000.0, rows)
    within = stack_rows({"shipped": {1: 500.0, 24: 900.0}, untuned: {1: 480.0, 24: 920.0}})
    assert summarize([], 4000.0, within, shipped_is_table=True)["target_untuned_within_15pct_of_tuned"] is True
