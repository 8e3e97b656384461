"""The evaluation and data CLIs (``tools.eval_acceptance``, ``tools.calibrate``,
``tools.distill``) and their readers (prompt files, checkpoints) given what a new user gives
them: an AR-only checkpoint, an exported artifact, a malformed prompt file. Each is refused
before the long work starts, with a message naming the flag or file (exit 1, no traceback)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import one_thread  # noqa: F401 - the fixture pytestmark uses
from tests.test_train_init import data, sources  # noqa: F401 - fixtures
from tools import fake_checkpoints as fake

pytestmark = pytest.mark.usefixtures("one_thread")


def refused(capsys, main, argv: list[str]) -> str:
    """Run a CLI, expect a user error: exit 1 (or 2 for click's own) and a message, no traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code in (1, 2), err
    assert "Error: " in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def ckpts(sources, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """A BitMTP checkpoint, an AR-only one, and an exported artifact folder."""
    d = tmp_path_factory.mktemp("eval_ckpts")
    artifact = d / "artifact"
    artifact.mkdir()
    (artifact / "manifest.json").write_text("{}")
    return {"bitmtp": fake.make_bitmtp(d / "bitmtp"), "ar": sources["bitnet-online"], "artifact": artifact}


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# -- prompt files ---------------------------------------------------------------------------------

def test_prompt_files_are_checked_line_by_line(tmp_path):
    from tools.prompts import PromptFileError, read_prompts

    cases = {
        '{"id": "x"': "line 1: not JSON",
        "[1, 2]": "line 1: a JSON list, not an object",
        '{"id": "x"}': 'line 1: no "prompt"',
        '{"prompt": ""}': 'line 1: an empty "prompt"',
        '{"prompt": 5}': "line 1: 'prompt' must be a string",
    }
    for line, match in cases.items():
        f = write_lines(tmp_path / "p.jsonl", "", line)
        with pytest.raises(PromptFileError, match=match.replace("line 1", "line 2")):
            read_prompts(f)
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\n")
    with pytest.raises(PromptFileError, match="not UTF-8"):
        read_prompts(tmp_path / "bin.jsonl")
    with pytest.raises(PromptFileError, match="a folder"):
        read_prompts(tmp_path)
    with pytest.raises(PromptFileError, match="no such file"):
        read_prompts(tmp_path / "missing.jsonl")
    # a file of one's own prompts needs only the text; the corpus' files read as before
    own = read_prompts(write_lines(tmp_path / "own.jsonl", json.dumps({"prompt": "def f(x):\n    return"}),
                                   json.dumps({"prompt": "import os", "id": "mine", "extra": 1})))
    assert [p.model_prompt for p in own] == ["def f(x):\n    return", "import os"]
    assert own[1].id == "mine" and len(own[0].id) == 16 and own[0].kind == ""


def test_corpus_prompt_files_still_read(data):  # noqa: F811
    from tools.prompts import read_prompts

    rows = [json.loads(line) for line in (data / "prompts.jsonl").read_text().splitlines()]
    got = read_prompts(data / "prompts.jsonl")
    assert len(got) == len(rows) > 0 and [p.__dict__ for p in got] == rows


# -- checkpoints ----------------------------------------------------------------------------------

def test_read_checkpoint_names_what_the_folder_is(ckpts, tmp_path):
    from tools.hf_checkpoint import CheckpointError, read_checkpoint

    with pytest.raises(CheckpointError, match="an exported artifact \\(manifest.json\\), not a checkpoint"):
        read_checkpoint(ckpts["artifact"])
    with pytest.raises(CheckpointError, match="no such folder"):
        read_checkpoint(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        read_checkpoint(bad)
    (bad / "config.json").write_text("[]")
    with pytest.raises(CheckpointError, match="model_type None"):
        read_checkpoint(bad)


# -- tools.eval_acceptance ------------------------------------------------------------------------

@pytest.fixture
def no_replay(monkeypatch):
    """The replay itself, stubbed: these tests are about what happens before it."""
    import tools.eval_acceptance as ea

    calls = []

    def fake_replay(path, prompts, *a, **k):
        calls.append((path, len(prompts)))
        counts = dict.fromkeys(ea.REPLAY_COUNTS, 1)
        return {p: ea.replay_rates(counts) for p in ("speculative", "hybrid")}

    monkeypatch.setattr(ea, "evaluate_in_slices", fake_replay)
    return calls


def test_eval_acceptance_checks_every_input_before_replaying(ckpts, data, tmp_path, capsys, no_replay):  # noqa: F811
    from tools.eval_acceptance import main

    base = ["--data", str(data), "--prompts", "2", "--json", str(tmp_path / "r.json")]
    good = f"a={ckpts['bitmtp']}"
    # an AR-only checkpoint second: refused before the first model's replay (whose work was lost)
    err = refused(capsys, main, [*base, "--model", good, "--model", f"b={ckpts['ar']}"])
    assert f"--model b={ckpts['ar']}: an AR-only checkpoint (no bitmtp.json) has no drafts" in err
    err = refused(capsys, main, [*base, "--model", f"a={ckpts['artifact']}"])
    assert "an exported artifact" in err
    err = refused(capsys, main, [*base, "--model", good, "--json", str(tmp_path)])  # after the replays, before
    assert f"--json {tmp_path}: a folder" in err
    bad = write_lines(tmp_path / "bad.jsonl", '{"prompt": "def f():"}', "{")
    assert f"{bad} line 2: not JSON" in refused(capsys, main, [*base, "--model", good, "--prompt-file", str(bad)])
    empty = write_lines(tmp_path / "empty.jsonl")
    assert "no prompts" in refused(capsys, main, [*base, "--model", good, "--prompt-file", str(empty)])
    assert "no prompts after --skip 1000" in refused(capsys, main, [*base, "--model", good, "--skip", "1000"])
    assert "no corpus index" in refused(capsys, main, [*base, "--model", good, "--data", str(tmp_path)])
    assert not no_replay and not (tmp_path / "r.json").exists()
    # a bare CHECKPOINT (no NAME=) is that checkpoint, named by its path (it used to read "." instead)
    with pytest.raises(SystemExit) as e:
        main([*base, "--model", str(ckpts["bitmtp"])])
    assert e.value.code == 0 and no_replay == [(str(ckpts["bitmtp"]), 2)]
    report = json.loads((tmp_path / "r.json").read_text())
    assert list(report["models"]) == [str(ckpts["bitmtp"])]


def test_eval_quality_checks_its_models_and_prompts_first(ckpts, data, tmp_path, capsys):  # noqa: F811
    from tools.eval_quality import main

    base = ["--data", str(data), "--json", str(tmp_path / "q.json"), "--md", str(tmp_path / "q.md")]
    err = refused(capsys, main, [*base, "--model", f"a={ckpts['artifact']}"])
    assert f"--model a={ckpts['artifact']}: " in err and "an exported artifact" in err
    bad = write_lines(tmp_path / "bad.jsonl", "[]")
    err = refused(capsys, main, [*base, "--model", f"a={ckpts['bitmtp']}", "--prompt-file", str(bad)])
    assert f"{bad} line 1: a JSON list" in err
    assert not (tmp_path / "q.json").exists()


# -- tools.calibrate ------------------------------------------------------------------------------

def test_calibrate_measure_checks_its_inputs_first(ckpts, data, tmp_path, capsys, monkeypatch):  # noqa: F811
    import tools.calibrate as cal

    def no_measure(*a, **k):
        raise AssertionError("inputs are checked before measuring")

    monkeypatch.setattr(cal, "measure", no_measure)
    base = ["measure", "--prompts", str(data / "prompts.jsonl"), "--json", str(tmp_path / "c.json")]
    err = refused(capsys, cal.main, [*base, "--model", str(ckpts["ar"])])
    assert "an AR-only checkpoint (no bitmtp.json) has no drafts" in err
    assert "an exported artifact" in refused(capsys, cal.main, [*base, "--model", str(ckpts["artifact"])])
    assert "--count" in refused(capsys, cal.main, [*base, "--model", str(ckpts["bitmtp"]), "--count", "0"])
    empty = write_lines(tmp_path / "empty.jsonl")
    err = refused(capsys, cal.main, [*base[:1], "--prompts", str(empty), *base[3:], "--model", str(ckpts["bitmtp"])])
    assert "no prompts in it" in err  # was a torch.cat traceback after loading the model


def test_calibrate_leaves_bitmtp_json_alone_on_a_degenerate_fit(ckpts, data, tmp_path, capsys,  # noqa: F811
                                                                monkeypatch):
    """Platt pairs with a <= 0 (a fit on too few samples) are no calibration: bitmtp.json
    stays as it was and the message says why, the report still written."""
    import tools.calibrate as cal

    ck = tmp_path / "ck"
    shutil.copytree(ckpts["bitmtp"], ck)
    before = (ck / "bitmtp.json").read_text()
    pairs = [[-3.9, 0.1]] * 4
    monkeypatch.setattr(cal, "measure", lambda *a, **k: {"slots": [], "hybrid": {}, "platt": pairs,
                                                          "platt_prefix": pairs})
    err = refused(capsys, cal.main, ["measure", "--model", str(ck), "--prompts", str(data / "prompts.jsonl"),
                                     "--json", str(tmp_path / "c.json"), "--write-config"])
    assert "bitmtp.json left as it was" in err and "a = -3.9 must be > 0" in err
    assert (ck / "bitmtp.json").read_text() == before and (tmp_path / "c.json").is_file()


def test_calibrate_prompts_names_a_folder_that_is_no_corpus(tmp_path, capsys):
    import tools.calibrate as cal

    err = refused(capsys, cal.main, ["prompts", "--data", str(tmp_path), "--root", f"demo={tmp_path}",
                                     "--out", str(tmp_path / "p.jsonl")])
    assert "no files.tsv" in err


# -- tools.distill --------------------------------------------------------------------------------

def test_distill_names_the_teacher_flag_and_bad_counts(data, tmp_path, capsys):  # noqa: F811
    from tools.distill import main

    base = ["--data", str(data), "--out", str(tmp_path / "d"), "--rows", "4", "--prompt-len", "10", "--seq-len", "32",
            "--batch", "4", "--device", "cpu"]
    err = refused(capsys, main, [*base, "--teacher", str(data)])
    assert f"--teacher {data}: no config.json, so not a checkpoint" in err
    assert "--rows 0" in refused(capsys, main, [*base, "--teacher", str(data), "--rows", "0"])
    assert not (tmp_path / "d").exists()


# -- tools.corpus ---------------------------------------------------------------------------------

def test_corpus_refuses_a_tokenizer_whose_ids_do_not_fit_its_shards(tmp_path, capsys):
    """A 128k-token checkpoint tokenizer (Llama 3's, BitNet b1.58 2B4T's) used to be adopted and
    its ids written modulo 65536 into the uint16 shards: a corpus of wrong tokens, silently."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.test_corpus_tokenizer import write_tree
    from tools.corpus import main
    from tools.tokenizer import EOS_TOKEN

    vocab = {"[UNK]": 0, EOS_TOKEN: 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    big = tmp_path / "big"
    big.mkdir()
    tok.save(str(big / "tokenizer.json"))
    write_tree(tmp_path / "src", n=8)
    out = tmp_path / "corpus"
    err = refused(capsys, main, ["build", "--out", str(out), "--root", f"demo={tmp_path / 'src'}",
                                 "--tokenizer", str(big)])
    assert f"--tokenizer {big}: 70003 tokens" in err and "at most 65536" in err
    assert not out.exists()


def test_a_rebuild_that_stops_halfway_leaves_no_index_to_trust(data, tmp_path, monkeypatch):  # noqa: F811
    """corpus.json is what the trainer trusts; a rebuild into the same folder that fails after
    rewriting some shards must not leave the old index vouching for them."""
    import tools.corpus as corpus
    from tests.test_corpus_tokenizer import write_tree

    folder = tmp_path / "corpus"
    shutil.copytree(data, folder)
    write_tree(tmp_path / "src", n=20)
    real = corpus.write_shards

    def fail_on_val(tok, texts, f, split, *a):
        if split == "val":
            raise KeyboardInterrupt
        return real(tok, texts, f, split, *a)

    monkeypatch.setattr(corpus, "write_shards", fail_on_val)
    with pytest.raises(KeyboardInterrupt):
        corpus.build(folder, [corpus.SourceRoot("demo", tmp_path / "src")],
                     corpus.CorpusOptions(vocab_size=300, val_permille=100, test_permille=150), log=lambda m: None)
    with pytest.raises(FileNotFoundError, match="no corpus index"):
        corpus.CorpusIndex.load(folder)
