"""The code tokenizer: byte-level BPE trained with Hugging Face ``tokenizers``.

Byte-level, so every string round-trips exactly (``decode(encode(s)) == s``), with GPT-2's
pre-tokenizer regex: runs of spaces stay separate pieces and BPE merges the common indents
into single tokens. Two special tokens come first, so their ids are fixed:

* ``<|endoftext|>`` (id 0): separates documents; the model's EOS / stop token;
* ``<|mask|>`` (id 1): the mask slot of an SDLM draft block.

Saved as ``tokenizer.json`` (what the runtime and ``PreTrainedTokenizerFast`` read) plus the
small ``tokenizer_config.json`` / ``special_tokens_map.json`` that ``AutoTokenizer`` wants.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)
TOKENIZER_FILE = "tokenizer.json"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Train a byte-level BPE on ``texts`` (an iterator of documents)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    ids = special_token_ids(tok)
    if ids != (0, 1):  # the trainer adds special tokens first; the corpus format relies on it
        raise RuntimeError(f"special token ids came out as {ids}, expected (0, 1)")
    return tok


def special_token_ids(tok) -> tuple[int, int]:
    """(eos id, mask id) of a ``tokenizers.Tokenizer``."""
    eos, mask = tok.token_to_id(EOS_TOKEN), tok.token_to_id(MASK_TOKEN)
    if eos is None or mask is None:
        raise ValueError(f"the tokenizer lacks {EOS_TOKEN} or {MASK_TOKEN}; it was not built by tools.tokenizer")
    return eos, mask


def save_tokenizer(tok, folder: str | Path) -> Path:
    """Write ``tokenizer.json`` and the transformers side files into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / TOKENIZER_FILE))
    write_transformers_files(folder)
    return folder / TOKENIZER_FILE


def write_transformers_files(folder: Path) -> None:
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "mask_token": MASK_TOKEN,
    }, indent=2) + "\n")


def load_tokenizer(path: str | Path):
    """``tokenizer.json`` (or a folder holding it) -> ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no tokenizer here; build one with `python -m tools.corpus build`")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"{p}: not a Hugging Face tokenizers file ({str(e).splitlines()[0][:160]})") from None


def encode_documents(tok, texts: list[str], batch: int = 512) -> Iterator[list[int]]:
    """Token ids of each document (no special tokens added), in parallel batches.

    A source file may spell ``<|endoftext|>`` literally (tokenizer code does); it is encoded
    as plain text here, so only the separators the corpus inserts are EOS.
    """
    previous = tok.encode_special_tokens
    tok.encode_special_tokens = True
    try:
        for i in range(0, len(texts), batch):
            for enc in tok.encode_batch(texts[i:i + batch], add_special_tokens=False):
                yield enc.ids
    finally:
        tok.encode_special_tokens = previous
