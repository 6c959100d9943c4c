"""Timing of one operation: warm-up, ``n`` timed calls, median and p99 (kvstore.workloads.stats), GB/s."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.workloads.stats import percentiles


@dataclass(frozen=True)
class Timing:
    size: int
    p50_s: float
    p99_s: float
    n: int

    @property
    def gbps(self) -> float:
        return self.size / self.p50_s / 1e9 if self.p50_s > 0 else float("inf")

    def as_dict(self) -> dict:
        return {"size": self.size, "p50_us": self.p50_s * 1e6, "p99_us": self.p99_s * 1e6,
                "gbps": self.gbps, "n": self.n}


def timing_of(size: int, times_s: Sequence[float]) -> Timing:
    """The :class:`Timing` of ``times_s`` (seconds per call, any order) for calls that move ``size`` bytes."""
    p50, p99 = percentiles(times_s, (50, 99))
    return Timing(size, p50, p99, len(times_s))


def iterations(size: int, budget_bytes: int = 512 << 20, lo: int = 20, hi: int = 3000) -> int:
    return max(lo, min(hi, budget_bytes // max(size, 1)))


def sample(fn: Callable[[], object], n: int, warmup: int = 3) -> list[float]:
    """``warmup`` untimed calls, then the wall-clock seconds of each of ``n`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def measure(fn: Callable[[], object], size: int, n: int | None = None, warmup: int = 3) -> Timing:
    """Time ``fn`` (which moves ``size`` bytes) ``n`` times (default :func:`iterations`) after a warm-up."""
    n = n or iterations(size)
    return timing_of(size, sample(fn, n, warmup))
