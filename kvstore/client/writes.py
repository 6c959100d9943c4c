"""The write path of a daemon client: how one connection stores objects, chosen once when it connects.

Every put follows one sequence, written here once: **reserve** the object's region (the daemon allocates it),
**move** the bytes into it (the transport's only job), then **commit** it — or leave it pending for a batch's
single ``commit_many``, or **abort** it when the bytes did not move (nothing half-written becomes visible).
On the stream path the bytes travel with the reserving request and the daemon commits in the same round trip.

Writes in place (``KVStore.reserve`` / ``reservation``) hand the caller a view to fill before the commit; where
that view lives is the connection's write strategy (:class:`WriteStrategy`), one of three:

* :class:`ArenaWrites` (same host, the daemon grants arenas): a slot of this client's arena, no round trip
  until the commit; objects no arena takes fall back to the region strategy.
* :class:`RegionWrites` (same host): a pending put in the daemon's mapped memory, one round trip to reserve.
* :class:`StagedWrites` (tcp, ucx: the daemon's memory cannot be mapped): a client staging buffer sent at commit.

Each hands out a typed handle (:data:`Reserved`) and takes it back at commit or abort.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvstore.client.arena import ArenaWriter, Slot, check_commit_size, commit_fits
from kvstore.client.compression import WirePolicy
from kvstore.client.rpc import Connection, Message
from kvstore.client.staging import Staged, StagingPool, send_staged, stage, unstage
from kvstore.client.store import PutFlags
from kvstore.core.digest import Digest
from kvstore.core.meta import ObjectMeta
from kvstore.core.value import Payload
from kvstore.errors import KVStoreError, ObjectTooLargeError, QuotaExceededError, TransportError
from kvstore.memory.device import DeviceBuffer
from kvstore.transports.base import DevicePath, PayloadDigest, Regions, Transport, TransportFailure

#: objects up to this size travel inline on the control connection (one round trip) whatever the data path
INLINE_MAX = 64 << 10

T = TypeVar("T")
Items = Sequence[tuple[ObjectMeta, Payload]]


@dataclass(frozen=True, slots=True)
class ArenaReserved:
    """An object reserved in a slot of one of this connection's arenas."""

    slot: Slot
    flags: PutFlags


@dataclass(frozen=True, slots=True)
class RegionReserved:
    """An object reserved as a pending put in the daemon's memory."""

    put_id: int


#: what a write strategy's ``reserve`` hands out (``Staged``: a client staging buffer, kvstore.client.staging)
Reserved = ArenaReserved | RegionReserved | Staged


class WriteStrategy(Protocol):
    """How one connection writes: whole values, and objects written in place then committed together."""

    def put(self, meta: ObjectMeta, payload: Payload, digest: PayloadDigest, flags: PutFlags) -> ObjectMeta:
        """Store one value; ``digest()`` is recorded as its checksum."""
        ...

    def put_many(self, items: Items, digests: Sequence[PayloadDigest], flags: PutFlags) -> list[ObjectMeta]:
        """Store every value, all or nothing (visible together, in order)."""
        ...

    def reserve(self, meta: ObjectMeta, flags: PutFlags) -> tuple[Reserved, memoryview]:
        """Reserve ``meta.size`` bytes; (handle, writable view)."""
        ...

    def commit(self, handles: list[Reserved], metas: list[ObjectMeta], checksums: list[int | None]
               ) -> list[ObjectMeta]:
        """Make the reserved objects visible at once with these checksums."""
        ...

    def abort(self, handles: list[Reserved], quiet: bool) -> None:
        """Free the reserved objects (``quiet``: an abort the daemon refuses is not reported)."""
        ...


def _committed(metas: Sequence[ObjectMeta], checksums: Sequence[int | None], reply: Message) -> list[ObjectMeta]:
    return [meta.with_commit(c, v, t)
            for meta, c, v, t in zip(metas, checksums, reply["versions"], reply["created"], strict=True)]


