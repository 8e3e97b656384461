"""tools/table_variants.py: candidate tables for the replay benchmark, on the CPU."""

from __future__ import annotations

import json

import pytest

from kernels_ampere import tuning
from kernels_ampere.tuning import LinearConfig
from tools.table_variants import main, parse_variant

SHAPES = ((3840, 2560), (2560, 2560), (13824, 2560), (2560, 6912))


def test_variants_replace_the_chosen_widths_and_keep_every_other_entry(tmp_path):
    base = tuning.TUNED_DIR / "nvidia_h200.json"
    before = json.loads(base.read_text())["entries"]
    assert main(["--out", str(tmp_path), "--widths", "32,33", "--variant", "more=128:8:4/4/2/4",
                 "--variant", "tiled=64:4:3/4/1/4:32"]) == 0
    for name, slices, block_n, block_m in (("more", (4, 4, 2, 4), 128, 0), ("tiled", (3, 4, 1, 4), 64, 32)):
        entries = json.loads((tmp_path / name / base.name).read_text())["entries"]
        for m in (32, 33):
            for (n, k), s in zip(SHAPES, slices):
                cfg = tuning.find_config(entries, "w2a8_linear", tuning.linear_key(n, k, m, False))
                assert cfg == LinearConfig("mma", block_n, 64, num_warps=8 if block_n == 128 else 4, num_stages=3,
                                           split_k=s, block_m=block_m, fold_lanes=True)
        kept = [e for e in before if not (e["op"] == "w2a8_linear" and e["key"]["M"] in (32, 33))]
        assert [e for e in entries if e in kept] == kept  # nothing else moved
        assert len(entries) == len(kept) + 8


@pytest.mark.parametrize("text, message", [
    ("x=128:8", "is not name="), ("=128:8:1/1/1/1", "is not name="), ("x=128:8:1/1", "2 slice counts for 4"),
    ("x=128:eight:1/1/1/1", "is not name="), ("x=100:8:1/1/1/1", "power of two"), ("x=128:3:1/1/1/1", "WARPS"),
    ("x=128:8:1/0/1/1", "slice count"), ("x=128:8:1/1/1/1:48", "block_m=48")])
def test_bad_variants_say_what_to_write(text, message):
    with pytest.raises(SystemExit, match=message):
        parse_variant(text, 4)


def test_a_missing_base_table_is_named(tmp_path):
    with pytest.raises(SystemExit, match="--base .*missing.json is not a file"):
        main(["--base", str(tmp_path / "missing.json"), "--out", str(tmp_path), "--widths", "32",
              "--variant", "a=128:8:1/1/1/1"])
