"""Rendering a plan: the metric table, verdict and crossover as text, and everything as JSON."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from kvstore.planner.crossover import Crossover
from kvstore.planner.metrics import Metrics
from kvstore.planner.plan import Evaluation, Planner
from kvstore.planner.verdict import Verdict
from kvstore.workloads.report import seconds as _s
from kvstore.workloads.report import text_table


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0%}"


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def _rate(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:,.0f}" if x >= 100 else f"{x:.2f}"


ROWS: tuple[tuple[str, callable], ...] = (
    ("requests done / rejected", lambda m: f"{m.completed} / {m.rejected}"),
    ("prompt tokens/s", lambda m: _rate(m.prompt_tokens_per_s)),
    ("output tokens/s", lambda m: _rate(m.output_tokens_per_s)),
    ("TTFT p50 / p90 / p99", lambda m: f"{_s(m.ttft_p50)} / {_s(m.ttft_p90)} / {_s(m.ttft_p99)}"),
    ("TPOT p50 / p90 / p99", lambda m: f"{_s(m.tpot_p50)} / {_s(m.tpot_p90)} / {_s(m.tpot_p99)}"),
    ("inter-token p50 / p99", lambda m: f"{_s(m.itl_p50)} / {_s(m.itl_p99)}"),
    ("prefill queue p50 / p99", lambda m: f"{_s(m.prefill_queue_p50)} / {_s(m.prefill_queue_p99)}"),
    ("decode queue p50 / p99", lambda m: f"{_s(m.decode_queue_p50)} / {_s(m.decode_queue_p99)}"),
    ("KV transferred", lambda m: _gb(m.kv_bytes_transferred)),
    ("transfer p50 / p99", lambda m: f"{_s(m.transfer_p50)} / {_s(m.transfer_p99)}"),
    ("transfer share of TTFT", lambda m: _pct(m.transfer_share_of_ttft)),
    ("interference share of TPOT", lambda m: _pct(m.interference_share_of_tpot)),
    ("TPOT p90 without stalls", lambda m: _s(m.tpot_p90_without_stalls)),
    ("weights resident (x copies)", lambda m: f"{_gb(m.weight_bytes_resident)} (x{m.weight_duplication:g})"),
    ("peak KV memory", lambda m: _gb(m.peak_kv_bytes)),
    ("busy: prefilling / decode-only", lambda m: f"{_pct(m.prefill_utilization)} / {_pct(m.decode_utilization)}"),
    ("SLO attainment", lambda m: _pct(m.slo_attainment)),
    ("goodput (req/s in SLO)", lambda m: _rate(m.goodput_rps)),
    ("meets SLO", lambda m: "yes" if m.meets_slo else "no"),
    ("energy", lambda m: m.energy),
)


def metric_table(metrics: list[Metrics]) -> str:
    """Rows are metrics, columns deployments; plain text so it reads the same in a terminal and a log."""
    header = ["metric"] + [m.label for m in metrics]
    return "\n".join(text_table([header] + [[name] + [fn(m) for m in metrics] for name, fn in ROWS]))


def setup_text(planner: Planner) -> str:
    c, cost = planner.config, planner.cost
    mem = f"KV room {cost.kv_capacity_tokens:,} tokens/worker ({cost.kv_bytes_per_token:,} B/token)"
    link = planner.transfer
    return "\n".join([
        f"trace   {planner.trace.describe()}",
        f"model   {c.model.name} on {c.gpu.name}: {c.gpus} GPU(s), tp={planner.tp} per worker; {mem}",
        f"link    {link.name}: {link.bytes_per_s * 8 / 1e9:,.4g} Gb/s per worker, {link.latency_s * 1e6:.0f} us "
        f"per transfer",
        f"cost    {cost.name}: prefill 1k tokens {_s(cost.prefill_s(1024))}, decode step (32 x 1k ctx) "
        f"{_s(cost.decode_s(32, 32 * 1024))}",
    ])


def crossover_text(crossover: Crossover) -> str:
    lines = [f"crossover ({crossover.kind}): {crossover.summary}"]
    for p in crossover.points:
        x = f"{p.x * 8 / 1e9:10,.4g} Gb/s" if crossover.kind == "link bandwidth" else \
            f"x{p.x:<6g} ({p.mean_prompt_tokens:>7.0f} tok)"
        lines.append(f"  {x}  disagg goodput {p.disagg_goodput_rps:7.3f} vs {p.best_colocated_goodput_rps:7.3f} "
                     f"req/s, p90/limit {p.disagg_slo_ratio:6.2f} vs {p.best_colocated_slo_ratio:6.2f}, "
                     f"transfer {p.transfer_share_of_ttft:4.0%} of TTFT  {'pays' if p.pays else '-'}")
    return "\n".join(lines)


def render(planner: Planner, ev: Evaluation, verdict: Verdict, crossovers: list[Crossover]) -> str:
    parts = [setup_text(planner), "", metric_table(list(ev.metrics.values())), "",
             "verdict: " + verdict.headline] + [f"  - {r}" for r in verdict.reasons]
    for crossover in crossovers:
        parts += ["", crossover_text(crossover)]
    return "\n".join(parts)


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def to_json(planner: Planner, ev: Evaluation, verdict: Verdict, crossovers: list[Crossover],
            per_request: bool = True) -> dict:
    c = planner.config
    doc = {
        "schema": "kvstore.plan/1",
        "trace": {"name": ev.trace.name, "requests": len(ev.trace), "source_requests": ev.trace.source_requests,
                  "time_scale": ev.trace.time_scale, "prompt_scale": ev.trace.prompt_scale,
                  "output_scale": ev.trace.output_scale, "mean_prompt": ev.trace.mean_prompt,
                  "mean_output": ev.trace.mean_output},
        "config": {"model": c.model.name, "gpu": c.gpu.name, "gpus": c.gpus, "tp": ev.tp, "link": c.link.name,
                   "slo": asdict(c.slo), "chunk_tokens": c.chunk_tokens, "max_batch": c.max_batch,
                   "efficiency": asdict(c.efficiency)},
        "cost_model": planner.cost.to_dict(),
        "transfer_model": planner.transfer.to_dict(),
        "metrics": {a.value: m.to_dict() for a, m in ev.metrics.items()},
        "disaggregated_splits": [m.to_dict() for m in ev.splits],
        "verdict": verdict.to_dict(),
        "crossovers": [asdict(x) for x in crossovers],
    }
    if per_request:
        doc["requests"] = {a.value: [_request_dict(r) for r in res.requests] for a, res in ev.results.items()}
    return _clean(doc)


def _request_dict(r) -> dict:
    d = asdict(r)
    d.pop("token_times_s")
    return d


def write_json(path: str | Path, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=1))
