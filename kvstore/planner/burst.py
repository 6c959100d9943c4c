"""Independent scaling: a burst of long documents, absorbed by growing the prefill pool alone.

The seed's point about capacity planning: when the long-prompt share of traffic rises for a while (a
batch of documents to summarise), a disaggregated fleet adds prefill workers and leaves its decode pool
as it is, while a colocated fleet (colocated or chunked) can only grow as a whole. :func:`plan_burst`
sizes both for the steady traffic and for the traffic of the burst (:func:`with_burst`: Poisson arrivals
of long documents in a window of the trace, so the long-prompt share changes over time; the burst fleets
are sized on the requests that arrive in the window), and says what each must add.

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
    """Long documents arriving at ``rate`` per second between ``start_s`` and ``end_s`` of the trace's
    clock (None: its end), lengths lognormal (shape 0.25) around the means."""

    rate: float
    prompt_tokens: int = 16384
    output_tokens: int = 256
    seed: int = 0
    start_s: float = 0.0
    end_s: float | None = None

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"burst rate must be > 0 requests/s, got {self.rate!r}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"burst lengths must be >= 1 token, got prompt {self.prompt_tokens!r}, "
                             f"output {self.output_tokens!r}")
        if self.start_s < 0 or (self.end_s is not None and self.end_s <= self.start_s):
            raise ValueError(f"burst window must have 0 <= start < end, got {self.start_s!r}..{self.end_s!r}")

    def window(self, trace: Trace) -> tuple[float, float]:
        end = trace.duration_s if self.end_s is None else min(self.end_s, trace.duration_s)
        if end <= self.start_s:
            raise ValueError(f"burst window {self.start_s:g}..{end:g} s is outside the trace "
                             f"(0..{trace.duration_s:.1f} s)")
        return self.start_s, end


def with_burst(trace: Trace, burst: Burst) -> Trace:
    """``trace`` with the burst's documents added in its window (ids after the trace's)."""
    rng = np.random.default_rng(burst.seed)
    start, end = burst.window(trace)
    count = max(1, int(rng.poisson(burst.rate * (end - start))))
    arrivals = np.sort(rng.uniform(start, end, count))

    def lengths(mean: int) -> np.ndarray:
        return np.maximum(1, np.round(rng.lognormal(np.log(mean) - 0.25**2 / 2, 0.25, count))).astype(int)

    prompts, outputs = lengths(burst.prompt_tokens), lengths(burst.output_tokens)
    first = max(r.id for r in trace.requests) + 1
    docs = [TraceRequest(first + i, float(a), int(p), int(o))
            for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs, strict=True))]
    merged = sorted([*trace.requests, *docs], key=lambda r: r.arrival_s)
    return replace(trace, name=f"{trace.name}+burst", requests=tuple(merged))


def _window(trace: Trace, start: float, end: float) -> Trace:
    """The requests arriving in [start, end], their clock starting at the first."""
    inside = [r for r in trace.requests if start <= r.arrival_s <= end]
    if len(inside) < 2:
        raise ValueError(f"the burst window {start:g}..{end:g} s holds {len(inside)} request(s); widen it")
    t0 = inside[0].arrival_s
    return replace(trace, name=f"{trace.name}[{start:g}..{end:g}s]",
                   requests=tuple(replace(r, arrival_s=r.arrival_s - t0) for r in inside))


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
        whole = b.start_s == 0 and b.end_s is None
        where = "over the whole trace" if whole else \
            f"from {b.start_s:g} s to {'the end' if b.end_s is None else f'{b.end_s:g} s'}"
        sized = "" if whole else "; the burst fleets are sized on that window's traffic"
        out = [f"burst   {self.documents} long documents added {where} ({b.rate:g}/s, ~{b.prompt_tokens} prompt "
               f"and ~{b.output_tokens} output tokens each){sized}"]
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
        b = self.burst
        return {"burst": {"rate_rps": b.rate, "prompt_tokens": b.prompt_tokens, "output_tokens": b.output_tokens,
                          "documents": self.documents, "start_s": b.start_s, "end_s": b.end_s},
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
    # the burst fleet is sized on the traffic of the window alone: over the whole trace the documents'
    # misses would be diluted by the steady hours around them
    burst_search = FleetSearch(config, Prober(config, _window(bursty, *burst.window(trace))), max_gpus)
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
