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
from collections.abc import Callable, Sequence

from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.block_io import BlockIO, LoadResult
from kvstore.integrations.vllm.store_link import CONNECTION_ERRORS, StoreLink, StoreUnavailable, log


class AsyncLoader:
    def __init__(self, io: BlockIO, link: StoreLink, *, unpin: bool = False,
                 count: Callable[..., None] | None = None):
        self.io, self.link = io, link
        self.unpin, self._count = unpin, count
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
            if self.unpin and result.loaded:  # after the report: the request does not wait for it
                failed = set(result.failed_blocks)
                self._unpin(req_id, [key for key, block in items if block not in failed])

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

    def _unpin(self, req_id: str, keys: list[str]) -> None:
        """The decode side consumed these hand-off blocks: unpin them (ordinary cache entries again, their TTL
        still running). Best effort: a failure leaves them pinned until the TTL."""
        try:
            n = unpin_loaded(self.link, keys)
        except Exception as exc:  # noqa: BLE001 - the loader thread must survive
            log.info("kvstore loader: hand-off blocks of request %s stay pinned until their TTL (%s: %s)", req_id,
                     type(exc).__name__, exc)
            return
        if self._count is not None and n:
            self._count(unpinned_blocks=n)

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        self.link.close()


def unpin_loaded(link: StoreLink, keys: list[str]) -> int:
    """Unpin ``keys`` (one round trip); how many were pinned. A store fault is recorded on the link and
    reported as 0 (the blocks stay pinned until their TTL)."""
    if not keys:
        return 0
    try:
        return link.client().unpin(keys)
    except StoreUnavailable:
        return 0
    except CONNECTION_ERRORS as exc:
        link.fault(exc)
        return 0
    except KVStoreError as exc:
        log.info("kvstore: hand-off blocks stay pinned until their TTL (%s: %s)", type(exc).__name__, exc)
        return 0