class TransportPuts:
    """Whole values through the connection's transport: the one put sequence, for host and device payloads.

    ``relieve``: called when the daemon refuses a put for this client's quota; True if it freed something (idle
    arenas) worth one more try."""

    def __init__(self, conn: Connection, data: Transport, inline: Transport, *, capacity: int, wire: WirePolicy,
                 device: Callable[[], DevicePath], relieve: Callable[[], bool] | None = None):
        self._conn, self._data, self._inline = conn, data, inline
        self.capacity, self._wire, self._device, self._relieve = capacity, wire, device, relieve

    @property
    def max_frame(self) -> int:
        """The daemon's frame limit (its hello says): a commit larger than that is refused unsent."""
        return self._conn.max_frame

    def check_size(self, meta: ObjectMeta) -> None:
        if meta.size > self.capacity:
            raise ObjectTooLargeError(f"value of {meta.size} bytes exceeds the store's capacity of {self.capacity}")

    def quota_retry(self, send: Callable[[], T]) -> T:
        """``send()``; if the daemon refuses it for this client's quota, which counts the client's idle arenas too,
        give those back and send it once more (the refused request stored nothing)."""
        try:
            return send()
        except QuotaExceededError:
            if self._relieve is None or not self._relieve():
                raise
        return send()

    def put(self, meta: ObjectMeta, payload: Payload, digest: PayloadDigest, flags: PutFlags) -> ObjectMeta:
        reply = self.send(meta, payload, digest, flags, defer=False)
        return meta.with_commit(digest(), reply["version"], reply["created"])

    def put_many(self, items: Items, digests: Sequence[PayloadDigest], flags: PutFlags) -> list[ObjectMeta]:
        """Every value sent as a pending put, then one ``commit_many``; on any failure every pending one is
        aborted."""
        pending: list[Message] = []
        try:
            for (meta, payload), digest in zip(items, digests, strict=True):
                pending.append(self.send(meta, payload, digest, flags, defer=True))
            reply = self._conn.call({"op": "commit_many", "put_ids": [p["put_id"] for p in pending],
                                     "checksums": [p.get("checksum") for p in pending]})
        except BaseException:
            if not self._conn.closed:
                for p in pending:
                    try:
                        self._conn.call({"op": "abort", "put_id": p["put_id"]})
                    except Exception:
                        pass  # already aborted by a failed commit_many, or the connection is gone
            raise
        return _committed([meta for meta, _ in items], [d() for d in digests], reply)

    def send(self, meta: ObjectMeta, payload: Payload, digest: PayloadDigest, flags: PutFlags, *,
             defer: bool) -> Message:
        """One put: the committed reply (``version``, ``created``), or with ``defer`` the pending put
        (``put_id``, ``checksum``) for the caller to commit with others."""
        self.check_size(meta)
        request = {"op": "put", "key": meta.key, "size": meta.size, "meta": meta.to_wire(),
                   "if_absent": flags.if_absent, "pin": flags.pin, "ephemeral": flags.ephemeral, "defer": defer}
        src = payload.view
        try:
            if isinstance(src, DeviceBuffer):  # routed here by device_memory().put_many
                path = self._device()
                return self._sequence(request, lambda r: path.reserve_device(self._conn, r),
                                      lambda reply: path.write_device(self._conn, reply, src), digest)
            data = self._inline if meta.size <= INLINE_MAX else self._data
            codec = self._wire.choose() if data is self._data and data.on_connection else None
            if codec is not None:
                request["compress"] = codec
            started = time.perf_counter()
            reply = self._sequence(request, lambda r: data.reserve(self._conn, r, src, digest),
                                   lambda reply: data.write(self._conn, reply, src, digest), digest)
            if data is self._data and data.on_connection:
                self._wire.observe(meta.size, time.perf_counter() - started, codec, src)
            return reply
        except TransportFailure as exc:
            raise TransportError(f"put of {meta.key!r} failed on the {self._data.name} path: {exc}") from None

    def _sequence(self, request: Message, reserve: Callable[[Message], Message], write: Callable[[Message], None],
                  digest: PayloadDigest) -> Message:
        """Reserve, move the bytes, then commit, leave pending (``request["defer"]``) or abort."""
        reply = self.quota_retry(lambda: reserve(request))
        if "version" in reply:  # the bytes went with the request and the daemon committed them (stream path)
            return reply
        try:
            write(reply)
        except BaseException:
            self._conn.call({"op": "abort", "put_id": reply["put_id"]})
            raise
        if request["defer"]:  # the caller commits a whole batch at once
            return {"put_id": reply["put_id"], "checksum": digest()}
        return self._conn.call({"op": "commit", "put_id": reply["put_id"], "checksum": digest()})


