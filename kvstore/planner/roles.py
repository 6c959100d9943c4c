"""The four worker roles of the simulator: colocated (prefill-first), chunked (Sarathi-style), and the
prefill-only and decode-only workers of a disaggregated deployment. Shared machinery is in
:mod:`kvstore.planner.worker`."""

from __future__ import annotations

import itertools

from kvstore.planner.costmodel import prefill_pairs
from kvstore.planner.worker import SimRequest, SimWorker


class ColocatedWorker(SimWorker):
    """Prefill-first: waiting prompts run (batched) before the next decode step, pausing the decodes."""

    def _plan(self, now: float) -> None:
        self._join_pending(now)
        batch = self._take_prefill_batch(self.sim.deployment.max_prefill_tokens)
        if batch:
            cost = self.sim.cost
            new = [r.prompt - r.cached for r in batch]
            pairs = sum(prefill_pairs(n, r.cached) for n, r in zip(new, batch, strict=True))
            duration = cost.step_s(prefill_tokens=sum(new), prefill_pair_count=pairs)
            for req in batch:
                req.t_prefill_start = now
            if self.running:
                self.stall_clock += duration
            self._start(now, duration, ("prefill", now, batch))
        elif self.running:
            self._start_decode_span(now)

    def _end_prefill(self, now: float, t0: float, batch: list[SimRequest]) -> None:
        self.busy_s += now - t0
        for req in batch:
            self.sim.kv_delta(req.prompt)
            self._prefilled(req, now)
            self._first_token(req, now)


