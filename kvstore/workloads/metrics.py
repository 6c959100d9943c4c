"""The aggregate metrics of a set of requests, measured or simulated: one record, one aggregate, shared by
the planner (:func:`kvstore.planner.metrics.summarize`) and the measured comparison
(:func:`benchmarks.pd.metrics.scorecard`), so a percentile, a throughput, a transfer share, the SLO block, the
interference and the burst numbers mean the same in a plan and in a measured run.

- :class:`RequestOutcome`: what happened to one request, times in seconds on the run's clock (``arrival_s``,
  ``prefill_end_s``, ``finish_s``, ``token_times_s``) or durations (the rest). A *lost* request never
  completed (a worker died and it was not recovered); a *rejected* one was turned away by admission. Neither
  is *completed*; both miss the SLO, and only a lost one stops a run from meeting it
  (:mod:`kvstore.workloads.slo`).
- :func:`aggregate` -> :class:`Aggregate`:

  - latencies: p50/p90/p99 of TTFT, TPOT, prefill queue and decode queue over the completed requests that
    have one (percentiles: :mod:`kvstore.workloads.stats`);
  - throughput: prompt and output tokens of the completed requests per second of the run, whose duration is
    the first arrival -> the last completed request's last token;
  - transfer: the *hand-offs* are the requests with KV bytes moved (lost ones included); p50/p90/p99 of their
    ``transfer_s``, of their per-request share of TTFT, and ``transfer_share_of_ttft`` = their summed
    transfer time / their summed TTFT (the aggregate share);
  - the SLO (:func:`~kvstore.workloads.slo.judge`) and per request class;
  - interference (given each worker's prefill step starts): each inter-token gap of a request (token i ->
    i+1) is "with prefill" when a step that ran prompt tokens on its decode worker started inside it.
    ``tpot_inflation`` = p50 gap with prefill / p50 gap without - 1: what a running decode pays when a prefill
    shares its worker (0 when none ever does, e.g. disaggregated);
  - burst: with background requests, the inter-token gaps of interactive requests inside the background
    window (first background arrival -> last background prefill end) against those outside.

:func:`slo_block`, :func:`by_class`, :func:`interference` and :func:`burst` give these blocks in the dict form
a run's ``summary.json`` stores, from ``requests.jsonl`` rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from kvstore.workloads.slo import SLO, Attainment, judge
from kvstore.workloads.stats import PERCENTILES, percentiles

__all__ = ["RequestOutcome", "Pcts", "ClassStats", "Interference", "Burst", "Aggregate", "aggregate",
           "prefill_step_starts", "judge_outcomes", "run_duration", "slo_block", "by_class", "interference", "burst"]

Row = dict[str, Any]


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One request's fate (see the module docstring). ``ttft_s`` None: no first token (lost or rejected);
    ``tpot_s`` None: fewer than two output tokens. ``kv_bytes_transferred`` > 0 makes it a hand-off."""

    id: str | int = ""
    klass: str = "interactive"
    arrival_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    prefill_queue_s: float | None = None
    decode_queue_s: float | None = None
    prefill_end_s: float | None = None
    finish_s: float | None = None  # the last token's time
    transfer_s: float = 0.0
    kv_bytes: int = 0
    kv_bytes_transferred: int = 0
    token_times_s: tuple[float, ...] = ()
    decode_worker: int | None = None
    lost: bool = False
    rejected: bool = False

    @property
    def completed(self) -> bool:
        return not (self.lost or self.rejected)

    def meets(self, slo: SLO) -> bool:
        return self.completed and slo.meets(self.ttft_s, self.tpot_s)

    @classmethod
    def from_row(cls, row: Row) -> RequestOutcome:
        """From a ``requests.jsonl`` line (:mod:`kvstore.workloads.runschema`; fields it lacks take their
        defaults). A row marked ``shed`` (turned away with a 429) is rejected."""
        times = tuple(row.get("token_times_s") or ())
        return cls(id=row.get("id", ""), klass=row.get("class") or "interactive",
                   arrival_s=row.get("arrival_s", 0.0), prompt_tokens=row.get("prompt_tokens", 0),
                   output_tokens=row.get("output_tokens", 0), ttft_s=row.get("ttft_s"), tpot_s=row.get("tpot_s"),
                   prefill_queue_s=row.get("prefill_queue_s"), decode_queue_s=row.get("decode_queue_s"),
                   prefill_end_s=row.get("prefill_end_s"), finish_s=times[-1] if times else None,
                   transfer_s=row.get("transfer_s") or 0.0, kv_bytes=row.get("kv_bytes") or 0,
                   kv_bytes_transferred=row.get("kv_bytes_transferred") or 0, token_times_s=times,
                   decode_worker=row.get("decode_worker"), lost=bool(row.get("lost")),
                   rejected=bool(row.get("shed")))


