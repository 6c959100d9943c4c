"""Admission control: when a request may go to which instance, and when it is refused (429).

Two queues, as in the seed: the *prefill queue* is held against the TTFT budget, the *decode queue* against
the TPOT budget. A request sent straight to a decode or colocated instance (short prompt, failed hand-off,
store down) must fit both.

- ``none``: every request goes at once to the live instance with the fewest outstanding tokens.
- ``budget``: an *interactive* request goes to the instance whose predicted prefill backlog plus its own
  prefill fits what is left of its TTFT budget (or that has nothing to prefill), and to a decode instance
  whose predicted step time with it added stays within the TPOT budget (or that decodes nothing). Otherwise it
  waits in the router, bound late to whichever instance frees up first, and is refused with 429 +
  Retry-After when its TTFT budget runs out in the queue. A *background* request (``X-Request-Class:
  background``) only fills slack — no interactive request waiting and an instance with nothing to prefill —
  and is refused after ``background_max_wait_s``: under overload it is shed first.
Predictions come from :class:`kvstore.router.estimates.Estimates` (measured). Every pool down: 503.
"""

from __future__ import annotations

import asyncio
import math
import time
from enum import Enum

from kvstore.errors import KVStoreError
from kvstore.router.config import AdmissionKind, RouterConfig
from kvstore.router.estimates import Estimates
from kvstore.router.pool import Instance, Load, Pool


class Stage(Enum):
    PREFILL = "prefill"  # the prefill hop of a hand-off: TTFT budget
    DECODE = "decode"  # the decode hop of a hand-off: TPOT budget
    DIRECT = "direct"  # a whole request on one decode or colocated instance: both


class Refused(KVStoreError):
    """The router cannot take the request now; nothing was sent to an instance. Retrying after
    ``retry_after_s`` can help. ``status``: 429 (a budget cannot be met) or 503 (no live instance)."""

    def __init__(self, message: str, status: int, retry_after_s: float):
        super().__init__(message)
        self.status, self.retry_after_s = status, max(1, math.ceil(retry_after_s))


class Admission:
    def __init__(self, config: RouterConfig, estimates: Estimates):
        self.config, self.est = config, estimates
        self.changed = asyncio.Condition()
        self.waiting: dict[tuple[Stage, bool], int] = {(s, i): 0 for s in Stage for i in (True, False)}

    async def admit(self, pool: Pool, stage: Stage, load: Load, deadline: float) -> Instance:
        """An instance of ``pool`` for ``load`` (not yet registered on it: the caller does that at once).
        ``deadline``: monotonic time by which the request must be sent. Raises Refused."""
        if not pool.live():
            raise Refused(f"every {pool.role.value} instance is down", 503, self.config.health_interval_s)
        if self.config.admission is AdmissionKind.NONE:
            return pool.pick()  # type: ignore[return-value]  # live() is not empty
        if not load.interactive:  # background: only slack, and never longer than its own wait bound
            deadline = time.monotonic() + self.config.max_wait_s
        key = (stage, load.interactive)
        if sum(self.waiting[(stage, c)] for c in (True, False)) >= self.config.max_queue:
            raise Refused(f"the {stage.value} queue is full", 429, self._retry_after(pool))
        self.waiting[key] += 1
        try:
            async with self.changed:
                while True:
                    inst = self._choose(pool, stage, load, deadline)
                    if inst is not None:
                        return inst
                    left = deadline - time.monotonic()
                    if left <= 0 or not pool.live():
                        break
                    try:  # a release or a health change wakes us; re-check at least every health interval
                        await asyncio.wait_for(self.changed.wait(), min(left, self.config.health_interval_s))
                    except asyncio.TimeoutError:
                        pass
        finally:
            self.waiting[key] -= 1
        if not pool.live():
            raise Refused(f"every {pool.role.value} instance is down", 503, self.config.health_interval_s)
        budget = "TTFT" if stage is not Stage.DECODE else "TPOT"
        raise Refused(f"the {budget} budget cannot be met now ({pool.role.value} pool busy)", 429,
                      self._retry_after(pool))

    async def release(self) -> None:
        """Some instance's load or health changed: let the waiting requests look again."""
        async with self.changed:
            self.changed.notify_all()

    def _choose(self, pool: Pool, stage: Stage, load: Load, deadline: float) -> Instance | None:
        if not load.interactive and any(self.waiting[(s, True)] for s in Stage):
            return None  # background fills slack only
        left = deadline - time.monotonic()
        best, best_key = None, None
        for inst in pool.live():
            if stage is not Stage.DECODE and not self._ttft_fits(inst, load, left):
                continue
            if stage is not Stage.PREFILL and not self._tpot_fits(inst):
                continue
            key = (self.backlog_s(inst), inst.outstanding_tokens())
            if best_key is None or key < best_key:
                best, best_key = inst, key
        return best

    def backlog_s(self, inst: Instance) -> float:
        """Predicted seconds of prefill already sent to ``inst``."""
        return sum(self.est.prefill_s(x.prompt_tokens) for x in inst.prefilling.values())

    def _ttft_fits(self, inst: Instance, load: Load, left: float) -> bool:
        if not inst.prefilling:
            return True
        if not load.interactive:
            return False
        return self.backlog_s(inst) + self.est.prefill_s(load.prompt_tokens) <= left

    def _tpot_fits(self, inst: Instance) -> bool:
        return not inst.decoding or self.est.step_s(len(inst.decoding) + 1) <= self.config.slo_tpot_s

    def _retry_after(self, pool: Pool) -> float:
        live = pool.live()
        return min((self.backlog_s(i) for i in live), default=self.config.health_interval_s)

    def queued(self, stage: Stage) -> int:
        return self.waiting[(stage, True)] + self.waiting[(stage, False)]
