"""Aggregate metrics of one run (``summary.json``), from the request records and the workers' stats."""

from __future__ import annotations

from benchmarks.pd.record import RequestRecord
from kvstore.workloads.metrics import RequestOutcome, run_duration
from kvstore.workloads.stats import PERCENTILES, distribution

__all__ = ["PERCENTILES", "distribution", "summarize"]


def _field(rows: list[dict], name: str) -> list[float]:
    return [row[name] for row in rows if row[name] is not None]


def _throughput(rows: list[dict]) -> dict:
    done = [r for r in rows if not r["lost"]]
    if not done:
        return {"duration_s": 0.0}
    span = max(run_duration([RequestOutcome.from_row(r) for r in rows]), 1e-9)  # the scorecard's duration too
    prompt = sum(r["prompt_tokens"] for r in done)
    output = sum(r["output_tokens"] for r in done)
    return {"duration_s": round(span, 6), "requests_per_s": round(len(done) / span, 4),
            "prompt_tokens_per_s": round(prompt / span, 2), "output_tokens_per_s": round(output / span, 2),
            "prompt_tokens": prompt, "output_tokens": output}


def _transfer(rows: list[dict]) -> dict:
    moved = [r for r in rows if r["kv_bytes_transferred"]]
    shares = [r["transfer_s"] / r["ttft_s"] for r in moved if r["ttft_s"]]
    return {
        "kv_bytes_transferred": sum(r["kv_bytes_transferred"] for r in rows),
        "kv_bytes_produced": sum(r["kv_bytes"] for r in rows if not r["lost"]),
        "handoffs": len(moved),
        "refetches": sum(r.get("refetched", 0) for r in rows),  # KV fetched again after a decode worker died
        "transfer_s": distribution([r["transfer_s"] for r in moved]),
        "publish_s": distribution([r["publish_s"] for r in moved]),
        "fetch_s": distribution([r["fetch_s"] for r in moved]),
        "transfer_share_of_ttft": distribution(shares),
    }


def _memory(worker_stats: list[dict], worker_info: list[dict]) -> dict:
    weights = [w["weight_bytes"] for w in worker_info]
    return {
        "weight_bytes_per_worker": weights,
        "model_memory_duplication": round(sum(weights) / weights[0], 3) if weights else None,
        "kv_cache_bytes_per_worker": [w["kv_cache_bytes"] for w in worker_info],
        "peak_kv_bytes_per_worker": {str(s["worker"]): s["peak_kv_bytes"] for s in worker_stats},
        "peak_kv_bytes_total": sum(s["peak_kv_bytes"] for s in worker_stats),
    }


def summarize(records: list[RequestRecord], *, worker_info: list[dict], worker_stats: list[dict],
              deployment: dict, trace: dict) -> dict:
    rows = [r.to_json() for r in records]
    done = [r for r in rows if not r["lost"]]
    return {
        "deployment": deployment,
        "trace": trace,
        "workers": worker_info,
        "requests": {"total": len(rows), "completed": len(done), "lost": len(rows) - len(done),
                     "recomputed": sum(r["recomputed"] for r in rows)},
        "throughput": _throughput(rows),
        "ttft_s": distribution(_field(done, "ttft_s")),
        "tpot_s": distribution(_field(done, "tpot_s")),
        "e2e_s": distribution(_field(done, "e2e_s")),
        "prefill_queue_s": distribution(_field(done, "prefill_queue_s")),
        "decode_queue_s": distribution(_field(done, "decode_queue_s")),
        "transfer": _transfer(rows),
        "memory": _memory(worker_stats, worker_info),
        "steps": {str(s["worker"]): len(s["timeline"]) for s in worker_stats},
        "definitions": "see benchmarks/pd/record.py: TTFT is arrival -> first token at the client; "
                       "in disaggregated runs that includes the hand-off and the decode queue",
    }
