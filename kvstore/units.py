"""Sizes and durations parsed once, at the edge ("8GiB" -> 8589934592)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Parse ``4096``, ``"64KiB"``, ``"1.5GiB"``, ``"8GB"`` into bytes; raise ValueError naming the value."""
    if isinstance(value, bool):
        raise TypeError(f"size must be an int or a string like '1GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"size must be an int or a string like '1GiB', got {type(value).__name__}")
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot parse size {value!r}; use e.g. 4096, '64KiB', '8GiB' or '1GB'")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(nbytes: int) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
