"""AsyncSaver: saves off the engine's critical path, with no copy on the engine thread.

``wait_for_save`` queues a request's newly computed blocks; a thread gathers them straight from the paged
cache into the store's memory and commits them (:meth:`BlockIO.save`: one copy, one commit round trip), over
a connection of its own. The blocks must not change meanwhile, and vLLM's own block references keep them:

- while the request runs, its blocks are its own;
- when it finishes, ``request_finished`` returns True while it has saves queued, so vLLM keeps its blocks
  until a worker names it in ``finished_sending`` (:meth:`finished`: its saves landed or were dropped);
- when it is preempted, its blocks go back to vLLM's pool: ``handle_preemptions`` (before they can be
  reused) waits for its saves (:meth:`wait_for`).

At most ``max_bytes`` wait at a time: beyond that a save is dropped and counted rather than holding more of
vLLM's blocks. A failed save is dropped and counted: a store fault never fails a request.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence

from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.block_io import BlockIO
from kvstore.integrations.vllm.store_link import CONNECTION_ERRORS, StoreLink, StoreUnavailable, log


class AsyncSaver:
    def __init__(self, io: BlockIO, link: StoreLink, count: Callable[..., None], *, ttl: float | None,
                 max_bytes: int = 256 << 20, on_saved: Callable[[list[str]], None] | None = None):
        self.io, self.link, self._count, self.ttl, self.max_bytes = io, link, count, ttl, max_bytes
        self._on_saved = on_saved  # called with the keys of every save that landed (KV events)
        self._queue: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._pending: dict[str, int] = {}  # request id -> queued jobs
        self._idle = threading.Condition()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="kvstore-vllm-saver", daemon=True)
        self._thread.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (s := ref()) is not None and s.drain(10.0))

    def submit(self, req_id: str, items: Sequence[tuple[str, int]], *, pin: bool = False,
               ttl: float | None = None) -> None:
        nbytes = len(items) * self.io.layout.block_nbytes
        with self._idle:
            if self._pending_bytes + nbytes > self.max_bytes:
                self._count(dropped_saves=len(items))
                return
            self._pending_bytes += nbytes
            self._pending[req_id] = self._pending.get(req_id, 0) + 1
        self._count(req_id=req_id, save_pending_bytes=nbytes)
        self._queue.put((req_id, list(items), nbytes, pin, self.ttl if ttl is None else ttl))

    def busy(self, req_id: str) -> bool:
        with self._idle:
            return req_id in self._pending

    def finished(self, req_ids: Iterable[str]) -> set[str]:
        """Those of ``req_ids`` with no save queued or in flight."""
        with self._idle:
            return {r for r in req_ids if r not in self._pending}

    def wait_for(self, req_ids: Iterable[str], timeout: float) -> bool:
        """Block until none of ``req_ids`` has a save queued or in flight; False after ``timeout`` seconds."""
        wanted = set(req_ids)
        deadline = time.monotonic() + timeout
        with self._idle:
            while wanted & self._pending.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def drain(self, timeout: float) -> bool:
        """Wait until every queued save is written (or dropped); False if ``timeout`` seconds passed first."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            req_id, items, nbytes, pin, ttl = job
            outcome: dict[str, float] = {"dropped_saves": len(items)}
            try:
                outcome = self._write(items, pin, ttl)
                if outcome.get("saved_blocks") and self._on_saved is not None:
                    self._on_saved([key for key, _ in items])
            finally:
                # one count: a reader never sees a save both pending and landed (or neither)
                self._count(req_id=req_id, save_pending_bytes=-nbytes, **outcome)
                with self._idle:
                    self._pending_bytes -= nbytes
                    left = self._pending.pop(req_id) - 1
                    if left:
                        self._pending[req_id] = left
                    self._idle.notify_all()

    def _write(self, items: list[tuple[str, int]], pin: bool, ttl: float | None) -> dict[str, float]:
        """Write the blocks; returns the counters' deltas (saved, or dropped and why)."""
        dropped: dict[str, float] = {"dropped_saves": len(items)}
        try:
            store = self.link.client()
        except StoreUnavailable:
            return dropped
        start = time.perf_counter()
        try:
            nbytes = self.io.save(store, items, ttl, pin=pin)
        except CONNECTION_ERRORS as exc:
            self.link.fault(exc)
            return {**dropped, "store_faults": 1}
        except KVStoreError as exc:
            if not self._warned:
                self._warned = True
                log.warning("kvstore saver: dropping saves (%s: %s); further drops are only counted",
                            type(exc).__name__, exc)
            return dropped
        except Exception as exc:  # noqa: BLE001 - the thread must survive to report every request
            log.warning("kvstore saver: save failed (%s: %s); dropped", type(exc).__name__, exc)
            return dropped
        return {"saved_blocks": len(items), "save_bytes": nbytes, "save_seconds": time.perf_counter() - start}

    def close(self, timeout: float) -> None:
        self.drain(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
        self.link.close()
