"""An interactive session over one Engine: the state behind ``bitmtp chat``.

The models BitMTP runs are completion models (code), so a "conversation" is a running
transcript: each user turn is appended as a line, the model continues it, and its reply
joins the transcript. When the transcript outgrows the largest KV segment the oldest
tokens are dropped (the model only ever sees the most recent context that fits).

Commands (a line starting with ``/``): ``/quit``, ``/policy [NAME]``, ``/reset``, ``/help``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..runtime.policies import POLICIES

if TYPE_CHECKING:
    from ..runtime.decoding import DecodeStats
    from ..runtime.engine import Engine

COMMANDS = {
    "/quit": "leave (also /exit, or end of input)",
    "/policy": f"show the decoding policy, or switch: /policy {'|'.join(POLICIES)}",
    "/reset": "forget the transcript and start afresh",
    "/help": "this list",
}


@dataclass(frozen=True)
class Command:
    name: str  # "quit" | "policy" | "reset" | "help"
    arg: str = ""


def parse_command(line: str) -> Command | None:
    """A ``/command`` line -> Command; any other line -> None (it is a user turn).

    Raises ValueError for an unknown command, naming the known ones."""
    text = line.strip()
    if not text.startswith("/"):
        return None
    head, _, arg = text.partition(" ")
    name = {"/exit": "/quit", "/q": "/quit"}.get(head.lower(), head.lower())
    if name not in COMMANDS:
        raise ValueError(f"unknown command {head!r}; commands: {', '.join(COMMANDS)}")
    return Command(name[1:], arg.strip())


class ChatSession:
    def __init__(self, engine: Engine, policy: str = "hybrid", max_new_tokens: int = 128,
                 tau: float | None = None, min_prefix: int | None = None, keep_history: bool = True,
                 sampling=None):
        self.engine, self.max_new_tokens, self.sampling = engine, max_new_tokens, sampling
        self.tau, self.min_prefix, self.keep_history = tau, min_prefix, keep_history
        self.policy = "ar"
        self.set_policy(policy)
        self.transcript = ""
        self.last_stats: DecodeStats | None = None

    def set_policy(self, name: str) -> str:
        """Switch to ``name``, checked with the session's τ, m, max_new_tokens and sampling the
        way a reply would check them: a policy that could not answer any turn (``fused`` with
        sampling, an m beyond the model's D) is refused here, the current policy kept."""
        from ..runtime.decoding import DecodingError
        from ..runtime.policies import POLICIES

        if name not in POLICIES:
            raise DecodingError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
        if name != "ar" and self.engine.manifest.mtp is None:
            raise DecodingError(f"policy {name!r} needs an MTP-trained model; this one is AR-only (use ar)")
        self.engine.decode_options(name, self.max_new_tokens, None, self.tau, self.min_prefix, sampling=self.sampling)
        self.policy = name
        return name

    def reset(self) -> None:
        self.transcript = ""

    def _separator(self) -> str:
        # Each user turn starts a line: a reply that did not end one (it stopped at
        # max_new_tokens) would otherwise run into the next turn ("return x" + "y = 1" ->
        # "return xy = 1"), and the model would read tokens nobody typed.
        return "\n" if self.transcript and not self.transcript.endswith("\n") else ""

    def _context_ids(self, user_text: str) -> list[int]:
        ids = self.engine.encode(self.transcript + user_text)
        d = self.engine.block_size or 0
        max_context = self.engine.backend.max_context
        # decode() keeps room for one draft block (2·D) and stops when the context is full, so
        # the kept transcript leaves room for the reply too (at most half the context): with
        # one slot spare, every reply after a long session was cut to a token or two.
        reply_room = min(self.max_new_tokens, max_context // 2)
        budget = max(1, max_context - (1 if self.policy == "ar" else 2 * d) - reply_room)
        return ids[-budget:] if len(ids) > budget else ids

    def reply(self, user_text: str) -> Iterator[tuple[str, DecodeStats]]:
        """Stream the model's continuation of the transcript + ``user_text``: yields
        (text piece, live stats). The stats' token and iteration counts grow as it runs;
        ``decode_s`` and so ``decode_tokens_per_s`` are final once the stream ends."""
        from ..runtime.decoding import DecodeStats

        turn = user_text if user_text.endswith("\n") else user_text + "\n"
        turn = self._separator() + turn
        stats = DecodeStats()
        self.last_stats = stats
        ids = self._context_ids(turn)
        pieces: list[str] = []
        for piece in self.engine.stream(ids, max_new_tokens=self.max_new_tokens, policy=self.policy,
                                        tau=self.tau, min_prefix=self.min_prefix, stats=stats,
                                        sampling=self.sampling):
            pieces.append(piece)
            yield piece, stats
        if self.keep_history:
            self.transcript += turn + "".join(pieces)


def stats_line(policy: str, stats: DecodeStats, live_tok_s: float | None = None) -> str:
    tok_s = stats.decode_tokens_per_s if live_tok_s is None else live_tok_s
    return (f"[{policy}] {stats.new_tokens} tokens · {tok_s:.1f} tok/s · "
            f"{stats.tokens_per_iteration:.2f} tokens/iteration · {stats.verifier_calls} verifier calls"
            + (f" · {stats.finish_reason}" if stats.finish_reason and live_tok_s is None else ""))
