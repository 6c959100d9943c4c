"""The one percentile: what every p50/p90/p99 in kvstore's planner and benchmarks is computed with.

Linear interpolation between the two nearest ranks (numpy's default method, also Excel's PERCENTILE.INC and
R's type 7): for ``n`` sorted samples the q-th percentile sits at rank ``(n - 1) * q / 100``. It is exact at
the ends (p0 = min, p100 = max), p50 is the ordinary median, and it does not jump by a whole sample when one
more sample arrives, which nearest-rank methods do at small ``n``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["PERCENTILES", "percentile", "median", "percentiles", "distribution"]

PERCENTILES = (50, 90, 99)  # what a distribution reports


def _samples(values: Iterable[float]) -> np.ndarray:
    arr = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"percentiles need a non-empty 1-D sequence of numbers, got shape {arr.shape}")
    return arr


def _check_q(q: float) -> None:
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not (0 <= q <= 100) or math.isnan(q):
        raise ValueError(f"percentile q must be a number in [0, 100], got {q!r}")


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` (any order), linearly interpolated.

    ValueError if ``values`` is empty or ``q`` is outside [0, 100]."""
    _check_q(q)
    return float(np.percentile(_samples(values), q))


def percentiles(values: Iterable[float], qs: Iterable[float]) -> list[float]:
    """:func:`percentile` at each of ``qs``, sorting ``values`` once."""
    qs = list(qs)
    for q in qs:
        _check_q(q)
    return [float(x) for x in np.percentile(_samples(values), qs)]


def median(values: Iterable[float]) -> float:
    """The 50th percentile (the mean of the two middle samples for an even count)."""
    return percentile(values, 50)


def distribution(values: list[float]) -> dict[str, Any] | None:
    """p50/p90/p99, mean and max of ``values`` (seconds), rounded to the microsecond, and their count; None
    when there are none. The form run summaries (``summary.json``) store a latency in."""
    if not values:
        return None
    arr = np.asarray(values, dtype=np.float64)
    out: dict[str, Any] = {f"p{p}": round(v, 6) for p, v in zip(PERCENTILES, percentiles(arr, PERCENTILES),
                                                                 strict=True)}
    out.update(mean=round(float(arr.mean()), 6), max=round(float(arr.max()), 6), n=len(values))
    return out
