"""Continuous batching: which requests run in the next step, and how many of their tokens.

Policies:

- ``prefill-first`` (classic collocated serving): if a waiting request can be admitted, the step is a prefill
  step (whole prompts, batched up to ``token_budget`` prompt tokens, at least one); running decodes wait for it.
  Otherwise the step decodes every running request by one token.
- ``chunked`` (Sarathi-Serve): every step has ``token_budget`` tokens. All running decodes take one each
  first; what is left goes to prompt chunks, continuing partly prefilled requests before admitting new ones.
- ``prefill-only`` (disaggregated prefill worker): prefill steps as in ``prefill-first``, never a decode; a
  request leaves the worker once its prompt is done.
- ``decode-only`` (disaggregated decode worker): requests arrive with their prompt KV to be fetched; every step
  decodes all running requests by one token.

A request is admitted only when blocks for its whole lifetime (prompt + max output) are free, so nothing is
ever preempted: simpler than vLLM's recompute/swap preemption and, for a benchmark, deterministic.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from benchmarks.pd.block_allocator import BlockAllocator
from benchmarks.pd.request import Phase, Request


class Policy(Enum):
    PREFILL_FIRST = "prefill-first"
    CHUNKED = "chunked"
    PREFILL_ONLY = "prefill-only"
    DECODE_ONLY = "decode-only"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: Policy
    token_budget: int = 512  # chunked: tokens per step; others: prompt tokens batched in one prefill step
    max_running: int = 64  # requests holding blocks at once

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise TypeError(f"policy must be a Policy, got {self.policy!r}")
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")


@dataclass(frozen=True, slots=True)
class Chunk:
    """Run ``num_new`` tokens of ``request`` starting at its position ``start``."""

    request: Request
    start: int
    num_new: int

    @property
    def is_prefill(self) -> bool:
        return self.start < self.request.num_prompt


@dataclass(slots=True)
class StepPlan:
    """Requests admitted this step (their blocks just allocated) and the chunks to run."""

    admitted: list[Request] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.chunks or self.admitted)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int):
        self.config = config
        self.allocator = allocator
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        """Queue a request. Raises ValueError if it could never fit in this worker's cache."""
        need = self._blocks_needed(request)
        if need > self.allocator.num_blocks:
            raise ValueError(
                f"request {request.id} needs {need} blocks ({request.max_tokens} tokens), "
                f"the cache has {self.allocator.num_blocks}"
            )
        request.phase = Phase.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        planners = {
            Policy.PREFILL_FIRST: self._plan_prefill_first,
            Policy.CHUNKED: self._plan_chunked,
            Policy.PREFILL_ONLY: self._plan_prefill_only,
            Policy.DECODE_ONLY: self._plan_decode_only,
        }
        return planners[self.config.policy]()

    def release(self, request: Request) -> None:
        """Drop a request that finished, was handed off or failed, and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        self.allocator.free(request.id)

    # -- policies ---------------------------------------------------------------------------------------
    def _plan_prefill_first(self) -> StepPlan:
        plan = self._admit_whole_prompts()
        if plan.admitted:
            return plan
        return StepPlan(chunks=self._decode_chunks(limit=None))

    def _plan_prefill_only(self) -> StepPlan:
        return self._admit_whole_prompts()

    def _plan_decode_only(self) -> StepPlan:
        admitted = []
        while self.waiting and self._try_admit(self.waiting[0]):
            admitted.append(self.waiting.popleft())
        return StepPlan(admitted=admitted, chunks=self._decode_chunks(limit=None))

    def _plan_chunked(self) -> StepPlan:
        budget = self.config.token_budget
        plan = StepPlan(chunks=self._decode_chunks(limit=budget))
        budget -= len(plan.chunks)
        for request in self.running:
            if budget <= 0:
                return plan
            if request.phase is Phase.PREFILLING:
                budget -= self._add_prompt_chunk(plan, request, budget)
        while budget > 0 and self.waiting and self._try_admit(self.waiting[0]):
            request = self.waiting.popleft()
            plan.admitted.append(request)
            budget -= self._add_prompt_chunk(plan, request, budget)
        return plan

    # -- helpers ----------------------------------------------------------------------------------------
    def _admit_whole_prompts(self) -> StepPlan:
        plan = StepPlan()
        tokens = 0
        while self.waiting:
            request = self.waiting[0]
            if plan.admitted and tokens + request.prompt_left > self.config.token_budget:
                break
            if not self._try_admit(request):
                break
            self.waiting.popleft()
            plan.admitted.append(request)
            tokens += self._add_prompt_chunk(plan, request, request.prompt_left)
        return plan

    def _add_prompt_chunk(self, plan: StepPlan, request: Request, budget: int) -> int:
        count = min(request.prompt_left, budget)
        plan.chunks.append(Chunk(request, request.num_computed, count))
        return count

    def _decode_chunks(self, limit: int | None) -> list[Chunk]:
        decoding = [r for r in self.running if r.phase is Phase.DECODING]
        if limit is not None:
            decoding = decoding[:limit]
        return [Chunk(r, r.num_tokens - 1, 1) for r in decoding]

    def _blocks_needed(self, request: Request) -> int:
        return -(-request.max_tokens // self.block_size)

    def _try_admit(self, request: Request) -> bool:
        if len(self.running) >= self.config.max_running:
            return False
        need = self._blocks_needed(request)
        if not self.allocator.can_allocate(need):
            return False
        self.allocator.allocate(request.id, need)
        self.running.append(request)
        request.phase = Phase.PREFILLING if request.prompt_left else Phase.DECODING
        return True
