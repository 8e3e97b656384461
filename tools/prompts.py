"""Held-out code prompts and the "is the completion valid Python" check.

A **prompt** is the start of a function from the test split, cut at a line boundary:

* a function with a docstring: the ``def`` header through the docstring's last line;
* otherwise: the header plus the first body line(s) (``FIRST_BODY_LINES``).

The rest of the function is kept as the ``reference`` (not used for scoring here).
The model is given ``model_prompt``: the prompt without its final newline. Byte-level BPE
merges a newline with the next line's indentation into one token, so a prompt ending in a
bare newline would put the model at a token boundary that, in training, almost only comes
before end-of-file or a column-0 line (it then emits EOS); without it, the completion starts
with the newline token the model would have produced anyway.

**Validity**: ``prompt + completion`` is cut at the function's end (the first non-blank line
indented no deeper than the ``def``), or, when the completion stops inside the function, at
its last complete line; the dedented text must pass ``ast.parse``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path

FIRST_BODY_LINES = 2
MIN_BODY_LINES = 3
MAX_FUNCTION_LINES = 60
MAX_PROMPT_CHARS = 1200


@dataclass(frozen=True)
class Prompt:
    id: str
    path: str
    name: str
    kind: str  # "docstring" | "first_lines"
    prompt: str
    reference: str

    @property
    def indent(self) -> int:
        return _indent(self.prompt.splitlines()[0])

    @property
    def model_prompt(self) -> str:
        """What the model is given (see the module docstring)."""
        return self.prompt[:-1] if self.prompt.endswith("\n") else self.prompt


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _docstring_node(fn: ast.AST):
    body = getattr(fn, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0]
    return None


def _prompt_of(path: str, lines: list[str], fn) -> Prompt | None:
    start, end = fn.lineno, fn.end_lineno  # 1-based, inclusive; lineno is the def line
    if end - start + 1 > MAX_FUNCTION_LINES or not fn.body:
        return None
    header_end = fn.body[0].lineno - 1  # last header line
    doc = _docstring_node(fn)
    if doc is not None:
        cut, kind = doc.end_lineno, "docstring"
        if len(fn.body) < 2:
            return None
    else:
        cut, kind = header_end + FIRST_BODY_LINES, "first_lines"
    if end - cut < MIN_BODY_LINES or cut <= header_end:
        return None
    prompt = "".join(lines[start - 1:cut])
    if len(prompt) > MAX_PROMPT_CHARS or not prompt.endswith("\n"):
        return None
    if not is_valid_completion(prompt, "".join(lines[cut:end]) + "\n"):
        return None  # tabs mixed with spaces, continuation lines: keep only cleanly cut functions
    pid = hashlib.sha256(f"{path}:{fn.name}:{start}".encode()).hexdigest()[:16]
    return Prompt(pid, path, fn.name, kind, prompt, "".join(lines[cut:end]))


def extract_prompts(docs: list[tuple[str, str]], limit: int, per_file: int = 2) -> list[Prompt]:
    """Up to ``limit`` prompts from ``docs`` [(key, source)], at most ``per_file`` per file,
    ordered by a hash of their id (a deterministic, file-spread sample)."""
    out: list[Prompt] = []
    for path, text in docs:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        found = [p for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 if (p := _prompt_of(path, lines, node)) is not None]
        found.sort(key=lambda p: p.id)
        out.extend(found[:per_file])
    out.sort(key=lambda p: p.id)
    return out[:limit]


def write_prompts(path: Path, prompts: list[Prompt]) -> None:
    path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in prompts))


class PromptFileError(ValueError):
    """A prompts.jsonl that cannot be read: names the file (and line) and what to do."""


PROMPT_FIELDS = ("id", "path", "name", "kind", "prompt", "reference")
PROMPT_FILE_FORMAT = ('a prompts file is one JSON object per line with a non-empty string "prompt" (optionally '
                      '"id", "path", "name", "kind", "reference"), as `python -m tools.corpus build` writes '
                      'prompts.jsonl')


def read_prompts(path: str | Path) -> list[Prompt]:
    """Every prompt of a prompts.jsonl. Only ``prompt`` is required (a file of one's own
    prompts); ``id`` defaults to a hash of it, the other fields to ""."""
    p = Path(path)
    if not p.is_file():
        raise PromptFileError(f"{p}: {'a folder' if p.is_dir() else 'no such file'}; {PROMPT_FILE_FORMAT}")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise PromptFileError(f"{p}: not UTF-8 text; {PROMPT_FILE_FORMAT}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{p} line {n}: not JSON ({e.msg}); {PROMPT_FILE_FORMAT}") from None
        if not isinstance(d, dict):
            raise PromptFileError(f"{p} line {n}: a JSON {type(d).__name__}, not an object; {PROMPT_FILE_FORMAT}")
        bad = [k for k in PROMPT_FIELDS if k in d and not isinstance(d[k], str)]
        if bad:
            raise PromptFileError(f"{p} line {n}: {bad[0]!r} must be a string")
        text = d.get("prompt")
        if text is None or not text.rstrip("\n"):
            what = "no" if text is None else "an empty"
            raise PromptFileError(f"{p} line {n}: {what} \"prompt\"; {PROMPT_FILE_FORMAT}")
        pid = d.get("id") or hashlib.sha256(text.encode()).hexdigest()[:16]
        out.append(Prompt(pid, d.get("path", ""), d.get("name", ""), d.get("kind", ""), text, d.get("reference", "")))
    return out


def cut_at_function_end(prompt: str, completion: str, finished: bool = False) -> tuple[str, bool]:
    """(completion cut at the function's end, whether the end was found).

    ``finished``: the generator stopped on its own (EOS), so a trailing partial line counts
    as complete.
    """
    def_indent = _indent(prompt.splitlines()[0])
    pieces = completion.split("\n")
    for i, line in enumerate(pieces):
        # Any text at or left of the def's column ends the function, even on a partial line.
        if line.strip() and _indent(line) <= def_indent:
            return "".join(piece + "\n" for piece in pieces[:i]), True
    complete = pieces[:-1]  # the piece after the last newline is a partial line
    if finished and pieces[-1].strip():
        complete.append(pieces[-1])
    return "".join(piece + "\n" for piece in complete), False


def is_valid_completion(prompt: str, completion: str, finished: bool = False) -> bool:
    """Does ``prompt + completion``, cut at the function's end, parse as Python?"""
    body, _ = cut_at_function_end(prompt, completion, finished)
    try:
        ast.parse(textwrap.dedent(prompt + body))
    except (SyntaxError, ValueError):
        return False
    return True
