"""The router: replays a trace's arrivals against the wall clock and moves requests between workers.

Collocated / chunked: each arrival goes to the replica with the least outstanding work. Disaggregated: an
arrival goes to a prefill worker; when that worker reports the KV published (``handed_off``) the router
forwards the request, with its first token, to the least-loaded decode worker, which fetches the KV from the
store. A failed hand-off or a dead worker sends its requests back to prefill (counted as recomputed).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from benchmarks.pd.pool import WorkerPool
from benchmarks.pd.record import RequestRecord
from benchmarks.pd.scheduler import Policy
from benchmarks.pd.trace import Trace, TraceRequest

MAX_ATTEMPTS = 3
ENTRY_ROLES = (Policy.PREFILL_FIRST, Policy.CHUNKED, Policy.PREFILL_ONLY)


class Router:
    def __init__(self, trace: Trace, pool: WorkerPool, roles: list[Policy], kv_bytes: Callable[[int], int],
                 drain_timeout_s: float = 600.0, on_finish: Callable[[RequestRecord], None] | None = None,
                 on_begin: Callable[[], None] | None = None):
        self.trace, self.pool, self.roles = trace, pool, roles
        self.drain_timeout_s = drain_timeout_s
        self.on_finish = on_finish or (lambda record: None)
        self.on_begin = on_begin or (lambda: None)
        self.by_id = {r.id: r for r in trace.requests}
        self.records = {r.id: RequestRecord(r.id, r.klass, r.arrival_s, r.prompt_tokens, r.output_tokens,
                                            kv_bytes(r.prompt_tokens)) for r in trace.requests}
        self.live = set(range(len(roles)))
        self.load: dict[int, dict[str, int]] = {i: {} for i in self.live}  # worker -> request -> token cost
        self.unfinished = set(self.records)
        self.worker_info: list[dict] = []
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
                self._dispatch_prefill(pending.popleft())
            wait = pending[0].arrival_s - now if pending else 0.05
            for msg in self.pool.pump(min(wait, 0.05)):
                self._handle(msg)
            if now > deadline:
                raise TimeoutError(f"{len(self.unfinished)} requests unfinished {now:.1f} s into the run: "
                                   f"{sorted(self.unfinished)[:8]}")

    # -- dispatch ---------------------------------------------------------------------------------------
    def _pick(self, roles: tuple[Policy, ...]) -> int:
        candidates = [i for i in sorted(self.live) if self.roles[i] in roles]
        if not candidates:
            raise RuntimeError(f"no live worker with a role in {[r.value for r in roles]}")
        return min(candidates, key=lambda i: sum(self.load[i].values()))

    def _wire_id(self, rid: str) -> str:
        attempt = self.records[rid].attempts
        return rid if attempt <= 1 else f"{rid}@{attempt}"

    def _dispatch_prefill(self, req: TraceRequest) -> None:
        record = self.records[req.id]
        record.attempts += 1
        if record.dispatch_s is None:
            record.dispatch_s = round(self.now(), 6)
        worker = self._pick(ENTRY_ROLES)
        cost = req.prompt_tokens + (req.output_tokens if self.roles[worker] is not Policy.PREFILL_ONLY else 0)
        self.load[worker][req.id] = cost
        self.pool.send(worker, "add", req={"id": self._wire_id(req.id), "prompt_ids": list(req.prompt_ids),
                                           "max_output": req.output_tokens})

    def _dispatch_decode(self, rid: str, first_token: int) -> None:
        req = self.by_id[rid]
        worker = self._pick((Policy.DECODE_ONLY,))
        self.load[worker][rid] = req.output_tokens
        self.pool.send(worker, "decode", req={"id": self._wire_id(rid), "prompt_ids": list(req.prompt_ids),
                                              "max_output": req.output_tokens, "output_ids": [first_token]})

    # -- worker reports ---------------------------------------------------------------------------------
    def _handle(self, msg: dict) -> None:
        handlers = {"finished": self._on_finished, "handed_off": self._on_handed_off,
                    "failed": self._on_failed, "lost": self._on_lost}
        try:
            handler = handlers[msg["op"]]
        except KeyError:
            raise RuntimeError(f"unexpected message from worker {msg.get('worker')}: {msg['op']!r}") from None
        handler(msg)

    def _on_finished(self, msg: dict) -> None:
        worker, r = msg["worker"], msg["req"]
        rid = r["id"].split("@")[0]
        self.load[worker].pop(rid, None)
        record = self.records[rid]
        if self.roles[worker] is Policy.DECODE_ONLY:
            record.on_decode_done(worker, r)
        else:
            record.on_colocated_done(worker, r)  # also a prefill-only request whose single token is out
        self._done(record)

    def _on_handed_off(self, msg: dict) -> None:
        worker, r = msg["worker"], msg["req"]
        rid = r["id"].split("@")[0]
        self.load[worker].pop(rid, None)
        self.records[rid].on_handed_off(worker, r)
        self._dispatch_decode(rid, r["output_ids"][0])

    def _on_failed(self, msg: dict) -> None:
        worker, r = msg["worker"], msg["req"]
        rid = r["id"].split("@")[0]
        self.load[worker].pop(rid, None)
        self._restart(rid, f"worker {worker} ({self.roles[worker].value}): {r['error']}")

    def _on_lost(self, msg: dict) -> None:
        worker = msg["worker"]
        self.live.discard(worker)
        for rid in list(self.load.pop(worker, {})):
            self._restart(rid, f"worker {worker} died (exit code {msg.get('exitcode')})")

    def _restart(self, rid: str, reason: str) -> None:
        record = self.records[rid]
        record.restart(reason)
        if record.attempts >= MAX_ATTEMPTS:
            record.lost = True
            self._done(record)
            return
        self._dispatch_prefill(self.by_id[rid])

    def _done(self, record: RequestRecord) -> None:
        self.unfinished.discard(record.id)
        self.on_finish(record)
