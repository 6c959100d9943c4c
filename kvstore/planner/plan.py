"""One planning question: how do the three architectures serve this trace on this hardware?

:class:`PlanConfig` fixes model, accelerator, link, GPU count and policies; :func:`evaluate` simulates
every architecture with all the GPUs (the disaggregated split chosen by the user or the best one), and
:func:`fewest_gpus` finds, per architecture, the fewest GPUs that still meet the SLO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvstore.planner.costmodel import CostModel, TransferModel, min_tp
from kvstore.planner.deployment import Arch, Deployment
from kvstore.planner.metrics import Metrics, summarize
from kvstore.planner.presets import CALIBRATED, cost_model_for, transfer_for
from kvstore.planner.simulator import SimResult, Simulator
from kvstore.planner.specs import Efficiency, GPUSpec, LinkSpec, ModelSpec
from kvstore.workloads.slo import SLO
from kvstore.workloads.trace import Trace

MIN_KV_TOKENS = 32768  # auto tp keeps at least this much KV room per worker (or the longest request)


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """What to plan for. ``tp=None`` picks the fewest GPUs per worker that hold the weights and the KV of
    the longest request; ``prefill_workers=None`` tries every split and keeps the best. ``cost`` and
    ``transfer`` override the preset-derived models (e.g. with calibrated ones)."""

    model: ModelSpec
    gpu: GPUSpec
    link: LinkSpec
    gpus: int
    slo: SLO = field(default_factory=SLO)
    tp: int | None = None
    prefill_workers: int | None = None
    chunk_tokens: int = 512
    max_batch: int = 256
    max_prefill_tokens: int = 16384
    prefix_cache_tokens: int = 0
    efficiency: Efficiency = field(default_factory=Efficiency)
    cost: CostModel | None = None
    transfer: TransferModel | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 1:
            raise ValueError(f"gpus must be a positive integer, got {self.gpus!r}")

    def resolve_tp(self, trace: Trace) -> int:
        if self.cost is not None:
            return self.cost.tp
        if self.tp is not None:
            return self.tp
        if (self.model.name, self.gpu.name) in CALIBRATED:
            return 1
        return min_tp(self.model, self.gpu, max(MIN_KV_TOKENS, trace.max_request_tokens), self.efficiency)

    def cost_model(self, tp: int) -> CostModel:
        return self.cost if self.cost is not None else cost_model_for(self.model, self.gpu, tp, self.efficiency)

    def transfer_model(self, tp: int) -> TransferModel:
        return self.transfer if self.transfer is not None else transfer_for(self.link, tp)

    def deployment(self, arch: Arch, gpus: int, tp: int, prefill_workers: int = 0) -> Deployment:
        return Deployment(arch=arch, gpus=gpus, tp=tp, prefill_workers=prefill_workers,
                          chunk_tokens=self.chunk_tokens, max_batch=self.max_batch,
                          max_prefill_tokens=self.max_prefill_tokens, prefix_cache_tokens=self.prefix_cache_tokens)


def rank(m: Metrics) -> tuple:
    """Sort key, larger is better: meets the SLO, then goodput (in 2 % buckets, so noise does not decide),
    then the smaller p90-to-limit ratio."""
    bucket = math.floor(math.log(m.goodput_rps) / math.log(1.02)) if m.goodput_rps > 0 else -10**9
    return (m.meets_slo, bucket, -m.slo_ratio)


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Every architecture simulated with the same GPUs: ``metrics`` keyed by Arch (the disaggregated entry
    is the chosen split); ``splits`` holds every disaggregated split tried; ``results`` the raw runs."""

    config: PlanConfig
    trace: Trace
    tp: int
    metrics: dict
    splits: tuple[Metrics, ...]
    results: dict
    notes: tuple[str, ...] = ()

    def best(self, archs: tuple[Arch, ...] = tuple(Arch)) -> Arch:
        return max((a for a in archs if a in self.metrics), key=lambda a: rank(self.metrics[a]))