class StagedWrites:
    """Writes in place where the daemon's memory cannot be mapped: a client staging buffer, sent at commit."""

    def __init__(self, puts: TransportPuts, pool: StagingPool):
        self._puts, self._pool = puts, pool

    def put(self, meta: ObjectMeta, payload: Payload, digest: PayloadDigest, flags: PutFlags) -> ObjectMeta:
        return self._puts.put(meta, payload, digest, flags)

    def put_many(self, items: Items, digests: Sequence[PayloadDigest], flags: PutFlags) -> list[ObjectMeta]:
        return self._puts.put_many(items, digests, flags)

    def reserve(self, meta: ObjectMeta, flags: PutFlags) -> tuple[Reserved, memoryview]:
        self._puts.check_size(meta)  # first: a staging buffer of any size is not even tried
        return stage(self._pool, meta, flags)

    def commit(self, handles: list[Reserved], metas: list[ObjectMeta], checksums: list[int | None]
               ) -> list[ObjectMeta]:
        staged = _only(Staged, handles)
        try:
            return send_staged(staged, checksums, self._send, self._pool)
        finally:
            handles.clear()  # sent or failed, the buffers went back to the pool (those nothing else holds)

    def _send(self, items: list[tuple[ObjectMeta, Payload]], digests: list[Digest], *, flags: PutFlags
              ) -> list[ObjectMeta]:
        return self._puts.put_many(items, digests, flags)

    def abort(self, handles: list[Reserved], quiet: bool) -> None:
        unstage(_only(Staged, handles), self._pool)
        handles.clear()


class RegionWrites:
    """Writes in place on a same-host daemon: a pending put in its mapped memory (one round trip to reserve)."""

    def __init__(self, puts: TransportPuts, conn: Connection, regions: Regions):
        self._puts, self._conn, self._regions = puts, conn, regions

    def put(self, meta: ObjectMeta, payload: Payload, digest: PayloadDigest, flags: PutFlags) -> ObjectMeta:
        return self._puts.put(meta, payload, digest, flags)

    def put_many(self, items: Items, digests: Sequence[PayloadDigest], flags: PutFlags) -> list[ObjectMeta]:
        return self._puts.put_many(items, digests, flags)

    def reserve(self, meta: ObjectMeta, flags: PutFlags) -> tuple[Reserved, memoryview]:
        self._puts.check_size(meta)
        reply = self._puts.quota_retry(lambda: self._conn.call(
            {"op": "put", "key": meta.key, "size": meta.size, "meta": meta.to_wire(), "if_absent": flags.if_absent,
             "pin": flags.pin, "ephemeral": flags.ephemeral, "defer": True, "mode": "region"}))
        handle = RegionReserved(reply["put_id"])
        try:
            view = self._regions.region(reply["segment"], reply["offset"], meta.size)
        except BaseException:
            self.abort([handle], quiet=True)
            raise
        return handle, view

    def commit(self, handles: list[Reserved], metas: list[ObjectMeta], checksums: list[int | None]
               ) -> list[ObjectMeta]:
        reply = self._conn.call({"op": "commit_many", "put_ids": [h.put_id for h in _only(RegionReserved, handles)],
                                 "checksums": list(checksums)})
        return _committed(metas, checksums, reply)

    def abort(self, handles: list[Reserved], quiet: bool) -> None:
        if self._conn.closed:
            return  # the daemon revoked them when the connection dropped
        for h in _only(RegionReserved, handles):
            try:
                self._conn.call({"op": "abort", "put_id": h.put_id})
            except KVStoreError:
                if not quiet:
                    raise


