"""The code corpus: Python source from directory trees, deduplicated, split, tokenised.

    python -m tools.corpus build --out runs/data            # stdlib + site-packages
    python -m tools.corpus build --out D --root mine=~/src  # any trees

Steps, all deterministic for a given set of files:

1. **gather** every ``*.py`` under each root (a root nested inside another, such as
   site-packages under the stdlib, is walked only as itself), skipping ``__pycache__``,
   files that are not UTF-8, empty, larger than ``max_file_bytes`` or with a line longer
   than ``max_line_chars`` (generated tables, minified data);
2. **deduplicate** by the sha256 of the content: the copy with the smallest key
   ``label/relative/path`` is kept;
3. **split** by a hash of the key: permille ``[0, val)`` → val, ``[val, val + test)`` →
   test, the rest → train (a file never moves between splits when others are added);
4. record the **file list** (``files.tsv``: split, key, sha256, bytes) and its sha256, the
   **corpus hash** that checkpoints carry;
5. train the **tokenizer** on the train split (``tools.tokenizer``);
6. **pack** each split into token shards: documents joined with ``<|endoftext|>`` after each,
   ``uint16`` little-endian ``{split}_{i:03d}.bin``, indexed by ``corpus.json``;
7. cut **evaluation prompts** from the test split (``tools.prompts``) into ``prompts.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from tools import prompts as prompt_lib
from tools.tokenizer import TOKENIZER_FILE, encode_documents, save_tokenizer, special_token_ids, train_tokenizer

SPLITS = ("train", "val", "test")
INDEX_FILE = "corpus.json"
FILE_LIST = "files.tsv"
PROMPTS_FILE = "prompts.jsonl"
TOKEN_DTYPE = np.uint16
MAX_VOCAB = 1 << 16  # token ids must fit TOKEN_DTYPE


@dataclass(frozen=True)
class SourceRoot:
    label: str
    path: Path


@dataclass(frozen=True)
class SourceFile:
    key: str  # label/relative/path, the identity used for splitting
    sha256: str
    size: int
    split: str


@dataclass(frozen=True)
class CorpusOptions:
    vocab_size: int = 8192
    val_permille: int = 20
    test_permille: int = 20
    max_file_bytes: int = 400_000
    max_line_chars: int = 1000
    tokenizer_sample_bytes: int = 40_000_000
    shard_tokens: int = 64 * 1024 * 1024
    max_prompts: int = 256


@dataclass
class CorpusIndex:
    """``corpus.json``: what a trainer or evaluator needs to find and trust the data."""

    corpus_sha256: str
    vocab_size: int
    eos_token_id: int
    mask_token_id: int
    roots: list[dict]
    options: dict
    files: dict[str, int]  # split -> number of files
    bytes: dict[str, int]
    tokens: dict[str, int]
    shards: dict[str, list[dict]]
    tokenizer: str = TOKENIZER_FILE
    file_list: str = FILE_LIST
    prompts: str = PROMPTS_FILE
    dtype: str = "uint16"
    build_s: float = 0.0
    python: str = field(default_factory=lambda: sys.version.split()[0])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def load(cls, folder: str | Path) -> "CorpusIndex":
        p = Path(folder) / INDEX_FILE
        if not p.is_file():
            if (Path(folder) / "config.json").is_file():  # building into it would overwrite its tokenizer
                raise FileNotFoundError(f"{folder}: a model checkpoint, not a corpus folder (no {INDEX_FILE}); "
                                        f"build a corpus with its tokenizer: `python -m tools.corpus build --tokenizer "
                                        f"{folder} --out NEW_FOLDER`")
            raise FileNotFoundError(f"{p}: no corpus index; build one with `python -m tools.corpus build --out {folder}`")
        rebuild = f"rebuild it with `python -m tools.corpus build --out {folder}`"
        try:
            d = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{p}: not valid JSON ({e}); {rebuild}") from None
        names = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
                   and f.name not in d] if isinstance(d, dict) else ["all"]
        if missing or not isinstance(d, dict):
            raise ValueError(f"{p}: not a corpus index written by tools.corpus (missing {', '.join(missing)}); "
                             f"{rebuild}")
        return cls(**{k: v for k, v in d.items() if k in names})


def default_roots() -> list[SourceRoot]:
    """The running interpreter's standard library and site-packages."""
    paths = sysconfig.get_paths()
    roots = [SourceRoot("stdlib", Path(paths["stdlib"]))]
    seen = {roots[0].path.resolve()}
    for key in ("purelib", "platlib"):
        p = Path(paths[key])
        if p.is_dir() and p.resolve() not in seen:
            roots.append(SourceRoot("site-packages", p))
            seen.add(p.resolve())
    return roots


