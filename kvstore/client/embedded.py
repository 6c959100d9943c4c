"""EmbeddedStore: master and segments in this process, no daemon. Thread-safe.

The lock guards the master only; payload copies run outside it (the region is PENDING or leased meanwhile,
so nothing else can reuse it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.client.device import StagedDeviceMemory
from kvstore.client.store import KVStore, PutFlags
from kvstore.core.digest import Digest
from kvstore.core.master import Master, Replica, describe_replica
from kvstore.core.meta import ObjectMeta
from kvstore.core.tiering import Tiering, decode_meta, describe_disk_object, promotion_meta
from kvstore.core.value import KVObject, Payload
from kvstore.errors import (
    InvalidArgumentError,
    KeyExistsError,
    KeyNotFoundError,
    KVStoreError,
    StoreConnectionError,
    StoreFullError,
)
from kvstore.memory.disk import DiskConfig, DiskObject, DiskPolicy, DiskTier
from kvstore.memory.segment import SegmentSet
from kvstore.units import parse_size


class _Notifier:
    def __init__(self, cond: threading.Condition, tiering: Tiering | None):
        self.cond = cond
        self.tiering = tiering

    def published(self, replica: Replica) -> None:
        if self.tiering is not None:
            self.tiering.published(replica)
        self.cond.notify_all()  # called with the lock held

    def unpublished(self, replica: Replica) -> None:
        if self.tiering is not None:
            self.tiering.unpublished(replica)

    def moving(self, replica: Replica) -> None:
        pass

    def moved(self, replica: Replica) -> None:
        pass  # nothing outside the master records where an object lies (views are taken under leases)


class EmbeddedStore(KVStore):
    def __init__(self, capacity: int, *, high_watermark: float = 0.9, low_watermark: float = 0.8,
                 disk_path: str | None = None, disk_capacity: int | str | None = None,
                 disk_policy: str | DiskPolicy = DiskPolicy.DEMOTE, disk_promote_after: int = 2):
        """With ``disk_path`` (an existing, writable directory) and ``disk_capacity``, objects evicted from
        memory go to a disk tier there (see ``kvstore.core.tiering``); DiskPathError when it cannot be used."""
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._disk = _open_disk(disk_path, disk_capacity, disk_policy, disk_promote_after)
        self._tiering = None if self._disk is None else Tiering(
            self._disk, self._replica_view, write_through=self._disk.config.policy is DiskPolicy.WRITE_THROUGH)
        try:
            self._segments = SegmentSet([capacity], private=True)
        except BaseException as exc:
            if self._disk is not None:
                self._disk.close()
            if isinstance(exc, OverflowError):
                raise InvalidArgumentError(f"capacity of {capacity} bytes is more than this machine can map") from None
            raise
        self._master = Master([capacity], high_watermark=high_watermark, low_watermark=low_watermark,
                              listener=_Notifier(self._cond, self._tiering),
                              on_evict=None if self._tiering is None else self._tiering.evicting,
                              mover=self._segments.move)
        self._client = self._master.register_client("embedded")
        self.producer = f"embedded:{id(self):x}"
        self._closed = False

    def _m(self) -> Master:
        """The master, with expired objects dropped (a heap peek when none is due); caller holds the lock."""
        if self._closed:
            raise StoreConnectionError("store is closed")
        self._master.expire()
        return self._master

    def _region(self, replica: Replica) -> memoryview:
        return self._segments[replica.segment].view(replica.offset, replica.size)

    def _replica_view(self, replica: Replica) -> memoryview:
        return self._region(replica)

    # ---- primitives ---------------------------------------------------------------------------------
    def _put(self, meta: ObjectMeta, payload: Payload, digest: Digest, *, flags: PutFlags) -> ObjectMeta:
        return self._put_many([(meta, payload)], [digest], flags=flags)[0]

    def _put_many(self, items: list[tuple[ObjectMeta, Payload]], digests: list[Digest], *,
                  flags: PutFlags) -> list[ObjectMeta]:
        replicas: list[Replica] = []
        try:
            for (meta, _), digest in zip(items, digests, strict=True):
                with self._lock:
                    master = self._m()
                    replicas.append(master.begin_put(meta, self._client, if_absent=flags.if_absent, pin=flags.pin,
                                                     ephemeral=flags.ephemeral))
                dst = self._region(replicas[-1])
                digest.copy_into(dst)  # one pass: each piece hashed while in cache
                dst.release()
            checksums: list[int | None] = [digest() for digest in digests]
        except BaseException:
            with self._lock:
                for replica in replicas:
                    self._master.abort(replica.id)
            raise
        with self._lock:
            return [r.meta for r in self._m().commit_many([r.id for r in replicas], checksums)]

    def _reserve(self, meta: ObjectMeta, flags: PutFlags) -> tuple[Any, memoryview]:
        with self._lock:
            replica = self._m().begin_put(meta, self._client, if_absent=flags.if_absent, pin=flags.pin,
                                          ephemeral=flags.ephemeral)
        return replica.id, self._region(replica)

    def _commit_reserved(self, handles: list[Any], metas: list[ObjectMeta], checksums: list[int | None]
                         ) -> list[ObjectMeta]:
        with self._lock:
            return [r.meta for r in self._m().commit_many(list(handles), list(checksums))]

    def _abort_reserved(self, handles: list[Any], quiet: bool = False) -> None:
        with self._lock:
            for put_id in handles:
                try:
                    self._master.abort(put_id)
                except KVStoreError:
                    if not quiet:
                        raise  # already aborted: commit_many aborts all of them when it fails

    def _get_into(self, key: str, fit: Callable[[int], memoryview]) -> tuple[int, int | None]:
        try:
            lease_id, replica = self._acquire(key)
        except KeyNotFoundError:
            if self._disk is None or not self._promote(key, force=False):
                return self._disk_get_into(key, fit)
            try:
                lease_id, replica = self._acquire(key)
            except KeyNotFoundError:  # its promotion was abandoned (removed or replaced meanwhile): look again
                return self._disk_get_into(key, fit)
        try:
            size = replica.size
            dst = fit(size)
            src = self._region(replica)
            dst[:size] = src
            src.release()
            return size, replica.meta.checksum
        finally:
            self._release(lease_id)

    def _get(self, key: str, *, copy: bool) -> KVObject:
        try:
            lease_id, replica = self._acquire(key)
        except KeyNotFoundError:
            if self._disk is None or not self._promote(key, force=not copy):
                return self._disk_get(key)
            try:
                lease_id, replica = self._acquire(key)
            except KeyNotFoundError:  # its promotion was abandoned (removed or replaced meanwhile): look again
                return self._disk_get(key)
        region = self._region(replica)
        if not copy:
            return KVObject.wrap(region, replica.meta, on_release=lambda: self._release(lease_id))
        try:
            return KVObject.wrap(bytearray(region), replica.meta)
        finally:
            region.release()
            self._release(lease_id)

    def _acquire(self, key: str) -> tuple[int, Replica]:
        with self._lock:
            lease = self._m().lease(key, self._client)
            return lease.id, lease.replica

    def _lease(self, key: str) -> tuple[Any, ObjectMeta]:
        try:
            lease_id, replica = self._acquire(key)
        except KeyNotFoundError:
            if self._disk is None or not self._promote(key, force=True):
                raise
            lease_id, replica = self._acquire(key)
        return lease_id, replica.meta

    def _release(self, handle: Any) -> None:
        with self._lock:
            if not self._closed:
                self._master.release(handle)

    # ---- metadata -----------------------------------------------------------------------------------
    def _exists(self, key: str) -> bool:
        with self._lock:
            return self._m().exists(key) or (self._disk is not None and self._disk.contains(key))

    def _touch(self, keys: list[str], ttl: float) -> list[int | None]:
        with self._lock:  # a key held on disk only gives its checksum; its disk copy keeps its own TTL
            touched = [self._m().touch(key, ttl) for key in keys]
            on_disk = [self._disk.get(k) if r is None and self._disk is not None else None
                       for k, r in zip(keys, touched, strict=True)]
        return [r.meta.checksum if r is not None else None if d is None else decode_meta(d.meta).checksum
                for r, d in zip(touched, on_disk, strict=True)]

    def _unpin(self, keys: list[str]) -> int:
        with self._lock:
            return sum(self._m().unpin(key) for key in keys)

    def _evict(self, key: str) -> bool:
        with self._lock:
            return self._m().evict(key) or (self._disk is not None and self._disk.discard(key))

    def _remove(self, key: str) -> bool:
        with self._lock:
            removed = self._m().remove(key)
            return (self._disk is not None and self._disk.discard(key)) or removed

    def _wait(self, keys: Sequence[str], timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                for key in keys:
                    if self._exists(key):
                        return key
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def keys(self, prefix: str = "") -> list[str]:
        with self._lock:
            keys = self._m().keys(prefix)
            return keys if self._disk is None else sorted(set(keys).union(self._disk.keys(prefix)))

    def _inspect(self, key: str) -> dict[str, Any]:
        with self._lock:
            try:
                return {**describe_replica(self._m().lookup(key), self._m().clock()), "tier": "host"}
            except KeyNotFoundError:
                if self._disk is None:
                    raise
                _, obj = self._disk_object(key)
                return describe_disk_object(obj)

    def device_memory(self) -> StagedDeviceMemory:
        """Device values move through a host buffer (this store holds host memory only)."""
        return StagedDeviceMemory(self._put_many, self._get_into)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = self._m().stats()
            if self._tiering is not None:
                out.update(self._tiering.stats())
        out["transport"] = "embedded"
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._disk is not None:
            self._disk.close()
        self._segments.close()

    # ---- the disk tier ------------------------------------------------------------------------------
    def _disk_object(self, key: str) -> tuple[DiskTier, DiskObject]:
        """The disk tier and its object under ``key``; KeyNotFoundError when there is neither."""
        disk = self._disk
        obj = disk.get(key) if disk is not None else None
        if disk is None or obj is None:
            raise KeyNotFoundError(f"key {key!r} not found")
        return disk, obj

    def _disk_get(self, key: str) -> KVObject:
        disk, obj = self._disk_object(key)
        buf = bytearray(obj.size)
        disk.read_into(obj, memoryview(buf))
        return KVObject.wrap(buf, decode_meta(obj.meta))

    def _disk_get_into(self, key: str, fit: Callable[[int], memoryview]) -> tuple[int, int | None]:
        """Read a disk object into the caller's buffer (no promotion): through a scratch buffer, so that a copy
        found corrupted (DiskReadError) leaves the caller's buffer as it was."""
        disk, obj = self._disk_object(key)
        dst = fit(obj.size)
        scratch = bytearray(obj.size)
        disk.read_into(obj, memoryview(scratch))
        dst[:obj.size] = scratch
        return obj.size, decode_meta(obj.meta).checksum

    def _promote(self, key: str, *, force: bool) -> bool:
        """Copy a disk object into memory when the promotion policy says so (or ``force``); False when it
        stays on disk only (not wanted yet, or it does not fit in memory)."""
        tiering = self._tiering
        if tiering is None:
            return False  # no disk tier (the callers ask only when there is one)
        disk, obj = self._disk_object(key)
        if not force and not disk.wants_promotion(key):
            return False
        meta = promotion_meta(obj.meta)
        with self._lock:
            try:
                replica = self._m().begin_put(meta, self._client, if_absent=True)
            except KeyExistsError:
                return True  # a writer put a newer version meanwhile: memory holds the key
            except StoreFullError:
                return False
        try:
            region = self._region(replica)
            disk.read_into(obj, region)
            region.release()
        except BaseException:
            with self._lock:
                self._master.abort(replica.id)
            raise
        with self._lock:
            if not disk.is_current(obj):
                # removed, or superseded by a newer put, while it was being read: committing it now would bring
                # back a removed key with its older bytes. The caller looks again.
                self._master.abort(replica.id)
                return True
            tiering.promoting(replica.id, obj)
            try:
                self._m().commit(replica.id, meta.checksum)
            except KeyExistsError:
                tiering.aborted(replica.id)
        return True


def _open_disk(path: str | None, capacity: int | str | None, policy: str | DiskPolicy,
               promote_after: int) -> DiskTier | None:
    if path is None:
        if capacity is not None:
            raise ValueError(f"disk_capacity={capacity!r} needs a disk_path")
        return None
    if capacity is None:
        raise ValueError(f"disk_path={path!r} needs a disk_capacity")
    return DiskTier(DiskConfig(path, parse_size(capacity), DiskPolicy.parse(policy), promote_after))

