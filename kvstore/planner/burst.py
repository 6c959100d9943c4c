"""Independent scaling: a burst of long documents, absorbed by growing the prefill pool alone.

The seed's point about capacity planning: when the long-prompt share of traffic rises for a while (a
batch of documents to summarise), a disaggregated fleet adds prefill workers and leaves its decode pool
as it is, while a colocated fleet (colocated or chunked) can only grow as a whole. :func:`plan_burst`
sizes both for the steady traffic and for the same traffic with the burst added (:func:`with_burst`:
Poisson arrivals of long documents over the trace's span), and says what each must add.

For the disaggregated fleet the decode pool is held at its steady size and the search grows only the
prefill pool (gallop and bisect, as :func:`kvstore.planner.search.smallest`); only when no prefill pool
of at most ``max_gpus`` meets the SLO does the decode pool grow, one worker at a time, and the report
says so. The colocated fleets are searched afresh on the burst traffic at their steady tp and chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kvstore.planner.deployment import Arch, Deployment
from kvstore.planner.plan import PlanConfig
from kvstore.planner.probe import Probe, Prober
from kvstore.planner.search import FleetSearch, Variant, smallest
from kvstore.workloads.trace import Trace, TraceRequest


@dataclass(frozen=True, slots=True)
class Burst:
    """Long documents arriving at ``rate`` per second, lengths lognormal (shape 0.25) around the means."""

    rate: float
    prompt_tokens: int = 16384
    output_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"burst rate must be > 0 requests/s, got {self.rate!r}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"burst lengths must be >= 1 token, got prompt {self.prompt_tokens!r}, "
                             f"output {self.output_tokens!r}")


def with_burst(trace: Trace, burst: Burst) -> Trace:
    """``trace`` with the burst's documents added over its whole span (ids after the trace's)."""
    rng = np.random.default_rng(burst.seed)
    span = trace.duration_s
    count = max(1, int(rng.poisson(burst.rate * span)))
    arrivals = np.sort(rng.uniform(0.0, span, count))

    def lengths(mean: int) -> np.ndarray:
        return np.maximum(1, np.round(rng.lognormal(np.log(mean) - 0.25**2 / 2, 0.25, count))).astype(int)

    prompts, outputs = lengths(burst.prompt_tokens), lengths(burst.output_tokens)
    first = max(r.id for r in trace.requests) + 1
    docs = [TraceRequest(first + i, float(a), int(p), int(o))
            for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs, strict=True))]
    merged = sorted([*trace.requests, *docs], key=lambda r: r.arrival_s)
    return replace(trace, name=f"{trace.name}+burst", requests=tuple(merged))


@dataclass(frozen=True, slots=True)
class Fleet:
    """One architecture's fleet for the steady traffic and for the burst (None: none within the search)."""

    arch: Arch
    steady: Deployment | None
    burst: Deployment | None
    burst_attainment: float | None = None

    @property
    def added_gpus(self) -> int | None:
        if self.steady is None or self.burst is None:
            return None
        return self.burst.gpus - self.steady.gpus


