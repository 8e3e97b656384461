"""The loop behind ``bitmtp chat``: lines in, streamed replies and command answers out."""

from __future__ import annotations

from typing import TextIO

import click

from ..runtime.policies import POLICIES
from .chat import COMMANDS, ChatSession, parse_command
from .live import reply_live, reply_plain


def run_chat(session: ChatSession, stdin: TextIO, interactive: bool) -> None:
    """The loop behind ``bitmtp chat``: read lines until /quit or end of input; a line is a
    user turn (streamed reply) or a ``/command``. Errors a user can cause are printed, not raised."""
    from ..runtime.decoding import DecodingError

    while True:
        if interactive:
            click.echo(click.style(">>> ", bold=True), nl=False)
        line = stdin.readline()
        if not line:  # end of input
            break
        if not line.strip():
            continue
        try:
            command = parse_command(line)
        except ValueError as e:
            click.echo(f"error: {e}", err=True)
            continue
        if command is None:
            try:
                (reply_live if interactive else reply_plain)(session, line)
            except DecodingError as e:
                click.echo(f"error: {e}", err=True)
        elif command.name == "quit":
            break
        elif command.name == "reset":
            session.reset()
            click.echo("transcript cleared", err=True)
        elif command.name == "help":
            for name, what in COMMANDS.items():
                click.echo(f"  {name:<8} {what}", err=True)
        elif command.name == "policy":
            if command.arg:
                try:
                    session.set_policy(command.arg)
                except DecodingError as e:
                    click.echo(f"error: {e}", err=True)
                    continue
            click.echo(f"policy: {session.policy} (choices: {', '.join(POLICIES)})", err=True)
