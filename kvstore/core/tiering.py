"""Tiering: which objects move between memory and the disk tier, and when (pure policy; the disk tier given
to it does the I/O).

- **Demote on eviction**: an object the master evicts is handed to the disk tier (a copy is queued and
  written in the background) instead of being dropped. An object with a TTL keeps its wall-clock expiry
  on disk (and the rest of it when promoted back); ephemeral ones (liveness claims) are not demoted: they
  mean nothing without their owner.
- **Write-through** (policy ``write-through``): every commit is also queued to disk, so objects survive a
  restart; an eviction then writes nothing when the disk already holds that version.
- **A new version supersedes the disk copy**: with ``demote``, a commit of a key drops its older disk copy.
- **Promotion**: the ``promote_after``-th read of a disk object copies it back into memory (and keeps the
  disk copy, so evicting it again costs no write). The owner of the memory asks ``wants_promotion`` and
  reports a promotion's put with ``promoting`` before committing it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgpack

from kvstore.core.master import Replica
from kvstore.core.meta import ObjectMeta


class DiskTierLike(Protocol):
    """What tiering needs of a disk tier (``kvstore.memory.disk.DiskTier``)."""

    def store(self, key: str, meta: bytes, payload: memoryview, version: int, expires: float = 0.0) -> bool: ...
    def get(self, key: str) -> Any: ...
    def discard(self, key: str) -> bool: ...
    def wants_promotion(self, key: str) -> bool: ...
    def stats(self) -> dict[str, Any]: ...


def encode_meta(meta: ObjectMeta) -> bytes:
    packed: bytes = msgpack.packb(meta.to_wire(), use_bin_type=True)
    return packed


def decode_meta(blob: bytes) -> ObjectMeta:
    return ObjectMeta.from_wire(msgpack.unpackb(blob, raw=False))


def expiry_of(meta: ObjectMeta) -> float:
    """The wall-clock time after which the object is gone (0.0: never)."""
    return 0.0 if meta.ttl is None else meta.created + meta.ttl


def promotion_meta(blob: bytes) -> ObjectMeta:
    """The meta a promoted copy is committed with: its TTL is what was left of it."""
    meta = decode_meta(blob)
    if meta.ttl is None:
        return meta
    return dataclasses.replace(meta, ttl=max(expiry_of(meta) - time.time(), 1e-3))


class Tiering:
    def __init__(self, disk: DiskTierLike, view: Callable[[Replica], memoryview | None], *, write_through: bool):
        """``view(replica)``: the replica's bytes, or None when they cannot go to disk (e.g. GPU memory)."""
        self.disk = disk
        self.view = view
        self.write_through = write_through
        self._from_disk: dict[int, Any] = {}  # replica id -> the disk object it was promoted from
        self._promotions: dict[int, Any] = {}  # put id of a promotion in flight -> its disk object
        self._written: dict[int, Any] = {}  # replica id -> the disk object its write-through made
        self.demotions = self.promotions = 0

    def evicting(self, replica: Replica) -> None:
        """Master hook: ``replica`` is being evicted from memory; demote it."""
        if replica.ephemeral:
            return
        origin = self._from_disk.get(replica.id) or self._written.get(replica.id)
        if origin is not None and self.disk.get(replica.key) is origin:
            self.demotions += 1  # the disk already holds these bytes
            return
        view = self.view(replica)
        if view is None:
            return
        try:
            if self.disk.store(replica.key, encode_meta(replica.meta), view, replica.meta.version or 0,
                               expiry_of(replica.meta)):
                self.demotions += 1
        finally:
            view.release()

    def promoting(self, put_id: int, disk_object: Any) -> None:
        """The pending put ``put_id`` holds a copy of ``disk_object``, read back from disk; commit it next."""
        self._promotions[put_id] = disk_object

    def published(self, replica: Replica) -> None:
        origin = self._promotions.pop(replica.id, None)
        if origin is not None:
            self._from_disk[replica.id] = origin
            self.promotions += 1
            return
        if not self.write_through or replica.ephemeral:
            self.disk.discard(replica.key)
            return
        view = self.view(replica)
        if view is None:
            self.disk.discard(replica.key)
            return
        try:
            if self.disk.store(replica.key, encode_meta(replica.meta), view, replica.meta.version or 0,
                               expiry_of(replica.meta)):
                self._written[replica.id] = self.disk.get(replica.key)
            else:
                self.disk.discard(replica.key)
        finally:
            view.release()

    def unpublished(self, replica: Replica) -> None:
        self._from_disk.pop(replica.id, None)
        self._written.pop(replica.id, None)

    def aborted(self, put_id: int) -> None:
        self._promotions.pop(put_id, None)

    def stats(self) -> dict[str, Any]:
        return {**self.disk.stats(), "demotions": self.demotions, "promotions": self.promotions}


def describe_disk_object(obj: Any) -> dict[str, Any]:
    """What ``kvstore inspect`` shows for an object held by the disk tier only."""
    meta = decode_meta(obj.meta)
    return {"key": obj.key, "size": obj.size, "kind": meta.kind, "dtype": meta.dtype,
            "shape": list(meta.shape) if meta.shape is not None else None,
            "checksum": f"{meta.checksum:016x}" if meta.checksum is not None else None,
            "state": "complete" if obj.record is not None else "writing", "version": meta.version,
            "tier": "disk", "disk_bytes": obj.nbytes, "disk_reads": obj.reads, "producer": meta.producer,
            "age_s": round(time.time() - meta.created, 6), "ttl_s": meta.ttl,
            "expires_in_s": None if meta.ttl is None else round(expiry_of(meta) - time.time(), 6), "meta": meta.user}