@dataclass(frozen=True, slots=True)
class Pcts:
    """p50 / p90 / p99 of some values, in their unit."""

    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Pcts | None:
        """None when there are no values."""
        if not values:
            return None
        p50, p90, p99 = percentiles(values, PERCENTILES)
        return cls(p50, p90, p99)

    def to_dict(self, keys: tuple[str, ...] = ("p50", "p90", "p99"), ndigits: int = 6) -> dict[str, float]:
        return {k: round(getattr(self, k), ndigits) for k in keys}


def _dict(p: Pcts | None, keys: tuple[str, ...] = ("p50", "p90", "p99")) -> dict[str, float] | None:
    return None if p is None else p.to_dict(keys)


@dataclass(frozen=True, slots=True)
class ClassStats:
    """One request class: its requests that were not lost, their TTFT and TPOT, the share meeting the SLO."""

    requests: int
    ttft: Pcts | None
    tpot: Pcts | None
    attainment: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "ttft_s": _dict(self.ttft), "tpot_s": _dict(self.tpot),
                "attainment": None if self.attainment is None else round(self.attainment, 4)}


@dataclass(frozen=True, slots=True)
class Interference:
    """Inter-token gaps split by whether a prefill step on the same worker started inside them."""

    gaps_decode_only: tuple[float, ...]
    gaps_with_prefill: tuple[float, ...]

    @property
    def gaps(self) -> int:
        return len(self.gaps_decode_only) + len(self.gaps_with_prefill)

    @property
    def share_with_prefill(self) -> float:
        return len(self.gaps_with_prefill) / self.gaps if self.gaps else 0.0

    @property
    def decode_only(self) -> Pcts | None:
        return Pcts.of(self.gaps_decode_only)

    @property
    def with_prefill(self) -> Pcts | None:
        return Pcts.of(self.gaps_with_prefill)

    def to_dict(self) -> dict[str, Any]:
        clean, hit = self.decode_only, self.with_prefill
        c50 = None if clean is None else round(clean.p50, 6)
        h50 = None if hit is None else round(hit.p50, 6)
        return {
            "gaps": self.gaps, "gaps_with_prefill": len(self.gaps_with_prefill),
            "share_with_prefill": round(self.share_with_prefill, 4),
            "gap_p50_decode_only_s": c50, "gap_p90_decode_only_s": None if clean is None else round(clean.p90, 6),
            "gap_p50_with_prefill_s": h50, "gap_p90_with_prefill_s": None if hit is None else round(hit.p90, 6),
            "tpot_inflation": round(h50 / c50 - 1, 3) if c50 and h50 is not None else 0.0,
        }


@dataclass(frozen=True, slots=True)
class Burst:
    """Interactive inter-token gaps inside and outside the background window ``(start_s, end_s)``."""

    start_s: float
    end_s: float
    inside: tuple[float, ...]
    outside: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        i, o = Pcts.of(self.inside), Pcts.of(self.outside)
        i90 = None if i is None else round(i.p90, 6)
        o90 = None if o is None else round(o.p90, 6)
        return {"background_window_s": [round(self.start_s, 3), round(self.end_s, 3)],
                "interactive_gaps_inside": len(self.inside), "interactive_gaps_outside": len(self.outside),
                "interactive_gap_p50_inside_s": None if i is None else round(i.p50, 6),
                "interactive_gap_p90_inside_s": i90,
                "interactive_gap_p50_outside_s": None if o is None else round(o.p50, 6),
                "interactive_gap_p90_outside_s": o90,
                "p90_inflation": round(i90 / o90 - 1, 3) if i90 is not None and o90 else None}


