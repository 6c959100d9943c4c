"""The comparison's metrics of one run: what ``compare`` puts in summary.json for each architecture x workload.

Input: the run's ``summary.json``, ``requests.jsonl`` and ``timeline.jsonl`` (deployment.py). Definitions:

- SLO: kvstore's one :class:`~kvstore.workloads.slo.SLO` and its accounting (:func:`~kvstore.workloads.slo.judge`),
  the planner's too: a request meets it when TTFT <= ``slo.ttft_s`` and TPOT <= ``slo.tpot_s`` (one-token
  outputs have no TPOT and are judged on TTFT). ``goodput_rps`` = such requests / the run's duration;
  ``attainment`` = their share; a run *meets the SLOs* when every request completed and interactive attainment
  >= ``slo.attainment`` (background requests are best-effort: measured, not held to the SLO).
- Interference: each inter-token gap of a request (token i -> i+1) is "with prefill" when a step that ran
  prompt tokens on the same worker overlaps it. ``tpot_inflation`` = p50 gap with prefill / p50 gap without -
  1: what a running decode pays when a prefill shares its worker (0 when none ever does, e.g. disaggregated).
- Burst: for workloads with background requests, the inter-token gaps of interactive requests inside the
  background window (first background arrival -> last background prefill end) against those outside.
- CPU share while busy: a worker's CPU seconds / the wall seconds of its steps; well under 1 means other
  processes on a shared machine took its core (the run's latencies then say more about them than about it).
"""

from __future__ import annotations

import bisect
from itertools import pairwise

from benchmarks.pd.summary import distribution
from kvstore.workloads.slo import SLO, judge
from kvstore.workloads.stats import percentile


def _met(slo: SLO, row: dict) -> bool:
    return not row["lost"] and slo.meets(row["ttft_s"], row["tpot_s"])


def _pcts(d: dict | None) -> dict | None:
    return None if d is None else {k: d[k] for k in ("p50", "p90", "p99")}


def _p(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 6) if values else None


def slo_block(rows: list[dict], slo: SLO, duration_s: float) -> dict:
    tally = judge(slo, ((None if r["lost"] else r["ttft_s"], r["tpot_s"], r["class"]) for r in rows), duration_s,
                  lost=sum(bool(r["lost"]) for r in rows))
    return {
        "goodput_rps": round(tally.goodput_rps, 4),
        "attainment": round(tally.attainment, 4),
        "attainment_interactive": round(tally.attainment_interactive, 4),
        "met": tally.meets_slo,
    }


def by_class(rows: list[dict], slo: SLO) -> dict:
    out = {}
    for klass in sorted({r["class"] for r in rows}):
        sub = [r for r in rows if r["class"] == klass and not r["lost"]]
        out[klass] = {"requests": len(sub),
                      "ttft_s": _pcts(distribution([r["ttft_s"] for r in sub if r["ttft_s"] is not None])),
                      "tpot_s": _pcts(distribution([r["tpot_s"] for r in sub if r["tpot_s"] is not None])),
                      "attainment": round(sum(_met(slo, r) for r in sub) / len(sub), 4) if sub else None}
    return out


def _prefill_starts(timeline: list[dict]) -> dict[int, list[float]]:
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


def _gaps(rows: list[dict], prefill: dict[int, list[float]]) -> tuple[list[float], list[float]]:
    """Inter-token gaps of the rows' decodes: (without a prefill on their worker, with one)."""
    clean, hit = [], []
    for row in rows:
        times, worker = row["token_times_s"], row["decode_worker"]
        if row["lost"] or worker is None:
            continue
        for a, b in pairwise(times):
            (hit if _overlaps(prefill.get(worker), a, b) else clean).append(b - a)
    return clean, hit


def interference(rows: list[dict], timeline: list[dict]) -> dict:
    clean, hit = _gaps(rows, _prefill_starts(timeline))
    n = len(clean) + len(hit)
    c50, h50 = _p(clean, 50), _p(hit, 50)
    return {
        "gaps": n, "gaps_with_prefill": len(hit), "share_with_prefill": round(len(hit) / n, 4) if n else 0.0,
        "gap_p50_decode_only_s": c50, "gap_p90_decode_only_s": _p(clean, 90),
        "gap_p50_with_prefill_s": h50, "gap_p90_with_prefill_s": _p(hit, 90),
        "tpot_inflation": round(h50 / c50 - 1, 3) if c50 and h50 is not None else 0.0,
    }


