"""The aggregate metrics of a run's requests, shared by the planner and the measured comparison.

Definitions (rows are ``requests.jsonl`` lines, :mod:`kvstore.workloads.runschema`):

- SLO: :func:`slo_block`, through :func:`~kvstore.workloads.slo.judge`.
- Interference: each inter-token gap of a request (token i -> i+1) is "with prefill" when a step that ran
  prompt tokens on the same worker overlaps it. ``tpot_inflation`` = p50 gap with prefill / p50 gap without -
  1: what a running decode pays when a prefill shares its worker (0 when none ever does, e.g. disaggregated).
- Burst: for workloads with background requests, the inter-token gaps of interactive requests inside the
  background window (first background arrival -> last background prefill end) against those outside.
"""

from __future__ import annotations

import bisect
from itertools import pairwise
from typing import Any

from kvstore.workloads.slo import SLO, judge
from kvstore.workloads.stats import distribution, percentile

Row = dict[str, Any]


def _met(slo: SLO, row: Row) -> bool:
    return not row["lost"] and slo.meets(row["ttft_s"], row["tpot_s"])


def _pcts(d: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if d is None else {k: d[k] for k in ("p50", "p90", "p99")}


def _p(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 6) if values else None


def slo_block(rows: list[Row], slo: SLO, duration_s: float) -> dict[str, Any]:
    tally = judge(slo, ((None if r["lost"] else r["ttft_s"], r["tpot_s"], r["class"]) for r in rows), duration_s,
                  lost=sum(bool(r["lost"]) for r in rows))
    return {
        "goodput_rps": round(tally.goodput_rps, 4),
        "attainment": round(tally.attainment, 4),
        "attainment_interactive": round(tally.attainment_interactive, 4),
        "met": tally.meets_slo,
    }


def by_class(rows: list[Row], slo: SLO) -> dict[str, Any]:
    out = {}
    for klass in sorted({r["class"] for r in rows}):
        sub = [r for r in rows if r["class"] == klass and not r["lost"]]
        out[klass] = {"requests": len(sub),
                      "ttft_s": _pcts(distribution([r["ttft_s"] for r in sub if r["ttft_s"] is not None])),
                      "tpot_s": _pcts(distribution([r["tpot_s"] for r in sub if r["tpot_s"] is not None])),
                      "attainment": round(sum(_met(slo, r) for r in sub) / len(sub), 4) if sub else None}
    return out


def _prefill_starts(timeline: list[Row]) -> dict[int, list[float]]:
    """Per worker: the sorted start times of steps that ran prompt tokens."""
    starts: dict[int, list[float]] = {}
    for s in timeline:
        if s["prefill_tokens"] > 0:
            starts.setdefault(s["worker"], []).append(s["start_s"])
    return {w: sorted(v) for w, v in starts.items()}


def _overlaps(starts: list[float] | None, a: float, b: float) -> bool:
    """Did a prefill step start between tokens ``a`` and ``b``? A worker's steps run one after another and
    token ``a`` comes out at the end of one, so any step that delayed token ``b`` started in ``[a, b)``."""
    if not starts:
        return False
    i = bisect.bisect_left(starts, a)
    return i < len(starts) and starts[i] < b


def _gaps(rows: list[Row], prefill: dict[int, list[float]]) -> tuple[list[float], list[float]]:
    """Inter-token gaps of the rows' decodes: (without a prefill on their worker, with one)."""
    clean: list[float] = []
    hit: list[float] = []
    for row in rows:
        times, worker = row["token_times_s"], row["decode_worker"]
        if row["lost"] or worker is None:
            continue
        for a, b in pairwise(times):
            (hit if _overlaps(prefill.get(worker), a, b) else clean).append(b - a)
    return clean, hit


def interference(rows: list[Row], timeline: list[Row]) -> dict[str, Any]:
    clean, hit = _gaps(rows, _prefill_starts(timeline))
    n = len(clean) + len(hit)
    c50, h50 = _p(clean, 50), _p(hit, 50)
    return {
        "gaps": n, "gaps_with_prefill": len(hit), "share_with_prefill": round(len(hit) / n, 4) if n else 0.0,
        "gap_p50_decode_only_s": c50, "gap_p90_decode_only_s": _p(clean, 90),
        "gap_p50_with_prefill_s": h50, "gap_p90_with_prefill_s": _p(hit, 90),
        "tpot_inflation": round(h50 / c50 - 1, 3) if c50 and h50 is not None else 0.0,
    }


def burst(rows: list[Row]) -> dict[str, Any] | None:
    """Interactive decoding inside and outside the background window; None without background requests."""
    bg = [r for r in rows if r["class"] == "background" and not r["lost"]]
    if not bg:
        return None
    start = min(r["arrival_s"] for r in bg)
    end = max((r["prefill_end_s"] for r in bg if r["prefill_end_s"] is not None), default=start)
    inside: list[float] = []
    outside: list[float] = []
    for row in rows:
        if row["class"] == "background" or row["lost"]:
            continue
        t = row["token_times_s"]
        for a, b in pairwise(t):
            (inside if a < end and b > start else outside).append(b - a)
    i90, o90 = _p(inside, 90), _p(outside, 90)
    return {"background_window_s": [round(start, 3), round(end, 3)],
            "interactive_gaps_inside": len(inside), "interactive_gaps_outside": len(outside),
            "interactive_gap_p50_inside_s": _p(inside, 50), "interactive_gap_p90_inside_s": i90,
            "interactive_gap_p50_outside_s": _p(outside, 50), "interactive_gap_p90_outside_s": o90,
            "p90_inflation": round(i90 / o90 - 1, 3) if i90 is not None and o90 else None}
