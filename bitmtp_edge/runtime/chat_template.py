"""Chat templates: turn OpenAI-style messages into the prompt text the model was tuned on.

The template is the tokenizer's own Jinja program (``chat_template.jinja`` beside the
tokenizer, or ``tokenizer_config.json``'s ``chat_template``; the exporter copies both into
the artifact). It is rendered the way transformers' ``apply_chat_template`` renders it: a
sandboxed Jinja environment with ``trim_blocks`` / ``lstrip_blocks``, loop controls, the
same ``tojson`` filter and the same globals (``raise_exception``, ``strftime_now``), and
the tokenizer's special tokens (``bos_token``, ``eos_token`` ...) as variables.
Templates are untrusted code from a model's files: the sandbox is why jinja2 ≥ 3.1.6.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """No template, a broken one, or messages the template refuses."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str], origin: str):
        self.source, self.special_tokens, self.origin = source, special_tokens, origin
        self._template = _compile(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """messages: [{"role": ..., "content": ...}, ...] -> the prompt text."""
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **extra)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template ({self.origin}) refused these messages: {e}") from None


def load_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The artifact's chat template, or None for a completion model without one."""
    folder = Path(folder)
    config = _read_config(folder / CONFIG_FILE)
    specials = {k: _token_text(config[k]) for k in SPECIAL_TOKEN_KEYS if _token_text(config.get(k)) is not None}
    path = folder / TEMPLATE_FILE
    if path.is_file():
        return ChatTemplate(path.read_text(encoding="utf-8"), specials, str(path))
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not source:
        return None
    if not isinstance(source, str):
        raise ChatTemplateError(f"{folder / CONFIG_FILE}: chat_template must be a string; re-export the artifact")
    return ChatTemplate(source, specials, f"{folder / CONFIG_FILE}: chat_template")


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{path}: not valid JSON ({e.msg}); re-export the artifact") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks; rendering a prompt just keeps the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse (line {e.lineno}: {e.message}); "
                                "fix chat_template.jinja / tokenizer_config.json in the artifact") from None
