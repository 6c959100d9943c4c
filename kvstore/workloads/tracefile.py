"""The one reader of request-trace files: Mooncake JSONL and Azure LLM inference 2023 CSV.

It yields :class:`TraceRecord` (one request as the file states it: absolute arrival in seconds, token
lengths, prefix-block ids), in file order. The one trace model (:mod:`kvstore.workloads.trace`) is built from
these records; the small engine (``benchmarks/pd/trace.py``) tokenizes that model (token ids, scaling, caps).

Lengths. A length of 0 is clamped to 1 and the record says so (``clamped``); a negative length, or one that
is not an integer, is refused with the file and line. Why: real traces record 0 for requests that still ran
(an empty completion, a prompt served entirely from a cache), and every served request has at least one
prompt token and produces at least one token, so 1 is the smallest request that exists; refusing them would
make a whole published trace unreadable for a few rows. A negative length is never real data, only a broken
file, so it is an error.

Times. Azure timestamps carry seven fractional digits (``2023-11-16 18:17:03.9799600``), which
``datetime.fromisoformat`` rejects before Python 3.11; :func:`parse_azure_timestamp` parses any number of
fractional digits on every supported Python.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512  # tokens per Mooncake ``hash_ids`` entry
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceFormat(Enum):
    MOONCAKE = "mooncake"  # jsonl: timestamp (ms), input_length, output_length, hash_ids
    AZURE = "azure"  # csv: TIMESTAMP, ContextTokens, GeneratedTokens

    @classmethod
    def from_path(cls, path: str | Path) -> TraceFormat:
        """The format named by the file's suffix (.jsonl/.json: Mooncake, .csv: Azure); ValueError otherwise."""
        suffix = Path(path).suffix.lower()
        by_suffix = {".jsonl": cls.MOONCAKE, ".json": cls.MOONCAKE, ".csv": cls.AZURE}
        try:
            return by_suffix[suffix]
        except KeyError:
            raise ValueError(f"cannot tell the trace format of {str(path)!r}: unknown format {suffix!r}; expected "
                             f".jsonl (Mooncake) or .csv (Azure)") from None


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a trace file as the file states it (lengths clamped up to 1, see the module doc)."""

    line: int  # 1-based line of the file (Azure: the header is line 1)
    arrival_s: float  # absolute, seconds (Mooncake: ms since the trace start / 1000; Azure: Unix time)
    prompt_tokens: int
    output_tokens: int
    prefix_ids: tuple[int, ...] = ()  # Mooncake hash_ids: one per MOONCAKE_BLOCK_TOKENS prompt tokens
    clamped: bool = False  # a length of 0 in the file was read as 1


_AZURE_TIME = re.compile(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d+))?(.*)$")


def parse_azure_timestamp(text: str) -> float:
    """``YYYY-MM-DD HH:MM:SS[.fraction][timezone]`` -> seconds since the epoch (naive times are local).

    Any number of fractional digits is accepted (Azure writes seven; ``fromisoformat`` before 3.11 and
    ``strptime``'s ``%f`` take at most six). ValueError names the text when it is not such a timestamp."""
    m = _AZURE_TIME.match(text.strip())
    if m is None:
        raise ValueError(f"not a timestamp (expected YYYY-MM-DD HH:MM:SS[.fraction]): {text!r}")
    base, frac, zone = m.groups()
    try:
        stamp = datetime.fromisoformat(base + zone).timestamp()
    except ValueError:
        raise ValueError(f"not a timestamp (expected YYYY-MM-DD HH:MM:SS[.fraction]): {text!r}") from None
    return stamp + (float("0." + frac) if frac else 0.0)


def _length(value: object, what: str) -> tuple[int, bool]:
    """(length, clamped) under the module's policy; ValueError for a negative or non-integer value."""
    if isinstance(value, str):
        value = value.strip()
        value = int(value) if value.lstrip("-").isdigit() else value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return max(1, value), value == 0


def _mooncake_record(rec: object, lineno: int) -> TraceRecord:
    if not isinstance(rec, dict):
        raise ValueError(f"not a JSON object: {rec!r}")
    stamp = rec.get("timestamp")
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        raise ValueError(f"field 'timestamp' missing or not a number: {stamp!r}")
    for key in ("input_length", "output_length"):
        if key not in rec:
            raise ValueError(f"field {key!r} missing")
    prompt, c1 = _length(rec["input_length"], "input_length")
    output, c2 = _length(rec["output_length"], "output_length")
    ids = rec.get("hash_ids", [])
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise ValueError(f"field 'hash_ids' is not a list of integers: {ids!r}")
    return TraceRecord(lineno, float(stamp) / 1e3, prompt, output, tuple(ids), c1 or c2)


def read_mooncake_records(path: str | Path) -> Iterator[TraceRecord]:
    """Records of a Mooncake jsonl file (blank lines skipped); ValueError names ``path:line`` and the field."""
    path = Path(path)
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield _mooncake_record(json.loads(line), lineno)
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record: {exc}: {line[:80]!r}") from None


def read_azure_records(path: str | Path) -> Iterator[TraceRecord]:
    """Records of an Azure 2023 CSV; ValueError names missing columns, or ``path:line`` and the bad row."""
    path = Path(path)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = set(AZURE_COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not an Azure 2023 trace, missing columns {sorted(missing)}; "
                             f"found {reader.fieldnames}")
        for lineno, row in enumerate(reader, 2):
            try:
                when = parse_azure_timestamp(row["TIMESTAMP"] or "")
                prompt, c1 = _length(row["ContextTokens"], "ContextTokens")
                output, c2 = _length(row["GeneratedTokens"], "GeneratedTokens")
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: bad Azure trace row {row!r}: {exc}") from None
            yield TraceRecord(lineno, when, prompt, output, (), c1 or c2)


def read_records(path: str | Path, fmt: TraceFormat | None = None) -> Iterator[TraceRecord]:
    """Records of a trace file in ``fmt`` (default: by suffix, :meth:`TraceFormat.from_path`), in file order.

    Lazy: a caller that wants the first N requests reads only as far as it needs."""
    fmt = fmt or TraceFormat.from_path(path)
    return read_mooncake_records(path) if fmt is TraceFormat.MOONCAKE else read_azure_records(path)