@dataclass(frozen=True, slots=True)
class Aggregate:
    """The shared metrics of a set of requests (see the module docstring). ``None``: nothing to measure
    (no completed request, no hand-off, no duration)."""

    requests: int
    completed: int
    lost: int
    rejected: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    prompt_tokens_per_s: float | None
    output_tokens_per_s: float | None
    ttft: Pcts | None
    tpot: Pcts | None
    prefill_queue: Pcts | None
    decode_queue: Pcts | None
    kv_bytes_transferred: int
    handoffs: int
    transfer: Pcts | None
    transfer_share_of_ttft: float  # the hand-offs' summed transfer time / their summed TTFT
    transfer_share_per_request: Pcts | None
    slo: Attainment
    slo_ratio: float  # max(TTFT p90 / limit, TPOT p90 / limit): < 1 means the p90s are within the limits
    by_class: dict[str, ClassStats]
    interference: Interference | None  # None: no prefill step starts were given
    burst: Burst | None  # None: no background requests

    def slo_dict(self) -> dict[str, Any]:
        """The SLO block of a run's summary: goodput, attainment (all, interactive), met."""
        return _slo_dict(self.slo)


def _slo_dict(tally: Attainment) -> dict[str, Any]:
    return {"goodput_rps": round(tally.goodput_rps, 4), "attainment": round(tally.attainment, 4),
            "attainment_interactive": round(tally.attainment_interactive, 4), "met": tally.meets_slo}


def prefill_step_starts(timeline: Iterable[Row]) -> dict[int, list[float]]:
    """Per worker: the sorted start times of the steps of a ``timeline.jsonl`` that ran prompt tokens."""
    starts: dict[int, list[float]] = {}
    for s in timeline:
        if s["prefill_tokens"] > 0:
            starts.setdefault(s["worker"], []).append(s["start_s"])
    return {w: sorted(v) for w, v in starts.items()}


def _overlaps(starts: Sequence[float] | None, a: float, b: float) -> bool:
    """Did a prefill step start between tokens ``a`` and ``b``? A worker's steps run one after another and
    token ``a`` comes out at the end of one, so any step that delayed token ``b`` started in ``[a, b)``."""
    if not starts:
        return False
    i = bisect.bisect_left(starts, a)
    return i < len(starts) and starts[i] < b


def _interference(outcomes: Sequence[RequestOutcome], starts: Mapping[int, Sequence[float]]) -> Interference:
    clean: list[float] = []
    hit: list[float] = []
    for o in outcomes:
        if o.lost or o.decode_worker is None:
            continue
        mine = starts.get(o.decode_worker)
        for a, b in pairwise(o.token_times_s):
            (hit if _overlaps(mine, a, b) else clean).append(b - a)
    return Interference(tuple(clean), tuple(hit))


def _burst(outcomes: Sequence[RequestOutcome]) -> Burst | None:
    bg = [o for o in outcomes if o.klass == "background" and not o.lost]
    if not bg:
        return None
    start = min(o.arrival_s for o in bg)
    end = max((o.prefill_end_s for o in bg if o.prefill_end_s is not None), default=start)
    inside: list[float] = []
    outside: list[float] = []
    for o in outcomes:
        if o.klass == "background" or o.lost:
            continue
        for a, b in pairwise(o.token_times_s):
            (inside if a < end and b > start else outside).append(b - a)
    return Burst(start, end, tuple(inside), tuple(outside))


def _by_class(outcomes: Sequence[RequestOutcome], slo: SLO) -> dict[str, ClassStats]:
    out = {}
    for klass in sorted({o.klass for o in outcomes}):
        sub = [o for o in outcomes if o.klass == klass and not o.lost]
        out[klass] = ClassStats(
            requests=len(sub), ttft=Pcts.of([o.ttft_s for o in sub if o.ttft_s is not None]),
            tpot=Pcts.of([o.tpot_s for o in sub if o.tpot_s is not None]),
            attainment=sum(slo.meets(o.ttft_s, o.tpot_s) for o in sub) / len(sub) if sub else None)
    return out


def judge_outcomes(outcomes: Sequence[RequestOutcome], slo: SLO, duration_s: float) -> Attainment:
    """:func:`~kvstore.workloads.slo.judge` of the outcomes: lost and rejected ones are misses, lost ones
    also stop the run from meeting the SLO."""
    return judge(slo, ((o.ttft_s if o.completed else None, o.tpot_s, o.klass) for o in outcomes), duration_s,
                 lost=sum(o.lost for o in outcomes))


