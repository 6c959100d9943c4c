"""The small engine's view of a trace: the library's :class:`kvstore.workloads.trace.Trace`, turned into
concrete prompt token ids (:func:`tokenize`), scaled and capped for a CPU engine.

There is one trace model, the library's: arrival times, prompt/output lengths, Mooncake prefix-block ids and a
request class. Files are read by :func:`kvstore.workloads.trace.load_trace` (through
:mod:`kvstore.workloads.tracefile`, the one reader); the built-in workloads (:func:`generate`) build the same
model. What is pd-specific is here: a :class:`TokenTrace` of :class:`TokenRequest`, each with concrete prompt
token ids, deterministic from the seed.
Real traces are far larger than a CPU model can serve, so lengths and time are scaled by explicit factors
(:class:`TraceScaling`) that end up in the run's summary. Nothing is truncated silently: a request that does
not fit the engine is an error unless an explicit cap was asked for, and capped requests are counted.

Mooncake ``hash_ids`` name 512-token prefix blocks; equal ids across requests are shared prefixes. They are
replayed as shared *token* prefixes: block ``h`` always expands to the same ``ceil(512 * prompt_scale)``
token ids, so two requests with the same leading ids start with the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

import numpy as np

from kvstore.workloads.trace import Trace, TraceRequest, read_azure, read_mooncake
from kvstore.workloads.tracefile import MOONCAKE_BLOCK_TOKENS, TraceFormat

__all__ = ["BUILTIN_WORKLOADS", "MOONCAKE_BLOCK_TOKENS", "BuiltinWorkload", "TokenRequest", "TokenTrace",
           "TraceFormat", "TraceScaling", "WorkloadSpec", "generate", "load_token_trace", "tokenize"]


class BuiltinWorkload(Enum):
    SHORT = "short"
    LONG = "long"
    MIXED = "mixed"
    BURST = "burst"  # interactive short requests, and a background burst of long documents a third of the way in


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A Poisson workload: a mix of short and long requests with uniform lengths in the given ranges."""

    rate_rps: float
    long_fraction: float
    short_prompt: tuple[int, int] = (32, 192)
    short_output: tuple[int, int] = (16, 48)
    long_prompt: tuple[int, int] = (640, 1024)
    long_output: tuple[int, int] = (8, 24)
    long_klass: str = "interactive"  # request class of the long requests (issue 5: a background burst)
    burst_window_s: float | None = None  # long requests all arrive within this window instead of by Poisson


#: default rates sized for the default model on two single-threaded workers of this class of CPU
BUILTIN_WORKLOADS = {
    BuiltinWorkload.SHORT: WorkloadSpec(rate_rps=6.0, long_fraction=0.0),
    BuiltinWorkload.LONG: WorkloadSpec(rate_rps=1.5, long_fraction=1.0),
    BuiltinWorkload.MIXED: WorkloadSpec(rate_rps=3.0, long_fraction=0.25, long_klass="background"),
    BuiltinWorkload.BURST: WorkloadSpec(rate_rps=3.0, long_fraction=0.25, long_output=(16, 48),
                                        long_klass="background", burst_window_s=1.0),
}