def burst(rows: list[dict]) -> dict | None:
    """Interactive decoding inside and outside the background window; None without background requests."""
    bg = [r for r in rows if r["class"] == "background" and not r["lost"]]
    if not bg:
        return None
    start = min(r["arrival_s"] for r in bg)
    end = max((r["prefill_end_s"] for r in bg if r["prefill_end_s"] is not None), default=start)
    inside, outside = [], []
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


def _transfer(summary: dict, rows: list[dict]) -> dict:
    t = summary["transfer"]
    moved = [r for r in rows if r["kv_bytes_transferred"] and r["ttft_s"]]
    total_ttft = sum(r["ttft_s"] for r in moved)
    aggregate = sum(r["transfer_s"] for r in moved) / total_ttft if total_ttft else 0.0
    share = t["transfer_share_of_ttft"]
    return {"kv_bytes_transferred": t["kv_bytes_transferred"], "handoffs": t["handoffs"],
            "refetches": t.get("refetches", 0),
            "transfer_s": {k: t["transfer_s"][k] for k in ("p50", "p99")} if t["transfer_s"] else None,
            "share_of_ttft": {"p50": share["p50"] if share else 0.0, "p99": share["p99"] if share else 0.0,
                              "aggregate": round(aggregate, 4)}}


def _memory(summary: dict) -> dict:
    m = summary["memory"]
    weights = m["weight_bytes_per_worker"]
    store = (summary.get("store") or {}).get("used_bytes_at_end")
    return {"model_memory_duplication": m["model_memory_duplication"], "weight_bytes_resident": sum(weights),
            "weight_bytes_one_copy": weights[0] if weights else 0, "peak_kv_bytes": m["peak_kv_bytes_total"],
            "peak_kv_bytes_per_worker": m["peak_kv_bytes_per_worker"], "store_kv_bytes_at_end": store}


def cpu_share(summary: dict, timeline: list[dict]) -> dict[str, float]:
    """Per worker: CPU seconds it used / wall seconds its steps took. About 1 when it had a core to itself
    while busy; well under 1 when other processes on the machine took the CPU from it (a starved run)."""
    busy: dict[str, float] = {}
    for step in timeline:
        key = str(step["worker"])
        busy[key] = busy.get(key, 0.0) + step["end_s"] - step["start_s"]
    cpu = summary["cpu_s"]["workers"]
    return {w: round(min(cpu[w] / b, 1.0), 3) for w, b in busy.items() if w in cpu and b > 0}


def scorecard(summary: dict, rows: list[dict], timeline: list[dict], slo: SLO) -> dict:
    """Every metric of one architecture x workload (see the module docstring)."""
    t = summary["throughput"]
    duration = t.get("duration_s", 0.0)
    req = summary["requests"]
    return {
        "requests": {**req, "refetched": summary["transfer"].get("refetches", 0)},
        "throughput": {"prompt_tokens_per_s": t.get("prompt_tokens_per_s", 0.0),
                       "output_tokens_per_s": t.get("output_tokens_per_s", 0.0), "duration_s": duration},
        "ttft_s": _pcts(summary["ttft_s"]), "tpot_s": _pcts(summary["tpot_s"]),
        "prefill_queue_s": _pcts(summary["prefill_queue_s"]), "decode_queue_s": _pcts(summary["decode_queue_s"]),
        "transfer": _transfer(summary, rows),
        "memory": _memory(summary),
        "energy": summary["energy"],
        "slo": slo_block(rows, slo, duration),
        "by_class": by_class(rows, slo),
        "interference": interference(rows, timeline),
        "burst": burst(rows),
        "fault": summary.get("fault"),
        "compute": {"workers": [w["role"] for w in summary["deployment"]["workers"]],
                    "threads_per_worker": summary["deployment"]["workers"][0]["threads"],
                    "cpu_s": summary["cpu_s"], "cpu_share_while_busy": cpu_share(summary, timeline)},
    }