def run_duration(outcomes: Sequence[RequestOutcome]) -> float:
    """The run's duration: the first arrival -> the last completed request's last token (0 when none
    completed)."""
    ends = [o.finish_s for o in outcomes if o.completed and o.finish_s is not None]
    return max(ends) - min(o.arrival_s for o in outcomes) if ends else 0.0


def aggregate(outcomes: Sequence[RequestOutcome], slo: SLO, *,
              prefill_starts: Mapping[int, Sequence[float]] | None = None,
              duration_s: float | None = None, classes: bool = True) -> Aggregate:
    """The shared metrics of ``outcomes`` against ``slo`` (see the module docstring). ``prefill_starts``
    (per worker, sorted: :func:`prefill_step_starts`) enables the interference block; ``duration_s`` overrides
    the run's duration (first arrival -> last completed token) for throughput and goodput; ``classes=False``
    skips the per-class block and the burst (a simulation of one class)."""
    done = [o for o in outcomes if o.completed]
    if duration_s is None:
        duration_s = run_duration(outcomes)
    prompt = sum(o.prompt_tokens for o in done)
    output = sum(o.output_tokens for o in done)
    ttft = Pcts.of([o.ttft_s for o in done if o.ttft_s is not None])
    tpot = Pcts.of([o.tpot_s for o in done if o.tpot_s is not None])
    moved = [o for o in outcomes if o.kv_bytes_transferred]
    timed = [o for o in moved if o.ttft_s]
    ttft_sum = sum(o.ttft_s or 0.0 for o in timed)
    return Aggregate(
        requests=len(outcomes), completed=len(done), lost=sum(o.lost for o in outcomes),
        rejected=sum(o.rejected and not o.lost for o in outcomes), duration_s=duration_s,
        prompt_tokens=prompt, output_tokens=output,
        prompt_tokens_per_s=prompt / duration_s if duration_s > 0 else None,
        output_tokens_per_s=output / duration_s if duration_s > 0 else None,
        ttft=ttft, tpot=tpot,
        prefill_queue=Pcts.of([o.prefill_queue_s for o in done if o.prefill_queue_s is not None]),
        decode_queue=Pcts.of([o.decode_queue_s for o in done if o.decode_queue_s is not None]),
        kv_bytes_transferred=sum(o.kv_bytes_transferred for o in outcomes), handoffs=len(moved),
        transfer=Pcts.of([o.transfer_s for o in moved]),
        transfer_share_of_ttft=sum(o.transfer_s for o in timed) / ttft_sum if ttft_sum else 0.0,
        transfer_share_per_request=Pcts.of([o.transfer_s / o.ttft_s for o in timed if o.ttft_s]),
        slo=judge_outcomes(outcomes, slo, duration_s),
        slo_ratio=max(ttft.p90 / slo.ttft_s if ttft else float("inf"), tpot.p90 / slo.tpot_s if tpot else 0.0),
        by_class=_by_class(outcomes, slo) if classes else {},
        interference=None if prefill_starts is None else _interference(outcomes, prefill_starts),
        burst=_burst(outcomes) if classes else None,
    )


# -- the blocks of a run's summary.json, from requests.jsonl rows ------------------------------------------
def _outcomes(rows: Iterable[Row]) -> list[RequestOutcome]:
    return [RequestOutcome.from_row(r) for r in rows]


def slo_block(rows: list[Row], slo: SLO, duration_s: float) -> dict[str, Any]:
    """The SLO block of ``rows`` over a run of ``duration_s`` seconds (:meth:`Aggregate.slo_dict`)."""
    return _slo_dict(judge_outcomes(_outcomes(rows), slo, duration_s))


def by_class(rows: list[Row], slo: SLO) -> dict[str, Any]:
    """Per request class: requests not lost, TTFT and TPOT p50/p90/p99, SLO attainment."""
    return {k: c.to_dict() for k, c in _by_class(_outcomes(rows), slo).items()}


def interference(rows: list[Row], timeline: list[Row]) -> dict[str, Any]:
    """The interference block of ``rows`` given the run's step ``timeline``."""
    return _interference(_outcomes(rows), prefill_step_starts(timeline)).to_dict()


def burst(rows: list[Row]) -> dict[str, Any] | None:
    """Interactive decoding inside and outside the background window; None without background requests."""
    b = _burst(_outcomes(rows))
    return None if b is None else b.to_dict()
