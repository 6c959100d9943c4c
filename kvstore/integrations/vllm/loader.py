"""AsyncLoader: store hits loaded on a worker thread while the engine keeps running the batch.

``start_load_kv`` queues a request's blocks; the thread scatters them straight into the paged cache (leased
views of the store's memory, or the shared-memory index: :class:`~.block_io.BlockIO`) over a connection of
its own, and :meth:`take` hands the finished ones to ``get_finished``, which reports them to vLLM (and their
failed blocks through ``get_block_ids_with_load_errors`` in the same step, as vLLM requires). vLLM keeps the
request in WAITING_FOR_REMOTE_KVS meanwhile: its blocks are allocated to it and to nothing else, so the
thread writes them while the forward pass reads other blocks. Every queued request is reported exactly once,
failed or not (vLLM frees an aborted request's blocks only then).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from kvstore.integrations.vllm.block_io import BlockIO, LoadResult
from kvstore.integrations.vllm.store_link import StoreLink, StoreUnavailable, log


class AsyncLoader:
    def __init__(self, io: BlockIO, link: StoreLink):
        self.io, self.link = io, link
        self._queue: queue.Queue = queue.Queue()
        self._done: list[tuple[str, LoadResult]] = []
        self._lock = threading.Lock()
        self._in_flight = 0
        self._thread = threading.Thread(target=self._run, name="kvstore-vllm-loader", daemon=True)
        self._thread.start()

    def submit(self, req_id: str, items: Sequence[tuple[str, int]]) -> None:
        with self._lock:
            self._in_flight += 1
        self._queue.put((req_id, list(items)))

    def take(self) -> list[tuple[str, LoadResult]]:
        """The loads finished since the last call (each request once)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            req_id, items = job
            result = self._load(req_id, items)
            with self._lock:
                self._in_flight -= 1
                self._done.append((req_id, result))

    def _load(self, req_id: str, items: list[tuple[str, int]]) -> LoadResult:
        every = tuple(b for _, b in items)
        try:
            store = self.link.client()
        except StoreUnavailable:
            return LoadResult(failed_blocks=every)
        try:
            result = self.io.load(store, items)
        except Exception as exc:  # noqa: BLE001 - a load must end in a report, or vLLM waits for it forever
            log.warning("kvstore loader: load of request %s failed (%s: %s); recomputing its blocks", req_id,
                        type(exc).__name__, exc)
            return LoadResult(failed_blocks=every)
        if result.connection_lost:
            self.link.fault(ConnectionError("connection lost during a load"))
        return result

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        self.link.close()
