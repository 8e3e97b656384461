"""Corpus building (tools.corpus), the BPE tokenizer (tools.tokenizer) and prompts (tools.prompts)."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tools import corpus as corpus_lib
from tools.corpus import CorpusIndex, CorpusOptions, SourceRoot, build, load_split, split_of
from tools.prompts import cut_at_function_end, is_valid_completion, read_prompts
from tools.tokenizer import EOS_TOKEN, MASK_TOKEN, encode_documents, load_tokenizer

MODULE = '''\
"""Module {i}: small helpers."""

import math


def scale_{i}(values, factor={i}):
    """Multiply every value by factor.

    Returns a new list.
    """
    out = []
    for v in values:
        out.append(v * factor)
    return out


class Box{i}:
    def area(self, w, h):
        total = w * h
        if total < 0:
            raise ValueError("negative")
        total += {i}
        total *= 2
        return total

    async def fetch(self, key):
        """Look a key up."""
        value = await self.get(key)
        if value is None:
            return None
        return value
'''


def write_tree(root: Path, n: int = 40) -> None:
    for i in range(n):
        sub = root / f"pkg{i % 4}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i}.py").write_text(MODULE.format(i=i))
    (root / "pkg0" / "copy_of_mod1.py").write_text(MODULE.format(i=1))  # exact duplicate
    (root / "pkg0" / "latin1.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8: skipped
    (root / "pkg0" / "wide.py").write_text("x = '" + "a" * 5000 + "'\n")  # a 5000-char line: skipped
    (root / "pkg0" / "__pycache__").mkdir()
    (root / "pkg0" / "__pycache__" / "mod0.py").write_text("skipped = True\n")
    (root / "pkg1" / "tok.py").write_text(f"SPECIAL = '{EOS_TOKEN}'  # spelled in source\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    write_tree(root)
    out = tmp_path_factory.mktemp("corpus")
    index = build(out, [SourceRoot("demo", root)],
                  CorpusOptions(vocab_size=400, val_permille=150, test_permille=200, max_prompts=50),
                  log=lambda m: None)
    return root, out, index


def test_gather_dedups_and_filters(corpus):
    root, out, index = corpus
    rows = [line.split("\t") for line in (out / "files.tsv").read_text().splitlines()]
    keys = [r[1] for r in rows]
    # equal content is kept once, under the smallest key
    assert "demo/pkg0/copy_of_mod1.py" in keys and "demo/pkg1/mod1.py" not in keys
    assert not any(k.endswith(("latin1.py", "wide.py")) or "__pycache__" in k for k in keys)
    assert len(keys) == len(set(r[2] for r in rows)) == sum(index.files.values()) == 41
    assert index.corpus_sha256 == hashlib.sha256((out / "files.tsv").read_bytes()).hexdigest()


def test_split_is_deterministic_by_path(corpus):
    _, out, _ = corpus
    for line in (out / "files.tsv").read_text().splitlines():
        split, key = line.split("\t")[:2]
        assert split == split_of(key, 150, 200)
    assert {split_of(f"x/{i}.py", 20, 20) for i in range(2000)} == {"train", "val", "test"}


def test_rebuild_gives_same_hash(corpus, tmp_path):
    root, _, index = corpus
    again = build(tmp_path, [SourceRoot("demo", root)],
                  CorpusOptions(vocab_size=400, val_permille=150, test_permille=200, max_prompts=50), log=lambda m: None)
    assert again.corpus_sha256 == index.corpus_sha256
    assert (tmp_path / "tokenizer.json").read_text() == (corpus[1] / "tokenizer.json").read_text()


def test_compare_says_whether_a_rebuilt_corpus_is_the_release_file_set(corpus, capsys):
    """What the device scripts print after rebuilding the corpus from the device's packages."""
    _, out, index = corpus
    with pytest.raises(SystemExit) as e:
        corpus_lib.main(["compare", str(out), "--to", str(out)])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"corpus sha256 {index.corpus_sha256[:12]} == release"
    with pytest.raises(SystemExit):
        corpus_lib.main(["compare", str(out)])  # the release corpus, by default
    assert "!= release 7bfe480be53c (other file set)" in capsys.readouterr().out


