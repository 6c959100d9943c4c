"""The verdict's shared core: which architectures meet the SLO, the winner among them, the closest when none
does, why each one that misses does, and the interference-vs-transfer reasons.

Both verdicts are :func:`choose` with their own ranking: the planner's (``kvstore.planner.verdict.decide``)
the fewest GPUs that meet the SLO, searched over fleet sizes; the measured comparison's
(``benchmarks.pd.verdict.verdict``) the least resources among architectures of equal compute. Each passes a
:class:`Standing` per architecture (from its aggregate: :mod:`kvstore.workloads.metrics`) and a cost key;
smaller costs win, and on equal costs (or equal closeness) the architecture given first.

The reasons are worded from the dict blocks of a run's aggregate (``interference``, ``transfer``,
``decode_queue_s``, ``burst``, ``by_class``, as :func:`benchmarks.pd.metrics.scorecard` writes them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvstore.workloads.metrics import Aggregate
from kvstore.workloads.slo import SLO

__all__ = ["Standing", "Choice", "choose", "miss", "interference_reason", "transfer_reason", "burst_reason"]

MiB = 1 << 20
Card = dict[str, Any]


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _finite(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


@dataclass(frozen=True, slots=True)
class Standing:
    """One architecture against the SLO: what the verdict reads of its aggregate. ``meets``: the caller's
    "meets the SLO" (the run's, or "within the GPUs given"); p90s None when there were none."""

    meets: bool
    attainment_interactive: float
    goodput_rps: float
    ttft_p90: float | None
    tpot_p90: float | None
    lost: int = 0

    @classmethod
    def of(cls, agg: Aggregate) -> Standing:
        return cls(meets=agg.slo.meets_slo, attainment_interactive=agg.slo.attainment_interactive,
                   goodput_rps=agg.slo.goodput_rps, ttft_p90=agg.ttft.p90 if agg.ttft else None,
                   tpot_p90=agg.tpot.p90 if agg.tpot else None, lost=agg.lost)

    @classmethod
    def of_card(cls, card: Card) -> Standing:
        """From a run's card (the dict form of its aggregate: ``slo``, ``ttft_s``, ``tpot_s``, ``requests``)."""
        ttft, tpot = card["ttft_s"], card["tpot_s"]
        return cls(meets=bool(card["slo"]["met"]), attainment_interactive=card["slo"]["attainment_interactive"],
                   goodput_rps=card["slo"]["goodput_rps"], ttft_p90=ttft["p90"] if ttft else None,
                   tpot_p90=tpot["p90"] if tpot else None, lost=card["requests"]["lost"])

    def closeness(self) -> tuple[float, float]:
        """How close to meeting the SLO, larger is closer: interactive attainment, then goodput."""
        return self.attainment_interactive, self.goodput_rps


K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class Choice(Generic[K]):
    """``meeting``: the architectures that meet the SLO, in the order given; ``winner``: the cheapest of them
    (None: none meets); ``closest``: the closest to meeting it; ``misses``: why each other one misses."""

    meeting: tuple[K, ...]
    winner: K | None
    closest: K
    misses: dict[K, str]


def choose(standings: Mapping[K, Standing], slo: SLO, cost: Callable[[K], Any],
           closeness: Callable[[K], Any] | None = None) -> Choice[K]:
    """The verdict's choice among ``standings`` (at least one): the winner is the one with the smallest
    ``cost(key)`` among those that meet the SLO; the closest the one with the largest ``closeness(key)``
    (default: :meth:`Standing.closeness`). Ties go to the architecture given first."""
    if not standings:
        raise ValueError("a verdict needs at least one architecture")
    meeting = tuple(k for k, s in standings.items() if s.meets)
    winner = min(meeting, key=cost) if meeting else None
    closest = max(standings, key=closeness or (lambda k: standings[k].closeness()))
    misses = {k: miss(s, slo) for k, s in standings.items() if not s.meets}
    return Choice(meeting, winner, closest, misses)


def miss(s: Standing, slo: SLO) -> str:
    """Why an architecture missed: lost requests, or the p90s past the limits and its interactive attainment."""
    if s.lost:
        return f"lost {s.lost} requests"
    parts = []
    for name, p90, limit in (("TTFT", s.ttft_p90, slo.ttft_s), ("TPOT", s.tpot_p90, slo.tpot_s)):
        p90 = _finite(p90)
        if p90 is not None and p90 > limit:
            parts.append(f"{name} p90 {ms(p90)} > {ms(limit)}")
    return (", ".join(parts) or "attainment short") + f" (interactive attainment {pct(s.attainment_interactive)})"


def interference_reason(arch: str, card: Card) -> str:
    i = card["interference"]
    if not i["gaps_with_prefill"]:
        return f"{arch}: no decode step ever waited on a prefill ({i['gaps']} inter-token gaps)"
    return (f"{arch}: {pct(i['share_with_prefill'])} of inter-token gaps had a prefill on the same worker, "
            f"p50 {ms(i['gap_p50_with_prefill_s'])} vs {ms(i['gap_p50_decode_only_s'])} without "
            f"(+{pct(i['tpot_inflation'])})")


def transfer_reason(arch: str, card: Card) -> str:
    t = card["transfer"]
    if not t["kv_bytes_transferred"]:
        return f"{arch}: no KV moved"
    dq = card["decode_queue_s"]
    return (f"{arch}: moved {t['kv_bytes_transferred'] / MiB:.1f} MiB of KV in {t['handoffs']} hand-offs, transfer "
            f"p50 {ms(t['transfer_s']['p50'])} = {pct(t['share_of_ttft']['p50'])} of TTFT (p50; "
            f"{pct(t['share_of_ttft']['aggregate'])} of all TTFT), decode queue p50 {ms(dq['p50'] if dq else None)}")


def burst_reason(arch: str, card: Card) -> str | None:
    b = card["burst"]
    if b is None or b["interactive_gap_p90_inside_s"] is None:
        return None
    bg = (card["by_class"].get("background") or {}).get("ttft_s")
    change = "-" if b["p90_inflation"] is None else f"{b['p90_inflation']:+.0%}"
    return (f"{arch}: interactive inter-token gap p90 {ms(b['interactive_gap_p90_inside_s'])} while background "
            f"requests arrive and prefill vs {ms(b['interactive_gap_p90_outside_s'])} otherwise ({change}), "
            f"background TTFT p90 {ms(bg['p90'] if bg else None)}")
