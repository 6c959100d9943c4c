"""Lookups: the scheduler's existence checks, off the scheduler thread.

``get_num_new_matched_tokens`` submits a request's keys and waits for the answer at most ``lookup_wait_s``
(a healthy daemon answers within it); past that it tells vLLM "not yet" (None) and reads the answer on a later
step. One thread sends every lookup queued meanwhile as one ``batch_exists`` (one round trip for the step),
over a connection of its own, so a slow or dead daemon costs the scheduler at most ``lookup_wait_s`` a step.
Counting is left to the scheduler thread (it reads :attr:`Lookup.error`).
"""

from __future__ import annotations

import threading
import time

from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.store_link import CONNECTION_ERRORS, StoreLink, StoreUnavailable, log

MAX_KEYS = 4096  # the daemon's limit on one batch_exists


class Lookup:
    """One request's question: which of ``keys`` are in the store."""

    __slots__ = ("keys", "local_blocks", "asked_at", "present", "error", "done")

    def __init__(self, keys: list[str], local_blocks: int):
        self.keys = keys
        self.local_blocks = local_blocks
        self.asked_at = time.monotonic()
        self.present: list[bool] | None = None
        self.error: str | None = None   # "unavailable", "fault" or "error": the answer is a miss
        self.done = threading.Event()


class Lookups:
    def __init__(self, link: StoreLink):
        self.link = link
        self._cv = threading.Condition()
        self._queue: list[Lookup] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, keys: list[str], local_blocks: int) -> Lookup:
        lookup = Lookup(keys, local_blocks)
        with self._cv:
            if self._thread is None:  # no thread at import or construction: only once vLLM asks
                self._thread = threading.Thread(target=self._run, name="kvstore-vllm-lookup", daemon=True)
                self._thread.start()
            self._queue.append(lookup)
            self._cv.notify()
        return lookup

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                batch, self._queue = self._queue, []
            self._answer(batch)

    def _answer(self, batch: list[Lookup]) -> None:
        keys = [k for lookup in batch for k in lookup.keys]
        present: list[bool] = []
        error = None
        try:
            store = self.link.client()
            for start in range(0, len(keys), MAX_KEYS):
                present += store.batch_exists(keys[start:start + MAX_KEYS])
        except StoreUnavailable:
            error = "unavailable"
        except CONNECTION_ERRORS as exc:
            self.link.fault(exc)
            error = "fault"
        except KVStoreError as exc:
            log.warning("kvstore scheduler: lookup failed (%s: %s); treating as a miss", type(exc).__name__, exc)
            error = "error"
        at = 0
        for lookup in batch:
            if error is None:
                lookup.present = present[at:at + len(lookup.keys)]
                at += len(lookup.keys)
            lookup.error = error
            lookup.done.set()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(5.0)
