"""The comparison's metrics of one run: what ``compare`` puts in summary.json for each architecture x workload.

Input: the run's ``summary.json``, ``requests.jsonl`` and ``timeline.jsonl`` (deployment.py). Definitions:

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

from kvstore.workloads.metrics import _pcts, burst, by_class, interference, slo_block
from kvstore.workloads.slo import SLO

__all__ = ["burst", "by_class", "cpu_share", "interference", "scorecard", "slo_block"]


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