class ArenaWrites:
    """Same host, with arenas: a put takes a slot of this client's arena (no round trip), copies into it and
    sends one ``arena_commit``. Whatever no arena takes (too big, no slot to be had, device memory) takes the
    region strategy."""

    def __init__(self, arenas: ArenaWriter, region: RegionWrites, puts: TransportPuts):
        self._arenas, self._region, self._puts = arenas, region, puts

    def _fits(self, meta: ObjectMeta, payload: Payload | None = None) -> bool:
        return self._arenas.fits(meta.size) and (payload is None or not isinstance(payload.view, DeviceBuffer))

    def put(self, meta: ObjectMeta, payload: Payload, digest: PayloadDigest, flags: PutFlags) -> ObjectMeta:
        if self._fits(meta, payload):
            slot = self._arenas.take(meta.size)
            if slot is not None:
                try:
                    self._arenas.write(slot, digest)
                except BaseException:
                    self._arenas.returned(slot)
                    raise
                reply = self._arenas.commit([self._arenas.entry(slot, meta, digest())], [slot], **_flags(flags))
                return meta.with_commit(digest(), reply["versions"][0], reply["created"][0])
        return self._region.put(meta, payload, digest, flags)

    def put_many(self, items: Items, digests: Sequence[PayloadDigest], flags: PutFlags) -> list[ObjectMeta]:
        if all(self._fits(m, p) for m, p in items) and commit_fits([m for m, _ in items], self._puts.max_frame):
            done = self._put_many_arena(items, digests, flags)
            if done is not None:
                return done
        return self._region.put_many(items, digests, flags)

    def _put_many_arena(self, items: Items, digests: Sequence[PayloadDigest], flags: PutFlags
                        ) -> list[ObjectMeta] | None:
        """Every object copied into a slot, then one commit. None if a slot is not to be had."""
        slots: list[Slot] = []
        try:
            for (meta, _), digest in zip(items, digests, strict=True):
                slot = self._arenas.take(meta.size)
                if slot is None:
                    for s in slots:
                        self._arenas.returned(s)
                    return None
                slots.append(slot)
                self._arenas.write(slot, digest)
        except BaseException:
            for s in slots:
                self._arenas.returned(s)
            raise
        sums = [d() for d in digests]
        entries = [self._arenas.entry(slot, meta, c) for slot, (meta, _), c in zip(slots, items, sums, strict=True)]
        reply = self._arenas.commit(entries, slots, **_flags(flags))
        return _committed([meta for meta, _ in items], sums, reply)

    def reserve(self, meta: ObjectMeta, flags: PutFlags) -> tuple[Reserved, memoryview]:
        self._puts.check_size(meta)  # first: an arena of any size is not even tried
        if self._fits(meta):  # no round trip: the commit is the only one
            slot = self._arenas.take(meta.size)
            if slot is not None:
                try:
                    return ArenaReserved(slot, flags), self._arenas.view(slot)
                except BaseException:
                    self._arenas.returned(slot)
                    raise
        return self._region.reserve(meta, flags)

    def commit(self, handles: list[Reserved], metas: list[ObjectMeta], checksums: list[int | None]
               ) -> list[ObjectMeta]:
        arena = [h for h in handles if isinstance(h, ArenaReserved)]
        if not arena:
            return self._region.commit(handles, metas, checksums)
        check_commit_size(metas, self._puts.max_frame)
        entries = [self._arenas.entry(h.slot, meta, c) if isinstance(h, ArenaReserved) else _pending(h, c)
                   for h, meta, c in zip(handles, metas, checksums, strict=True)]
        reply = self._arenas.commit(entries, [h.slot for h in arena], **_flags(arena[0].flags), give_back=False)
        return _committed(metas, checksums, reply)

    def abort(self, handles: list[Reserved], quiet: bool) -> None:
        for h in handles:
            if isinstance(h, ArenaReserved):
                self._arenas.returned(h.slot)
        self._region.abort([h for h in handles if not isinstance(h, ArenaReserved)], quiet)


def choose(puts: TransportPuts, conn: Connection, regions: Regions | None, arenas: ArenaWriter | None,
           pool: Callable[[], StagingPool]) -> WriteStrategy:
    """The write strategy of a connection: arenas when the daemon grants them, regions where its memory is
    mapped here, staging buffers otherwise."""
    if regions is None:
        return StagedWrites(puts, pool())
    region = RegionWrites(puts, conn, regions)
    return region if arenas is None else ArenaWrites(arenas, region, puts)


H = TypeVar("H", ArenaReserved, RegionReserved, Staged)


def _only(kind: type[H], handles: Sequence[Reserved]) -> list[H]:
    """``handles`` as this strategy's own kind (TypeError for another strategy's: a bug, not bad input)."""
    out: list[H] = []
    for h in handles:
        if not isinstance(h, kind):
            raise TypeError(f"a {type(h).__name__} handle given to the {kind.__name__} write strategy")
        out.append(h)
    return out


def _pending(handle: Reserved, checksum: int | None) -> Message:
    """An arena_commit entry for a pending region put."""
    return {"put_id": _only(RegionReserved, [handle])[0].put_id, "checksum": checksum}


def _flags(flags: PutFlags) -> dict[str, bool]:
    return {"if_absent": flags.if_absent, "pin": flags.pin, "ephemeral": flags.ephemeral}
