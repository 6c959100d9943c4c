"""Per-GPU goodput (DistServe's metric): the highest arrival rate at which a deployment still meets the
SLO attainment, divided by its GPUs; and the bounds the fleet search prunes with.

The rate is found by :func:`bisect_rate`, which assumes attainment falls as the rate rises (one knee):
from a starting rate it doubles (or halves) until the answer flips, then bisects geometrically to a
relative tolerance. The bounds are cheap arithmetic over the trace, no simulation:

- :func:`work_bounds`: worker-seconds of prompt compute and of decoding per second of trace. A step
  costs at least its compute and at least its memory time, so a worker can do at most one second of
  either per second: fewer workers than this cannot keep up at any latency.
- :func:`ceiling`: the share of requests that meet both limits alone on an idle worker (a lone prefill,
  plus the transfer when disaggregated; a lone decode). If it is below the target, no number of workers
  of that size meets the SLO, so the search skips that tp for that architecture.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.planner.costmodel import CostModel, TransferModel, prefill_pairs
from kvstore.planner.deployment import Arch
from kvstore.workloads.slo import SLO
from kvstore.workloads.trace import Trace


@dataclass(frozen=True, slots=True)
class RateSearch:
    """The highest rate found to meet the SLO (0.0: none down to ``start / growth**halvings``) and the rates
    tried, in order, with their answers."""

    rate: float
    tried: tuple[tuple[float, bool], ...]


def bisect_rate(meets: Callable[[float], bool], start: float, rel_tol: float = 0.02, growth: float = 2.0,
                max_rate: float = 1e6, halvings: int = 20) -> RateSearch:
    """Highest rate r (within ``rel_tol``) with ``meets(r)`` True, assuming True below a knee, False above.
    The bracket grows (or shrinks) by ``growth`` per step: a guess of how far the knee is saves steps."""
    if not (start > 0 and math.isfinite(start)):
        raise ValueError(f"start rate must be a finite number > 0, got {start!r}")
    if not 0 < rel_tol < 1 or not growth > 1:
        raise ValueError(f"need 0 < rel_tol < 1 and growth > 1, got {rel_tol!r}, {growth!r}")
    tried: list[tuple[float, bool]] = []

    def ask(r: float) -> bool:
        ok = bool(meets(r))
        tried.append((r, ok))
        return ok

    if ask(start):
        if start >= max_rate:
            return RateSearch(start, tuple(tried))
        lo, hi = start, min(max_rate, start * growth)
        while ask(hi):
            if hi >= max_rate:
                return RateSearch(hi, tuple(tried))
            lo, hi = hi, min(max_rate, hi * growth)
    else:
        lo, hi = start / growth, start
        while not ask(lo):
            if len(tried) > halvings:
                return RateSearch(0.0, tuple(tried))
            lo, hi = lo / growth, lo
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ask(mid) else (lo, mid)
    return RateSearch(lo, tuple(tried))


@dataclass(frozen=True, slots=True)
class WorkBounds:
    """Worker-seconds per second of trace (at one tp) that prompts and decoding need at the least."""

    prefill: float
    decode: float

    def workers(self, arch: Arch) -> int:
        """Fewest workers that can keep up: colocated steps are either prompt or decode, so the work adds;
        a chunked step does both at once, so the larger bounds it; disaggregated pools need each their own."""
        p, d = max(1, math.ceil(self.prefill)), max(1, math.ceil(self.decode))
        if arch is Arch.DISAGGREGATED:
            return p + d
        if arch is Arch.CHUNKED:
            return max(1, math.ceil(max(self.prefill, self.decode)))
        return max(1, math.ceil(self.prefill + self.decode))

    def split(self, workers: int) -> int:
        """The prefill workers of a disaggregated fleet of ``workers`` that balances the two pools' work."""
        share = self.prefill / (self.prefill + self.decode) if self.prefill + self.decode > 0 else 0.5
        return min(workers - 1, max(1, round(workers * share)))


def work_bounds(trace: Trace, cost: CostModel, max_batch: int, prefix_cache: bool = False) -> WorkBounds:
    """Compute seconds of every prompt (none with a prefix cache, which may skip any of it), and memory
    seconds of every output token at the largest batch a worker could hold (weights read once per step,
    each sequence's context read every step)."""
    prompt_s = 0.0 if prefix_cache else sum(
        cost.token_s * r.prompt_tokens + cost.pair_s * prefill_pairs(r.prompt_tokens) for r in trace.requests)
    smallest = min(r.prompt_tokens + r.output_tokens for r in trace.requests)
    batch = max(1, min(max_batch, cost.kv_capacity_tokens // smallest))
    decode_s = sum((r.output_tokens - 1) * (cost.weight_s / batch
                                            + cost.ctx_s * (r.prompt_tokens + r.output_tokens / 2))
                   for r in trace.requests)
    span = max(trace.duration_s, 1e-9)
    return WorkBounds(prefill=prompt_s / span, decode=decode_s / span)


def ceiling(trace: Trace, cost: CostModel, slo: SLO, transfer: TransferModel | None = None) -> float:
    """Share of requests that meet both limits served alone (TTFT: a lone prefill, plus the KV transfer
    when ``transfer`` is given; TPOT: a lone decode step) and that fit the worker's KV memory."""
    ok = 0
    for r in trace.requests:
        if r.prompt_tokens + r.output_tokens > cost.kv_capacity_tokens:
            continue
        ttft = cost.prefill_s(r.prompt_tokens)
        if transfer is not None:
            ttft += transfer.time_s(r.prompt_tokens * cost.kv_bytes_per_token)
        tpot = cost.decode_s(1, r.prompt_tokens + r.output_tokens / 2)
        ok += ttft <= slo.ttft_s and (r.output_tokens == 1 or tpot <= slo.tpot_s)
    return ok / len(trace)
