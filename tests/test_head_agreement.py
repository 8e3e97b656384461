"""tools/head_agreement.py: the 16-bit verify head against the int8 head on held-out text."""

from __future__ import annotations

import json

import pytest

from tests.test_train import data, one_thread, trained  # noqa: F401  (module fixtures)
from tools import head_agreement as ha
from tools.corpus import load_split
from tools.hf_checkpoint import load_runtime_model


def test_the_same_head_agrees_everywhere_and_the_int8_head_is_measured(trained, data):  # noqa: F811
    model, _ = load_runtime_model(trained / "compact")
    tokens = load_split(data, "test")
    r8 = ha.compare_heads(model, tokens, 32, 4, "cpu")
    assert r8["positions"] == 4 * 32 and r8["windows"] == 4
    assert 0.0 < r8["argmax_agreement"] <= 1.0
    assert r8["argmax_disagreements"] == round((1 - r8["argmax_agreement"]) * r8["positions"])
    # with no int8 head installed the draft logits are the verify head's: nothing differs
    model.draft_head_int8 = None
    same = ha.compare_heads(model, tokens, 32, 4, "cpu")
    assert same["argmax_agreement"] == 1.0 and same["ntp_loss_int8"] == same["ntp_loss_16bit"]
    assert same["ntp_loss_16bit"] == r8["ntp_loss_16bit"]  # the same 16-bit head either way
    with pytest.raises(ValueError, match="fewer than one window"):
        ha.compare_heads(model, tokens[:10], 32, 4, "cpu")


def test_command_writes_the_report_and_refuses_a_bad_model(trained, data, tmp_path):  # noqa: F811
    out = tmp_path / "report"
    assert ha.main(["--data", str(data), "--model", f"tiny={trained / 'compact'}", "--window", "32",
                    "--max-windows", "2", "--out", str(out)]) == 0
    report = json.loads((out / "head_agreement.json").read_text())
    assert report["models"]["tiny"]["positions"] == 64
    assert "| tiny | 64 |" in (out / "head_agreement.md").read_text()
    with pytest.raises(SystemExit, match="NAME=CHECKPOINT_FOLDER"):
        ha.main(["--data", str(data), "--model", "tiny", "--out", str(out)])
