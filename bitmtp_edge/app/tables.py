"""The bench results table on the terminal (``bitmtp bench``): rich when interactive, Markdown when piped."""

from __future__ import annotations

import sys

import click


def print_bench_table(data: dict) -> None:
    """A rich table on a terminal; the Markdown table (as in bench.md) when piped."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from .bench_report import TERMINAL_COLUMNS, markdown_table, table_rows

    if not sys.stdout.isatty():
        click.echo("\n".join(markdown_table(data)))
        for note in data["notes"]:
            click.echo(f"note: {note}")
        return
    rows = table_rows(data)
    # Columns nobody measured here (power off a power sensor, GPU clocks on a CPU) are left
    # out of the terminal table; bench.md keeps them all.
    keep = [i for i in range(len(TERMINAL_COLUMNS)) if i == 0 or any(row[i] != "–" for row in rows)]
    table = Table(title=f"{data['device']} — {data['engine']['backend']} backend", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for i in keep:
        table.add_column(TERMINAL_COLUMNS[i], justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    console = Console(soft_wrap=False)
    console.print(table)
    for note in data["notes"]:
        console.print(f"note: {note}", markup=False, highlight=False)
