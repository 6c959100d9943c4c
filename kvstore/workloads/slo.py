"""The one service-level objective of kvstore's evaluation, and how a set of requests is judged against it.

Shared by the planner (simulated requests: :func:`kvstore.planner.metrics.summarize`) and the measured
comparison of ``benchmarks/pd`` (its ``metrics.py``), so "meets the SLO", "attainment" and "goodput" mean
the same in a plan and in a measured run:

- a request *meets* the SLO when it got a first token within ``ttft_s`` and its time per output token is
  within ``tpot_s`` (one-token outputs have no TPOT and are judged on TTFT); a rejected or lost request
  does not;
- ``attainment``: the share of requests that meet it; ``attainment_interactive`` the share among the
  interactive ones (background requests are best-effort: measured, not held to the SLO);
- ``goodput_rps``: requests that meet it per second of the run;
- a run *meets the SLO* when no request was lost and ``attainment_interactive >= slo.attainment``
  (DistServe's "SLO attainment"). A request the planner's admission rejects is a miss, not a loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["SLO", "Attainment", "judge"]


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency limits per request, and the share of (interactive) requests that must meet both."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1
    attainment: float = 0.9

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"SLO {name} must be a finite number of seconds > 0, got {value!r}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"SLO attainment must be in (0, 1], got {self.attainment!r}")

    def meets(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Did a request with this TTFT and TPOT meet both limits? ``ttft_s`` None (or NaN): it never got a
        first token; ``tpot_s`` None: a one-token output, judged on TTFT."""
        if ttft_s is None or not ttft_s <= self.ttft_s:
            return False
        return tpot_s is None or tpot_s <= self.tpot_s

    def describe(self) -> str:
        tpot = f"{self.tpot_s * 1e3:g} ms" if self.tpot_s < 1 else f"{self.tpot_s:g} s"
        return f"TTFT <= {self.ttft_s:g} s and TPOT <= {tpot} for {self.attainment:.0%} of requests"


@dataclass(frozen=True, slots=True)
class Attainment:
    """How a set of requests fared against an :class:`SLO` (see the module docstring)."""

    requests: int
    met: int
    attainment: float
    attainment_interactive: float
    goodput_rps: float
    meets_slo: bool


def judge(slo: SLO, outcomes: Iterable[tuple[float | None, float | None, str]], duration_s: float,
          lost: int = 0) -> Attainment:
    """Judge requests given as ``(ttft_s, tpot_s, klass)`` (ttft None: rejected or lost) over a run of
    ``duration_s`` seconds in which ``lost`` requests never completed."""
    requests = met = interactive = interactive_met = 0
    for ttft, tpot, klass in outcomes:
        ok = slo.meets(ttft, tpot)
        requests += 1
        met += ok
        if klass != "background":
            interactive += 1
            interactive_met += ok
    attain_i = interactive_met / interactive if interactive else 1.0
    return Attainment(requests=requests, met=met, attainment=met / requests if requests else 0.0,
                      attainment_interactive=attain_i,
                      goodput_rps=met / duration_s if duration_s > 0 else 0.0,
                      meets_slo=lost == 0 and attain_i >= slo.attainment)