class ChunkedWorker(SimWorker):
    """Sarathi-style: each step spends a token budget on every running decode, then on prompt chunks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefilling: list[SimRequest] = []

    @property
    def load(self) -> int:
        return super().load + len(self.prefilling)

    def _plan(self, now: float) -> None:
        self._join_pending(now)
        budget = self.sim.deployment.chunk_tokens - len(self.running)
        chunks = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.prompt - req.prefilled, budget)
            chunks.append((req, n))
            budget -= n
        while budget > 0 and (req := self._admissible()) is not None:
            self._admit(req)
            req.t_prefill_start = now
            self.prefilling.append(req)
            n = min(req.prompt - req.prefilled, budget)
            chunks.append((req, n))
            budget -= n
        if chunks:
            durations, stall = self._mixed_steps(chunks)
            self.stall_clock += stall
            self._start(now, sum(durations), ("mixed", now, chunks, durations))
        elif self.running:
            self._start_decode_span(now)

    def _mixed_steps(self, chunks: list[tuple[SimRequest, int]]) -> tuple[list[float], float]:
        """Durations of the next mixed steps and the stall they add to the running decodes. When one prompt
        takes the whole budget for several steps and no decode finishes meanwhile, those steps are
        planned together (one event instead of one per chunk)."""
        cost, batch = self.sim.cost, len(self.running)
        k = 1
        if len(chunks) == 1:
            req, n = chunks[0]
            k = max(1, (req.prompt - req.prefilled - 1) // n)
            if batch:
                k = min(k, self._finishes[0][0] - self.steps)
        if k == 1:
            tokens = sum(n for _, n in chunks)
            pairs = sum(prefill_pairs(n, req.prefilled) for req, n in chunks)
            duration = cost.step_s(batch, self.ctx, tokens, pairs)
            return [duration], (duration - cost.decode_s(batch, self.ctx)) if batch else 0.0
        durations, stall = [], 0.0
        for i in range(k):
            ctx = self.ctx + i * batch
            duration = cost.step_s(batch, ctx, n, prefill_pairs(n, req.prefilled + i * n))
            durations.append(duration)
            if batch:
                stall += duration - cost.decode_s(batch, ctx)
        return durations, stall

    def _end_mixed(self, now: float, t0: float, chunks: list[tuple[SimRequest, int]],
                   durations: list[float]) -> None:
        self.busy_s += now - t0
        k = len(durations)
        if self.running:
            bounds = list(itertools.accumulate(durations, initial=t0))[1:]
            if self.sim.record_tokens:
                for req in self.running.values():
                    req.tokens.extend(bounds)
            self._count_gaps(bounds[0])
            for d in durations[1:]:
                self.sim.gaps.add(d, len(self.running))
            self.last_emit_s = now
            self._advance(now, k)
        for req, n in chunks:
            self.sim.kv_delta(n * k + (req.cached if req.prefilled == req.cached else 0))
            req.prefilled += n * k
            if req.prefilled >= req.prompt:
                self.prefilling.remove(req)
                self._prefilled(req, now)
                self._first_token(req, now)


class PrefillWorker(SimWorker):
    """Disaggregated prefill: batched prompts only; the KV stays here until its transfer completes."""

    def _admit_tokens(self, req: SimRequest) -> int:
        return req.prompt

    def routing_cost(self, req: SimRequest) -> int:
        return req.prompt

    def _plan(self, now: float) -> None:
        batch = self._take_prefill_batch(self.sim.deployment.max_prefill_tokens)
        if batch:
            new = [r.prompt - r.cached for r in batch]
            pairs = sum(prefill_pairs(n, r.cached) for n, r in zip(new, batch, strict=True))
            for req in batch:
                req.t_prefill_start = now
                req.src = self
            self._start(now, self.sim.cost.step_s(prefill_tokens=sum(new), prefill_pair_count=pairs),
                        ("prefill", now, batch))

    def _end_prefill(self, now: float, t0: float, batch: list[SimRequest]) -> None:
        self.busy_s += now - t0
        transfer = self.sim.transfer
        for req in batch:
            self.sim.kv_delta(req.prompt)
            self._prefilled(req, now)
            self.outstanding -= self.routing_cost(req)
            if transfer.staged:
                req.publish_s = transfer.publish_s(req.prompt * self.sim.cost.kv_bytes_per_token)
        if transfer.staged:  # publish every prompt of the batch to the store before the next step
            self._start(now, sum(r.publish_s for r in batch), ("publish", now, batch))
            return
        for req in batch:
            self.sim.on_prefilled(req, now)

    def _end_publish(self, now: float, t0: float, batch: list[SimRequest]) -> None:
        self.busy_s += now - t0
        for req in batch:  # the KV now lives in the store
            self.release(req.prompt)
            self.sim.kv_delta(-req.prompt)
            self.sim.on_prefilled(req, now)


class DecodeWorker(SimWorker):
    """Disaggregated decode: a request whose KV has arrived is admitted at the next step boundary, and
    its first token (computed by the prefill worker) is delivered then, as a P/D engine's decode side
    streams the response."""

    does_prefill = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arrived: list[SimRequest] = []

    @property
    def load(self) -> int:
        return super().load + len(self.arrived)

    def routing_cost(self, req: SimRequest) -> int:
        return req.output

    def _plan(self, now: float) -> None:
        arrived, self.arrived = self.arrived, []
        transfer = self.sim.transfer
        if arrived and transfer.staged:  # fetch from the store inside this step, before decoding
            kvb = self.sim.cost.kv_bytes_per_token
            for req in arrived:
                req.t_xfer_start = now
            self._start(now, sum(transfer.fetch_s(r.prompt * kvb) for r in arrived), ("fetch", now, arrived))
            return
        self._deliver(arrived, now)
        self._join_pending(now)
        if self.running:
            self._start_decode_span(now)

    def _deliver(self, arrived: list[SimRequest], now: float) -> None:
        for req in arrived:
            self._first_token(req, now)

    def _end_fetch(self, now: float, t0: float, arrived: list[SimRequest]) -> None:
        self.busy_s += now - t0
        for req in arrived:
            req.t_transfer_end = now
        self._deliver(arrived, now)

    def arrive(self, req: SimRequest, now: float) -> None:
        """``req`` is assigned here with its KV on the way (or, staged, waiting in the store)."""
        self.arrived.append(req)
        self.poke(now)
