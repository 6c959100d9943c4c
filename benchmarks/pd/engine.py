"""One engine worker: model + paged KV cache + scheduler, advanced one step at a time.

A step: ask the scheduler for a plan, (decode role) fetch the KV of newly admitted requests, run the model
once over every scheduled chunk, sample greedily where a chunk reached the end of its known tokens, and
(prefill role) hand off requests whose prompt is done. Every step is logged as a :class:`StepEvent`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from benchmarks.pd.attention import AttentionBatch, SeqChunk
from benchmarks.pd.block_allocator import BlockAllocator
from benchmarks.pd.kv_cache import CacheSpec, PagedKVCache
from benchmarks.pd.model import LlamaModel
from benchmarks.pd.request import Phase, Request
from benchmarks.pd.scheduler import Chunk, Policy, Scheduler, SchedulerConfig
from kvstore.errors import KVStoreError

#: failures of a hand-off that cost one request, not the worker; anything else is a bug and propagates
HANDOFF_ERRORS = (KVStoreError, OSError)


class KVPort(Protocol):
    """Where a prefill worker sends a finished prompt's KV and a decode worker gets it (see transfer.py)."""

    def publish(self, request: Request, cache: PagedKVCache, block_ids: list[int]) -> float: ...

    def fetch(self, request: Request, cache: PagedKVCache, block_ids: list[int]) -> float: ...


@dataclass(frozen=True, slots=True)
class StepEvent:
    """One engine step, for the run's timeline (seconds since the run's start)."""

    start_s: float
    end_s: float
    prefill_tokens: int
    decode_tokens: int
    prefill_seqs: int
    running: int
    blocks_used: int
    transfer_s: float  # publish/fetch time spent inside this step

    def to_wire(self) -> list:
        return [self.start_s, self.end_s, self.prefill_tokens, self.decode_tokens, self.prefill_seqs,
                self.running, self.blocks_used, self.transfer_s]


@dataclass(slots=True)
class StepOutcome:
    """Requests that left the engine during a step."""

    finished: list[Request] = field(default_factory=list)
    handed_off: list[Request] = field(default_factory=list)
    prefilled: list[Request] = field(default_factory=list)  # collocated: prompt done, first token out
    failed: list[Request] = field(default_factory=list)
    event: StepEvent | None = None


def monotonic_since(t0: float) -> Callable[[], float]:
    return lambda: time.monotonic() - t0


