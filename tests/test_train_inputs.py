"""``python -m tools.train`` given what a new user gives it: folders that are not checkpoints
or corpora, flag values no run can use, ``--resume`` of a run that does not match. Each is
refused with a message naming the flag or file (exit 1, no traceback) before anything is
written under ``--out``; a save interrupted between ``latest/`` and ``resume.pt`` is never
resumed as a mixed state."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import one_thread  # noqa: F401 - the fixture pytestmark uses
from tests.test_train_init import data, sources  # noqa: F401 - fixtures
from tools.train import TrainConfig, Trainer, main

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--preset", "tiny", "--seq-len", "32", "--block-size", "4", "--blocks", "4", "--batch-size", "4",
        "--warmup-steps", "2", "--max-steps", "4", "--eval-every", "0", "--eval-batches", "1", "--log-every", "1",
        "--device", "cpu", "--compile", "off"]


def tiny(data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(data=str(data), out=str(out), preset="tiny", seq_len=32, block_size=4, blocks=4, batch_size=4,
                lr=2e-3, warmup_steps=2, max_steps=4, eval_every=0, eval_batches=1, log_every=1, save_every_s=1e9,
                device="cpu", compile="off")
    base.update(kw)
    return TrainConfig(**base)


def refused(capsys, argv: list[str]) -> str:
    """Run the CLI, expect a user error: exit 1 and a one-line message (an exception that
    escaped would propagate here instead of SystemExit)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 1, err
    assert err.startswith("Error: ") and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def paused(data, tmp_path_factory) -> Path:  # noqa: F811
    """A tiny run paused at step 2 (latest/ + resume.pt)."""
    out = tmp_path_factory.mktemp("paused") / "run"
    Trainer(tiny(data, out, stop_at=2), log=lambda m: None).run()
    return out


# -- flag values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,match", [
    (["--lr", "0"], "--lr 0.0: the learning rate must be > 0"),
    (["--eval-batches", "0"], "--eval-batches 0"),  # failed after the last step, nothing saved
    (["--log-every", "0"], "--log-every 0"),
    (["--batch-size", "0"], "--batch-size 0"),
    (["--max-steps", "-3"], "--max-steps -3"),
    (["--mtp-weight", "-1"], "--mtp-weight -1.0"),  # trained the SFT baseline silently
    (["--kl-weight", "-1"], "--kl-weight -1.0"),
    (["--mtp-weight", "0", "--kl-weight", "1"], "--kl-weight 1.0: a term of the block slots' loss"),  # ignored
    (["--grad-clip", "0"], "--grad-clip 0.0"),  # zeroed every gradient
    (["--slot-weights", "1,2"], "2 values; give one per slot"),
    (["--slot-weights", "1,1,-1,1"], "--slot-weights 1,1,-1,1"),  # maximised slot 2's cross-entropy
    (["--slot-weights", "0,0,0,0"], "one at least > 0"),
    (["--slot-weights", "nan,1,1,1"], "finite"),  # a NaN loss at step 1, exit 0
    (["--mtp-weight", "0", "--slot-weights", "1,1,1,1"], "needs --mtp-weight > 0"),
    (["--block-size", "1"], "--block-size 1"),
    (["--block-size", "2"], "--min-prefix 3"),  # the default m: a ConfigError traceback
    (["--tau", "1.5"], "--tau 1.5"),
    (["--blocks", "40"], "--blocks 40"),
    (["--distill-frac", "1.5"], "--distill-frac 1.5"),
    (["--max-steps", "0", "--time-budget-s", "-5"], "--time-budget-s -5.0"),
])
def test_bad_flag_values_are_refused_by_name(data, tmp_path, capsys, flags, match):  # noqa: F811
    out = tmp_path / "run"
    err = refused(capsys, ["--data", str(data), "--out", str(out), *TINY, *flags])
    assert match in err
    assert not out.exists(), "nothing is written for a run that cannot start"


def test_out_that_is_a_file(data, tmp_path, capsys):  # noqa: F811
    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "f", tmp_path / "f" / "run"):
        err = refused(capsys, ["--data", str(data), "--out", str(out), *TINY])
        assert f"--out {out}" in err and "is a file" in err


# -- --init and --data folders -------------------------------------------------------------------

@pytest.fixture(scope="module")
def own_corpus(tmp_path_factory) -> Path:
    """A corpus with its own trained tokenizer (not the fake checkpoints')."""
    from tests.test_corpus_tokenizer import write_tree
    from tools.corpus import CorpusOptions, SourceRoot, build

    root = tmp_path_factory.mktemp("own_src")
    write_tree(root, n=60)
    out = tmp_path_factory.mktemp("own_corpus")
    build(out, [SourceRoot("demo", root)], CorpusOptions(vocab_size=384, val_permille=100, test_permille=150),
          log=lambda m: None)
    return out


