"""Request traces for the planner: the Mooncake and Azure 2023 formats, and a built-in Poisson generator.

The one trace model of kvstore, used by the planner and by the measured comparison in ``benchmarks/pd``
(which tokenizes it: ``benchmarks.pd.trace.tokenize``). The files are read by
:mod:`kvstore.workloads.tracefile`; this module builds the model from its records. A trace is arrival times plus
prompt/output lengths, and optionally prefix-block ids (Mooncake's
``hash_ids``: one id per ``block_tokens`` prompt tokens; equal ids across requests are a shared prefix).
Scaling is explicit (:meth:`Trace.scaled`) and recorded on the trace so reports can print it; nothing is
truncated silently (:meth:`Trace.head` records how many requests the source had).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvstore.workloads.tracefile import MOONCAKE_BLOCK_TOKENS, TraceFormat, TraceRecord, read_records

__all__ = ["MOONCAKE_BLOCK_TOKENS", "WORKLOADS", "Trace", "TraceRequest", "Workload", "get_workload", "load_trace",
           "poisson", "read_azure", "read_mooncake"]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_ids: tuple[int, ...] = ()
    klass: str = "interactive"  # request class: "background" requests are best-effort in benchmarks/pd

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"request {self.id}: prompt_tokens {self.prompt_tokens} and output_tokens "
                             f"{self.output_tokens} must both be >= 1")
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"request {self.id}: arrival_s must be finite and >= 0, got {self.arrival_s!r}")


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: tuple[TraceRequest, ...]
    block_tokens: float = MOONCAKE_BLOCK_TOKENS
    time_scale: float = 1.0
    prompt_scale: float = 1.0
    output_scale: float = 1.0
    source_requests: int = 0  # requests in the source before head(); 0 means "all of them"

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError(f"trace {self.name!r} has no requests")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def mean_prompt(self) -> float:
        return float(np.mean([r.prompt_tokens for r in self.requests]))

    @property
    def mean_output(self) -> float:
        return float(np.mean([r.output_tokens for r in self.requests]))

    @property
    def max_request_tokens(self) -> int:
        return max(r.prompt_tokens + r.output_tokens for r in self.requests)

    def scaled(self, time: float = 1.0, prompt: float = 1.0, output: float = 1.0) -> Trace:
        """Multiply inter-arrival times by ``time`` and lengths by ``prompt``/``output`` (rounded, >= 1).
        Prefix blocks scale with the prompt, so shared prefixes stay shared."""
        for label, factor in (("time", time), ("prompt", prompt), ("output", output)):
            if not (isinstance(factor, (int, float)) and factor > 0 and math.isfinite(factor)):
                raise ValueError(f"{label} scale must be a finite number > 0, got {factor!r}")
        t0 = self.requests[0].arrival_s
        reqs = tuple(replace(r, arrival_s=(r.arrival_s - t0) * time,
                             prompt_tokens=max(1, round(r.prompt_tokens * prompt)),
                             output_tokens=max(1, round(r.output_tokens * output)))
                     for r in self.requests)
        return replace(self, requests=reqs, block_tokens=self.block_tokens * prompt,
                       time_scale=self.time_scale * time, prompt_scale=self.prompt_scale * prompt,
                       output_scale=self.output_scale * output)

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (the count of the source is kept for the report)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"number of requests must be a positive integer, got {n!r}")
        return replace(self, requests=self.requests[:n], source_requests=self.source_requests or len(self))

    def describe(self) -> str:
        src = f"first {len(self)} of {self.source_requests}" if self.source_requests > len(self) else str(len(self))
        return (f"{self.name}: {src} requests over {self.duration_s:.1f} s; mean prompt {self.mean_prompt:.0f} "
                f"tokens, mean output {self.mean_output:.0f}; scales time x{self.time_scale:g}, "
                f"prompt x{self.prompt_scale:g}, output x{self.output_scale:g}")


def read_mooncake(path: str | Path) -> Trace:
    """Mooncake jsonl: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` per line."""
    return _build(Path(path).stem, read_records(path, TraceFormat.MOONCAKE))


def read_azure(path: str | Path) -> Trace:
    """Azure LLM inference trace 2023 CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens``."""
    return _build(Path(path).stem, read_records(path, TraceFormat.AZURE))


def _build(name: str, records: Iterator[TraceRecord]) -> Trace:
    rows = sorted(records, key=lambda r: r.arrival_s)
    if not rows:
        raise ValueError(f"trace {name!r} is empty")
    t0 = rows[0].arrival_s
    reqs = tuple(TraceRequest(i, r.arrival_s - t0, r.prompt_tokens, r.output_tokens, r.prefix_ids)
                 for i, r in enumerate(rows))
    return Trace(name=name, requests=reqs, block_tokens=MOONCAKE_BLOCK_TOKENS)


def load_trace(path: str | Path) -> Trace:
    """Read a trace file, choosing the format by extension (.jsonl/.json: Mooncake, .csv: Azure)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {str(path)!r} does not exist")
    fmt = TraceFormat.from_path(path)
    return read_mooncake(path) if fmt is TraceFormat.MOONCAKE else read_azure(path)


@dataclass(frozen=True, slots=True)
class Workload:
    """A Poisson workload: lognormal prompt lengths around ``prompt_mean``; a ``long_fraction`` of requests
    draws from ``long_prompt_mean`` instead (a bimodal mix, as in long-document traffic)."""

    name: str
    prompt_mean: float
    output_mean: float
    long_prompt_mean: float = 0.0
    long_fraction: float = 0.0


WORKLOADS: dict[str, Workload] = {
    "short": Workload("short", prompt_mean=256, output_mean=128),
    "long": Workload("long", prompt_mean=4096, output_mean=256),
    "mixed": Workload("mixed", prompt_mean=256, output_mean=128, long_prompt_mean=4096, long_fraction=0.2),
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}") from None


def poisson(workload: Workload, rate: float, num_requests: int, seed: int = 0, sigma: float = 0.5) -> Trace:
    """``num_requests`` Poisson arrivals at ``rate`` requests/s, lengths lognormal with shape ``sigma``."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be a positive integer, got {num_requests!r}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    arrivals -= arrivals[0]
    is_long = rng.random(num_requests) < workload.long_fraction
    means = np.where(is_long, workload.long_prompt_mean, workload.prompt_mean)

    def lognormal(mean: np.ndarray | float) -> np.ndarray:
        # mean of lognormal(mu, s) is exp(mu + s^2/2)
        return rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, num_requests)

    prompts = np.maximum(1, np.round(lognormal(means))).astype(int)
    outputs = np.maximum(1, np.round(lognormal(workload.output_mean))).astype(int)
    reqs = tuple(TraceRequest(i, float(a), int(p), int(o))
                 for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs, strict=True)))
    return Trace(name=f"poisson-{workload.name}@{rate:.3g}rps", requests=reqs)
