"""The kernels package surface: what it imports, the tuned tables and their lookup order."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_ampere import tuning
from kernels_ampere.tuning import DOT, GEMV, MMA, HeadConfig, LinearConfig

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_package_does_not_import_triton():
    code = ("import sys, kernels_ampere as k; assert 'triton' not in sys.modules, 'triton imported'; "
            "assert callable(k.pack_ternary) and k.PACKING_LAYOUT")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_kernels_are_imported_from_their_modules_and_bound_by_the_ops():
    """No name is resolved at run time: the package exports the packing layout only, and
    the backends' operator set holds the very functions of the kernel modules."""
    pytest.importorskip("triton")
    code = ("import os, torch\n"
            "if not torch.cuda.is_available(): os.environ['TRITON_INTERPRET'] = '1'\n"
            "import kernels_ampere as k\n"
            "from kernels_ampere.w2a8 import w2a8_linear, w2a8_linear_reference\n"
            "from kernels_ampere.attention import small_width_attention_reference\n"
            "from bitmtp_edge.backends.ops import kernel_ops, twin_ops\n"
            "assert kernel_ops().w2a8_linear is w2a8_linear and twin_ops().w2a8_linear is w2a8_linear_reference\n"
            "assert twin_ops().small_width_attention is small_width_attention_reference\n"
            "assert not hasattr(k, 'w2a8_linear') and k.__all__ == ['PACKING_LAYOUT', 'pack_ternary', 'unpack_ternary']\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


ENTRIES = [
    {"op": "w2a8_linear", "key": tuning.linear_key(2560, 2560, 1, False),
     "config": {"kernel": GEMV, "block_n": 4, "block_kb": 512, "num_warps": 2, "num_stages": 1}},
    {"op": "w2a8_linear", "key": tuning.linear_key(2560, 2560, 9, False),
     "config": {"kernel": DOT, "block_n": 64, "block_kb": 128, "num_warps": 4, "num_stages": 3}},
    {"op": "w2a16_linear", "key": tuning.linear_key(2560, 2560, 1, False),
     "config": {"kernel": DOT, "block_n": 32, "block_kb": 64, "num_warps": 4, "num_stages": 2}},
]


def test_lookup_prefers_the_exact_key_then_the_nearest_tuned_width():
    assert tuning.find_config(ENTRIES, "w2a8_linear", tuning.linear_key(2560, 2560, 1, False)) == \
        LinearConfig(GEMV, 4, 512, 2, 1)
    nearest = tuning.find_config(ENTRIES, "w2a8_linear", tuning.linear_key(2560, 2560, 7, False))
    assert nearest == LinearConfig(DOT, 64, 128, 4, 3)
    tie = tuning.find_config(ENTRIES, "w2a8_linear", tuning.linear_key(2560, 2560, 5, False))
    assert tie.kernel == GEMV  # |5-1| == |5-9|: the smaller width wins


def test_lookup_answers_from_the_table_in_use(tmp_path, monkeypatch):
    """``lookup`` remembers its answers per loaded table: the same config as ``find_config``
    for exact and nearest keys, and a table loaded again (another TUNED_DIR, or the file
    rewritten and the table cache cleared, as ``bitmtp tune`` and the replay bench do)
    answers from the new entries, not from what the old ones said."""
    import torch

    def write(folder, block_n):
        folder.mkdir(exist_ok=True)
        entries = [dict(ENTRIES[0], config=dict(ENTRIES[0]["config"], block_n=block_n)), *ENTRIES[1:]]
        (folder / "cpu.json").write_text(json.dumps({"gpu": "cpu", "entries": entries}))

    cpu = torch.device("cpu")
    write(tmp_path / "a", 4)
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path / "a")
    tuning.load_table.cache_clear()
    try:
        for m in (1, 7, 9):
            key = tuning.linear_key(2560, 2560, m, False)
            assert tuning.lookup("w2a8_linear", key, cpu) == tuning.find_config(ENTRIES, "w2a8_linear", key)
            assert tuning.lookup("w2a8_linear", key, cpu) == tuning.find_config(ENTRIES, "w2a8_linear", key)
        assert tuning.lookup("w2a8_linear", tuning.linear_key(3840, 2560, 1, False), cpu) is None
        m1 = tuning.linear_key(2560, 2560, 1, False)
        write(tmp_path / "a", 16)  # rewritten: the cached table still holds block_n 4 until cleared
        assert tuning.lookup("w2a8_linear", m1, cpu).block_n == 4
        tuning.load_table.cache_clear()
        assert tuning.lookup("w2a8_linear", m1, cpu).block_n == 16
        write(tmp_path / "b", 8)
        monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path / "b")
        tuning.load_table.cache_clear()
        assert tuning.lookup("w2a8_linear", m1, cpu).block_n == 8
    finally:
        monkeypatch.undo()
        tuning.load_table.cache_clear()


