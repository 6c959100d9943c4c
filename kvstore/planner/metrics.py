"""Per-request results of a simulation and the aggregate metrics the planner reports.

The SLO and its accounting (attainment, goodput, "meets the SLO") are :mod:`kvstore.workloads.slo`, the
same as the measured comparison's in ``benchmarks/pd``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstore.workloads.slo import SLO, judge
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


def _pct(values: list[float], q: float) -> float:
    return percentile(values, q) if values else NAN


def summarize(result: SimResult, slo: SLO) -> Metrics:
    """Aggregate one simulation against ``slo``."""
    dep = result.deployment
    done = [r for r in result.requests if not r.rejected]
    duration = result.makespan_s
    ttft = [r.ttft_s for r in done]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    moved = [r for r in done if r.transferred]
    decoding = [r for r in done if r.tpot_s is not None]
    shares = [r.stall_s / (r.tpot_s * (r.output_tokens - 1)) for r in decoding if r.tpot_s > 0]
    clean = [r.tpot_s - r.stall_s / (r.output_tokens - 1) for r in decoding]
    tally = judge(slo, ((None if r.rejected else r.ttft_s, r.tpot_s, "interactive") for r in result.requests),
                  duration)
    front = dep.prefill_workers if dep.arch.value == "disaggregated" else dep.workers
    back = dep.decode_workers
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: NAN)
    ttft_sum = sum(r.ttft_s for r in moved)
    ttft_p90, tpot_p90 = _pct(ttft, 90), _pct(tpot, 90)
    return Metrics(
        label=dep.label, arch=dep.arch.value, gpus=dep.gpus, tp=dep.tp, workers=dep.workers,
        requests=len(result.requests), completed=len(done), rejected=len(result.requests) - len(done),
        duration_s=duration,
        prompt_tokens_per_s=per_s(sum(r.prompt_tokens for r in done)),
        output_tokens_per_s=per_s(sum(r.output_tokens for r in done)),
        ttft_p50=_pct(ttft, 50), ttft_p90=ttft_p90, ttft_p99=_pct(ttft, 99),
        tpot_p50=_pct(tpot, 50), tpot_p90=tpot_p90, tpot_p99=_pct(tpot, 99),
        itl_p50=result.gaps.percentile(50), itl_p99=result.gaps.percentile(99),
        prefill_queue_p50=_pct([r.prefill_queue_s for r in done], 50),
        prefill_queue_p99=_pct([r.prefill_queue_s for r in done], 99),
        decode_queue_p50=_pct([r.decode_queue_s for r in done], 50),
        decode_queue_p99=_pct([r.decode_queue_s for r in done], 99),
        kv_bytes_transferred=result.kv_bytes_transferred,
        transfer_p50=_pct([r.transfer_s for r in moved], 50) if moved else 0.0,
        transfer_p99=_pct([r.transfer_s for r in moved], 99) if moved else 0.0,
        transfer_share_of_ttft=(sum(r.transfer_s for r in moved) / ttft_sum) if ttft_sum else 0.0,
        weight_duplication=float(dep.workers),
        weight_bytes_resident=dep.workers * result.cost.weight_bytes,
        peak_kv_bytes=float(result.peak_kv_tokens * result.cost.kv_bytes_per_token),
        tpot_p90_without_stalls=_pct(clean, 90),
        interference_share_of_tpot=float(np.mean(shares)) if shares else 0.0,
        prefill_utilization=(result.prefill_busy_s / (front * duration)) if duration > 0 else NAN,
        decode_utilization=(result.decode_busy_s / (back * duration)) if duration > 0 and back else NAN,
        slo_attainment=tally.attainment,
        goodput_rps=tally.goodput_rps,
        slo_ratio=max(ttft_p90 / slo.ttft_s if ttft else math.inf, tpot_p90 / slo.tpot_s if tpot else 0.0),
        meets_slo=tally.meets_slo,
    )