@dataclass(frozen=True, slots=True)
class BurstPlan:
    burst: Burst
    documents: int
    fleets: dict  # Arch -> Fleet
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        b = self.burst
        out = [f"burst   {self.documents} long documents added ({b.rate:g}/s, ~{b.prompt_tokens} prompt and "
               f"~{b.output_tokens} output tokens each)"]
        for arch, f in self.fleets.items():
            if f.steady is None:
                out.append(f"  {arch.value:14s} no steady fleet within the search")
                continue
            if f.burst is None:
                out.append(f"  {arch.value:14s} steady {f.steady.label} ({f.steady.gpus} GPUs); no fleet within "
                           f"the search absorbs the burst")
                continue
            grow = _growth(f)
            out.append(f"  {arch.value:14s} steady {f.steady.label} ({f.steady.gpus} GPUs) -> burst "
                       f"{f.burst.label} ({f.burst.gpus} GPUs, {f.burst_attainment:.1%} in SLO): {grow}")
        return out + [f"  note: {n}" for n in self.notes]

    def to_dict(self) -> dict:
        def dep(d: Deployment | None) -> dict | None:
            return None if d is None else {"label": d.label, "gpus": d.gpus, "tp": d.tp, "workers": d.workers,
                                           "prefill_workers": d.prefill_workers, "decode_workers": d.decode_workers}
        return {"burst": {"rate_rps": self.burst.rate, "prompt_tokens": self.burst.prompt_tokens,
                          "output_tokens": self.burst.output_tokens, "documents": self.documents},
                "fleets": {a.value: {"steady": dep(f.steady), "burst": dep(f.burst), "added_gpus": f.added_gpus,
                                     "burst_attainment": f.burst_attainment} for a, f in self.fleets.items()},
                "notes": list(self.notes)}


def _growth(f: Fleet) -> str:
    if f.arch is not Arch.DISAGGREGATED:
        return f"+{f.added_gpus} GPUs, the whole fleet grows ({f.steady.workers} -> {f.burst.workers} workers)"
    dp = f.burst.prefill_workers - f.steady.prefill_workers
    dd = f.burst.decode_workers - f.steady.decode_workers
    decode = "decode pool unchanged" if dd == 0 else f"decode pool also +{dd}"
    return f"+{dp} prefill worker(s), {decode} (+{f.added_gpus} GPUs)"


def _disaggregated(search: FleetSearch, steady: Deployment, max_gpus: int) -> Probe | None:
    """Grow the prefill pool with the decode pool held; grow decode only if no prefill pool suffices."""
    prober, tp = search.prober, steady.tp
    rate = prober.base_rate
    for decode in range(steady.decode_workers, max_gpus // tp):
        def meets(prefill: int, decode: int = decode) -> Probe | None:
            dep = prober.deployment(Arch.DISAGGREGATED, prefill + decode, tp, prefill_workers=prefill)
            probe = prober.probe(dep, rate)
            return probe if probe.meets else None

        found = smallest(meets, steady.prefill_workers, max_gpus // tp - decode)
        if found is not None:
            return prober.probe(found.deployment, rate, full=True)
    return None


def plan_burst(config: PlanConfig, trace: Trace, burst: Burst, max_gpus: int = 64,
               steady: dict | None = None) -> BurstPlan:
    """Fleets per architecture for ``trace`` and for ``trace`` with ``burst`` added (both at their own rate).
    ``steady`` (Arch -> Deployment or None, e.g. from a search already run at the trace's rate) skips
    the steady search."""
    if steady is None:
        steady_search = FleetSearch(config, Prober(config, trace), max_gpus)
        rate = steady_search.prober.base_rate
        found = {arch: steady_search.plan_arch(arch, rate).best for arch in Arch}
        steady = {arch: probe.deployment if probe else None for arch, probe in found.items()}
    bursty = with_burst(trace, burst)
    burst_search = FleetSearch(config, Prober(config, bursty), max_gpus)
    fleets, notes = {}, []
    for arch in Arch:
        dep = steady.get(arch)
        if dep is None:
            fleets[arch] = Fleet(arch, None, None)
            continue
        if arch is Arch.DISAGGREGATED:
            found = _disaggregated(burst_search, dep, max_gpus)
        else:
            v = Variant(arch, dep.tp, dep.chunk_tokens if arch is Arch.CHUNKED else 0)
            found = burst_search.fewest(v, burst_search.prober.base_rate)
            found = found and burst_search.prober.probe(found.deployment, found.rate, full=True)
        fleets[arch] = Fleet(arch, dep, found.deployment if found else None,
                             found.metrics.slo_attainment if found else None)
    return BurstPlan(burst, len(bursty) - len(trace), fleets, tuple(notes))