class Engine:
    def __init__(self, model: LlamaModel, cache_spec: CacheSpec, scheduler_config: SchedulerConfig,
                 port: KVPort | None = None, clock: Callable[[], float] = time.monotonic):
        needs_port = scheduler_config.policy in (Policy.PREFILL_ONLY, Policy.DECODE_ONLY)
        if needs_port and port is None:
            raise ValueError(f"policy {scheduler_config.policy.value} needs a KV port for the hand-off")
        self.model, self.port, self.clock = model, port, clock
        self.cache = PagedKVCache(cache_spec)
        self.allocator = BlockAllocator(cache_spec.num_blocks)
        self.scheduler = Scheduler(scheduler_config, self.allocator, cache_spec.block_size)
        self.policy = scheduler_config.policy

    def add(self, request: Request) -> None:
        request.times.queued_s = self.clock()
        self.scheduler.add(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> StepOutcome:
        """Run one step; an empty outcome (``event`` None) when there was nothing to do."""
        start = self.clock()
        plan = self.scheduler.schedule()
        outcome = StepOutcome()
        for request in plan.admitted:
            request.times.admitted_s = start
        transfer_s = 0.0
        if self.policy is Policy.DECODE_ONLY:
            transfer_s = self._fetch_admitted(plan.admitted, plan.chunks, outcome)
        if plan.chunks:
            prefilled = self._run_chunks(plan.chunks, start)
            if self.policy is not Policy.PREFILL_ONLY:
                outcome.prefilled = prefilled
            transfer_s += self._collect(plan.chunks, outcome)
        if not plan:
            return outcome
        outcome.event = self._event(start, plan.chunks, transfer_s)
        return outcome

    # -- step parts -------------------------------------------------------------------------------------
    def _fetch_admitted(self, admitted: list[Request], chunks: list[Chunk], outcome: StepOutcome) -> float:
        """Decode role: pull each admitted request's prompt KV into its blocks; it decodes in this very step."""
        spent = 0.0
        for request in admitted:
            blocks = self.allocator.table(request.id)[: self.cache.spec.blocks_for(request.num_prompt)]
            try:
                request.times.fetch_s = self.port.fetch(request, self.cache, blocks)
            except HANDOFF_ERRORS as exc:  # reported to the router, which re-prefills the request
                self._fail(request, exc, outcome)
                continue
            spent += request.times.fetch_s
            request.num_computed = request.num_prompt
            request.phase = Phase.DECODING
            request.times.token_times_s.append(self.clock())  # first token reaches the client now
            if request.done:
                self._finish(request, outcome)
            else:
                chunks.append(Chunk(request, request.num_tokens - 1, 1))
        return spent

    def _run_chunks(self, chunks: list[Chunk], start: float) -> list[Request]:
        """Run the model over ``chunks``; returns the requests whose prompt completed in this step."""
        seqs, ids, prefilled = [], [], []
        for chunk in chunks:
            request = chunk.request
            if chunk.is_prefill and request.times.prefill_start_s is None:
                request.times.prefill_start_s = start
            seqs.append(SeqChunk(self.allocator.table(request.id), chunk.start, chunk.num_new))
            ids.extend(request.tokens(chunk.start, chunk.num_new))
        batch = AttentionBatch.build(seqs, self.cache)
        logits = self.model(torch.tensor(ids, dtype=torch.long), batch, self.cache)
        next_ids = logits.argmax(dim=-1).tolist()
        now = self.clock()
        for chunk, token in zip(chunks, next_ids, strict=True):
            request = chunk.request
            request.num_computed = chunk.start + chunk.num_new
            if request.num_computed < request.num_tokens:
                continue  # a prompt chunk short of the prompt's end: no token to sample yet
            if chunk.is_prefill:
                request.times.prefill_end_s = now
                request.phase = Phase.DECODING
                prefilled.append(request)
            request.output_ids.append(token)
            request.times.token_times_s.append(now)
        return prefilled

    def _collect(self, chunks: list[Chunk], outcome: StepOutcome) -> float:
        """Retire finished requests; prefill role: publish those whose prompt just completed."""
        spent = 0.0
        for chunk in chunks:
            request = chunk.request
            if request.done:
                self._finish(request, outcome)
            elif self.policy is Policy.PREFILL_ONLY and request.phase is Phase.DECODING:
                spent += self._hand_off(request, outcome)
        return spent

    def _hand_off(self, request: Request, outcome: StepOutcome) -> float:
        blocks = self.allocator.table(request.id)[: self.cache.spec.blocks_for(request.num_prompt)]
        try:
            request.times.publish_s = self.port.publish(request, self.cache, blocks)
        except HANDOFF_ERRORS as exc:  # reported to the router, which decides whether to retry
            self._fail(request, exc, outcome)
            return 0.0
        request.phase = Phase.HANDED_OFF
        self.scheduler.release(request)
        outcome.handed_off.append(request)
        return request.times.publish_s

    def _finish(self, request: Request, outcome: StepOutcome) -> None:
        request.phase = Phase.FINISHED
        self.scheduler.release(request)
        outcome.finished.append(request)

    def _fail(self, request: Request, exc: Exception, outcome: StepOutcome) -> None:
        request.phase = Phase.FAILED
        request.error = f"{type(exc).__name__}: {exc}"
        self.scheduler.release(request)
        outcome.failed.append(request)

    def _event(self, start: float, chunks: list[Chunk], transfer_s: float) -> StepEvent:
        prefill = [c for c in chunks if c.is_prefill]
        return StepEvent(
            start_s=start, end_s=self.clock(),
            prefill_tokens=sum(c.num_new for c in prefill), decode_tokens=len(chunks) - len(prefill),
            prefill_seqs=len(prefill), running=len(self.scheduler.running),
            blocks_used=self.allocator.num_used, transfer_s=transfer_s,
        )