class Planner:
    """Runs simulations for one config and trace, caching each (deployment, link) result."""

    def __init__(self, config: PlanConfig, trace: Trace):
        self.config = config
        self.trace = trace
        self.tp = config.resolve_tp(trace)
        if config.gpus < self.tp:
            raise ValueError(f"{config.model.name} on {config.gpu.name} needs {self.tp} GPUs per worker "
                             f"(weights + KV room), but --gpus is {config.gpus}")
        if config.gpus % self.tp:
            raise ValueError(f"--gpus {config.gpus} is not a multiple of the {self.tp} GPUs per worker")
        self.cost = config.cost_model(self.tp)
        self.transfer = config.transfer_model(self.tp)
        self._cache: dict = {}

    def simulate(self, arch: Arch, gpus: int, prefill_workers: int = 0,
                 transfer: TransferModel | None = None, trace: Trace | None = None) -> tuple[SimResult, Metrics]:
        transfer = transfer or self.transfer
        trace = trace or self.trace
        dep = self.config.deployment(arch, gpus, self.tp, prefill_workers)
        key = (dep, transfer if arch is Arch.DISAGGREGATED else None, id(trace))
        if key not in self._cache:
            result = Simulator(self.cost, dep, transfer).run(trace)
            # the trace rides along so its id cannot be reused while the entry lives
            self._cache[key] = (trace, result, summarize(result, self.config.slo))
        return self._cache[key][1:]

    def best_split(self, gpus: int, transfer: TransferModel | None = None,
                   trace: Trace | None = None) -> list[tuple[SimResult, Metrics]]:
        """Every prefill/decode split of ``gpus`` (or only the configured one), best first."""
        workers = gpus // self.tp
        fixed = self.config.prefill_workers
        if fixed is not None:
            if not 1 <= fixed < workers:
                raise ValueError(f"--prefill-workers {fixed} must be in 1..{workers - 1} for {workers} workers")
            choices = [fixed]
        else:
            choices = list(range(1, workers))
        runs = [self.simulate(Arch.DISAGGREGATED, gpus, p, transfer, trace) for p in choices]
        return sorted(runs, key=lambda run: rank(run[1]), reverse=True)

    def evaluate(self) -> Evaluation:
        gpus = self.config.gpus
        metrics, results, notes = {}, {}, []
        for arch in (Arch.COLOCATED, Arch.CHUNKED):
            results[arch], metrics[arch] = self.simulate(arch, gpus)
        splits: tuple[Metrics, ...] = ()
        if gpus // self.tp >= 2:
            runs = self.best_split(gpus)
            results[Arch.DISAGGREGATED], metrics[Arch.DISAGGREGATED] = runs[0]
            splits = tuple(m for _, m in runs)
        else:
            notes.append(f"disaggregated needs at least 2 workers of {self.tp} GPU(s); --gpus is {gpus}")
        return Evaluation(self.config, self.trace, self.tp, metrics, splits, results, tuple(notes))

    def meets(self, arch: Arch, gpus: int) -> Metrics | None:
        """The best metrics of ``arch`` on ``gpus`` GPUs if they meet the SLO, else None."""
        if arch is Arch.DISAGGREGATED:
            m = self.best_split(gpus)[0][1]
        else:
            m = self.simulate(arch, gpus)[1]
        return m if m.meets_slo else None

    def fewest_gpus(self, arch: Arch) -> tuple[int, Metrics] | None:
        """Fewest GPUs (a multiple of tp, at most the configured count) with which ``arch`` meets the SLO.
        Binary search: it assumes more workers never make the SLO attainment worse."""
        lo = (2 if arch is Arch.DISAGGREGATED else 1)
        hi = self.config.gpus // self.tp
        if self.config.prefill_workers is not None and arch is Arch.DISAGGREGATED:
            lo = hi  # a fixed split only makes sense at the configured size
        if hi < lo:
            return None
        best = self.meets(arch, hi * self.tp)
        if best is None:
            return None
        found = (hi * self.tp, best)
        while lo < hi:
            mid = (lo + hi) // 2
            m = self.meets(arch, mid * self.tp)
            if m is None:
                lo = mid + 1
            else:
                hi = mid
                found = (mid * self.tp, m)
        return found