def test_lookup_stays_within_the_row_tile_of_the_width():
    """M = 31 pads to the 32 rows of M = 27's entry, not to the 64 of M = 33's, although 33
    is nearer; M = 17 also takes M = 27's (32 rows), not M = 16's; M = 41 and 64 M = 33's."""
    entries = [{"op": "w2a8_linear", "key": tuning.linear_key(2560, 2560, m, False),
                "config": {"kernel": kind, "block_n": 64, "block_kb": 64, "split_k": sk}}
               for m, kind, sk in ((16, MMA, 4), (27, MMA, 2), (33, DOT, 1), (80, MMA, 1))]
    pick = lambda m: tuning.find_config(entries, "w2a8_linear", tuning.linear_key(2560, 2560, m, False))  # noqa: E731
    assert [tuning.row_tile(m) for m in (1, 16, 17, 32, 33, 64, 65, 200)] == [16, 16, 32, 32, 64, 64, 128, 128]
    assert pick(31) == pick(17) == pick(27) == LinearConfig(MMA, 64, 64, split_k=2)
    assert pick(33) == pick(41) == pick(64) == LinearConfig(DOT, 64, 64)
    assert pick(9) == pick(16) == LinearConfig(MMA, 64, 64, split_k=4) and pick(120) == pick(80)


def test_lookup_misses_other_shapes_ops_and_scale_kinds():
    assert tuning.find_config(ENTRIES, "w2a8_linear", tuning.linear_key(3840, 2560, 1, False)) is None
    assert tuning.find_config(ENTRIES, "w2a8_linear", tuning.linear_key(2560, 2560, 1, True)) is None
    assert tuning.find_config(ENTRIES, "int8_head_argmax", {"V": 1, "H": 2, "M": 1}) is None


def test_fallbacks_and_candidates_are_valid_configs():
    for m in range(1, 18):
        for grouped in (False, True):
            assert tuning.default_linear(m, grouped, generation="v1").kernel == (GEMV if m <= 2 else DOT)
            v3 = tuning.default_linear(m, grouped, n=2560, k=2560, generation="v3")
            assert v3.kernel == (GEMV if m <= 2 else tuning.MMA if m <= tuning.MMA_MAX_M else DOT)
            assert v3.prefetch == (m == 1)
            assert tuning.default_linear(m, grouped, weight_only=True).kernel == (GEMV if m == 1 else DOT)
            for n, k in ((2560, 6912), (13824, 2560), (1024, 2048)):
                cfg = tuning.default_linear(m, grouped, n=n, k=k)
                assert 1 <= cfg.split_k <= k // 128
                v2 = tuning.default_linear(m, grouped, n=n, k=k, generation="v2")
                assert v2.kernel == (tuning.LANES if m <= tuning.LANES_MAX_M else tuning.MMA)
                assert 1 <= v2.split_k <= k // 128
                cands = tuning.linear_candidates(m, n, k, grouped)
                assert cands and len(set(cands)) == len(cands)
                kinds = {c.kernel for c in cands}
                assert kinds == ({GEMV, tuning.LANES, tuning.MMA} | ({DOT} if m == 2 else set()) if m <= 2
                                 else {tuning.MMA, DOT})
                # the weight-only linear has none of the W2A8-only kernels: never offered to it
                wo = {c.kernel for c in tuning.linear_candidates(m, n, k, grouped, weight_only=True)}
                assert wo == ({GEMV, DOT} if m <= 2 else {DOT})
    with pytest.raises(ValueError, match="block_kb"):
        LinearConfig(GEMV, 8, 48)
    with pytest.raises(ValueError, match="kernel"):
        LinearConfig("cublas", 8, 64)


def test_the_tuner_offers_a_boards_default_launches():
    """``bitmtp tune`` on an Orin times what the board's untuned default launches (v8's four warps
    of 128 / 256 weight rows, the tail tile at 33..48) among its candidates, so a board's table can
    keep them where they win."""
    for m in (1, 2, 9, 16, 27, 33, 40, 64, 80, 128):
        for n, k in ((2560, 6912), (13824, 2560), (3840, 2560)):
            for sms in (8, 16):
                board = tuning.default_linear(m, False, n=n, k=k, sms=sms)
                assert board in tuning.linear_candidates(m, n, k, False), (m, n, k, sms, board)


def test_gpu_table_names():
    assert tuning.gpu_table_name("NVIDIA H200") == "nvidia_h200"
    assert tuning.gpu_table_name("Orin (nvgpu)") == "orin_nvgpu"


def test_shipped_tables_are_well_formed():
    for path in sorted(tuning.TUNED_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        assert tuning.gpu_table_name(data["gpu"]) == path.stem, f"{path.name} holds {data['gpu']}"
        for e in data["entries"]:
            cls = {"w2a8_linear": LinearConfig, "w2a16_linear": LinearConfig, "int8_head_argmax": HeadConfig,
                   "f16_head_argmax": HeadConfig}.get(e["op"], tuning.AttentionConfig)
            cls(**e["config"])  # validates
