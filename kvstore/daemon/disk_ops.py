"""DiskOps: the session's read and metadata ops when the daemon has a disk tier (``--disk-path``; a handler
object that a :class:`~kvstore.daemon.session.Session` owns then).

Each wraps the memory-only op of :class:`~kvstore.daemon.session.Session`: a key memory does not hold is
looked up on disk. ``get`` in region mode (the shm path) and ``lease`` promote the object (its bytes must be
in segment memory to be mapped); a stream ``get`` (tcp, or shm clients reading into their own buffer)
sends the bytes read from disk and promotes on the ``promote_after``-th read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.core.tiering import decode_meta, describe_disk_object
from kvstore.errors import KeyNotFoundError, ObjectTooLargeError
from kvstore.protocol import wire
from kvstore.protocol.wire import ok_reply

if TYPE_CHECKING:
    from kvstore.daemon.context import SessionContext
    from kvstore.daemon.disk_io import DiskService
    from kvstore.daemon.session import Handler


class DiskOps:
    """Its ``handlers()`` override entries of the session's op table when a disk tier runs; ``get``, ``lease``,
    ``inspect``, ``touch`` and ``get_regions`` are the session's memory-only handlers it wraps (a subclass's
    overrides included)."""

    def __init__(self, session: SessionContext, disk: DiskService, *, get: Handler, lease: Handler,
                 inspect: Handler, touch: Handler, get_regions: Handler):
        self.s, self._disk = session, disk
        self._get, self._lease, self._inspect, self._touch = get, lease, inspect, touch
        self._get_regions = get_regions

    def handlers(self) -> dict[str, Handler]:
        return {"get": self.op_disk_get, "lease": self.op_disk_lease, "exists": self.op_disk_exists,
                "batch_exists": self.op_disk_batch_exists, "evict": self.op_disk_evict,
                "remove": self.op_disk_remove, "ls": self.op_disk_ls, "inspect": self.op_disk_inspect,
                "touch": self.op_disk_touch, "get_regions": self.op_disk_get_regions}

    async def op_disk_get_regions(self, rid: int, f: dict[str, Any]) -> dict[str, Any] | None:
        """Objects only on disk are promoted into memory first (a region must be mapped memory)."""
        disk = self._disk
        for key in f["keys"]:
            if not self.s.master.exists(key) and disk.contains(key):
                await disk.promote(key)
        return await self._get_regions(rid, f)

    async def op_disk_get(self, rid: int, f: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return await self._get(rid, f)
        except KeyNotFoundError:
            if not self._disk.contains(f["key"]):
                raise
        disk = self._disk
        if (f["mode"] != "stream" or disk.wants_promotion(f["key"])) and await disk.promote(f["key"]):
            try:
                return await self._get(rid, f)
            except KeyNotFoundError:
                pass  # evicted again at once (memory too small): serve it from disk
        if f["mode"] != "stream":
            if not disk.contains(f["key"]):  # removed while its promotion ran
                raise KeyNotFoundError(f"key {f['key']!r} not found")
            raise ObjectTooLargeError(f"key {f['key']!r} is on disk and does not fit in memory, so it cannot be "
                                      f"mapped ({f['mode']} path); read it with a stream path (tcp)")
        meta, buf = await disk.read(f["key"])
        await self.s.conn.send(ok_reply(rid, meta=meta.to_wire(), stream=meta.size), memoryview(buf))
        return None

    async def op_disk_lease(self, rid: int, f: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return await self._lease(rid, f)
        except KeyNotFoundError:
            if not self._disk.contains(f["key"]) or not await self._disk.promote(f["key"]):
                raise
        return await self._lease(rid, f)

    async def op_disk_touch(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        """A key held on disk only gives its checksum (the version kept); its disk copy keeps its own TTL."""
        reply = await self._touch(rid, f)
        if reply is None:  # the session's touch always answers
            raise RuntimeError("touch gave no reply")
        for i, key in enumerate(f["keys"]):
            obj = self._disk.disk.get(key) if reply["value"][i] is None else None
            if obj is not None:
                reply["value"][i] = decode_meta(obj.meta).checksum
        return reply

    async def op_disk_exists(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        return ok_reply(rid, value=self.s.master.exists(f["key"]) or self._disk.contains(f["key"]))

    async def op_disk_batch_exists(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        return ok_reply(rid, value=[self.s.master.exists(k) or self._disk.contains(k) for k in f["keys"]])

    async def op_disk_evict(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        """Evicting a memory object demotes it; evicting a disk-only object drops it."""
        return ok_reply(rid, value=self.s.master.evict(f["key"]) or self._disk.disk.discard(f["key"]))

    async def op_disk_remove(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        removed = self.s.master.remove(f["key"])
        return ok_reply(rid, value=self._disk.disk.discard(f["key"]) or removed)

    async def op_disk_ls(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        keys = sorted(set(self.s.master.keys(f["prefix"])).union(self._disk.disk.keys(f["prefix"])))
        page, more = wire.page_of_keys(keys, f["after"], f["limit"])
        return ok_reply(rid, value=page, total=len(keys), more=more)

    async def op_disk_inspect(self, rid: int, f: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return await self._inspect(rid, f)
        except KeyNotFoundError:
            return ok_reply(rid, value=describe_disk_object(self._disk.lookup(f["key"])))
