"""The router: replays a trace's arrivals against the wall clock and moves requests between workers.

Arrivals join the *prefill queue*; an admission policy (admission.py) sends them to prefill-capable workers.
Collocated / chunked: a replica prefills and decodes. Disaggregated: when a prefill worker reports the KV
published (``handed_off``) the request joins the *decode queue*, from which the policy sends it, with its
first token, to a decode worker, which fetches the KV from the store.

Failures: a failed hand-off sends the request back to prefill (counted as recomputed). A dead worker
(``lost``) gives back everything it held: requests it was decoding after a hand-off are re-fetched from the
store when the KV is still there (``refetch``), the rest are re-prefilled; with ``respawn`` a replacement
process with the same role is started and joins when ready. ``fault`` kills a worker on purpose (fault.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from benchmarks.pd.admission import Admission, Immediate, WorkerLoad
from benchmarks.pd.channel import ChannelClosedError
from benchmarks.pd.fault import FaultLog, FaultSpec, choose_victim
from benchmarks.pd.pool import WorkerPool
from benchmarks.pd.record import RequestRecord
from benchmarks.pd.scheduler import Policy
from benchmarks.pd.trace import TokenRequest, TokenTrace

MAX_ATTEMPTS = 3
ENTRY_ROLES = (Policy.PREFILL_FIRST, Policy.CHUNKED, Policy.PREFILL_ONLY)
POLL_S = 0.02  # longest pause between admission decisions while nothing arrives


class Router:
    def __init__(self, trace: TokenTrace, pool: WorkerPool, roles: list[Policy], kv_bytes: Callable[[int], int],
                 drain_timeout_s: float = 600.0, on_finish: Callable[[RequestRecord], None] | None = None,
                 on_begin: Callable[[], None] | None = None, *, admission: Admission | None = None,
                 fault: FaultSpec | None = None, respawn: bool = False, refetch: bool = False):
        """``refetch``: the store keeps a fetched request's KV (prefix-keyed chunks), so a dead decode
        worker's requests can be fetched again instead of re-prefilled."""
        self.trace, self.pool, self.roles = trace, pool, roles
        self.drain_timeout_s = drain_timeout_s
        self.on_finish = on_finish or (lambda record: None)
        self.on_begin = on_begin or (lambda: None)
        self.admission = admission or Immediate()
        self.respawn, self.refetch = respawn, refetch
        self.fault_log = FaultLog(fault) if fault is not None else None
        self.by_id = {r.id: r for r in trace.requests}
        self.records = {r.id: RequestRecord(r.id, r.klass, r.arrival_s, r.prompt_tokens, r.output_tokens,
                                            kv_bytes(r.prompt_tokens)) for r in trace.requests}
        self.workers = {i: WorkerLoad(i, role) for i, role in enumerate(roles)}  # the live ones
        self.prefill_queue: list[TokenRequest] = []
        self.decode_queue: list[TokenRequest] = []
        self.refetching: set[str] = set()
        self.unfinished = set(self.records)
        self.worker_info: list[dict] = []
        self.respawned_info: list[dict] = []
        self.t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> tuple[list[RequestRecord], list[dict]]:
        """Serve the whole trace; returns the records (trace order) and each worker's stats."""
        try:
            self.worker_info = self.pool.start()
            self._serve()
        except BaseException:
            self.pool.abort()
            raise
        return [self.records[r.id] for r in self.trace.requests], self.pool.stop()

    def _serve(self) -> None:
        self.t0 = time.monotonic()
        self.pool.begin(self.t0)
        self.on_begin()
        pending = deque(self.trace.requests)
        deadline = self.trace.describe()["duration_s"] + self.drain_timeout_s
        while self.unfinished:
            now = self.now()
            while pending and pending[0].arrival_s <= now:
                self.prefill_queue.append(pending.popleft())
            self._maybe_inject(now)
            self._admit(now)
            wait = min(POLL_S, pending[0].arrival_s - now if pending else POLL_S)
            if self.fault_log is not None and not self.fault_log.injected:
                wait = min(wait, self.fault_log.spec.at_s - now)
            for msg in self.pool.pump(max(0.0, wait)):
                self._handle(msg)
            if now > deadline:
                raise TimeoutError(f"{len(self.unfinished)} requests unfinished {now:.1f} s into the run: "
                                   f"{sorted(self.unfinished)[:8]}")

    # -- dispatch ---------------------------------------------------------------------------------------
    def _live(self, roles: tuple[Policy, ...]) -> list[WorkerLoad]:
        return [w for _, w in sorted(self.workers.items()) if w.role in roles]

    def _admit(self, now: float) -> None:
        entry, decoders = self._live(ENTRY_ROLES), self._live((Policy.DECODE_ONLY,))
        while (decision := self.admission.next_prefill(self.prefill_queue, entry, now)) is not None:
            req, worker = decision
            self.prefill_queue.remove(req)
            self._send_prefill(req, worker)
        while (decision := self.admission.next_decode(self.decode_queue, decoders, now)) is not None:
            req, worker = decision
            self.decode_queue.remove(req)
            self._send_decode(req, worker)

    def _wire_id(self, rid: str) -> str:
        attempt = self.records[rid].attempts
        return rid if attempt <= 1 else f"{rid}@{attempt}"

    def _send_prefill(self, req: TokenRequest, worker: WorkerLoad) -> None:
        record = self.records[req.id]
        record.attempts += 1
        if record.dispatch_s is None:
            record.dispatch_s = round(self.now(), 6)
        worker.prefill[req.id] = req
        self._send(worker.index, "add", req={"id": self._wire_id(req.id), "prompt_ids": list(req.prompt_ids),
                                             "max_output": req.output_tokens})

    def _send_decode(self, req: TokenRequest, worker: WorkerLoad) -> None:
        worker.decode[req.id] = req
        first_token = self.records[req.id].output_token_ids[0]
        self._send(worker.index, "decode", req={
            "id": self._wire_id(req.id), "prompt_ids": list(req.prompt_ids), "max_output": req.output_tokens,
            "output_ids": [first_token], "refetch": req.id in self.refetching})

    def _send(self, index: int, op: str, **fields) -> None:
        try:
            self.pool.send(index, op, **fields)
        except ChannelClosedError:
            pass  # it died an instant ago; its ``lost`` report hands back everything it held, this included

    # -- worker reports ---------------------------------------------------------------------------------
    def _handle(self, msg: dict) -> None:
        handlers = {"prefilled": self._on_prefilled, "finished": self._on_finished, "handed_off": self._on_handed_off,
                    "failed": self._on_failed, "lost": self._on_lost, "ready": self._on_ready}
        try:
            handler = handlers[msg["op"]]
        except KeyError:
            raise RuntimeError(f"unexpected message from worker {msg.get('worker')}: {msg['op']!r}") from None
        handler(msg)

    def _current(self, msg: dict) -> tuple[str, WorkerLoad] | None:
        """The request id and its worker, or None for a report about an attempt that was given up."""
        rid = msg["req"]["id"].split("@")[0]
        worker = self.workers.get(msg["worker"])
        if rid not in self.records or msg["req"]["id"] != self._wire_id(rid) or worker is None:
            return None
        return rid, worker

    def _on_prefilled(self, msg: dict) -> None:
        if (cur := self._current(msg)) is not None and cur[0] in cur[1].prefill:
            rid, worker = cur
            worker.decode[rid] = worker.prefill.pop(rid)

    def _on_finished(self, msg: dict) -> None:
        if (cur := self._current(msg)) is None:
            return
        rid, worker = cur
        worker.pop(rid)
        record = self.records[rid]
        if worker.role is Policy.DECODE_ONLY:
            record.on_decode_done(worker.index, msg["req"])
        else:
            record.on_colocated_done(worker.index, msg["req"])  # also a prefill-only request whose one token is out
        self.refetching.discard(rid)
        self._done(record)

    def _on_handed_off(self, msg: dict) -> None:
        if (cur := self._current(msg)) is None:
            return
        rid, worker = cur
        worker.pop(rid)
        self.records[rid].on_handed_off(worker.index, msg["req"])
        self.decode_queue.append(self.by_id[rid])

    def _on_failed(self, msg: dict) -> None:
        if (cur := self._current(msg)) is None:
            return
        rid, worker = cur
        worker.pop(rid)
        self.refetching.discard(rid)
        self._restart(rid, f"worker {worker.index} ({worker.role.value}): {msg['req']['error']}")

    def _on_lost(self, msg: dict) -> None:
        worker = self.workers.pop(msg["worker"], None)
        if worker is None:
            return
        log = self.fault_log
        is_victim = log is not None and log.victim == worker.index
        if is_victim:
            log.detected_at_s = self.now()
            log.interrupted = worker.rids()
        reason = f"worker {worker.index} died (exit code {msg.get('exitcode')})"
        for rid in worker.rids():
            keeps_kv = self.refetch and worker.role is Policy.DECODE_ONLY and self.records[rid].handed_off
            if keeps_kv:
                self.records[rid].refetch(reason)
                self.refetching.add(rid)
                self.decode_queue.append(self.by_id[rid])
            else:
                self._restart(rid, reason)
            if is_victim:
                (log.refetched if keeps_kv else log.recomputed).append(rid)
        if self.respawn:
            self.pool.respawn(worker.index)

    def _on_ready(self, msg: dict) -> None:
        """A replacement worker is built and warmed up: give it the run's clock and start using it."""
        index = msg["worker"]
        self.workers[index] = WorkerLoad(index, self.roles[index])
        self._send(index, "start", t0=self.t0)
        self.respawned_info.append({k: v for k, v in msg.items() if k not in ("op", "v")})
        if self.fault_log is not None and self.fault_log.victim == index:
            self.fault_log.replacement_ready_at_s = self.now()

    # -- faults -----------------------------------------------------------------------------------------
    def _maybe_inject(self, now: float) -> None:
        log = self.fault_log
        if log is None or log.injected or now < log.spec.at_s:
            return
        victim = choose_victim({i: w.role for i, w in self.workers.items()},
                               {i: len(w.decode) for i, w in self.workers.items()})
        if victim is None:
            raise RuntimeError(f"fault {log.spec}: no live decode-capable worker to kill")
        self.pool.kill(victim)
        log.victim, log.killed_at_s = victim, now

    # -- request lifecycle ------------------------------------------------------------------------------
    def _restart(self, rid: str, reason: str) -> None:
        record = self.records[rid]
        record.restart(reason)
        if record.attempts >= MAX_ATTEMPTS:
            record.lost = True
            self._done(record)
            return
        self.prefill_queue.append(self.by_id[rid])

    def _done(self, record: RequestRecord) -> None:
        self.unfinished.discard(record.id)
        self.on_finish(record)