@dataclass(frozen=True, slots=True)
class TraceScaling:
    """Explicit factors mapping a real trace onto a small engine; all are reported with the results."""

    prompt_scale: float = 1.0
    output_scale: float = 1.0
    time_scale: float = 1.0  # arrival offsets are multiplied by this (0.5 = twice the request rate)
    max_prompt_tokens: int | None = None  # explicit cap; capped prompts are counted, never hidden
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("prompt_scale", "output_scale", "time_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"TraceScaling.{name} must be a positive number, got {value!r}")
        for name in ("max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"TraceScaling.{name} must be a positive int or None, got {value!r}")

    def prompt_len(self, n: int) -> int:
        return max(1, round(n * self.prompt_scale))

    def output_len(self, n: int) -> int:
        return max(1, round(n * self.output_scale))


@dataclass(frozen=True, slots=True)
class TokenRequest:
    """One request of a :class:`TokenTrace`: concrete prompt token ids, scaled (and maybe capped) lengths."""

    id: str
    arrival_s: float
    prompt_ids: tuple[int, ...]
    output_tokens: int
    source_prompt_tokens: int  # before scaling and capping
    source_output_tokens: int
    capped: bool = False
    klass: str = "interactive"

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True, slots=True)
class TokenTrace:
    """A :class:`~kvstore.workloads.trace.Trace` tokenized for an engine (:func:`tokenize`)."""

    name: str
    source: str
    requests: tuple[TokenRequest, ...]
    scaling: TraceScaling
    seed: int

    @property
    def capped_requests(self) -> int:
        return sum(r.capped for r in self.requests)

    def check_fits(self, max_tokens: int) -> None:
        """Raise ValueError naming the first request whose prompt + output exceeds ``max_tokens``."""
        for r in self.requests:
            if r.prompt_tokens + r.output_tokens > max_tokens:
                raise ValueError(
                    f"{self.name}: request {r.id} needs {r.prompt_tokens}+{r.output_tokens} tokens, the engine "
                    f"holds at most {max_tokens} per request; scale lengths down (--prompt-scale/--output-scale) "
                    f"or cap them explicitly (--max-prompt-tokens/--max-output-tokens)"
                )

    def describe(self) -> dict:
        s = self.scaling
        return {
            "name": self.name, "source": self.source, "seed": self.seed, "requests": len(self.requests),
            "prompt_scale": s.prompt_scale, "output_scale": s.output_scale, "time_scale": s.time_scale,
            "max_prompt_tokens": s.max_prompt_tokens, "max_output_tokens": s.max_output_tokens,
            "capped_requests": self.capped_requests,
            "duration_s": self.requests[-1].arrival_s if self.requests else 0.0,
        }


def _random_tokens(seed: int, key: int, count: int, vocab_size: int) -> list[int]:
    return np.random.default_rng([seed, key]).integers(0, vocab_size, count).tolist()


def tokenize(trace: Trace, *, seed: int = 0, vocab_size: int = 4096, scaling: TraceScaling = TraceScaling(),
             source: str | None = None) -> TokenTrace:
    """Give each request of ``trace`` concrete prompt token ids, scaled and capped by ``scaling``.

    A request with prefix-block ids expands each block ``h`` into the same ``ceil(block_tokens * prompt_scale)``
    tokens (so shared prefixes stay shared token for token); one without draws its tokens from ``(seed, id)``.
    Arrival offsets start at 0 and are multiplied by ``scaling.time_scale``."""
    block_tokens = math.ceil(trace.block_tokens * scaling.prompt_scale)
    blocks: dict[int, list[int]] = {}
    t0 = min(r.arrival_s for r in trace.requests)
    requests = []
    for r in trace.requests:
        n_in = scaling.prompt_len(r.prompt_tokens)
        if r.prefix_ids:
            prompt: list[int] = []
            for h in r.prefix_ids:
                if h not in blocks:
                    blocks[h] = _random_tokens(seed, h, block_tokens, vocab_size)
                prompt.extend(blocks[h])
            if len(prompt) < n_in:
                raise ValueError(f"{trace.name}: request {r.id}: {len(r.prefix_ids)} hash blocks cannot hold "
                                 f"{r.prompt_tokens} input tokens")
            prompt = prompt[:n_in]
        else:
            prompt = _random_tokens(seed, r.id, n_in, vocab_size)
        output, capped = scaling.output_len(r.output_tokens), False
        if scaling.max_prompt_tokens is not None and len(prompt) > scaling.max_prompt_tokens:
            prompt, capped = prompt[: scaling.max_prompt_tokens], True
        if scaling.max_output_tokens is not None and output > scaling.max_output_tokens:
            output, capped = scaling.max_output_tokens, True
        requests.append(TokenRequest(f"r{r.id:05d}", round((r.arrival_s - t0) * scaling.time_scale, 6),
                                     tuple(prompt), output, r.prompt_tokens, r.output_tokens, capped, r.klass))
    requests.sort(key=lambda r: r.arrival_s)
    return TokenTrace(trace.name, source or trace.name, tuple(requests), scaling, seed)


def generate(workload: BuiltinWorkload, num_requests: int, *, seed: int = 0, vocab_size: int = 4096,
             rate_rps: float | None = None, scaling: TraceScaling = TraceScaling()) -> TokenTrace:
    """A Poisson trace of ``num_requests`` requests of ``workload`` (default rate from
    :data:`BUILTIN_WORKLOADS`), built as a library :class:`Trace` and tokenized."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    spec = BUILTIN_WORKLOADS[workload]
    if rate_rps is not None:
        if rate_rps <= 0:
            raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
        spec = replace(spec, rate_rps=rate_rps)
    rng = np.random.default_rng(seed)
    if spec.burst_window_s is not None:
        arrivals, longs = _burst_arrivals(rng, spec, num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / spec.rate_rps, num_requests))
        arrivals -= arrivals[0]
        longs = None
    reqs = []
    for i in range(num_requests):
        is_long = rng.random() < spec.long_fraction if longs is None else bool(longs[i])
        p_lo, p_hi = spec.long_prompt if is_long else spec.short_prompt
        o_lo, o_hi = spec.long_output if is_long else spec.short_output
        src_in, src_out = int(rng.integers(p_lo, p_hi + 1)), int(rng.integers(o_lo, o_hi + 1))
        klass = spec.long_klass if is_long else "interactive"
        reqs.append(TraceRequest(i, float(arrivals[i]), src_in, src_out, klass=klass))
    trace = Trace(name=workload.value, requests=tuple(reqs))
    return tokenize(trace, seed=seed, vocab_size=vocab_size, scaling=scaling,
                    source=f"poisson:{workload.value}@{spec.rate_rps}rps")


def _burst_arrivals(rng: np.random.Generator, spec: WorkloadSpec, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Short requests by Poisson at ``rate_rps``; ``long_fraction`` of ``n`` (at least one) arrive uniformly in
    ``burst_window_s`` seconds starting a third of the way into the short requests' span."""
    n_long = min(n, max(1, round(n * spec.long_fraction)))
    short = np.cumsum(rng.exponential(1.0 / spec.rate_rps, n - n_long))
    short -= short[0] if len(short) else 0.0
    start = short[-1] / 3 if len(short) else 0.0
    burst = start + np.sort(rng.uniform(0.0, spec.burst_window_s, n_long))
    arrivals = np.concatenate([short, burst])
    longs = np.concatenate([np.zeros(len(short), bool), np.ones(n_long, bool)])
    order = np.argsort(arrivals, kind="stable")
    return arrivals[order], longs[order]


def load_token_trace(path: str | Path, *, fmt: TraceFormat | None = None, num_requests: int | None = None,
                     seed: int = 0, vocab_size: int = 4096, scaling: TraceScaling = TraceScaling()) -> TokenTrace:
    """Read a trace file with the library's reader (by ``fmt`` or by its suffix: .jsonl Mooncake, .csv Azure),
    keep its first ``num_requests`` and tokenize it."""
    path = Path(path)
    fmt = fmt or TraceFormat.from_path(path)
    trace = read_mooncake(path) if fmt is TraceFormat.MOONCAKE else read_azure(path)
    if num_requests is not None:
        trace = trace.head(num_requests)
    return tokenize(trace, seed=seed, vocab_size=vocab_size, scaling=scaling, source=str(path))
