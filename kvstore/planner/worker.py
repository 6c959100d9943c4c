"""The simulator's worker: one engine (a group of ``tp`` GPUs), the state machine shared by every role
(:mod:`kvstore.planner.roles`).

Every worker owns a prefill queue, a decode batch and a KV budget. Runs of pure decode steps are
simulated as one *span* (k steps at once, with the context growing by the batch size each step), ended
early at the next step boundary when new work arrives (:meth:`SimWorker.poke`), so a simulation costs
O(events), not O(steps). Prefill steps are simulated one at a time; consecutive chunked steps that
spend the whole budget on one prompt are planned together (see ChunkedWorker).

Memory is reserved at admission for the whole request (prompt + output: the simulator knows the output
length, so it never has to preempt), and released when the request finishes or its KV leaves.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import TYPE_CHECKING

from kvstore.planner.costmodel import decode_span_s, steps_to_cover
from kvstore.planner.prefixcache import PrefixCache

if TYPE_CHECKING:
    from kvstore.planner.simulator import Simulator
    from kvstore.workloads.trace import TraceRequest


class SimRequest:
    """Mutable per-request state while simulating (results are frozen into RequestResult afterwards)."""

    __slots__ = ("spec", "prompt", "output", "cached", "prefilled", "t_prefill_start", "t_prefill_end", "t_ready",
                 "t_dispatch", "t_xfer_start", "t_transfer_end", "publish_s", "t_first", "t_join", "t_last",
                 "finish_step", "src", "tokens", "rejected", "stall0", "stall")

    def __init__(self, spec: TraceRequest):
        self.spec = spec
        self.prompt = spec.prompt_tokens
        self.output = spec.output_tokens
        self.cached = 0
        self.prefilled = 0
        self.t_prefill_start = self.t_prefill_end = self.t_ready = math.nan
        self.t_dispatch = self.t_xfer_start = self.t_transfer_end = math.nan
        self.t_first = self.t_join = self.t_last = math.nan
        self.publish_s = 0.0
        self.finish_step = 0
        self.src: SimWorker | None = None
        self.tokens: list[float] | None = None
        self.rejected = False
        self.stall0 = self.stall = 0.0  # worker stall clock at join; stall seen while decoding


class SimWorker:
    """Decode machinery, KV budget and step bookkeeping shared by every role."""

    does_prefill = True

    def __init__(self, wid: int, sim: Simulator, capacity_tokens: int, cache_blocks: int = 0):
        self.id = wid
        self.sim = sim
        self.capacity = capacity_tokens
        self.reserved = 0
        self.waiting: deque[SimRequest] = deque()
        self.queued_tokens = 0  # prompt tokens in ``waiting``
        self.outstanding = 0  # tokens of work routed here and not yet done (the router's load measure)
        self.pending: list[SimRequest] = []
        self.running: dict[int, SimRequest] = {}
        self._finishes: list[tuple[int, int, SimRequest]] = []
        self.steps = 0
        self.ctx = 0
        self.busy = False
        self._ending = False  # inside a step-end handler: the plan follows it, pokes wait
        self.epoch = 0
        self._activity: tuple = ()
        self.end_s = 0.0
        self.stall_clock = 0.0  # total time this worker's decodes were held up by prefill work
        self.busy_s = 0.0
        self.nic_free_s = 0.0
        self.last_emit_s = 0.0  # time of this worker's last decode step boundary
        self._fresh: list[SimRequest] = []  # joined since then: their last token is their first
        self.incoming = 0  # decode role: requests whose KV is on its way here
        self.cache = PrefixCache(cache_blocks) if cache_blocks > 0 else None

    # -- load and memory ----------------------------------------------------------------------------
    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.pending) + self.incoming

    def fits(self, tokens: int) -> bool:
        return self.reserved + tokens <= self.capacity

    def release(self, tokens: int) -> None:
        self.reserved -= tokens

    # -- scheduling ---------------------------------------------------------------------------------
    def poke(self, now: float) -> None:
        """New work may be runnable: start a step if idle, or end the current decode span at its next
        step boundary so the next plan sees the work."""
        if self._ending:
            return
        if not self.busy:
            self._plan(now)
            return
        if self._activity[0] != "decode":
            return
        _, t0, k, a, c, batch, ctx0 = self._activity
        if k <= 1:
            return
        j = steps_to_cover(a, c, ctx0, batch, now - t0) if now > t0 else 1
        if j < k:
            self._activity = ("decode", t0, j, a, c, batch, ctx0)
            self._schedule_end(t0 + decode_span_s(a, c, ctx0, batch, j))

    def _schedule_end(self, t: float) -> None:
        self.epoch += 1
        self.end_s = t
        self.sim.at(t, self._on_step_end, self.epoch)

    def _start(self, now: float, duration: float, activity: tuple) -> None:
        self.busy = True
        self._activity = activity
        self._schedule_end(now + duration)

    def _on_step_end(self, now: float, epoch: int) -> None:
        if epoch != self.epoch:
            return  # superseded by a shortened span
        activity, self._activity = self._activity, ()
        self.busy, self._ending = False, True
        getattr(self, "_end_" + activity[0])(now, *activity[1:])  # may start a follow-up activity
        self._ending = False
        if not self.busy:
            self._plan(now)

    def _plan(self, now: float) -> None:
        raise NotImplementedError

    # -- decode ---------------------------------------------------------------------------------------
    def _join_pending(self, now: float) -> None:
        for req in self.pending:
            req.t_join = now
            req.finish_step = self.steps + req.output - 1
            req.stall0 = self.stall_clock
            self.running[req.spec.id] = req
            self.ctx += req.prompt + 1
            self._fresh.append(req)
            heapq.heappush(self._finishes, (req.finish_step, req.spec.id, req))
        self.pending.clear()

    def _start_decode_span(self, now: float) -> None:
        batch = len(self.running)
        a, c = self.sim.cost.decode_linear(batch)
        k = self._finishes[0][0] - self.steps
        self._start(now, decode_span_s(a, c, self.ctx, batch, k), ("decode", now, k, a, c, batch, self.ctx))

    def _end_decode(self, now: float, t0: float, k: int, a: float, c: float, batch: int, ctx0: float) -> None:
        self.busy_s += now - t0
        if self.sim.record_tokens:
            times = [t0 + decode_span_s(a, c, ctx0, batch, i) for i in range(1, k + 1)]
            for req in self.running.values():
                req.tokens.extend(times)
        first = t0 + a + c * ctx0
        self._count_gaps(first)
        # the k - 1 later steps lengthen linearly; count them at up to 8 representative durations
        pieces = min(k - 1, 8)
        for p in range(pieces):
            mid = 1 + (k - 1) * (p + 0.5) / pieces
            self.sim.gaps.add(a + c * (ctx0 + mid * batch), batch * (k - 1) / pieces)
        self.last_emit_s = now
        self._advance(now, k)

    def _count_gaps(self, boundary: float) -> None:
        """Record the gap each running request sees at a decode boundary (stalls by prefills included)."""
        gaps = self.sim.gaps
        gaps.add(boundary - self.last_emit_s, len(self.running) - len(self._fresh))
        for req in self._fresh:
            gaps.add(boundary - req.t_first)
        self._fresh.clear()

    def _advance(self, now: float, k: int) -> None:
        """``k`` decode steps finished at ``now``: grow contexts, retire finished requests."""
        batch = len(self.running)
        self.steps += k
        self.ctx += batch * k
        self.sim.kv_delta(batch * k)
        while self._finishes and self._finishes[0][0] <= self.steps:
            _, _, req = heapq.heappop(self._finishes)
            del self.running[req.spec.id]
            self.ctx -= req.prompt + req.output
            self.finish(req, now)

    def finish(self, req: SimRequest, now: float) -> None:
        req.t_last = now
        req.stall = self.stall_clock - req.stall0 if req.output > 1 else 0.0
        self.outstanding -= self.routing_cost(req)
        self.release(req.prompt + req.output)
        self.sim.kv_delta(-(req.prompt + req.output))
        self.sim.on_finish(req, self, now)

    # -- prefill --------------------------------------------------------------------------------------
    def _admit_tokens(self, req: SimRequest) -> int:
        """KV tokens a request reserves on admission here."""
        return req.prompt + req.output

    @property
    def active(self) -> int:
        """Requests admitted here (prefilling, waiting to join or decoding)."""
        return self.load - len(self.waiting)

    def _admissible(self) -> SimRequest | None:
        """The head of the prefill queue if it may be admitted now (FCFS: nothing overtakes it)."""
        if not self.waiting or self.active >= self.sim.deployment.max_batch:
            return None
        req = self.waiting[0]
        return req if self.fits(self._admit_tokens(req)) else None

    def routing_cost(self, req: SimRequest) -> int:
        """Tokens of work ``req`` brings to this worker, for least-outstanding-work routing."""
        return req.prompt + req.output

    def enqueue(self, req: SimRequest, now: float) -> None:
        self.waiting.append(req)
        self.queued_tokens += req.prompt
        self.outstanding += self.routing_cost(req)
        self.poke(now)

    def _admit(self, req: SimRequest) -> None:
        self.waiting.popleft()
        self.queued_tokens -= req.prompt
        self.reserved += self._admit_tokens(req)
        req.cached = self._cached_tokens(req)
        req.prefilled = req.cached

    def _take_prefill_batch(self, limit_tokens: int) -> list[SimRequest]:
        """Admit queued prompts (FCFS) up to ``limit_tokens`` new tokens; the first one always fits."""
        batch, tokens = [], 0
        while (req := self._admissible()) is not None:
            new = req.prompt - self._cached_tokens(req)
            if batch and tokens + new > limit_tokens:
                break
            self._admit(req)
            tokens += new
            batch.append(req)
        return batch

    def _cached_tokens(self, req: SimRequest) -> int:
        if self.cache is None or not req.spec.prefix_ids:
            return 0
        blocks = self.cache.match(req.spec.prefix_ids)
        return min(req.prompt - 1, int(blocks * self.sim.trace.block_tokens))

    def _prefilled(self, req: SimRequest, now: float) -> None:
        req.t_prefill_end = now
        if self.cache is not None and req.spec.prefix_ids:
            self.cache.insert(req.spec.prefix_ids)

    def _first_token(self, req: SimRequest, now: float) -> None:
        req.t_first = now
        self.sim.kv_delta(1)  # the first token's KV slot
        if req.tokens is not None:
            req.tokens.append(now)
        if req.output == 1:
            self.finish(req, now)
        else:
            self.pending.append(req)
