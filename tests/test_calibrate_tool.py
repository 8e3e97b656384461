"""tools.calibrate: training-split prompts only, the per-slot statistics, the two fits, and the
hybrid replay it reports (on synthetic tables: no model needed)."""

from __future__ import annotations

import gzip
import hashlib
import math

import pytest
import torch

from tools import calibrate as cal

FUNC = '''def f{i}(x, y):
    """Add {i} to the sum of x and y."""
    z = x + y
    w = z + {i}
    return w
'''


def _corpus(tmp_path):
    """A corpus folder whose files.tsv.gz lists a train file, a test file and a train file
    whose text changed on disk since (its sha256 no longer matches)."""
    root = tmp_path / "tree"
    root.mkdir()
    rows = []
    for name, split, i in (("a.py", "train", 1), ("b.py", "test", 2), ("c.py", "train", 3)):
        text = FUNC.format(i=i)
        (root / name).write_text(text)
        rows.append(f"{split}\tsrc/{name}\t{hashlib.sha256(text.encode()).hexdigest()}\t{len(text.encode())}\n")
    (root / "c.py").write_text(FUNC.format(i=4))  # same size, other text
    data = tmp_path / "data"
    data.mkdir()
    with gzip.open(data / "files.tsv.gz", "wt") as f:
        f.writelines(rows)
    return data, root


def test_prompts_come_from_unchanged_training_split_files_only(tmp_path):
    data, root = _corpus(tmp_path)
    prompts, n_docs = cal.train_split_prompts(data, {"src": str(root)}, count=10)
    assert n_docs == 1
    assert [p.path for p in prompts] == ["src/a.py"] and "Add 1" in prompts[0].prompt
    with pytest.raises(FileNotFoundError, match="training-split files"):
        cal.train_split_prompts(data, {"other": str(root)}, count=10)
    with pytest.raises(FileNotFoundError, match="files.tsv"):
        cal.train_split_prompts(tmp_path / "tree", {"src": str(root)}, count=10)


def test_slot_statistics_match_a_direct_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(30, 17, generator=g) * 3
    targets = torch.randint(0, 17, (30,), generator=g)
    targets[:10] = logits[:10].argmax(-1)  # some hits
    hit, conf, nll = cal.slot_statistics(logits, targets)
    assert hit.tolist() == (logits.argmax(-1) == targets).tolist()
    for k in (0, cal.GRID.index(1.0), len(cal.GRID) - 1):
        p = torch.softmax(logits.double() / cal.GRID[k], -1)
        assert torch.allclose(conf[k].double(), p.max(-1).values, rtol=1e-6)
        assert nll[k].item() == pytest.approx(float(-p.gather(1, targets.unsqueeze(1)).log().sum()), rel=1e-9)


def test_platt_fit_recovers_the_map_that_drew_the_labels():
    g = torch.Generator().manual_seed(1)
    conf = torch.rand(20000, generator=g) * 0.98 + 0.01
    a, b = 1.3, 1.5
    p = torch.sigmoid(a * torch.logit(conf.double()) + b)
    hit = torch.rand(20000, generator=g, dtype=torch.float64) < p
    fa, fb = cal.fit_platt(conf, hit)
    assert fa == pytest.approx(a, abs=0.1) and fb == pytest.approx(b, abs=0.1)
    assert cal.platt(conf, fa, fb).mean().item() == pytest.approx(hit.double().mean().item(), abs=0.01)


def _tables(seed: int, n_prompts: int = 4, n: int = 40, d: int = 4, lift: float = 0.0):
    """Synthetic per-prompt tables: drafts right with probability well above their confidence
    (underconfident), confidences at every grid temperature (the raw one at T = 1)."""
    g = torch.Generator().manual_seed(seed)
    tables, nll = [], torch.zeros(d, len(cal.GRID), dtype=torch.float64)
    for _ in range(n_prompts):
        cont = torch.randint(0, 50, (n + d,), generator=g).tolist()
        raw = torch.rand(n, d, generator=g) * 0.6 + 0.35
        right = torch.rand(n, d, generator=g) < (raw + 0.3 + lift).clamp(max=0.999)
        drafts = [[cont[i + j] if bool(right[i, j]) else (cont[i + j] + 1) % 50 for j in range(d)] for i in range(n)]
        conf = torch.stack([raw ** (1.0 / t) for t in cal.GRID])  # any increasing family will do
        tables.append({"cont": cont, "drafts": drafts, "conf": conf, "hit": right, "stop": None})
        for k in range(len(cal.GRID)):
            nll[:, k] += -torch.where(right, conf[k], 1 - conf[k]).double().clamp(min=1e-9).log().sum(0)
    return {"block_size": d, "nll": nll, "tables": tables}


def test_summary_finds_the_underconfidence_and_the_calibrated_replay_verifies_less():
    s = cal.summarise(_tables(2), tau=0.9, min_prefix=2, max_new=40)
    for slot in s["slots"]:
        raw, fitted = slot["as_trained"], slot["platt_fitted"]
        assert slot["agreement"] > raw["mean_confidence"] + 0.1  # underconfident, as built
        assert fitted["ece"] < raw["ece"]
        assert slot["platt"][1] > 0  # the map lifts the confidences
    h = s["hybrid"]
    assert h["platt"]["verifier_call_rate"] < h["as_trained"]["verifier_call_rate"]
    assert h["platt"]["tokens"] == h["as_trained"]["tokens"] == 4 * 40
    assert all(math.isfinite(x) for pair in s["platt"] for x in pair)


def test_write_config_stores_the_pairs_and_refuses_bad_ones(tmp_path):
    import json

    (tmp_path / "bitmtp.json").write_text(json.dumps({"block_size": 2, "mask_token_id": 1, "min_prefix": 1}))
    cal.write_config(tmp_path, [[1.2, 0.5], [1.1, 0.25]])
    assert json.loads((tmp_path / "bitmtp.json").read_text())["confidence_calibration"] == [[1.2, 0.5], [1.1, 0.25]]
    with pytest.raises(ValueError, match="must be > 0"):
        cal.write_config(tmp_path, [[1.2, 0.5], [-1.0, 0.25]])
    assert json.loads((tmp_path / "bitmtp.json").read_text())["confidence_calibration"][1] == [1.1, 0.25]
    with pytest.raises(FileNotFoundError, match="no bitmtp.json"):
        cal.write_config(tmp_path / "nowhere", [[1.0, 0.0]])
