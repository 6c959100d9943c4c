"""The comparison's metrics of one run: what ``compare`` puts in summary.json for each architecture x workload.

Input: the run's ``summary.json``, ``requests.jsonl`` and ``timeline.jsonl`` (deployment.py). The latencies,
throughput, transfer, SLO, per-class, interference and burst blocks are the shared aggregate of
:mod:`kvstore.workloads.metrics` (the planner's too), from the rows and the timeline's prefill steps; the rest
(memory, energy, faults, CPU) comes from the run's summary. Definitions:

- SLO: kvstore's one :class:`~kvstore.workloads.slo.SLO` and its accounting (:func:`~kvstore.workloads.slo.judge`),
  the planner's too: a request meets it when TTFT <= ``slo.ttft_s`` and TPOT <= ``slo.tpot_s`` (one-token
  outputs have no TPOT and are judged on TTFT). ``goodput_rps`` = such requests / the run's duration;
  ``attainment`` = their share; a run *meets the SLOs* when every request completed and interactive attainment
  >= ``slo.attainment`` (background requests are best-effort: measured, not held to the SLO).
- Interference (decode gaps a prefill on the same worker interrupted) and burst (interactive decoding inside
  the background window): :mod:`kvstore.workloads.metrics`, which holds the SLO block and per-class latencies too.
- CPU share while busy: a worker's CPU seconds / the wall seconds of its steps; well under 1 means other
  processes on a shared machine took its core (the run's latencies then say more about them than about it).
"""

from __future__ import annotations

from kvstore.workloads.metrics import (
    Aggregate,
    Pcts,
    RequestOutcome,
    aggregate,
    burst,
    by_class,
    interference,
    prefill_step_starts,
    slo_block,
)
from kvstore.workloads.slo import SLO

__all__ = ["burst", "by_class", "cpu_share", "interference", "scorecard", "slo_block"]


def _transfer(agg: Aggregate, summary: dict) -> dict:
    share = agg.transfer_share_per_request
    return {"kv_bytes_transferred": agg.kv_bytes_transferred, "handoffs": agg.handoffs,
            "refetches": summary["transfer"].get("refetches", 0),
            "transfer_s": None if agg.transfer is None else agg.transfer.to_dict(("p50", "p99")),
            "share_of_ttft": {**(share.to_dict(("p50", "p99")) if share else {"p50": 0.0, "p99": 0.0}),
                              "aggregate": round(agg.transfer_share_of_ttft, 4)}}


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


def _pcts(p: Pcts | None) -> dict | None:
    return None if p is None else p.to_dict()


def scorecard(summary: dict, rows: list[dict], timeline: list[dict], slo: SLO) -> dict:
    """Every metric of one architecture x workload: the shared ones (:func:`kvstore.workloads.metrics.aggregate`
    of the rows and the timeline's prefill steps) and the run's own (memory, energy, faults, CPU)."""
    agg = aggregate([RequestOutcome.from_row(r) for r in rows], slo, prefill_starts=prefill_step_starts(timeline))
    return {
        "requests": {**summary["requests"], "total": agg.requests, "completed": agg.completed, "lost": agg.lost,
                     "refetched": summary["transfer"].get("refetches", 0)},
        "throughput": {"prompt_tokens_per_s": round(agg.prompt_tokens_per_s or 0.0, 2),
                       "output_tokens_per_s": round(agg.output_tokens_per_s or 0.0, 2),
                       "duration_s": round(agg.duration_s, 6)},
        "ttft_s": _pcts(agg.ttft), "tpot_s": _pcts(agg.tpot),
        "prefill_queue_s": _pcts(agg.prefill_queue), "decode_queue_s": _pcts(agg.decode_queue),
        "transfer": _transfer(agg, summary),
        "memory": _memory(summary),
        "energy": summary["energy"],
        "slo": agg.slo_dict(),
        "by_class": {k: c.to_dict() for k, c in agg.by_class.items()},
        "interference": agg.interference.to_dict() if agg.interference else None,
        "burst": None if agg.burst is None else agg.burst.to_dict(),
        "fault": summary.get("fault"),
        "compute": {"workers": [w["role"] for w in summary["deployment"]["workers"]],
                    "threads_per_worker": summary["deployment"]["workers"][0]["threads"],
                    "cpu_s": summary["cpu_s"], "cpu_share_while_busy": cpu_share(summary, timeline)},
    }