def test_shards_hold_documents_separated_by_eos(corpus):
    root, out, index = corpus
    tok = load_tokenizer(out)
    for split in ("train", "val", "test"):
        tokens = load_split(out, split)
        assert tokens.dtype == np.uint16 and len(tokens) == index.tokens[split]
        assert tokens[-1] == index.eos_token_id
        docs = np.split(tokens, np.where(tokens == index.eos_token_id)[0] + 1)[:-1]
        assert len(docs) == index.files[split]
        keys = [line.split("\t")[1] for line in (out / "files.tsv").read_text().splitlines() if line.startswith(split)]
        for key, doc in zip(keys, docs):
            assert tok.decode(doc[:-1].tolist(), skip_special_tokens=False) == (root / key[len("demo/"):]).read_text()


def test_tokenizer_special_tokens_and_round_trip(corpus):
    _, out, index = corpus
    tok = load_tokenizer(out / "tokenizer.json")
    assert (tok.token_to_id(EOS_TOKEN), tok.token_to_id(MASK_TOKEN)) == (0, 1) == (index.eos_token_id, index.mask_token_id)
    assert tok.get_vocab_size() == index.vocab_size <= 400
    samples = ["def f(x):\n\treturn x  # tab\n", "    \n\n  trailing  ", "ünïcödé → 漢字 🙂", "", "a\r\nb",
               f"literal {EOS_TOKEN} text"]
    for s in samples:
        ids = next(encode_documents(tok, [s])) if s else []
        assert tok.decode(ids, skip_special_tokens=False) == s
    assert 0 not in next(encode_documents(tok, [f"x = '{EOS_TOKEN}'"])), "source text never yields the EOS id"


def test_transformers_loads_the_tokenizer(corpus):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    _, out, _ = corpus
    fast = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(out))
    tok = load_tokenizer(out)
    text = "def area(self, w, h):\n        return w * h\n"
    assert fast.encode(text) == auto.encode(text) == tok.encode(text).ids
    assert auto.decode(auto.encode(text)) == text
    assert (auto.eos_token, auto.mask_token) == (EOS_TOKEN, MASK_TOKEN)


def test_prompts_cut_functions_at_line_boundaries(corpus):
    root, out, _ = corpus
    prompts = read_prompts(out / "prompts.jsonl")
    assert prompts, "the test split yields prompts"
    test_keys = {line.split("\t")[1] for line in (out / "files.tsv").read_text().splitlines() if line.startswith("test")}
    for p in prompts:
        assert p.path in test_keys, "prompts come from the test split only"
        assert p.prompt.endswith("\n") and p.prompt.lstrip().startswith(("def ", "async def "))
        source = (root / p.path[len("demo/"):]).read_text()
        assert p.prompt + p.reference in source, "prompt + reference is a verbatim slice of the file"
        assert is_valid_completion(p.prompt, p.reference)
        if p.kind == "docstring":
            assert p.prompt.rstrip().endswith('"""')
    assert {p.kind for p in prompts} == {"docstring", "first_lines"}


def test_validity_cuts_at_the_function_end():
    prompt = '    def area(self, w, h):\n        """Area."""\n'
    ok = "        return w * h\n\n    def other(self):\n        garbage = (\n"
    body, ended = cut_at_function_end(prompt, ok)
    assert ended and body == "        return w * h\n\n"
    assert is_valid_completion(prompt, ok)
    assert not is_valid_completion(prompt, "        return (w *\n")
    # a partial last line is dropped unless the generator finished on its own
    assert is_valid_completion(prompt, "        return w\n        x = (")
    assert not is_valid_completion(prompt, "        return w\n        x = (", finished=True)
    assert is_valid_completion("def f():\n", textwrap.indent("return 1\n", "    "))


def test_index_round_trips(corpus):
    _, out, index = corpus
    assert CorpusIndex.load(out) == index
    assert json.loads((out / corpus_lib.INDEX_FILE).read_text())["shards"]["train"][0]["file"] == "train_000.bin"
