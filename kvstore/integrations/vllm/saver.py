"""AsyncSaver: saves off the engine's critical path (the shared prefix cache's default).

``wait_for_save`` packs the step's blocks into a new buffer (one copy, on the engine's thread, so the cache
blocks may be reused at once) and queues it; one thread writes the queue to the store over a connection of
its own, so a slow save never holds up a load. At most ``max_bytes`` wait at a time: beyond that a save is
dropped and counted rather than stalling the engine. A prefill instance (``kv_producer``) saves
synchronously instead, so its hand-off is complete when the prompt's step ends.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.block_io import BlockIO
from kvstore.integrations.vllm.store_link import CONNECTION_ERRORS, StoreLink, StoreUnavailable, log


class AsyncSaver:
    def __init__(self, io: BlockIO, link: StoreLink, count: Callable[..., None], *, ttl: float | None,
                 max_bytes: int = 256 << 20):
        self.io, self.link, self._count, self.ttl, self.max_bytes = io, link, count, ttl, max_bytes
        self._queue: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._idle = threading.Condition()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="kvstore-vllm-saver", daemon=True)
        self._thread.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (s := ref()) is not None and s.drain(10.0))

    def submit(self, items: Sequence[tuple[str, int]]) -> None:
        nbytes = len(items) * self.io.layout.block_nbytes
        with self._idle:
            if self._pending_bytes + nbytes > self.max_bytes:
                self._count(dropped_saves=len(items))
                return
            self._pending_bytes += nbytes
        try:
            packed = self.io.pack([b for _, b in items])
        except KVStoreError:  # a device error while packing CUDA blocks: this save is dropped, the engine goes on
            with self._idle:
                self._pending_bytes -= nbytes
            self._count(dropped_saves=len(items))
            return
        except BaseException:
            with self._idle:
                self._pending_bytes -= nbytes
            raise
        self._queue.put(([k for k, _ in items], packed, nbytes))

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
            keys, packed, nbytes = job
            try:
                self._write(keys, packed)
            finally:
                with self._idle:
                    self._pending_bytes -= nbytes
                    self._idle.notify_all()

    def _write(self, keys: list[str], packed: torch.Tensor) -> None:
        try:
            store = self.link.client()
        except StoreUnavailable:
            self._count(dropped_saves=len(keys))
            return
        start = time.perf_counter()
        try:
            nbytes = self.io.put_packed(store, keys, packed, self.ttl)
        except CONNECTION_ERRORS as exc:
            self.link.fault(exc)
            self._count(dropped_saves=len(keys), store_faults=1)
            return
        except KVStoreError as exc:
            self._count(dropped_saves=len(keys))
            if not self._warned:
                self._warned = True
                log.warning("kvstore saver: dropping saves (%s: %s); further drops are only counted",
                            type(exc).__name__, exc)
            return
        self._count(saved_blocks=len(keys), save_bytes=nbytes, save_seconds=time.perf_counter() - start)

    def close(self, timeout: float) -> None:
        self.drain(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
        self.link.close()
