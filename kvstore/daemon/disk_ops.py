"""DiskOps: the session's read and metadata ops when the daemon has a disk tier (``--disk-path``).

Each wraps the memory-only op of :class:`~kvstore.daemon.session.Session`: a key memory does not hold is
looked up on disk. ``get`` in region mode (the shm path) and ``lease`` promote the object (its bytes must be
in segment memory to be mapped); a stream ``get`` (tcp, or shm clients reading into their own buffer)
sends the bytes read from disk and promotes on the ``promote_after``-th read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.core.tiering import describe_disk_object
from kvstore.errors import KeyNotFoundError, ObjectTooLargeError
from kvstore.protocol import wire

if TYPE_CHECKING:
    from kvstore.daemon.disk_io import DiskService


class DiskOps:
    """Mixin of Session; ``disk_handlers()`` overrides entries of the op table when a disk tier runs."""

    ctx: Any
    master: Any

    def disk_handlers(self) -> dict:
        if getattr(getattr(self, "ctx", None), "disk", None) is None:  # the table is also built unconnected
            return {}
        return {"get": self.op_disk_get, "lease": self.op_disk_lease, "exists": self.op_disk_exists,
                "batch_exists": self.op_disk_batch_exists, "evict": self.op_disk_evict,
                "remove": self.op_disk_remove, "ls": self.op_disk_ls, "inspect": self.op_disk_inspect,
                "get_regions": self.op_disk_get_regions}

    async def op_disk_get_regions(self, rid: int, f: dict) -> dict:
        """Objects only on disk are promoted into memory first (a region must be mapped memory)."""
        disk = self._disk
        for key in f["keys"]:
            if not self.master.exists(key) and disk.contains(key):
                await disk.promote(key)
        return await self.op_get_regions(rid, f)  # type: ignore[attr-defined]

    @property
    def _disk(self) -> DiskService:
        return self.ctx.disk

    async def op_disk_get(self, rid: int, f: dict) -> dict | None:
        try:
            return await self.op_get(rid, f)
        except KeyNotFoundError:
            if not self._disk.contains(f["key"]):
                raise
        disk = self._disk
        if (f["mode"] != "stream" or disk.wants_promotion(f["key"])) and await disk.promote(f["key"]):
            try:
                return await self.op_get(rid, f)
            except KeyNotFoundError:
                pass  # evicted again at once (memory too small): serve it from disk
        if f["mode"] != "stream":
            if not disk.contains(f["key"]):  # removed while its promotion ran
                raise KeyNotFoundError(f"key {f['key']!r} not found")
            raise ObjectTooLargeError(f"key {f['key']!r} is on disk and does not fit in memory, so it cannot be "
                                      f"mapped ({f['mode']} path); read it with a stream path (tcp)")
        meta, buf = await disk.read(f["key"])
        await self._send(self._ok(rid, meta=meta.to_wire(), stream=meta.size), memoryview(buf))
        return None

    async def op_disk_lease(self, rid: int, f: dict) -> dict:
        try:
            return await self.op_lease(rid, f)
        except KeyNotFoundError:
            if not self._disk.contains(f["key"]) or not await self._disk.promote(f["key"]):
                raise
        return await self.op_lease(rid, f)

    async def op_disk_exists(self, rid: int, f: dict) -> dict:
        return self._ok(rid, value=self.master.exists(f["key"]) or self._disk.contains(f["key"]))

    async def op_disk_batch_exists(self, rid: int, f: dict) -> dict:
        return self._ok(rid, value=[self.master.exists(k) or self._disk.contains(k) for k in f["keys"]])

    async def op_disk_evict(self, rid: int, f: dict) -> dict:
        """Evicting a memory object demotes it; evicting a disk-only object drops it."""
        return self._ok(rid, value=self.master.evict(f["key"]) or self._disk.disk.discard(f["key"]))

    async def op_disk_remove(self, rid: int, f: dict) -> dict:
        removed = self.master.remove(f["key"])
        return self._ok(rid, value=self._disk.disk.discard(f["key"]) or removed)

    async def op_disk_ls(self, rid: int, f: dict) -> dict:
        keys = sorted(set(self.master.keys(f["prefix"])).union(self._disk.disk.keys(f["prefix"])))
        page, more = wire.page_of_keys(keys, f["after"], f["limit"])
        return self._ok(rid, value=page, total=len(keys), more=more)

    async def op_disk_inspect(self, rid: int, f: dict) -> dict:
        try:
            return await self.op_inspect(rid, f)
        except KeyNotFoundError:
            return self._ok(rid, value=describe_disk_object(self._disk.lookup(f["key"])))
