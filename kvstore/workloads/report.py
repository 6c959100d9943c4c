"""The formatting both reports share (the planner's ``kvstore plan`` text, the measured comparison's
report.md / report.html): a duration, a latency cell, and a table as plain text, Markdown or HTML."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["seconds", "ms_cell", "text_table", "md_table", "html_table"]


def seconds(x: float | None) -> str:
    """A duration in seconds as ``12.3 ms`` or ``4.56 s``; ``-`` for None or NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x * 1e3:.1f} ms" if abs(x) < 1 else f"{x:.2f} s"


def ms_cell(d: Mapping[str, float] | None, keys: Sequence[str] = ("p50", "p90", "p99")) -> str:
    """Percentiles (seconds) of a latency block as whole milliseconds joined by ``/``; ``-`` for None."""
    return "-" if d is None else "/".join(f"{d[k] * 1000:.0f}" for k in keys)


def text_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns two spaces apart, the first row a header underlined with dashes."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def md_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table (cells through ``str``)."""
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def html_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An HTML table, every cell escaped."""
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"
