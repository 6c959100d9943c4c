"""ArenaWriter: a same-host (shm) client's arenas — segment space the daemon granted it, allocated here.

A put takes a slot from an arena (no round trip), copies its bytes into the mapped segment (hashing them in
the same pass) and sends one ``arena_commit``: one copy, one round trip. A slot that is committed stays
consumed (its space is the object's now, freed by the daemon when the object goes); a slot whose put failed
or was aborted goes back to the local allocator. When no arena has room, one more is asked for (``arena``),
retiring in the same message the arenas no uncommitted slot uses any more. The arenas are released at close;
if this process stops heart-beating while it lives, the daemon quarantines them (see kvstore.core.arena).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvstore.client.rpc import Connection
from kvstore.core.allocator import Allocator
from kvstore.core.meta import ObjectMeta
from kvstore.errors import InvalidArgumentError, KVStoreError, StoreConnectionError, StoreFullError
from kvstore.protocol import wire
from kvstore.transports.base import PayloadDigest, Regions

#: the most objects one arena_commit carries (the schema's bound on a commit's entries)
MAX_ENTRIES = 4096


@dataclass(slots=True, eq=False)
class _Arena:
    id: int
    segment: int
    base: int
    local: Allocator  # offsets relative to ``base``
    open: int = 0  # slots taken and not yet committed or returned


@dataclass(frozen=True, slots=True)
class Slot:
    arena: _Arena
    offset: int  # in the segment
    nbytes: int


class ArenaWriter:
    """The arenas of one connection. ``size``: bytes of one arena (the daemon's ``--arena-size``). Thread-safe."""

    def __init__(self, conn: Connection, regions: Regions, size: int):
        self._conn, self._regions, self.size = conn, regions, size
        self._arenas: list[_Arena] = []
        self._lock = threading.Lock()

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.size

    @property
    def ids(self) -> list[int]:
        with self._lock:
            return [a.id for a in self._arenas]

    # ---- slots --------------------------------------------------------------------------------------
    def take(self, nbytes: int) -> Slot | None:
        """A slot of ``nbytes``; asks the daemon for an arena when none has room. None when the daemon grants
        none now (its quota or space): the caller takes the region path, which reports why."""
        with self._lock:
            for arena in reversed(self._arenas):  # the newest has the most room
                offset = arena.local.allocate(nbytes)
                if offset is not None:
                    arena.open += 1
                    return Slot(arena, arena.base + offset, nbytes)
            retire = [a for a in self._arenas if a.open == 0]
            try:
                reply = self._conn.call({"op": "arena", "size": self.size, "need": nbytes,
                                         "retire": [a.id for a in retire]})
            except StoreFullError:  # QuotaExceededError included: the retired ones are gone all the same
                self._arenas = [a for a in self._arenas if a not in retire]
                return None
            self._arenas = [a for a in self._arenas if a not in retire]
            arena = _Arena(reply["arena"], reply["segment"], reply["offset"], Allocator(reply["size"],
                                                                                       reply["alignment"]))
            self._arenas.append(arena)
            offset = arena.local.allocate(nbytes)
            if offset is None:
                return None
            arena.open += 1
            return Slot(arena, arena.base + offset, nbytes)

    def view(self, slot: Slot) -> memoryview:
        return self._regions.region(slot.arena.segment, slot.offset, slot.nbytes)

    def write(self, slot: Slot, digest: PayloadDigest) -> None:
        """Copy the payload into the slot, hashing each piece while it is in cache."""
        dst = self.view(slot)
        try:
            digest.copy_into(dst)
        finally:
            dst.release()

    def returned(self, slot: Slot) -> None:
        """The slot's put failed or was aborted: its space is this client's to use again."""
        with self._lock:
            if slot.arena in self._arenas:  # else its arena went with a lost connection
                slot.arena.local.free(slot.offset - slot.arena.base)
                slot.arena.open -= 1

    # ---- commits ------------------------------------------------------------------------------------
    @staticmethod
    def entry(slot: Slot, meta: ObjectMeta, checksum: int | None) -> dict[str, Any]:
        return {"arena": slot.arena.id, "offset": slot.offset, "meta": meta.to_wire(), "checksum": checksum}

    def commit(self, entries: list[dict[str, Any]], slots: Sequence[Slot], *, if_absent: bool = False,
               pin: bool = False, ephemeral: bool = False, give_back: bool = True) -> dict[str, Any]:
        """One ``arena_commit`` of ``entries`` (arena entries for ``slots``, and pending region puts). On a refusal
        the slots go back to the local allocator (unless ``give_back`` is False: the caller's abort does it)."""
        try:
            reply = self._conn.call({"op": "arena_commit", "entries": entries, "if_absent": if_absent, "pin": pin,
                                     "ephemeral": ephemeral})
        except StoreConnectionError:
            self.forget()
            raise
        except KVStoreError:
            if give_back:
                for slot in slots:
                    self.returned(slot)
            raise
        with self._lock:
            for slot in slots:
                slot.arena.open -= 1
        return reply

    def retire_idle(self) -> bool:
        """Give back every arena no slot is open in (a put outside the arenas was refused for this client's quota,
        which counts its arenas); True if any went. The daemon frees their space at once."""
        with self._lock:
            idle = [a for a in self._arenas if a.open == 0]
            self._arenas = [a for a in self._arenas if a.open != 0]
        if not idle or self._conn.closed:
            return False
        self._conn.call({"op": "arena_release", "arenas": [a.id for a in idle]})
        return True

    # ---- closing ------------------------------------------------------------------------------------
    def release(self) -> None:
        """Give every arena back (at close: nothing of this client writes into them any more)."""
        ids = self.ids
        self.forget()
        if ids and not self._conn.closed:
            try:
                self._conn.call({"op": "arena_release", "arenas": ids})
            except KVStoreError:
                pass  # the connection is going: the daemon frees them when it drops

    def forget(self) -> None:
        with self._lock:
            self._arenas = []


def commit_fits(metas: Sequence[ObjectMeta], max_frame: int = wire.MAX_FRAME) -> bool:
    """Whether one arena_commit of these objects stays within the daemon's bounds on a request (past them the
    daemon closes the connection): at most MAX_ENTRIES objects, not too much nested user metadata, and a frame
    within ``max_frame``, the daemon's (4096 entries of 100-character keys are more than wire.MAX_FRAME)."""
    if len(metas) > MAX_ENTRIES:
        return False
    if sum(_entry_bytes(m) for m in metas) > max_frame - 4096:
        return False
    return len(metas) * 6 < wire.COMMIT_CONTAINERS or \
        sum(4 + _containers(m.user) for m in metas) <= wire.COMMIT_CONTAINERS


def _entry_bytes(meta: ObjectMeta) -> int:
    """An upper bound on one entry's encoded size: its fixed fields (about 175 bytes measured) and its strings."""
    size = 224 + len(meta.key.encode()) + len(meta.producer.encode()) + len((meta.dtype or "").encode())
    size += 9 * len(meta.shape or ())
    return size + (len(msgpack.packb(meta.user, use_bin_type=True)) if meta.user else 0)


def check_commit_size(metas: Sequence[ObjectMeta], max_frame: int = wire.MAX_FRAME) -> None:
    """InvalidArgumentError, before anything is sent, unless ``commit_fits(metas, max_frame)``."""
    if not commit_fits(metas, max_frame):
        raise InvalidArgumentError(f"a commit of {len(metas)} objects written in place is more (objects, or maps "
                                   f"and arrays of their metadata) than one request may carry; commit fewer at once")


def _containers(value: object) -> int:
    if isinstance(value, dict):
        return 1 + sum(_containers(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return 1 + sum(_containers(v) for v in value)
    return 0