def split_of(key: str, val_permille: int, test_permille: int) -> str:
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % 1000
    if h < val_permille:
        return "val"
    if h < val_permille + test_permille:
        return "test"
    return "train"


def _acceptable(text: str, max_line_chars: int) -> bool:
    return bool(text.strip()) and max(len(line) for line in text.splitlines() or [""]) <= max_line_chars


def gather(roots: list[SourceRoot], opts: CorpusOptions) -> list[tuple[SourceFile, str]]:
    """Every acceptable ``.py`` file under ``roots``, deduplicated by content, sorted by key."""
    root_paths = {r.path.resolve() for r in roots}
    candidates: list[tuple[str, Path]] = []
    for root in roots:
        base = root.path.resolve()
        if not base.is_dir():
            raise FileNotFoundError(f"corpus root {root.label}={root.path} is not a directory")
        for dirpath, dirnames, filenames in os.walk(base):
            d = Path(dirpath)
            dirnames[:] = sorted(n for n in dirnames
                                 if n != "__pycache__" and (d / n).resolve() not in root_paths)
            for name in filenames:
                if name.endswith(".py"):
                    p = d / name
                    candidates.append((f"{root.label}/{p.relative_to(base).as_posix()}", p))
    candidates.sort()
    by_hash: dict[str, tuple[SourceFile, str]] = {}
    for key, p in candidates:
        try:
            if not p.is_file() or p.stat().st_size > opts.max_file_bytes:
                continue
            raw = p.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text = text.replace("\r\n", "\n")
        if not _acceptable(text, opts.max_line_chars):
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in by_hash:
            continue
        split = split_of(key, opts.val_permille, opts.test_permille)
        by_hash[digest] = (SourceFile(key, digest, len(raw), split), text)
    return sorted(by_hash.values(), key=lambda ft: ft[0].key)


def file_list_text(files: list[SourceFile]) -> str:
    return "".join(f"{f.split}\t{f.key}\t{f.sha256}\t{f.size}\n" for f in sorted(files, key=lambda f: f.key))


def _tokenizer_sample(docs: list[tuple[SourceFile, str]], limit: int) -> list[str]:
    """Train-split documents in content-hash order up to ``limit`` bytes (a deterministic sample)."""
    out, total = [], 0
    for f, text in sorted((d for d in docs if d[0].split == "train"), key=lambda d: d[0].sha256):
        if total >= limit:
            break
        out.append(text)
        total += len(text)
    return out


def write_shards(tok, texts: list[str], folder: Path, split: str, eos_id: int, shard_tokens: int) -> list[dict]:
    """Pack ``texts`` (each followed by EOS) into ``{split}_{i:03d}.bin`` uint16 shards."""
    shards: list[dict] = []
    buf: list[np.ndarray] = []
    held = 0

    def flush():
        nonlocal buf, held
        if not buf:
            return
        arr = np.concatenate(buf)
        if arr.size and int(arr.max()) >= MAX_VOCAB:
            raise ValueError(f"token id {int(arr.max())} does not fit the corpus' {TOKEN_DTYPE.__name__} shards")
        arr = arr.astype(TOKEN_DTYPE)
        name = f"{split}_{len(shards):03d}.bin"
        arr.astype("<u2").tofile(folder / name)
        shards.append({"file": name, "tokens": int(arr.size)})
        buf, held = [], 0

    for ids in encode_documents(tok, texts):
        piece = np.asarray(ids + [eos_id], dtype=np.int64)
        buf.append(piece)
        held += piece.size
        if held >= shard_tokens:
            flush()
    flush()
    return shards


