"""Live terminal rendering for the ``bitmtp`` commands (rich): progress bars and streamed replies.

Nothing here decides anything; the commands in ``cli.py`` call these to show what the
library is doing while it does it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from .chat import stats_line

if TYPE_CHECKING:
    from .chat import ChatSession


class CaptureProgress:
    """A progress bar on stderr for graph capture at load (shown only once capture starts)."""

    def __init__(self, console=None):
        self.console = console
        self._bar = self._task = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("capturing CUDA graphs"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console or Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("capture", total=total)
        self._bar.update(self._task, completed=done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class BenchProgress:
    """The bench progress bar, on stderr."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                             TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                             console=Console(stderr=True), transient=True)
        self._task = None

    def start(self, total: int) -> None:
        self._bar.start()
        self._task = self._bar.add_task("", total=total)

    def advance(self, description: str) -> None:
        self._bar.update(self._task, advance=1, description=description)

    def stop(self) -> None:
        self._bar.stop()


def reply_plain(session: ChatSession, line: str) -> None:
    for piece, _ in session.reply(line):
        click.echo(piece, nl=False)
    click.echo()
    click.echo(stats_line(session.policy, session.last_stats), err=True)


def reply_live(session: ChatSession, line: str) -> None:
    """A terminal: the reply's tail and a live footer redrawn as tokens arrive; then the
    whole reply printed plainly (scrollback keeps it) with the final statistics."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    console = Console()
    pieces: list[str] = []
    t0 = time.perf_counter()
    with Live(console=console, transient=True, refresh_per_second=12) as live:
        for piece, stats in session.reply(line):
            pieces.append(piece)
            elapsed = time.perf_counter() - t0 - stats.prefill_s
            rate = stats.new_tokens / elapsed if elapsed > 0 else 0.0
            tail = "".join(pieces).splitlines()[-max(console.height - 3, 1):]
            live.update(Group(Text("\n".join(tail)), Text(stats_line(session.policy, stats, rate), style="dim")))
    click.echo("".join(pieces))
    if session.last_stats is not None:
        click.echo(click.style(stats_line(session.policy, session.last_stats), dim=True), err=True)
