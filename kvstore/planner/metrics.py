"""Per-request results of a simulation and the aggregate metrics the planner reports.

The shared metrics (percentiles, throughput, transfer share, the SLO and its accounting) are
:mod:`kvstore.workloads.metrics` and :mod:`kvstore.workloads.slo`, the same as the measured comparison's in
``benchmarks/pd``; this module adds what only a simulation has."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstore.workloads.metrics import Pcts, RequestOutcome, aggregate
from kvstore.workloads.slo import SLO
from kvstore.workloads.stats import percentile

if TYPE_CHECKING:
    from kvstore.planner.simulator import SimResult

NAN = math.nan


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request's fate, times in seconds on the trace clock. ``tpot_s`` is None for one-token outputs;
    ``transfer_s`` is the hand-off's part of TTFT (publish + fetch when staged through a store; waiting
    for a busy link + the copy when direct), ``link_wait_s`` the waiting part; ``decode_queue_s`` the
    time from prefilled to decoding (waiting for a decode worker with KV room, and for the next step
    boundary); ``stall_s`` the part of its decoding time spent on prefill work sharing its worker."""

    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    rejected: bool = False
    cached_tokens: int = 0
    prefill_queue_s: float = NAN
    prefill_start_s: float = NAN
    prefill_end_s: float = NAN
    decode_queue_s: float = NAN
    transfer_s: float = 0.0
    link_wait_s: float = 0.0
    ttft_s: float = NAN
    tpot_s: float | None = None
    stall_s: float = 0.0  # time its decoding was held up by prefill work on the same worker
    finish_s: float = NAN
    kv_bytes: int = 0
    transferred: bool = False
    token_times_s: tuple[float, ...] | None = None

    def meets(self, slo: SLO) -> bool:
        return not self.rejected and slo.meets(self.ttft_s, self.tpot_s)

    def outcome(self) -> RequestOutcome:
        """As the shared per-request record (all requests of a simulation are interactive)."""
        if self.rejected:
            return RequestOutcome(id=self.id, arrival_s=self.arrival_s, prompt_tokens=self.prompt_tokens,
                                  output_tokens=self.output_tokens, rejected=True)
        return RequestOutcome(
            id=self.id, arrival_s=self.arrival_s, prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
            ttft_s=self.ttft_s, tpot_s=self.tpot_s, prefill_queue_s=self.prefill_queue_s,
            decode_queue_s=self.decode_queue_s, prefill_end_s=self.prefill_end_s, finish_s=self.finish_s,
            transfer_s=self.transfer_s, kv_bytes=self.kv_bytes,
            kv_bytes_transferred=self.kv_bytes if self.transferred else 0, token_times_s=self.token_times_s or ())


@dataclass(frozen=True, slots=True)
class Metrics:
    """Aggregates of one simulated deployment. Times in seconds, rates per second, memory in bytes.

    ``itl_*`` are percentiles over every inter-token gap (token-weighted; where prefill stalls show up as
    "generation stalls"), ``tpot_*`` over requests. ``prefill_utilization`` is the busy share of the
    workers that prefill (all workers when colocated or chunked), ``decode_utilization`` that of the
    decode-only workers (NaN unless disaggregated). ``weight_duplication`` is weight bytes resident
    across all workers over one copy."""

    label: str
    arch: str
    gpus: int
    tp: int
    workers: int
    requests: int
    completed: int
    rejected: int
    duration_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p90: float
    tpot_p99: float
    itl_p50: float
    itl_p99: float
    prefill_queue_p50: float
    prefill_queue_p99: float
    decode_queue_p50: float
    decode_queue_p99: float
    kv_bytes_transferred: int
    transfer_p50: float
    transfer_p99: float
    transfer_share_of_ttft: float
    weight_duplication: float
    weight_bytes_resident: float
    peak_kv_bytes: float
    tpot_p90_without_stalls: float
    interference_share_of_tpot: float
    prefill_utilization: float
    decode_utilization: float
    slo_attainment: float
    goodput_rps: float
    slo_ratio: float  # max(TTFT p90 / limit, TPOT p90 / limit): < 1 means the p90s are within the limits
    meets_slo: bool
    energy: str = "not modelled"

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


