"""``kvstore plan --search``: the cheapest fleet per architecture, its per-GPU goodput and the frontier.

For each architecture the search looks for the fewest GPUs that meet both latency budgets on the trace at
its own rate (or a given one), over tp per worker (powers of two from the fewest that fit, up to x4),
the prefill:decode split (disaggregated) and the chunk budget (chunked). The space is pruned so that a
search of the shipped traces takes seconds, not the thousands of simulations a full grid would:

1. **Ceiling** (no simulation): a tp whose idle-worker latencies already miss the target share of
   requests cannot meet the SLO at any size, and is skipped (:func:`goodput.ceiling`).
2. **Work bound** (no simulation): the search starts at the fewest workers that can keep up with the
   trace's prompt compute and decode memory traffic (:class:`goodput.WorkBounds`), then gallops up
   (+1, +2, +4, ...) to the first size that meets the SLO and bisects back between the last two sizes;
   this assumes more workers never lower the attainment.
3. **Split walk**: a disaggregated fleet of n workers starts at the split that balances the two pools'
   work, and moves one worker toward the pool whose budget failed most (TTFT misses: more prefill; TPOT
   misses: more decode); it stops when the failing budget flips side.
4. **Incumbent bound**: further variants of an architecture (larger tp, other chunk budgets) are only
   tried at sizes with fewer GPUs than the best found so far.
5. **Early stop**: each simulation stops once more requests have missed than the target allows
   (:class:`probe.Prober`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.planner import goodput
from kvstore.planner.deployment import Arch
from kvstore.planner.plan import PlanConfig
from kvstore.planner.probe import Probe, Prober

CHUNK_CHOICES = (512, 256, 1024, 2048)  # the default first: later ones only need to beat it
TP_STEPS = 3  # tp_min, 2 tp_min, 4 tp_min
SPLIT_TRIES = 4
STEADY_SPANS = 20  # the time-scaled trace must last this many TTFT budgets for a goodput figure


@dataclass(frozen=True, slots=True)
class Variant:
    """What the search varies besides the size: tp, and the chunk budget of the chunked architecture."""

    arch: Arch
    tp: int
    chunk_tokens: int = 0

    @property
    def label(self) -> str:
        chunk = f", {self.chunk_tokens} tok/step" if self.arch is Arch.CHUNKED else ""
        return f"{self.arch.value} (tp={self.tp}{chunk})"


@dataclass(frozen=True, slots=True)
class FrontierPoint:
    gpus: int
    label: str
    attainment: float
    meets: bool
    ttft_misses: int = 0
    tpot_misses: int = 0


@dataclass(slots=True)
class ArchPlan:
    """One architecture's answer: its cheapest meeting fleet (``best``: a full-run Probe, or None),
    per-GPU goodput at that placement, the frontier around it, and what was pruned or not found."""

    arch: Arch
    best: Probe | None = None
    max_rate: float = 0.0
    rate_tries: int = 0
    rate_capped: bool = False  # max_rate is a lower bound: the trace became too short to find the knee
    frontier: list[FrontierPoint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def gpus(self) -> int | None:
        return self.best.deployment.gpus if self.best else None

    @property
    def goodput_per_gpu(self) -> float:
        return self.max_rate / self.gpus if self.best else 0.0


@dataclass(frozen=True, slots=True)
class SearchResult:
    rate: float
    trace_rate: float
    max_gpus: int
    plans: dict  # Arch -> ArchPlan
    winner: Arch | None
    simulations: int
    stopped_early: int
    elapsed_s: float


class FleetSearch:
    """Runs the search for one config and trace; ``max_gpus`` caps every fleet."""

    def __init__(self, config: PlanConfig, prober: Prober, max_gpus: int = 64,
                 chunk_choices: tuple[int, ...] = CHUNK_CHOICES, rel_tol: float = 0.03):
        if not isinstance(max_gpus, int) or max_gpus < 1:
            raise ValueError(f"max_gpus must be a positive integer, got {max_gpus!r}")
        self.config, self.prober, self.max_gpus = config, prober, max_gpus
        self.chunk_choices, self.rel_tol = chunk_choices, rel_tol
        self._walks: dict = {}

    # -- variants and bounds --------------------------------------------------------------------------------
    def tps(self) -> list[int]:
        """tp per worker to try: powers of two from the fewest that fit (the configured one if fixed)."""
        if self.config.cost is not None or self.config.tp is not None:
            return [self.config.resolve_tp(self.prober.trace)]
        first = self.config.resolve_tp(self.prober.trace)
        return [first * 2 ** i for i in range(TP_STEPS) if first * 2 ** i <= self.max_gpus]

    def variants(self, arch: Arch) -> list[Variant]:
        chunks = self.chunk_choices if arch is Arch.CHUNKED else (0,)
        return [Variant(arch, tp, c) for tp in self.tps() for c in chunks]

    def _bounds(self, tp: int, rate: float) -> goodput.WorkBounds:
        return goodput.work_bounds(self.prober.trace_at(rate), self.prober.cost(tp), self.config.max_batch,
                                   prefix_cache=self.config.prefix_cache_tokens > 0)

    # -- one size ---------------------------------------------------------------------------------------------
    def meets_at(self, v: Variant, workers: int, rate: float) -> Probe | None:
        """The meeting probe of ``v`` with ``workers`` workers, else the last one tried (None: no valid split)."""
        p = self.prober
        if v.arch is not Arch.DISAGGREGATED:
            return p.probe(p.deployment(v.arch, workers, v.tp, chunk_tokens=v.chunk_tokens or None), rate)
        bounds = self._bounds(v.tp, rate)
        lo, hi = max(1, int(bounds.prefill)), workers - max(1, int(bounds.decode))
        if lo > hi:
            return None
        split, last, side = min(hi, max(lo, bounds.split(workers))), None, ""
        for _ in range(SPLIT_TRIES):
            last = p.probe(p.deployment(v.arch, workers, v.tp, prefill_workers=split), rate)
            self._walks[(v, workers, rate)] = last
            if last.meets or (side and last.short_of != side):
                break
            side = last.short_of
            split += 1 if side == "ttft" else -1
            if not lo <= split <= hi:
                break
        return last

    def _meets(self, v: Variant, workers: int, rate: float) -> Probe | None:
        probe = self.meets_at(v, workers, rate)
        return probe if probe is not None and probe.meets else None

    # -- fewest workers ---------------------------------------------------------------------------------------
    def fewest(self, v: Variant, rate: float, below_gpus: int | None = None) -> Probe | None:
        """Fewest workers of ``v`` meeting the SLO at ``rate`` (only sizes under ``below_gpus`` GPUs)."""
        lo = self._bounds(v.tp, rate).workers(v.arch)
        hi = self.max_gpus // v.tp if below_gpus is None else (below_gpus - 1) // v.tp
        return smallest(lambda n: self._meets(v, n, rate), lo, hi)

    def plan_arch(self, arch: Arch, rate: float) -> ArchPlan:
        plan = ArchPlan(arch)
        tops: dict[int, float] = {}
        for v in self.variants(arch):
            if v.tp not in tops:
                transfer = self.prober.transfer(v.tp) if arch is Arch.DISAGGREGATED else None
                tops[v.tp] = goodput.ceiling(self.prober.trace, self.prober.cost(v.tp), self.config.slo, transfer)
                if tops[v.tp] < self.config.slo.attainment:
                    plan.notes.append(f"{arch.value} at tp={v.tp} skipped: alone on an idle worker only "
                                      f"{tops[v.tp]:.1%} of requests meet both limits (target "
                                      f"{self.config.slo.attainment:.0%})")
            if tops[v.tp] < self.config.slo.attainment:
                continue
            found = self.fewest(v, rate, plan.gpus)
            if found is not None:
                plan.best = self.prober.probe(found.deployment, rate, full=True)
        if plan.best is None:
            plan.notes.append(f"no {arch.value} fleet of at most {self.max_gpus} GPUs meets the SLO at "
                              f"{rate:.3g} req/s")
        return plan

    # -- goodput and frontier ---------------------------------------------------------------------------------
    def per_gpu_goodput(self, plan: ArchPlan, rate: float) -> None:
        if plan.best is None:
            return
        dep = plan.best.deployment
        # the cheapest fleet meets at ``rate`` and one worker fewer does not, so its knee is likely within
        # about workers / (workers - 1) of the rate: the first bracket is that wide (at least 25 %)
        growth = max(1.25, dep.workers / max(1, dep.workers - 1))
        # a finite trace squeezed into a few TTFT budgets is one burst, absorbed or not, not a steady
        # rate: past the rate at which it spans STEADY_SPANS budgets the knee is not measured
        trace = self.prober.trace
        cap = max(rate, self.prober.base_rate * trace.duration_s / (STEADY_SPANS * self.config.slo.ttft_s))
        found = goodput.bisect_rate(lambda r: self.prober.probe(dep, r).meets, rate, self.rel_tol, growth,
                                    max_rate=cap)
        plan.max_rate, plan.rate_tries = found.rate, len(found.tried)
        plan.rate_capped = found.rate >= cap

    def frontier(self, plan: ArchPlan, rate: float, below: int = 2, above: int = 1) -> None:
        """Attainment at sizes around the cheapest fleet (full runs), with its placement kept."""
        if plan.best is None:
            return
        dep = plan.best.deployment
        v = Variant(dep.arch, dep.tp, dep.chunk_tokens if dep.arch is Arch.CHUNKED else 0)
        least = 2 if dep.arch is Arch.DISAGGREGATED else 1
        for n in range(max(least, dep.workers - below), dep.workers + above + 1):
            if n * dep.tp > self.max_gpus:
                break
            probe = plan.best if n == dep.workers else self._frontier_probe(v, n, rate)
            if probe is not None and probe.metrics is not None:
                plan.frontier.append(FrontierPoint(probe.deployment.gpus, probe.metrics.label,
                                                   probe.metrics.slo_attainment, probe.meets,
                                                   probe.ttft_misses + probe.rejected, probe.tpot_misses))

    def _frontier_probe(self, v: Variant, n: int, rate: float) -> Probe | None:
        probe = self._walks.get((v, n, rate)) if v.arch is Arch.DISAGGREGATED else None
        if probe is None:
            probe = self.meets_at(v, n, rate)
        return None if probe is None else self.prober.probe(probe.deployment, rate, full=True)

    def run(self, rate: float | None = None) -> SearchResult:
        t0 = time.perf_counter()
        rate = rate or self.prober.base_rate
        plans = {arch: self.plan_arch(arch, rate) for arch in Arch}
        for plan in plans.values():
            self.per_gpu_goodput(plan, rate)
            self.frontier(plan, rate)
        return SearchResult(rate=rate, trace_rate=self.prober.base_rate, max_gpus=self.max_gpus, plans=plans,
                            winner=pick_winner(plans), simulations=self.prober.simulations,
                            stopped_early=self.prober.stopped_early, elapsed_s=time.perf_counter() - t0)


def smallest(meets: Callable[[int], Probe | None], lo: int, hi: int) -> Probe | None:
    """The meeting probe of the smallest n in [lo, hi] with ``meets(n)`` not None, assuming a larger n never
    fails where a smaller one meets: gallop up from ``lo`` (+1, +2, +4, ...), then bisect back between the
    last failing and the first meeting size."""
    if lo > hi:
        return None
    fail, n, step, found = lo - 1, lo, 1, None
    while found is None:
        n = min(n, hi)
        found = meets(n)
        if found is None:
            if n == hi:
                return None
            fail, n, step = n, n + step, step * 2
    while n - fail > 1:
        mid = (fail + n) // 2
        probe = meets(mid)
        if probe is None:
            fail = mid
        else:
            n, found = mid, probe
    return found


# On equal GPUs the higher per-GPU goodput wins (in 5 % buckets: the bisection's tolerance is 3 %), then
# the architecture that moves no state (as kvstore.planner.verdict ranks them).
_SIMPLICITY = {Arch.CHUNKED: 2, Arch.COLOCATED: 1, Arch.DISAGGREGATED: 0}


def pick_winner(plans: dict) -> Arch | None:
    meeting = [p for p in plans.values() if p.best is not None]
    if not meeting:
        return None

    def key(p: ArchPlan) -> tuple:
        bucket = math.floor(math.log(p.goodput_per_gpu) / math.log(1.05)) if p.goodput_per_gpu > 0 else -10**9
        return (p.gpus, -bucket, -_SIMPLICITY[p.arch])

    return min(meeting, key=key).arch


def search(config: PlanConfig, trace, rate: float | None = None, max_gpus: int = 64, **kwargs) -> SearchResult:
    """The cheapest fleet per architecture for ``trace`` at ``rate`` (default: the trace's own)."""
    return FleetSearch(config, Prober(config, trace), max_gpus, **kwargs).run(rate)

