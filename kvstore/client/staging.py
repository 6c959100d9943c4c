"""Staging buffers for writes in place on the paths that cannot map the store's memory (tcp, ucx, a cluster).

A reservation there hands out a client-side buffer that is sent at commit. A fresh ``bytearray`` of tens of MiB
is fresh pages: the filler's first write to each page faults (about a third of memcpy speed here). The pool keeps
the buffers of committed or aborted reservations, by size, and hands them out again, so a steady stream of
hand-offs writes into warm memory. A reused buffer holds the bytes of an earlier object of this process until
the filler overwrites them (as segment memory does on the mapped paths): the contract is "fill it".
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

#: bytes of idle staging buffers kept per store (beyond this, released buffers go back to the allocator)
POOL_BYTES = 256 << 20
#: buffers smaller than this are not pooled (a fresh one is cheap)
POOL_MIN = 64 << 10


@dataclass(slots=True)
class Staged:
    """A reservation's staging buffer on a path that sends the bytes at commit."""

    meta: Any  # ObjectMeta
    buffer: bytearray
    flags: Any  # PutFlags


class StagingPool:
    """Idle staging buffers by exact size, at most ``limit`` bytes in all; safe to use from several threads."""

    def __init__(self, limit: int = POOL_BYTES):
        self.limit = limit
        self._idle: dict[int, list[bytearray]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        if size >= POOL_MIN:
            with self._lock:
                idle = self._idle.get(size)
                if idle:
                    self._bytes -= size
                    return idle.pop()
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        size = len(buffer)
        if size < POOL_MIN or size > self.limit:
            return
        with self._lock:
            while self._bytes + size > self.limit and self._idle:  # drop the largest idle buffers first
                biggest = max(self._idle)
                self._idle[biggest].pop()
                self._bytes -= biggest
                if not self._idle[biggest]:
                    del self._idle[biggest]
            self._idle.setdefault(size, []).append(buffer)
            self._bytes += size

    @property
    def idle_bytes(self) -> int:
        return self._bytes
