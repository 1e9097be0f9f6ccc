"""One report style for every ``flowlock`` command: lines and tables, drawn with ``rich`` when the
output stream is a terminal and as plain aligned text otherwise (pipes, files, CI logs, tests).

JSON is separate and always complete: :func:`write_json` writes the whole payload a report was
drawn from, so nothing shown is lost when the output is not a terminal.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO


@dataclass(frozen=True)
class Table:
    """A titled table of text cells. ``right`` holds the indexes of right-aligned (numeric) columns."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    right: frozenset[int] = frozenset()

    def __post_init__(self):
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"table {self.title!r}: a row has {len(row)} cells for {len(self.columns)} columns")


Block = str | Table


def plain(table: Table) -> str:
    """``table`` as aligned text: the title, a header, a rule, one line per row, cells split by `` | ``."""
    widths = [max([len(c)] + [len(r[i]) for r in table.rows]) for i, c in enumerate(table.columns)]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(c.rjust(w) if i in table.right else c.ljust(w)
                          for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    head = line(table.columns)
    return "\n".join([table.title, head, "-" * len(head)] + [line(r) for r in table.rows])


def _rich_table(table: Table):
    from rich.table import Table as RichTable

    drawn = RichTable(title=table.title, title_justify="left", title_style="bold")
    for i, column in enumerate(table.columns):
        drawn.add_column(column, justify="right" if i in table.right else "left", overflow="fold")
    for row in table.rows:
        drawn.add_row(*row)
    return drawn


def show(blocks: Iterable[Block], stream: TextIO | None = None) -> None:
    """Write ``blocks`` (lines and tables) to ``stream`` (default stdout): ``rich`` on a terminal,
    :func:`plain` text otherwise. Lines are written as they are (no markup, no highlighting)."""
    stream = sys.stdout if stream is None else stream
    if not stream.isatty():
        for block in blocks:
            print(plain(block) if isinstance(block, Table) else block, file=stream)
        stream.flush()
        return
    from rich.console import Console

    console = Console(file=stream, highlight=False, soft_wrap=True)
    for block in blocks:
        if isinstance(block, Table):
            console.print(_rich_table(block))
        else:
            console.print(block, markup=False)


def write_json(path: str | Path, payload: dict) -> None:
    """Write ``payload`` as indented JSON to ``path``, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
