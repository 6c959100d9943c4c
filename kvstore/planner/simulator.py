"""Discrete-event simulator: replays a trace through one deployment under a cost model.

Time advances from event to event (arrivals, step ends, transfer completions); workers are the state
machines of :mod:`kvstore.planner.roles`. Routing: a new request goes to the prefill-capable worker
with the longest cached prefix (when prefix caching is on), then the least outstanding work (tokens of
the requests routed to it and not yet done: prompt + output, prompt for a prefill worker, output for a
decode worker), as the small engine's router does. In the
disaggregated deployment a prefilled request waits for a decode worker with KV room (the decode queue),
then its KV crosses the link; the link of each worker carries one transfer at a time; the first token is
delivered when the KV has arrived (the decode worker streams the response).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.planner.costmodel import CostModel, TransferModel
from kvstore.planner.deployment import Arch, Deployment
from kvstore.planner.metrics import GapHistogram, RequestResult
from kvstore.planner.roles import ChunkedWorker, ColocatedWorker, DecodeWorker, PrefillWorker
from kvstore.planner.worker import SimRequest, SimWorker
from kvstore.workloads.trace import Trace


@dataclass(frozen=True, slots=True)
class SimResult:
    """Everything one simulation produced: per-request results and deployment-wide counters."""

    deployment: Deployment
    cost: CostModel
    transfer: TransferModel | None
    trace_name: str
    requests: tuple[RequestResult, ...]
    peak_kv_tokens: int
    prefill_busy_s: float  # summed over prefill-capable workers
    decode_busy_s: float  # summed over decode-only workers (disaggregated)
    kv_bytes_transferred: int
    gaps: GapHistogram  # inter-token gaps of every decoded token (ITL / TBT)

    @property
    def makespan_s(self) -> float:
        done = [r for r in self.requests if not r.rejected]
        if not done:
            return 0.0
        return max(r.finish_s for r in done) - min(r.arrival_s for r in self.requests)


class Simulator:
    """Replay traces through ``deployment``. ``transfer`` is required for the disaggregated arch."""

    def __init__(self, cost: CostModel, deployment: Deployment, transfer: TransferModel | None = None,
                 record_tokens: bool = False):
        if deployment.arch is Arch.DISAGGREGATED and transfer is None:
            raise ValueError("the disaggregated deployment needs a TransferModel (the link)")
        if cost.tp != deployment.tp:
            raise ValueError(f"cost model is for tp={cost.tp} but the deployment uses tp={deployment.tp}")
        self.cost = cost
        self.deployment = deployment
        self.transfer = transfer
        self.record_tokens = record_tokens

    # -- event loop -----------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn, args))

    def kv_delta(self, tokens: int) -> None:
        self._kv_tokens += tokens
        if self._kv_tokens > self._peak_kv:
            self._peak_kv = self._kv_tokens

    def run(self, trace: Trace) -> SimResult:
        self.trace = trace
        self._events: list = []
        self._seq = 0
        self._kv_tokens = self._peak_kv = 0
        self._bytes_moved = 0
        self.gaps = GapHistogram()
        self._decode_queue: deque[SimRequest] = deque()
        self._build_workers()
        reqs = [SimRequest(spec) for spec in trace.requests]
        for req in reqs:
            if self.record_tokens:
                req.tokens = []
            self.at(req.spec.arrival_s, self._arrive, req)
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            fn(t, *args)
        stuck = [r.spec.id for r in reqs if not r.rejected and math.isnan(r.t_last)]
        if stuck:
            raise RuntimeError(f"simulation ended with {len(stuck)} unfinished requests (first ids {stuck[:5]})")
        return self._result(reqs)

    def _build_workers(self) -> None:
        dep, cost = self.deployment, self.cost
        cache_tokens = dep.prefix_cache_tokens
        blocks = int(cache_tokens // self.trace.block_tokens) if cache_tokens else 0
        if dep.arch is Arch.DISAGGREGATED:
            self.front: list[SimWorker] = [PrefillWorker(i, self, cost.kv_capacity_tokens, blocks)
                                        for i in range(dep.prefill_workers)]
            self.back: list[SimWorker] = [DecodeWorker(dep.prefill_workers + i, self, cost.kv_capacity_tokens)
                                       for i in range(dep.decode_workers)]
        else:
            kind = ChunkedWorker if dep.arch is Arch.CHUNKED else ColocatedWorker
            self.front = [kind(i, self, cost.kv_capacity_tokens, blocks) for i in range(dep.workers)]
            self.back = []

    # -- arrivals and routing -------------------------------------------------------------------------
    def _rejects(self, req: SimRequest) -> bool:
        cap = self.cost.kv_capacity_tokens
        if self.deployment.arch is Arch.DISAGGREGATED:
            return req.prompt > cap or req.prompt + req.output > cap
        return req.prompt + req.output > cap

    def _arrive(self, now: float, req: SimRequest) -> None:
        if self._rejects(req):
            req.rejected = True
            return

        def key(w: SimWorker) -> tuple:
            cached = w.cache.match(req.spec.prefix_ids) if w.cache is not None else 0
            return (-cached, w.outstanding, w.id)

        min(self.front, key=key).enqueue(req, now)

    # -- disaggregated hand-off -----------------------------------------------------------------------
    def on_prefilled(self, req: SimRequest, now: float) -> None:
        req.t_ready = now
        self._decode_queue.append(req)
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        """Give queued prefilled requests (FCFS) a decode worker with room and start their transfers."""
        max_batch = self.deployment.max_batch
        while self._decode_queue:
            req = self._decode_queue[0]
            need = req.prompt + req.output
            free = [w for w in self.back if w.fits(need) and w.active < max_batch]
            if not free:
                return
            self._decode_queue.popleft()
            dst = min(free, key=lambda w: (w.outstanding, w.id))
            dst.reserved += need
            dst.outstanding += dst.routing_cost(req)
            nbytes = req.prompt * self.cost.kv_bytes_per_token
            req.t_dispatch = now
            self._bytes_moved += nbytes
            self.kv_delta(req.prompt)  # room taken on the decode worker
            if self.transfer.staged:
                dst.arrive(req, now)  # it fetches from the store at its next step
                continue
            src = req.src
            start = max(now, src.nic_free_s, dst.nic_free_s)
            end = start + self.transfer.time_s(nbytes)
            src.nic_free_s = dst.nic_free_s = end
            req.t_xfer_start = start
            dst.incoming += 1
            self.at(end, self._transfer_done, req, dst)

    def _transfer_done(self, now: float, req: SimRequest, dst: SimWorker) -> None:
        req.t_transfer_end = now
        src = req.src
        src.release(req.prompt)
        self.kv_delta(-req.prompt)
        dst.incoming -= 1
        dst.arrive(req, now)
        src.poke(now)

    def on_finish(self, req: SimRequest, worker: SimWorker, now: float) -> None:
        if self._decode_queue:
            self._dispatch(now)

    # -- results --------------------------------------------------------------------------------------
    def _result(self, reqs: list[SimRequest]) -> SimResult:
        kvb = self.cost.kv_bytes_per_token
        results = tuple(_request_result(r, kvb) for r in reqs)
        return SimResult(
            deployment=self.deployment, cost=self.cost, transfer=self.transfer, trace_name=self.trace.name,
            requests=results, peak_kv_tokens=self._peak_kv,
            prefill_busy_s=sum(w.busy_s for w in self.front),
            decode_busy_s=sum(w.busy_s for w in self.back),
            kv_bytes_transferred=self._bytes_moved, gaps=self.gaps)


def _request_result(r: SimRequest, kv_bytes_per_token: int) -> RequestResult:
    spec = r.spec
    if r.rejected:
        return RequestResult(id=spec.id, arrival_s=spec.arrival_s, prompt_tokens=r.prompt,
                             output_tokens=r.output, rejected=True)
    disagg = not math.isnan(r.t_dispatch)
    joined = r.t_first if math.isnan(r.t_join) else r.t_join
    decode_queue = joined - r.t_first  # waiting for the next step boundary
    transfer = link_wait = 0.0
    if disagg:
        # ready -> dispatched: a decode worker with room; dispatched -> transfer start: the link is busy
        # (direct) or the decode worker's step boundary (staged, counted as decode queue like the engine)
        link_wait = r.t_xfer_start - r.t_dispatch
        staged = r.publish_s > 0
        decode_queue += r.t_dispatch - r.t_ready + (link_wait if staged else 0.0)
        link_wait = 0.0 if staged else link_wait
        transfer = r.publish_s + (r.t_transfer_end - r.t_xfer_start) + link_wait
    return RequestResult(
        id=spec.id, arrival_s=spec.arrival_s, prompt_tokens=r.prompt, output_tokens=r.output,
        cached_tokens=r.cached,
        prefill_queue_s=r.t_prefill_start - spec.arrival_s,
        prefill_start_s=r.t_prefill_start, prefill_end_s=r.t_prefill_end,
        decode_queue_s=decode_queue,
        transfer_s=transfer, link_wait_s=link_wait,
        ttft_s=r.t_first - spec.arrival_s,
        tpot_s=(r.t_last - r.t_first) / (r.output - 1) if r.output > 1 else None,
        stall_s=r.stall,
        finish_s=r.t_last,
        kv_bytes=r.prompt * kv_bytes_per_token,
        transferred=disagg,
        token_times_s=tuple(r.tokens) if r.tokens is not None else None)