class GapHistogram:
    """Weighted log-binned histogram of inter-token gaps (100 bins per decade, 1 us to 10^4 s), so the
    simulator can count millions of token gaps in constant memory. Percentiles are accurate to ~1.2 %."""

    BINS_PER_DECADE = 100
    LOW = 1e-6

    def __init__(self) -> None:
        self.counts = np.zeros(10 * self.BINS_PER_DECADE + 1)

    def add(self, gap_s: float, weight: float = 1.0) -> None:
        if weight <= 0:
            return
        idx = int(math.log10(max(gap_s, self.LOW) / self.LOW) * self.BINS_PER_DECADE)
        self.counts[min(idx, len(self.counts) - 1)] += weight

    def percentile(self, q: float) -> float:
        total = self.counts.sum()
        if total <= 0:
            return NAN
        idx = int(np.searchsorted(np.cumsum(self.counts), total * q / 100.0))
        return self.LOW * 10 ** ((idx + 0.5) / self.BINS_PER_DECADE)


def _p(p: Pcts | None, q: str) -> float:
    return NAN if p is None else float(getattr(p, q))


def _rate(x: float | None) -> float:
    return NAN if x is None else x


def summarize(result: SimResult, slo: SLO) -> Metrics:
    """Aggregate one simulation against ``slo``: the shared metrics (:func:`kvstore.workloads.metrics.aggregate`
    of the requests) plus the simulation's own (GPUs, utilization, weights, peak KV, the inter-token gap
    histogram, and the decode time lost to prefill stalls, which the simulator records per request)."""
    dep = result.deployment
    agg = aggregate([r.outcome() for r in result.requests], slo, classes=False)
    duration = agg.duration_s
    decoding = [r for r in result.requests if not r.rejected and r.tpot_s is not None]
    shares = [r.stall_s / (r.tpot_s * (r.output_tokens - 1)) for r in decoding if r.tpot_s > 0]
    clean = [r.tpot_s - r.stall_s / (r.output_tokens - 1) for r in decoding]
    front = dep.prefill_workers if dep.arch.value == "disaggregated" else dep.workers
    back = dep.decode_workers
    return Metrics(
        label=dep.label, arch=dep.arch.value, gpus=dep.gpus, tp=dep.tp, workers=dep.workers,
        requests=agg.requests, completed=agg.completed, rejected=agg.requests - agg.completed,
        duration_s=duration,
        prompt_tokens_per_s=_rate(agg.prompt_tokens_per_s), output_tokens_per_s=_rate(agg.output_tokens_per_s),
        ttft_p50=_p(agg.ttft, "p50"), ttft_p90=_p(agg.ttft, "p90"), ttft_p99=_p(agg.ttft, "p99"),
        tpot_p50=_p(agg.tpot, "p50"), tpot_p90=_p(agg.tpot, "p90"), tpot_p99=_p(agg.tpot, "p99"),
        itl_p50=result.gaps.percentile(50), itl_p99=result.gaps.percentile(99),
        prefill_queue_p50=_p(agg.prefill_queue, "p50"), prefill_queue_p99=_p(agg.prefill_queue, "p99"),
        decode_queue_p50=_p(agg.decode_queue, "p50"), decode_queue_p99=_p(agg.decode_queue, "p99"),
        kv_bytes_transferred=agg.kv_bytes_transferred,
        transfer_p50=agg.transfer.p50 if agg.transfer else 0.0,
        transfer_p99=agg.transfer.p99 if agg.transfer else 0.0,
        transfer_share_of_ttft=agg.transfer_share_of_ttft,
        weight_duplication=float(dep.workers),
        weight_bytes_resident=dep.workers * result.cost.weight_bytes,
        peak_kv_bytes=float(result.peak_kv_tokens * result.cost.kv_bytes_per_token),
        tpot_p90_without_stalls=percentile(clean, 90) if clean else NAN,
        interference_share_of_tpot=float(np.mean(shares)) if shares else 0.0,
        prefill_utilization=(result.prefill_busy_s / (front * duration)) if duration > 0 else NAN,
        decode_utilization=(result.decode_busy_s / (back * duration)) if duration > 0 and back else NAN,
        slo_attainment=agg.slo.attainment,
        goodput_rps=agg.slo.goodput_rps,
        slo_ratio=agg.slo_ratio,
        meets_slo=agg.slo.meets_slo,
    )
