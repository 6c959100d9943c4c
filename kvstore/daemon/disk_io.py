"""DiskService: the daemon's side of the disk tier — reads and promotions off the event loop.

The master's eviction hook and the publish hooks go to :class:`~kvstore.core.tiering.Tiering` (demotion
copies the bytes into the tier's staging area; its writer thread does the writes). Reads of disk objects run
in the loop's default executor: a promotion reads the file straight into a PENDING replica of segment memory
and commits it (the shm path then maps it like any object); a stream read fills a buffer that is sent.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvstore.core.master import Master, Replica, Tier
from kvstore.core.meta import ObjectMeta
from kvstore.core.tiering import Tiering, decode_meta, promotion_meta
from kvstore.errors import KeyExistsError, KeyNotFoundError, StoreFullError
from kvstore.memory.disk import DiskConfig, DiskObject, DiskPolicy, DiskTier
from kvstore.memory.segment import SegmentSet

log = logging.getLogger("kvstore.daemon.disk")


class DiskService:
    def __init__(self, config: DiskConfig, segments: SegmentSet):
        self.disk = DiskTier(config)  # first: a bad or locked path fails the start before anything else
        self.segments = segments
        self.tiering = Tiering(self.disk, self._view, write_through=config.policy is DiskPolicy.WRITE_THROUGH)
        self.master: Master | None = None
        self.client = 0
        self._inflight: dict[str, asyncio.Future[bool]] = {}

    def attach(self, master: Master) -> None:
        self.master = master
        self.client = master.register_client("disk-tier")

    def _view(self, replica: Replica) -> memoryview | None:
        if self.master is None or self.master.tier_of(replica) is not Tier.HOST:
            return None
        return self.segments[replica.segment].view(replica.offset, replica.size)

    # ---- reads --------------------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return self.disk.contains(key)

    def lookup(self, key: str) -> DiskObject:
        obj = self.disk.get(key)
        if obj is None:
            raise KeyNotFoundError(f"key {key!r} not found")
        return obj

    def wants_promotion(self, key: str) -> bool:
        return self.disk.wants_promotion(key)

    async def read(self, key: str) -> tuple[ObjectMeta, bytearray]:
        """The object's meta and bytes, read into a new buffer off the loop (no promotion)."""
        obj = self.lookup(key)
        buf = bytearray(obj.size)
        await asyncio.get_running_loop().run_in_executor(None, self.disk.read_into, obj, memoryview(buf))
        return decode_meta(obj.meta), buf

    async def promote(self, key: str) -> bool:
        """Copy the disk object into host memory and make it visible there; False when it does not fit.
        Concurrent promotions of one key share the first."""
        running = self._inflight.get(key)
        if running is not None:
            return await asyncio.shield(running)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            done = await self._promote(key)
        except BaseException:
            fut.set_result(False)
            raise
        finally:
            del self._inflight[key]
        fut.set_result(done)
        return done

    async def _promote(self, key: str) -> bool:
        master = self._attached()
        obj = self.lookup(key)
        meta = promotion_meta(obj.meta)
        master.heartbeat(self.client)
        try:
            replica = master.begin_put(meta, self.client, if_absent=True)
        except KeyExistsError:
            return True  # a writer committed a newer version meanwhile: memory holds the key
        except StoreFullError:
            return False
        region = self.segments[replica.segment].view(replica.offset, meta.size)
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.disk.read_into, obj, region)
        except BaseException:
            master.abort(replica.id)
            raise
        finally:
            region.release()
        if not self.disk.is_current(obj):
            # removed, or superseded by a newer put, while it was being read: committing it now would bring
            # back a removed key with its older bytes. The caller looks again (memory, then disk).
            master.abort(replica.id)
            return True
        self.tiering.promoting(replica.id, obj)
        try:
            master.commit(replica.id, meta.checksum)
        except KeyExistsError:
            self.tiering.aborted(replica.id)
        return True

    # ---- lifecycle ----------------------------------------------------------------------------------
    def _attached(self) -> Master:
        if self.master is None:
            raise RuntimeError("the disk service is not attached to a master yet (attach() first)")
        return self.master

    def stats(self) -> dict[str, Any]:
        return self.tiering.stats()

    def close(self, timeout: float) -> None:
        """Finish queued writes (up to ``timeout``) and release the disk path."""
        if not self.disk.flush(timeout):
            log.warning("disk tier: writes still queued after %.0f s at shutdown were dropped", timeout)
        self.disk.close(timeout=0.1)
