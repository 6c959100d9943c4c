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
from typing import TYPE_CHECKING, Protocol

from kvstore.core.digest import Digest
from kvstore.core.meta import ObjectMeta
from kvstore.core.value import Payload

if TYPE_CHECKING:
    from kvstore.client.store import PutFlags

#: bytes of idle staging buffers kept per store (beyond this, released buffers go back to the allocator)
POOL_BYTES = 256 << 20
#: buffers smaller than this are not pooled (a fresh one is cheap)
POOL_MIN = 64 << 10


@dataclass(slots=True)
class Staged:
    """A reservation's staging buffer on a path that sends the bytes at commit."""

    meta: ObjectMeta
    buffer: bytearray
    flags: PutFlags


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


class PutMany(Protocol):
    """A store's ``_put_many``: every item written, then committed at once (all or nothing)."""

    def __call__(self, items: list[tuple[ObjectMeta, Payload]], digests: list[Digest], *,
                 flags: PutFlags) -> list[ObjectMeta]: ...


def stage(pool: StagingPool, meta: ObjectMeta, flags: PutFlags) -> tuple[Staged, memoryview]:
    """Reserve ``meta.size`` bytes as a staging buffer; (handle, writable view)."""
    staged = Staged(meta, pool.take(meta.size), flags)
    return staged, memoryview(staged.buffer)  # the caller's view is released before commit


def send_staged(handles: list[Staged], checksums: list[int | None], put_many: PutMany,
                pool: StagingPool | None) -> list[ObjectMeta]:
    """Store the staged objects with ``put_many`` (all or nothing); the buffers go back to ``pool`` either way,
    and ``handles`` is emptied. A None checksum is computed by the path that sends the bytes (a daemon hashes a
    stream as it lands)."""
    items = [(h.meta, Payload(memoryview(h.buffer), h.meta.kind, h.meta.dtype, h.meta.shape)) for h in handles]
    digests = [Digest(item[1].view, known=c) for item, c in zip(items, checksums, strict=True)]
    try:
        return put_many(items, digests, flags=handles[0].flags)
    finally:
        reusable = []
        for h, (_, payload) in zip(handles, items, strict=True):
            try:
                payload.view.release()
                reusable.append(h)
            except BufferError:  # something still holds the bytes: let that buffer go with it
                pass
        handles[:] = reusable
        unstage(handles, pool)  # sent (or failed): the buffers go back to the pool


def unstage(handles: list[Staged], pool: StagingPool | None) -> None:
    """Give the staged buffers back to ``pool`` (nothing was sent); ``handles`` is emptied."""
    for h in handles:
        if pool is not None:
            pool.give(h.buffer)
    handles.clear()
