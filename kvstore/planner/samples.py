"""Engine steps recovered from a measured run, as (step composition, seconds) samples for calibration.

- *prefill steps*: requests sharing one (worker, prefill_start, prefill_end) window were prefilled in one
  step (prefill-first and prefill-only workers; chunked runs give none: their prompts span steps).
- *decode and mixed steps*: tokens emitted at the same instant (within ``tol_s``) on one worker come from
  one step; its duration is the gap since those requests' previous tokens (so scheduling overhead between
  steps counts), against the batch size and summed context. With ``timeline.jsonl`` the step's prompt
  tokens are known, so chunked steps become *mixed* samples (chunks assumed to start at offset 0) and a
  decode worker's KV fetch time inside a step is taken out (the planner models it as the transfer).
  Without it, gaps that overlap a prefill window on the same worker are dropped (colocated, chunked), so
  interference does not pollute the decode fit.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from kvstore.planner.costmodel import prefill_pairs
from kvstore.planner.deployment import Arch
from kvstore.workloads.runlog import RunLog
from kvstore.workloads.stats import median


@dataclass(frozen=True, slots=True)
class StepSample:
    kind: str  # "prefill", "decode" or "mixed"
    seconds: float
    prefill_tokens: float = 0.0
    pairs: float = 0.0
    decode_seqs: float = 0.0
    decode_ctx: float = 0.0


def prefill_samples(run: RunLog) -> list[StepSample]:
    if run.arch is Arch.CHUNKED:
        return []
    groups: dict[tuple, list] = defaultdict(list)
    for r in run.requests:
        groups[(r.prefill_worker, round(r.prefill_start_s, 6), round(r.prefill_end_s, 6))].append(r)
    return [StepSample("prefill", end - start, prefill_tokens=sum(r.prompt_tokens for r in reqs),
                       pairs=sum(prefill_pairs(r.prompt_tokens) for r in reqs))
            for (_, start, end), reqs in groups.items() if end > start]


def _token_groups(run: RunLog, tol_s: float) -> list[tuple]:
    """(worker, time, members) per step that emitted decode tokens; members are (prev time, ctx, index)."""
    by_worker: dict = defaultdict(list)
    for r in run.requests:
        worker = r.decode_worker if r.decode_worker is not None else r.prefill_worker
        t = r.token_times_s
        for k in range(1, len(t)):  # token k (0-based) comes from a step whose context is prompt + k
            by_worker[worker].append((t[k], t[k - 1], r.prompt_tokens + k, k))
    groups = []
    for worker, events in by_worker.items():
        events.sort()
        start = 0
        for i in range(1, len(events) + 1):
            if i == len(events) or events[i][0] - events[i - 1][0] > tol_s:
                groups.append((worker, events[start][0], [e[1:] for e in events[start:i]]))
                start = i
    return groups


class _Steps:
    """The timeline's steps per worker, found by time."""

    def __init__(self, timeline: tuple[dict, ...]):
        self._by_worker: dict = defaultdict(list)
        for step in sorted(timeline, key=lambda s: s["start_s"]):
            self._by_worker[step.get("worker")].append(step)
        self._starts = {w: [s["start_s"] for s in steps] for w, steps in self._by_worker.items()}

    def at(self, worker, t: float, tol_s: float) -> dict | None:
        steps = self._by_worker.get(worker)
        if not steps:
            return None
        i = bisect.bisect_right(self._starts[worker], t + tol_s) - 1
        return steps[i] if i >= 0 and steps[i]["end_s"] + tol_s >= t else None


class _Windows:
    """Prefill windows per worker (all under one key when the run does not record workers)."""

    def __init__(self, run: RunLog):
        known = all(r.prefill_worker is not None for r in run.requests)
        spans: dict = defaultdict(list)
        for r in run.requests:
            spans[r.prefill_worker if known else None].append((r.prefill_start_s, r.prefill_end_s))
        self._known = known
        self._spans = {w: (np.array([a for a, _ in sorted(v)]), np.maximum.accumulate([b for _, b in sorted(v)]))
                       for w, v in spans.items()}

    def overlap(self, worker, lo: float, hi: float) -> bool:
        starts, ends = self._spans.get(worker if self._known else None, (np.array([]), np.array([])))
        n = int(np.searchsorted(starts, hi, side="left"))  # windows starting before hi
        return n > 0 and ends[n - 1] > lo


def decode_samples(run: RunLog, tol_s: float = 50e-6) -> list[StepSample]:
    steps, windows = _Steps(run.timeline), _Windows(run)
    mixed_known = bool(run.timeline) and run.arch is Arch.CHUNKED
    check_overlap = run.arch is not Arch.DISAGGREGATED and not mixed_known
    out = []
    for worker, t, members in _token_groups(run, tol_s):
        gaps = [t - prev for prev, _, k in members if k >= 2]  # previous token came from a decode step too
        if not gaps:
            continue
        gap = median(gaps)
        step = steps.at(worker, t, tol_s)
        ctx = sum(c for _, c, _ in members)
        if step is not None:
            gap -= step.get("transfer_s", 0.0)
        if step is not None and step.get("prefill_tokens", 0) > 0 and mixed_known:
            n, seqs = step["prefill_tokens"], max(1, step.get("prefill_seqs", 1))
            out.append(StepSample("mixed", gap, prefill_tokens=n, pairs=seqs * prefill_pairs(n / seqs),
                                  decode_seqs=len(members), decode_ctx=ctx))
        elif not (check_overlap and windows.overlap(worker, t - gap, t)) and gap > 0:
            out.append(StepSample("decode", gap, decode_seqs=len(members), decode_ctx=ctx))
    return out