def build(out: str | Path, roots: list[SourceRoot] | None = None, opts: CorpusOptions | None = None,
          log=print, tokenizer: str | Path | None = None) -> CorpusIndex:
    """Gather, split, train the tokenizer, pack the shards and cut the prompts into ``out``.

    ``tokenizer`` (a ``tokenizer.json`` or a checkpoint folder holding one): encode with it
    instead of training one, so the shards' ids are a given checkpoint's (``tools.train --init``).
    """
    t0 = time.perf_counter()
    opts = opts or CorpusOptions()
    roots = roots or default_roots()
    adopted = adopt_tokenizer(tokenizer, log) if tokenizer is not None else None
    vocab = adopted.get_vocab_size() if adopted is not None else opts.vocab_size
    if vocab > MAX_VOCAB:
        raise ValueError(f"{f'--tokenizer {tokenizer}' if tokenizer else f'--vocab-size {vocab}'}: {vocab} tokens; the "
                         f"corpus stores {TOKEN_DTYPE.__name__} token ids, so at most {MAX_VOCAB} (larger ids would "
                         "wrap around silently)")
    folder = Path(out)
    docs = gather(roots, opts)
    if not any(f.split == "train" for f, _ in docs):
        raise ValueError(f"no training files found under {[str(r.path) for r in roots]}")
    folder.mkdir(parents=True, exist_ok=True)
    # corpus.json is written last and is what readers trust: an old one must not vouch for
    # the shards of a rebuild that stops halfway
    (folder / INDEX_FILE).unlink(missing_ok=True)
    files = [f for f, _ in docs]
    listing = file_list_text(files)
    (folder / FILE_LIST).write_text(listing)
    corpus_sha = hashlib.sha256(listing.encode()).hexdigest()
    log(f"corpus: {len(files)} files, {sum(f.size for f in files) / 1e6:.1f} MB, sha256 {corpus_sha[:12]} "
        f"({time.perf_counter() - t0:.1f}s)")

    tok = adopted if adopted is not None else train_tokenizer(_tokenizer_sample(docs, opts.tokenizer_sample_bytes),
                                                               opts.vocab_size)
    save_tokenizer(tok, folder)
    eos_id, mask_id = special_token_ids(tok)
    log(f"tokenizer: vocab {tok.get_vocab_size()} ({time.perf_counter() - t0:.1f}s)")

    shards, tokens, nbytes, nfiles = {}, {}, {}, {}
    for split in SPLITS:
        texts = [t for f, t in docs if f.split == split]
        shards[split] = write_shards(tok, texts, folder, split, eos_id, opts.shard_tokens)
        tokens[split] = sum(s["tokens"] for s in shards[split])
        nbytes[split] = sum(len(t.encode()) for t in texts)
        nfiles[split] = len(texts)
    log("shards: " + ", ".join(f"{s} {tokens[s] / 1e6:.2f}M tokens" for s in SPLITS)
        + f" ({time.perf_counter() - t0:.1f}s)")

    test_docs = [(f.key, t) for f, t in docs if f.split == "test"]
    cut = prompt_lib.extract_prompts(test_docs, opts.max_prompts)
    prompt_lib.write_prompts(folder / PROMPTS_FILE, cut)
    log(f"prompts: {len(cut)} from the test split")

    index = CorpusIndex(
        corpus_sha256=corpus_sha, vocab_size=tok.get_vocab_size(), eos_token_id=eos_id, mask_token_id=mask_id,
        roots=[{"label": r.label, "path": str(r.path)} for r in roots], options=asdict(opts),
        files=nfiles, bytes=nbytes, tokens=tokens, shards=shards, build_s=round(time.perf_counter() - t0, 1),
    )
    (folder / INDEX_FILE).write_text(json.dumps(index.to_dict(), indent=2) + "\n")
    return index


def adopt_tokenizer(path: str | Path, log=print):
    """A checkpoint's tokenizer, with ``<|mask|>`` appended as a special token if it lacks one."""
    from tools.tokenizer import EOS_TOKEN, MASK_TOKEN, load_tokenizer

    tok = load_tokenizer(path)
    if tok.token_to_id(EOS_TOKEN) is None:
        raise ValueError(f"{path}: the tokenizer has no {EOS_TOKEN} token, which separates the corpus' documents; "
                         "use a tokenizer that has it")
    if tok.token_to_id(MASK_TOKEN) is None:
        tok.add_special_tokens([MASK_TOKEN])
        log(f"tokenizer: added {MASK_TOKEN} as id {tok.token_to_id(MASK_TOKEN)}")
    return tok


