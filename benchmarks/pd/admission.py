"""Admission control: which queued request the router sends to which worker, and when.

The router keeps two queues: the *prefill queue* (arrived, not yet sent to a prefill-capable worker) and the
*decode queue* (disaggregated: prefilled and published, KV parked in the store, not yet sent to a decode
worker). An :class:`Admission` policy picks the next request to send from each.

- :class:`Immediate` (``none``): every request goes at once to the least-loaded worker (outstanding tokens).
- :class:`Budgeted` (``budget``): two latency budgets and two request classes.
  *Prefill queue against the TTFT budget*: interactive requests go first, in arrival order, to the worker with
  the least predicted prefill backlog, but only while that backlog plus their own prefill fits the TTFT
  budget (or the worker's prefill queue is empty); otherwise they wait in the router, bound late to
  whichever worker frees up first. Background requests only fill slack: no interactive request waiting, a
  worker with an empty prefill queue, and, on a worker that also decodes, a predicted stall of its running
  interactive decodes within the TPOT budget.
  *Decode queue against the TPOT budget*: a request joins the decode worker whose predicted step time stays
  within the TPOT budget with it added (or whose batch is empty); interactive first, background only when no
  interactive request waits.
  A background request older than ``background_max_wait_s`` is admitted as if interactive (no starvation).
  Predictions come from :class:`benchmarks.pd.stepmodel.StepModel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from benchmarks.pd.scheduler import Policy
from benchmarks.pd.stepmodel import StepModel
from benchmarks.pd.trace import TokenRequest

INTERACTIVE, BACKGROUND = "interactive", "background"
REQUEST_CLASSES = (INTERACTIVE, BACKGROUND)


class AdmissionKind(Enum):
    NONE = "none"
    BUDGET = "budget"


@dataclass(slots=True)
class WorkerLoad:
    """What the router has sent one live worker and not yet heard back about."""

    index: int
    role: Policy
    prefill: dict[str, TokenRequest] = field(default_factory=dict)  # sent, prompt not done yet
    decode: dict[str, TokenRequest] = field(default_factory=dict)  # prompt done (or fetched), generating

    def tokens(self) -> int:
        """Outstanding tokens: the least-loaded routing key. A prefill-only worker only owes the prompt."""
        decodes_too = self.role is not Policy.PREFILL_ONLY
        owed = sum(r.prompt_tokens + (r.output_tokens if decodes_too else 0) for r in self.prefill.values())
        return owed + sum(r.output_tokens for r in self.decode.values())

    def pop(self, rid: str) -> TokenRequest | None:
        return self.prefill.pop(rid, None) or self.decode.pop(rid, None)

    def rids(self) -> list[str]:
        return [*self.prefill, *self.decode]


Decision = tuple[TokenRequest, WorkerLoad]


class Admission(Protocol):
    def next_prefill(self, queue: Sequence[TokenRequest], workers: Sequence[WorkerLoad],
                     now: float) -> Decision | None: ...

    def next_decode(self, queue: Sequence[TokenRequest], workers: Sequence[WorkerLoad],
                    now: float) -> Decision | None: ...

    def describe(self) -> dict: ...


def _least_tokens(workers: Sequence[WorkerLoad]) -> WorkerLoad:
    return min(workers, key=lambda w: (w.tokens(), w.index))


class Immediate:
    """No admission control: first come, first sent, to the worker with the fewest outstanding tokens."""

    def next_prefill(self, queue: Sequence[TokenRequest], workers: Sequence[WorkerLoad],
                     now: float) -> Decision | None:
        return (queue[0], _least_tokens(workers)) if queue and workers else None

    def next_decode(self, queue: Sequence[TokenRequest], workers: Sequence[WorkerLoad],
                    now: float) -> Decision | None:
        return self.next_prefill(queue, workers, now)

    def describe(self) -> dict:
        return {"policy": AdmissionKind.NONE.value}


@dataclass(frozen=True, slots=True)
class Budgets:
    ttft_s: float
    tpot_s: float
    background_max_wait_s: float | None = None  # default: 10 x the TTFT budget

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Budgets.{name} must be > 0, got {getattr(self, name)!r}")
        if self.background_max_wait_s is not None and self.background_max_wait_s <= 0:
            raise ValueError(f"Budgets.background_max_wait_s must be > 0, got {self.background_max_wait_s!r}")

    @property
    def max_wait_s(self) -> float:
        return self.background_max_wait_s if self.background_max_wait_s is not None else 10 * self.ttft_s


class Budgeted:
    """Two queues, two budgets, two classes (see the module docstring)."""

    def __init__(self, budgets: Budgets, step: StepModel, chunk_budget: int = 256):
        self.budgets, self.step, self.chunk_budget = budgets, step, chunk_budget

    # -- prefill queue: the TTFT budget -----------------------------------------------------------------
    def next_prefill(self, queue: Sequence[TokenRequest], workers: Sequence[WorkerLoad],
                     now: float) -> Decision | None:
        if not queue or not workers:
            return None
        req = self._head(queue, now)
        by_backlog = sorted(workers, key=lambda w: (self.backlog_s(w), w.index))
        if self._urgent(req, now):
            w = by_backlog[0]
            backlog = self.backlog_s(w)
            fits = backlog == 0 or backlog + self.step.prefill_s(req.prompt_tokens) <= self.budgets.ttft_s
            return (req, w) if fits else None
        for w in by_backlog:  # a background request, and no interactive one is waiting
            if self.backlog_s(w) == 0 and self.stall_s(w, req) <= self.budgets.tpot_s:
                return req, w
        return None

    def backlog_s(self, w: WorkerLoad) -> float:
        """Predicted seconds of prefill already queued on ``w``."""
        return sum(self.step.prefill_s(r.prompt_tokens) for r in w.prefill.values())

    def stall_s(self, w: WorkerLoad, req: TokenRequest) -> float:
        """Predicted pause ``req``'s prefill puts between two tokens of ``w``'s running interactive decodes."""
        if w.role is Policy.PREFILL_ONLY or not any(r.klass == INTERACTIVE for r in w.decode.values()):
            return 0.0
        if w.role is Policy.CHUNKED:  # one chunk per step, shared with the decodes
            return self.step.prefill_s(min(self.chunk_budget, req.prompt_tokens)) + self.step_s(w)
        return self.step.prefill_s(req.prompt_tokens)  # prefill-first: the decodes wait for the whole prompt

    # -- decode queue: the TPOT budget ------------------------------------------------------------------
    def next_decode(self, queue: Sequence[TokenRequest], workers: Sequence[WorkerLoad],
                    now: float) -> Decision | None:
        if not queue or not workers:
            return None
        req = self._head(queue, now)
        w = min(workers, key=lambda w: (self.step_s(w, req), w.index))
        fits = not w.decode or self.step_s(w, req) <= self.budgets.tpot_s
        return (req, w) if fits else None

    def step_s(self, w: WorkerLoad, extra: TokenRequest | None = None) -> float:
        """Predicted decode step time of ``w``'s batch (plus ``extra``), context at its largest."""
        reqs = [*w.decode.values(), *([extra] if extra is not None else [])]
        context = sum(r.prompt_tokens + r.output_tokens for r in reqs)
        return self.step.decode_step_s(len(reqs), context)

    # -- classes ----------------------------------------------------------------------------------------
    def _urgent(self, req: TokenRequest, now: float) -> bool:
        return req.klass != BACKGROUND or now - req.arrival_s >= self.budgets.max_wait_s

    def _head(self, queue: Sequence[TokenRequest], now: float) -> TokenRequest:
        """The oldest urgent (interactive, or starved background) request, else the oldest background one."""
        return next((r for r in queue if self._urgent(r, now)), queue[0])

    def describe(self) -> dict:
        b = self.budgets
        return {"policy": AdmissionKind.BUDGET.value, "ttft_budget_s": b.ttft_s, "tpot_budget_s": b.tpot_s,
                "background_max_wait_s": b.max_wait_s, "chunk_budget": self.chunk_budget,
                "step_model": self.step.describe()}
