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
from kvstore.core.value import KVObject, Payload
from kvstore.errors import KVStoreError, StoreConnectionError
from kvstore.memory.segment import SegmentSet


class _Notifier:
    def __init__(self, cond: threading.Condition):
        self.cond = cond

    def published(self, replica: Replica) -> None:
        self.cond.notify_all()  # called with the lock held

    def unpublished(self, replica: Replica) -> None:
        pass


class EmbeddedStore(KVStore):
    def __init__(self, capacity: int, *, high_watermark: float = 0.9, low_watermark: float = 0.8):
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._segments = SegmentSet([capacity], private=True)
        self._master = Master([capacity], high_watermark=high_watermark, low_watermark=low_watermark,
                              listener=_Notifier(self._cond))
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
            checksums = [digest() for digest in digests]
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

    def _commit_reserved(self, handles: list[Any], metas: list[ObjectMeta], checksums: list[int]
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
        lease_id, replica = self._acquire(key)
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
        lease_id, replica = self._acquire(key)
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
        lease_id, replica = self._acquire(key)
        return lease_id, replica.meta

    def _release(self, handle: Any) -> None:
        with self._lock:
            if not self._closed:
                self._master.release(handle)

    # ---- metadata -----------------------------------------------------------------------------------
    def _exists(self, key: str) -> bool:
        with self._lock:
            return self._m().exists(key)

    def _evict(self, key: str) -> bool:
        with self._lock:
            return self._m().evict(key)

    def _remove(self, key: str) -> bool:
        with self._lock:
            return self._m().remove(key)

    def _wait(self, keys: Sequence[str], timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                for key in keys:
                    if self._m().exists(key):
                        return key
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def keys(self, prefix: str = "") -> list[str]:
        with self._lock:
            return self._m().keys(prefix)

    def _inspect(self, key: str) -> dict:
        with self._lock:
            return describe_replica(self._m().lookup(key), self._m().clock())

    def device_memory(self) -> StagedDeviceMemory:
        """Device values move through a host buffer (this store holds host memory only)."""
        return StagedDeviceMemory(self._put_many, self._get_into)

    def stats(self) -> dict:
        with self._lock:
            out = self._m().stats()
        out["transport"] = "embedded"
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._segments.close()