def load_split(folder: str | Path, split: str) -> np.ndarray:
    """All tokens of one split as one uint16 array (memory-mapped when it is a single shard)."""
    folder = Path(folder)
    index = CorpusIndex.load(folder)
    parts = []
    for s in index.shards.get(split, []):
        f = folder / s["file"]
        size = f.stat().st_size if f.is_file() else None
        if size != 2 * s["tokens"]:  # a missing or cut shard: memmap would fail, or read past its end
            raise ValueError(f"{f}: {'missing' if size is None else f'{size} bytes'}, {INDEX_FILE} says "
                             f"{s['tokens']} uint16 tokens; rebuild the corpus (`python -m tools.corpus build`)")
        parts.append(np.memmap(f, dtype="<u2", mode="r", shape=(s["tokens"],)))
    if not parts:
        more = f", or with a larger --{split}-permille" if split != "train" else ""
        raise ValueError(f"{folder}: the {split} split is empty; build the corpus from more files{more}")
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _parse_root(spec: str) -> SourceRoot:
    label, sep, path = spec.partition("=")
    if not sep or not label or not path or "/" in label:
        raise ValueError(f"--root {spec!r}: expected LABEL=PATH, e.g. stdlib=/usr/lib/python3.12")
    return SourceRoot(label, Path(path).expanduser())


def main(argv: list[str] | None = None) -> None:
    import click

    @click.group()
    def cli():
        """Build the code corpus, tokenizer and evaluation prompts."""

    @cli.command("build")
    @click.option("--out", required=True, type=click.Path(file_okay=False), help="output folder")
    @click.option("--root", "roots", multiple=True, help="LABEL=PATH source tree (default: stdlib + site-packages)")
    @click.option("--vocab-size", default=CorpusOptions.vocab_size, show_default=True)
    @click.option("--val-permille", default=CorpusOptions.val_permille, show_default=True)
    @click.option("--test-permille", default=CorpusOptions.test_permille, show_default=True)
    @click.option("--tokenizer-sample-mb", default=CorpusOptions.tokenizer_sample_bytes / 1e6, show_default=True)
    @click.option("--max-prompts", default=CorpusOptions.max_prompts, show_default=True)
    @click.option("--tokenizer", default=None, type=click.Path(exists=True),
                  help="encode with this tokenizer.json (or checkpoint folder) instead of training one")
    def build_cmd(out, roots, vocab_size, val_permille, test_permille, tokenizer_sample_mb, max_prompts, tokenizer):
        opts = CorpusOptions(vocab_size=vocab_size, val_permille=val_permille, test_permille=test_permille,
                             tokenizer_sample_bytes=int(tokenizer_sample_mb * 1e6), max_prompts=max_prompts)
        try:
            parsed = [_parse_root(r) for r in roots] or None
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        try:
            index = build(out, parsed, opts, tokenizer=tokenizer)
        except (ValueError, FileNotFoundError) as e:
            raise click.ClickException(str(e)) from None
        click.echo(json.dumps({k: index.to_dict()[k] for k in ("corpus_sha256", "files", "tokens", "build_s")}))

    @cli.command("compare")
    @click.argument("built", type=click.Path(exists=True, file_okay=False))
    @click.option("--to", "reference", default=str(Path(__file__).resolve().parent / "checkpoints" / "data"),
                  show_default="tools/checkpoints/data",
                  type=click.Path(exists=True, file_okay=False), help="the corpus to compare with (the release's)")
    def compare_cmd(built, reference):
        """Whether BUILT holds the same file set as the release corpus (a device rebuilds it from
        its own site-packages: another Python or package set gives another corpus)."""
        a, b = (json.loads((Path(d) / "corpus.json").read_text())["corpus_sha256"] for d in (built, reference))
        click.echo(f"corpus sha256 {a[:12]} " + ("== release" if a == b else f"!= release {b[:12]} (other file set)"))

    cli.main(args=argv, prog_name="python -m tools.corpus", standalone_mode=True)


if __name__ == "__main__":
    main()
