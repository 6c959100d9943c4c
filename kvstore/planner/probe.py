"""One question the search asks many times: does this deployment meet the SLO at this arrival rate?

:class:`Prober` answers it with the simulator, cheaply: a run stops as soon as more requests have missed
a limit than the attainment target allows (the answer is then "no", whatever the rest of the trace does),
requests that cannot fit a worker's KV memory are counted as misses before anything runs, and every
answer is cached. The trace's arrivals are time-scaled to the rate asked for (lengths unchanged), which
is how DistServe measures goodput: the same traffic, arriving faster or slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvstore.planner.costmodel import CostModel, TransferModel
from kvstore.planner.deployment import Arch, Deployment
from kvstore.planner.metrics import Metrics, summarize
from kvstore.planner.plan import PlanConfig
from kvstore.planner.simulator import Simulator
from kvstore.workloads.slo import SLO
from kvstore.workloads.trace import Trace


def trace_rate(trace: Trace) -> float:
    """Mean arrival rate of a trace, requests/s (its requests over the span of their arrivals)."""
    if len(trace) < 2 or trace.duration_s <= 0:
        raise ValueError(f"trace {trace.name!r} needs at least two arrivals at different times to have a rate")
    return (len(trace) - 1) / trace.duration_s


def allowed_misses(requests: int, attainment: float) -> int:
    """Most requests that may miss a limit with the share that meet both still >= ``attainment``."""
    k = math.floor(requests * (1 - attainment) + 1e-9)
    while k > 0 and (requests - k) / requests < attainment:
        k -= 1
    return max(0, k)


@dataclass(frozen=True, slots=True)
class Probe:
    """The answer for one (deployment, rate). ``metrics`` is None when the run was stopped early (it had
    already missed too many); the miss counts are then those seen up to that point (lower bounds)."""

    deployment: Deployment
    rate: float
    meets: bool
    ttft_misses: int
    tpot_misses: int
    rejected: int
    metrics: Metrics | None

    @property
    def attainment(self) -> float | None:
        return self.metrics.slo_attainment if self.metrics is not None else None

    @property
    def short_of(self) -> str:
        """Which budget failed most: "ttft", "tpot" or "" (none failed)."""
        if not (self.ttft_misses or self.tpot_misses or self.rejected):
            return ""
        return "ttft" if self.ttft_misses + self.rejected >= self.tpot_misses else "tpot"


class _OverBudget(Exception):
    pass


class _BudgetedSimulator(Simulator):
    """The simulator, stopped once the misses exceed the budget (``budget`` None: never stopped)."""

    def __init__(self, cost, deployment, transfer, slo: SLO, budget: int | None):
        super().__init__(cost, deployment, transfer)
        self.slo, self.budget = slo, budget
        self.ttft_misses = self.tpot_misses = self.misses = 0

    def on_finish(self, req, worker, now: float) -> None:
        super().on_finish(req, worker, now)
        late = req.t_first - req.spec.arrival_s > self.slo.ttft_s
        slow = req.output > 1 and (req.t_last - req.t_first) / (req.output - 1) > self.slo.tpot_s
        self.ttft_misses += late
        self.tpot_misses += slow
        self.misses += late or slow
        if self.budget is not None and self.misses > self.budget:
            raise _OverBudget


class Prober:
    """Simulates deployments of ``config`` (any tp) on ``trace`` time-scaled to a rate, with a cache."""

    def __init__(self, config: PlanConfig, trace: Trace):
        self.config = config
        self.trace = trace
        self.base_rate = trace_rate(trace)
        self._traces: dict[float, Trace] = {}
        self._costs: dict[int, CostModel] = {}
        self._cache: dict = {}
        self.simulations = 0  # runs started (stopped early or not), for the report
        self.stopped_early = 0

    def trace_at(self, rate: float) -> Trace:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be a finite number of requests/s > 0, got {rate!r}")
        if rate not in self._traces:
            scaled = self.trace.scaled(time=self.base_rate / rate)
            self._traces[rate] = replace(scaled, name=f"{self.trace.name}@{rate:.4g}rps")
        return self._traces[rate]

    def cost(self, tp: int) -> CostModel:
        if tp not in self._costs:
            cfg = self.config
            if cfg.cost is not None and cfg.cost.tp != tp:
                raise ValueError(f"the given cost model is for tp={cfg.cost.tp}, not tp={tp}")
            self._costs[tp] = cfg.cost_model(tp)
        return self._costs[tp]

    def transfer(self, tp: int) -> TransferModel:
        return self.config.transfer_model(tp)

    def deployment(self, arch: Arch, workers: int, tp: int, prefill_workers: int = 0,
                   chunk_tokens: int | None = None) -> Deployment:
        c = self.config
        return Deployment(arch=arch, gpus=workers * tp, tp=tp, prefill_workers=prefill_workers,
                          chunk_tokens=chunk_tokens or c.chunk_tokens, max_batch=c.max_batch,
                          max_prefill_tokens=c.max_prefill_tokens, prefix_cache_tokens=c.prefix_cache_tokens)

    def probe(self, dep: Deployment, rate: float, full: bool = False) -> Probe:
        """Does ``dep`` meet the SLO at ``rate``? ``full`` runs the whole trace and returns its metrics."""
        key = (dep, rate)
        cached = self._cache.get(key)
        if cached is not None and (cached.metrics is not None or not full):
            return cached
        result = self._run(dep, rate, full)
        self._cache[key] = result
        return result

    def _run(self, dep: Deployment, rate: float, full: bool) -> Probe:
        slo, trace, cost = self.config.slo, self.trace_at(rate), self.cost(dep.tp)
        budget = allowed_misses(len(trace), slo.attainment)
        rejected = sum(r.prompt_tokens + r.output_tokens > cost.kv_capacity_tokens for r in trace.requests)
        if rejected > budget and not full:
            return Probe(dep, rate, False, 0, 0, rejected, None)
        transfer = self.transfer(dep.tp) if dep.arch is Arch.DISAGGREGATED else None
        sim = _BudgetedSimulator(cost, dep, transfer, slo, None if full else budget - rejected)
        self.simulations += 1
        try:
            result = sim.run(trace)
        except _OverBudget:
            self.stopped_early += 1
            return Probe(dep, rate, False, sim.ttft_misses, sim.tpot_misses, rejected, None)
        m = summarize(result, slo)
        return Probe(dep, rate, m.meets_slo, sim.ttft_misses, sim.tpot_misses, rejected, m)
