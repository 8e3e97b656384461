"""The OpenAI API's request bodies and response objects, as far as BitMTP serves them.

Requests are pydantic models that refuse what the server cannot honour (``n`` > 1,
logprobs, tools ...) with a message naming the field, instead of silently ignoring it.
BitMTP's own knobs ride along as extra body fields (``policy``, ``tau``, ``min_prefix``,
plus ``top_k`` and ``repetition_penalty``, which OpenAI lacks); the per-request decoding
statistics come back in an extra ``bitmtp`` field of the response.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["system", "developer", "user", "assistant", "tool"]
StopReason = Literal["stop", "length"]


class Unsupported(ValueError):
    """A request the server refuses, naming the field at fault: the error body's ``param``
    (pydantic keeps the exception in the validation error's context)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    # OpenAI documents these as nullable ("n": null means 1): clients that serialise every
    # field send null for the ones they leave unset.
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    n: int | None = 1
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # BitMTP extras
    policy: str | None = None
    tau: float | None = None
    min_prefix: int | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.n not in (None, 1):
            raise Unsupported("n", f"n = {self.n}: this server generates one choice per request (batch 1); "
                                   "send n = 1 and repeat the request for more")
        if self.logit_bias:
            raise Unsupported("logit_bias", "logit_bias is not supported; leave it out")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise Unsupported("stop", f"stop has {len(self.stop)} strings; give at most 16")
        if self.stream_options is not None and set(self.stream_options) - {"include_usage"}:
            raise Unsupported("stream_options", "stream_options supports only include_usage")
        return self

    @property
    def include_usage(self) -> bool:
        """stream_options.include_usage: usage comes in a last chunk of its own, no choices."""
        return bool((self.stream_options or {}).get("include_usage"))

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Body):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.echo:
            raise Unsupported("echo", "echo is not supported; prepend the prompt yourself")
        if self.logprobs:
            raise Unsupported("logprobs", "logprobs are not supported; leave logprobs out")
        if self.best_of not in (None, 1):
            raise Unsupported("best_of", "best_of > 1 is not supported (batch 1)")
        if self.suffix:
            raise Unsupported("suffix", "suffix (insertion) is not supported; send a plain prompt")
        return self

    def prompt_value(self) -> str | list[int]:
        """The one prompt, as text or token ids (a list of one prompt is unwrapped)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise Unsupported("prompt", f"prompt holds {len(p)} prompts; this server takes one per request "
                                            "(batch 1)")
            p = p[0]
        if not p:
            raise Unsupported("prompt", "prompt is empty; give some text or token ids")
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id ... reach the template as they are
    role: Role
    content: Union[str, list[ContentPart], None] = None

    def template_dict(self) -> dict:
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # text parts joined: the templates BitMTP runs take strings
            out["content"] = "".join(part.text for part in self.content)
        return out


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # as transformers' apply_chat_template

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.logprobs or self.top_logprobs:
            raise Unsupported("top_logprobs" if self.top_logprobs and not self.logprobs else "logprobs",
                              "logprobs are not supported; leave logprobs out")
        if self.tools:
            raise Unsupported("tools", "tools are not supported; leave tools and tool_choice out")
        if self.tool_choice not in (None, "none"):
            raise Unsupported("tool_choice", "tools are not supported; leave tools and tool_choice out")
        if self.response_format not in (None, {"type": "text"}):
            raise Unsupported("response_format", "response_format other than text is not supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise Unsupported("max_completion_tokens", "max_tokens and max_completion_tokens disagree; give one "
                                                       "of them")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def token_limit_field(self) -> str:
        """The field the limit came from, for an error that names what the client sent."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# --- responses ------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(decode_reason: str) -> StopReason:
    """decode()'s reasons -> OpenAI's: a full KV segment is a length limit too."""
    return "stop" if decode_reason == "stop" else "length"


def completion(rid: str, model: str, text: str, reason: str, use: dict, stats: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}],
            "usage": use, "bitmtp": stats}


def completion_chunk(rid: str, model: str, created: int, text: str, reason: str | None = None,
                     use: dict | None = None, stats: dict | None = None, choices: bool = True) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}] if choices else []}
    if use is not None:
        out["usage"], out["bitmtp"] = use, stats
    return out


def chat_completion(rid: str, model: str, text: str, reason: str, use: dict, stats: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                         "logprobs": None}],
            "usage": use, "bitmtp": stats}


def chat_chunk(rid: str, model: str, created: int, delta: dict, reason: str | None = None,
               use: dict | None = None, stats: dict | None = None, choices: bool = True) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}] if choices else []}
    if use is not None:
        out["usage"], out["bitmtp"] = use, stats
    return out


def error(message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
