"""The one table printer of the benchmarks: fixed-width columns, each a header, a format spec and a value.

    COLUMNS = [Column("path", "<11", "path"), Column("size", ">9", lambda r: format_size(r["size"])),
               Column("p50 us", ">10.1f", "p50_us")]
    print(format_table(COLUMNS, rows))

A header takes its column's alignment and width (``">10.1f"`` -> ``">10"``) unless ``header_spec`` says
otherwise; ``gap`` is the number of spaces before the column.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

_ALIGN_WIDTH = re.compile(r"^([<>^]?)(\d*)")


@dataclass(frozen=True)
class Column:
    header: str
    spec: str  # format spec of the value: "<11", ">10.1f"
    value: str | Callable[[Any], object]  # a key of the row (dict or attribute), or a function of the row
    header_spec: str | None = None
    gap: int = 1

    def get(self, row: Any) -> object:
        if callable(self.value):
            return self.value(row)
        return row[self.value] if isinstance(row, dict) else getattr(row, self.value)

    def head(self) -> str:
        spec = self.header_spec
        if spec is None:
            align, width = _ALIGN_WIDTH.match(self.spec).groups()
            spec = f"{align or '<'}{width}"
        return format(self.header, spec)


def _join(columns: Sequence[Column], cells: Iterable[str]) -> str:
    out = []
    for i, (column, cell) in enumerate(zip(columns, cells, strict=True)):
        out.append(("" if i == 0 else " " * column.gap) + cell)
    return "".join(out)


def format_table(columns: Sequence[Column], rows: Iterable[Any], rule: bool = False) -> str:
    """The header line, a rule of dashes under it if ``rule``, and one line per row."""
    header = _join(columns, (c.head() for c in columns))
    lines = [header] + (["-" * len(header)] if rule else [])
    lines += [_join(columns, (format(c.get(row), c.spec) for c in columns)) for row in rows]
    return "\n".join(lines)