def test_init_folders_that_cannot_seed_a_run(sources, data, own_corpus, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    run = ["--out", str(out), *TINY]
    # a corpus folder is no checkpoint: say so, not "tokenizer.json missing"
    err = refused(capsys, ["--data", str(data), "--init", str(data), *run])
    assert f"--init {data}: no config.json, so not a checkpoint" in err
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(sources["bitnet-online"] / name, bare / name)
    err = refused(capsys, ["--data", str(data), "--init", str(bare), *run])
    assert f"{bare / 'tokenizer.json'}: missing" in err
    (bare / "tokenizer.json").write_text("not a tokenizer")
    err = refused(capsys, ["--data", str(data), "--init", str(bare), *run])
    assert "not a Hugging Face tokenizers file" in err
    # a corpus encoded with another tokenizer
    err = refused(capsys, ["--data", str(own_corpus), "--init", str(sources["bitnet-online"]), *run])
    assert f"corpus build --tokenizer {sources['bitnet-online']}" in err
    assert not out.exists()


def test_data_folders_that_are_not_a_usable_corpus(sources, data, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"

    def err_for(folder: Path) -> str:
        return refused(capsys, ["--data", str(folder), "--out", str(out), *TINY])

    assert "no corpus index; build one" in err_for(tmp_path / "missing")
    # a checkpoint: building a corpus into it would overwrite its tokenizer
    assert f"--tokenizer {sources['bitnet-online']} --out NEW_FOLDER" in err_for(sources["bitnet-online"])

    def broken(name: str, how) -> Path:
        d = tmp_path / name
        shutil.copytree(data, d)
        how(d)
        return d

    index = json.loads((data / "corpus.json").read_text())
    cases = {
        "not valid JSON": broken("badjson", lambda d: (d / "corpus.json").write_text("{")),
        "not a corpus index written by tools.corpus": broken(
            "nokeys", lambda d: (d / "corpus.json").write_text(json.dumps({"vocab_size": 3}))),
        "val_000.bin: missing": broken("noshard", lambda d: (d / "val_000.bin").unlink()),
        "train_000.bin: 100 bytes": broken("cut", lambda d: (d / "train_000.bin").write_bytes(b"\0" * 100)),
        "the val split is empty": broken("noval", lambda d: (d / "corpus.json").write_text(json.dumps(
            {**index, "shards": {**index["shards"], "val": []}}))),
    }
    for match, folder in cases.items():
        assert match in err_for(folder), match
    # an index with a key a newer tools.corpus added still loads
    extra = broken("extra", lambda d: (d / "corpus.json").write_text(json.dumps({**index, "new_field": 1})))
    from tools.corpus import CorpusIndex

    assert CorpusIndex.load(extra).corpus_sha256 == index["corpus_sha256"]
    assert not out.exists()


def test_distill_rows_that_cannot_train(data, tmp_path, capsys):  # noqa: F811
    rows = tmp_path / "distill"
    rows.mkdir()
    meta = {"prompt_len": 10, "teacher": "t", "corpus_sha256": "x", "generate_s": 0.0}
    (rows / "distill_000.json").write_text(json.dumps(meta))
    np.save(rows / "rows_000.npy", np.full((4, 48), 600, dtype=np.uint16), allow_pickle=False)
    run = ["--data", str(data), "--out", str(tmp_path / "run"), *TINY, "--distill", str(rows)]
    err = refused(capsys, run)  # ids of another tokenizer: an IndexError mid-step before
    assert "token id 600, the model's vocabulary has 512" in err
    np.save(rows / "rows_000.npy", np.full((4, 48), 5, dtype=np.uint16), allow_pickle=False)
    # every row of the batch a distill row: no NTP target, a NaN loss at step 1 (exit 0)
    assert "--distill-frac 1.0: all 4 rows" in refused(capsys, [*run, "--distill-frac", "1"])
    assert "needs the MTP term" in refused(capsys, [*run, "--mtp-weight", "0"])


# -- --resume ------------------------------------------------------------------------------------

def test_resume_without_a_run(data, tmp_path, capsys):  # noqa: F811
    err = refused(capsys, ["--data", str(data), "--out", str(tmp_path / "run"), *TINY, "--resume"])
    assert "resume.pt: nothing to resume from; run without --resume first" in err


@pytest.mark.parametrize("flags,match", [
    (["--block-size", "8"], "trained with --block-size 4; this command gives --block-size 8"),
    (["--mtp-weight", "0"], "--mtp-weight 1.0"),
    (["--seq-len", "64"], "--seq-len 32"),
    (["--preset", "small"], "the model (--preset / --init) hidden_size 128"),
    (["--slot-weights", "1,1,1,2"], "--slot-weights None"),
])
def test_resume_with_other_settings_is_refused(paused, data, capsys, flags, match):  # noqa: F811
    """Such a resume went on silently (or failed in load_state_dict): a D=4 run resumed as D=8
    wrote a D=8 bitmtp.json over weights trained half as D=4."""
    before = sorted(p.name for p in paused.iterdir())
    stamp = (paused / "resume.pt").stat().st_mtime_ns
    err = refused(capsys, ["--data", str(data), "--out", str(paused), *TINY, "--resume", *flags])
    assert match in err and f"--init {paused / 'latest'} --out NEW" in err
    assert sorted(p.name for p in paused.iterdir()) == before and (paused / "resume.pt").stat().st_mtime_ns == stamp


def test_resume_with_another_init_is_refused(paused, sources, data, capsys):  # noqa: F811
    err = refused(capsys, ["--data", str(data), "--out", str(paused), *TINY, "--resume",
                           "--init", str(sources["bitnet-packed"])])
    assert "trained with --init None" in err and f"gives --init {Path(sources['bitnet-packed']).resolve()}" in err


def test_resume_from_a_moved_init_or_distill_folder_goes_on(sources, data, tmp_path):  # noqa: F811
    """Paths move between calls (a device's checkout, a copied run folder): given or not must
    match, the folder itself need not; the log says what moved."""
    src = tmp_path / "init-a"
    shutil.copytree(sources["bitnet-packed"], src)
    run = tmp_path / "run"
    Trainer(tiny(data, run, init=str(src), stop_at=2), log=lambda m: None).run()
    moved = tmp_path / "init-b"
    src.rename(moved)
    s = Trainer(tiny(data, run, init=str(moved), resume=True), log=lambda m: None).run()
    log = json.loads((run / "train_log.json").read_text())
    assert s["steps"] == 4 and any("--init is" in e and "init-a" in e for e in log["events"])


def test_resume_may_change_the_optimisation(paused, data, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(paused, run)
    s = Trainer(tiny(data, run, resume=True, max_steps=5, lr=1e-2, batch_size=8), log=lambda m: None).run()
    assert s["steps"] == 5


def test_interrupted_save_is_completed_or_refused(paused, data, tmp_path, monkeypatch):  # noqa: F811
    """A save stopped after latest/ was replaced but before resume.pt was: latest/ holds step
    4's weights, resume.pt step 2's optimiser and data state. --resume used to mix the two."""
    run = tmp_path / "run"
    shutil.copytree(paused, run)
    replace = os.replace

    def interrupted(src, dst):
        if Path(dst).name == "resume.pt":
            raise KeyboardInterrupt
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Trainer(tiny(data, run, resume=True), log=lambda m: None).run()
    monkeypatch.setattr(os, "replace", replace)
    assert torch.load(run / "resume.pt", weights_only=True)["step"] == 2
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    (broken / "resume.pt.tmp").unlink()
    # resume.pt.tmp holds the state that goes with latest/: the save is completed
    t = Trainer(tiny(data, run, resume=True, max_steps=6), log=lambda m: None)
    assert t.step == 4 and any("interrupted" in e for e in t.events)
    assert t.run()["steps"] == 6 and torch.load(run / "resume.pt", weights_only=True)["step"] == 6
    # without it, the pair is refused
    with pytest.raises(ValueError, match="holds step 4 and .* step 2: a save was interrupted"):
        Trainer(tiny(data, broken, resume=True), log=lambda m: None)


def test_resume_state_that_is_not_the_trainers(paused, data, tmp_path, capsys):  # noqa: F811
    """resume.pt is read with weights_only (no code runs from a pickle); a file it cannot
    read is named, not a traceback."""
    import pickle

    run = tmp_path / "run"
    shutil.copytree(paused, run)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (run / "resume.pt").write_bytes(pickle.dumps({"step": Payload()}, protocol=2))
    argv = ["--data", str(data), "--out", str(run), *TINY, "--resume"]
    assert f"{run / 'resume.pt'}: not a resume state tools.train wrote" in refused(capsys, argv)
    assert not marker.exists()
    (run / "resume.pt").write_bytes(b"\0" * 10)
    assert "not a resume state" in refused(capsys, argv)
    shutil.copy(paused / "resume.pt", run / "resume.pt")
    shutil.rmtree(run / "latest")
    assert "latest: missing or incomplete" in refused(capsys, argv)


def test_a_diverged_run_writes_no_final_checkpoint_and_fails(data, tmp_path):  # noqa: F811
    """A NaN loss used to end as stop_reason "diverged" with exit status 0 and NaN final/ and
    compact/ checkpoints that looked trained. Now the last periodic save stays the good one."""
    from safetensors.torch import load_file

    from tools.train import TrainingDiverged

    run = tmp_path / "run"
    trainer = Trainer(tiny(data, run, max_steps=8, save_every_s=0.0), log=lambda m: None)
    poison = trainer.model.model.embed_tokens.register_forward_hook(
        lambda mod, args, out: out * float("nan") if trainer.step >= 3 else out)
    with pytest.raises(TrainingDiverged, match="non-finite at step 4") as e:
        trainer.run()
    poison.remove()
    assert "--resume it with a lower --lr" in str(e.value)
    assert not (run / "final").exists() and not (run / "compact").exists()
    log = json.loads((run / "train_log.json").read_text())
    assert log["summary"]["stop_reason"] == "diverged"
    weights = load_file(str(run / "latest" / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())  # the last save is a good one


def test_one_non_finite_batch_is_skipped_not_trained_on(data, tmp_path):  # noqa: F811
    """A 56M D = 8 run lost every weight to one NaN gradient at step 925 (its loss smooth until
    then): the update of such a batch is now skipped and counted, and the run goes on."""
    run = tmp_path / "run"
    trainer = Trainer(tiny(data, run, max_steps=8), log=lambda m: None)
    poison = trainer.model.model.embed_tokens.register_forward_hook(
        lambda mod, args, out: out * float("nan") if trainer.step == 3 else out)
    summary = trainer.run()
    poison.remove()
    assert summary["stop_reason"] == "max_steps" and summary["steps"] == 8
    assert summary["skipped_steps"] == 1
    log = json.loads((run / "train_log.json").read_text())
    losses = {h["step"]: h["loss"] for h in log["history"]}
    assert all(math.isfinite(losses[s]) for s in (3, 5, 8))  # before and after the bad batch
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert (run / "compact").is_dir()


def test_blocks_zero_with_an_mtp_weight_is_refused(data, tmp_path):  # noqa: F811
    """It trained an AR-only model without a word, although --mtp-weight asked for blocks."""
    with pytest.raises(ValueError, match="--blocks 0: no mask blocks for --mtp-weight 1.0"):
        Trainer(tiny(data, tmp_path / "run", blocks=0, mtp_weight=1.0), log=lambda m: None)
    assert not (tmp_path / "run").exists()
    Trainer(tiny(data, tmp_path / "sft", blocks=0, mtp_weight=0.0), log=lambda m: None)  # the SFT baseline


def test_a_new_run_into_a_folder_holding_a_run_is_refused(paused, data, tmp_path):  # noqa: F811
    """Its first save overwrote the run there (latest/, resume.pt) without a word."""
    run = tmp_path / "run"
    shutil.copytree(paused, run)
    stamp = (run / "resume.pt").stat().st_mtime_ns
    with pytest.raises(ValueError, match="holds a training run \\(resume.pt\\); continue it with --resume"):
        Trainer(tiny(data, run), log=lambda m: None)
    assert (run / "resume.pt").stat().st_mtime_ns == stamp
    (run / "resume.pt").unlink()  # cut before its first save: nothing to lose, it may start over
    assert Trainer(tiny(data, run), log=lambda m: None).run()["steps"] == 4


def test_a_seq_len_beyond_the_models_positions_is_refused(sources, data, tmp_path):  # noqa: F811
    """It trained RoPE positions past the --init config's max_position_embeddings, which the
    exported artifact then refuses (or decodes past what the model was built for)."""
    src = tmp_path / "init"
    shutil.copytree(sources["bitnet-packed"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = 16
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="--seq-len 32: the model has 16 positions"):
        Trainer(tiny(data, tmp_path / "run", init=str(src)), log=lambda m: None)
    assert not (tmp_path / "run").exists()


def test_out_may_not_be_an_input_folder(sources, data, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="is the --data folder"):
        Trainer(tiny(data, data), log=lambda m: None)
    with pytest.raises(ValueError, match="is the --init folder"):
        Trainer(tiny(data, sources["bitnet-packed"], init=str(sources["bitnet-packed"])), log=lambda m: None)
