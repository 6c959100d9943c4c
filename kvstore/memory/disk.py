"""DiskTier: objects on a local disk under one directory — index, LRU and watermarks, a background writer,
crash recovery from the files' headers (``kvstore.memory.disk_dir``), and a lock so that one process owns the directory.

Writes are copied into a bounded staging area and written by one thread as large sequential writes
(``O_DIRECT`` + ``fdatasync`` from page-aligned staging; see ``kvstore.memory.disk_file`` for the format
and the README for the measurement behind the choice), so the caller never waits for the device unless the
writer falls more than ``staging_bytes`` behind; then it waits up to ``stall_s`` for room, and the daemon, whose
evictions run on its event loop, sets that to 0: the object is dropped from the tier at once (``disk_behind``).
Reads copy straight into the caller's buffer (``O_DIRECT`` through a page-aligned bounce buffer, since the
caller's buffer need not be aligned) and check the checksum. The disk never holds more than ``capacity`` bytes,
staged writes included.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvstore.errors import DiskReadError, KeyNotFoundError
from kvstore.memory.disk_dir import fsync_dir, lock_directory, scan
from kvstore.memory.disk_file import (
    SUFFIX,
    TMP_SUFFIX,
    Record,
    RecordError,
    file_bytes,
    open_record,
    payload_offset,
    read_payload,
    stage,
    write_record,
)

log = logging.getLogger("kvstore.memory.disk")
_BOUNCE = 16 << 20  # the most an O_DIRECT read moves at a time (through a page-aligned buffer)


class DiskPolicy(Enum):
    """When objects are written to disk: ``demote`` when memory evicts them; ``write-through`` at every
    commit as well (in the background), so that they survive a restart."""

    DEMOTE = "demote"
    WRITE_THROUGH = "write-through"

    @classmethod
    def parse(cls, value: object) -> DiskPolicy:
        """A policy, or its name (``demote``, ``write-through``); ValueError naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"disk policy must be one of {[p.value for p in cls]}, got {value!r}") from None


@dataclass(frozen=True, slots=True)
class DiskConfig:
    path: str
    capacity: int
    policy: DiskPolicy = DiskPolicy.DEMOTE
    promote_after: int = 2  # the read of a disk object that copies it back into memory (1: the first)
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    staging_bytes: int = 256 << 20  # bytes of writes queued ahead of the device
    stall_s: float = 10.0  # how long a write waits for staging room before it is dropped (0: never waits)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"disk path must be a non-empty string, got {self.path!r}")
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity <= 0:
            raise ValueError(f"disk capacity must be a positive size, got {self.capacity!r}")
        if not isinstance(self.policy, DiskPolicy):
            object.__setattr__(self, "policy", DiskPolicy.parse(self.policy))
        if isinstance(self.promote_after, bool) or not isinstance(self.promote_after, int) or self.promote_after < 1:
            raise ValueError(f"promote_after must be an int >= 1, got {self.promote_after!r}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError(f"need 0 < low <= high <= 1, got low={self.low_watermark} high={self.high_watermark}")
        if self.staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {self.staging_bytes!r}")


@dataclass(slots=True, eq=False)
class DiskObject:
    """One object of the tier. ``staged`` holds its bytes while its write is in flight; ``record`` is set
    once the file is in place."""

    key: str
    meta: bytes
    size: int
    version: int
    generation: int
    nbytes: int
    staged: mmap.mmap | None = None  # laid out as the file (disk_file.stage)
    record: Record | None = None
    reads: int = 0
    expires: float = 0.0  # time.time() after which it is gone (0: never)

    def staging(self) -> mmap.mmap:
        """The staged bytes of an object whose write is in flight (RuntimeError otherwise: a bug)."""
        if self.staged is None:
            raise RuntimeError(f"disk object {self.key!r} has no staged bytes (its write is not in flight)")
        return self.staged

    def expired(self, now: float) -> bool:
        return 0.0 < self.expires <= now

    @property
    def name(self) -> str:
        return f"{hashlib.blake2b(self.key.encode(), digest_size=16).hexdigest()}-{self.generation:016x}{SUFFIX}"


class DiskTier:
    def __init__(self, config: DiskConfig):
        self.config = config
        self.path = os.path.abspath(config.path)
        self.capacity = config.capacity
        self._lock_fd = lock_directory(self.path)
        self._cond = threading.Condition()
        self._objects: OrderedDict[str, DiskObject] = OrderedDict()  # least recently used first
        self._queue: collections.deque[DiskObject] = collections.deque()
        self._used = self._staged = self._unsynced = self._pooled = 0
        self._pool: list[mmap.mmap] = []  # staging buffers to reuse (a fresh mapping faults in every page)
        self._generation = 0
        self._closing = False
        self._writer: threading.Thread | None = None
        self.counters = dict.fromkeys(("disk_writes", "disk_reads", "disk_errors", "disk_dropped", "disk_full",
                                       "disk_evictions", "disk_behind"), 0)
        try:
            self.recovery = self._recover()
        except BaseException:
            os.close(self._lock_fd)
            raise

    # ---- writes -------------------------------------------------------------------------------------
    def store(self, key: str, meta: bytes, payload: memoryview, version: int, expires: float = 0.0) -> bool:
        """Queue a copy of ``payload`` to be written as ``key`` (replacing any older copy), gone after the
        wall-clock time ``expires`` (0: never); False when it was dropped instead (larger than the tier, no
        room, or the writer too far behind)."""
        nbytes = file_bytes(key, meta, len(payload))
        with self._cond:
            if not self._closing and nbytes <= self.capacity and not self._staging_room(len(payload)):
                self.counters["disk_behind"] += 1  # the writer is a whole staging area behind (a slow disk)
                self.counters["disk_dropped"] += 1
                return False
            if self._closing or nbytes > self.capacity or not self._make_room(nbytes, exclude=key):
                self.counters["disk_dropped"] += 1
                return False
            self._generation += 1
            staged = self._buffer(nbytes)
            obj = DiskObject(key, meta, len(payload), version, self._generation, nbytes, staged=staged,
                             expires=expires)
            stage(staged, key, meta, payload)
            self._forget(self._objects.get(key))
            self._objects[key] = obj
            self._used += nbytes
            self._staged += obj.size
            self._queue.append(obj)
            self._cond.notify_all()
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="kvstore-disk-writer", daemon=True)
                self._writer.start()
        return True

    def _staging_room(self, size: int) -> bool:
        deadline = time.monotonic() + self.config.stall_s
        while self._staged and self._staged + size > self.config.staging_bytes:
            left = deadline - time.monotonic()
            if left <= 0 or self._closing:
                return False
            self._cond.wait(left)
        return True

    def _make_room(self, nbytes: int, exclude: str = "") -> bool:
        """Evict least recently used objects past the high watermark, down to the low one."""
        old = self._objects.get(exclude)
        used = self._used - (old.nbytes if old is not None else 0)
        if used + nbytes > self.config.high_watermark * self.capacity:
            target = self.config.low_watermark * self.capacity - nbytes
            for victim in list(self._objects.values()):
                if used <= target:
                    break
                if victim.key == exclude:
                    continue
                used -= victim.nbytes
                self._forget(victim)
                self.counters["disk_evictions"] += 1
        return used + nbytes <= self.capacity

    def _buffer(self, nbytes: int) -> mmap.mmap:
        for i, buf in enumerate(self._pool):
            if nbytes <= len(buf) <= 2 * nbytes:
                self._pooled -= len(buf)
                return self._pool.pop(i)
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)

    def _recycle(self, buf: mmap.mmap) -> None:
        if self._pooled + len(buf) <= self.config.staging_bytes and not self._closing:
            self._pool.append(buf)
            self._pooled += len(buf)
            return
        try:
            buf.close()
        except BufferError:  # a view of it is still alive (an exception's traceback): freed with it
            pass

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                obj = self._queue.popleft()
                current = self._objects.get(obj.key) is obj
            try:
                if current:
                    self._write(obj)
            except Exception:  # a bug, not an I/O error: keep the writer alive for the others
                log.exception("disk tier: writing %r failed", obj.key)
                with self._cond:
                    self.counters["disk_errors"] += 1
                    self._forget(obj)
            with self._cond:
                self._staged -= obj.size
                self._recycle(obj.staging())
                obj.staged = None
                self._unsynced += 1
                sync = not self._queue or self._unsynced >= 32
                self._cond.notify_all()
            if sync:  # the renames reach the disk together: one directory sync a batch, not one an object
                fsync_dir(self.path)
                with self._cond:
                    self._unsynced = 0
                    self._cond.notify_all()

    def _write(self, obj: DiskObject) -> None:
        tmp = os.path.join(self.path, "." + obj.name + TMP_SUFFIX)
        try:
            checksum = write_record(tmp, obj.staging(), obj.key, obj.meta, obj.size, obj.version, obj.generation,
                                    obj.expires)
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
            log.warning("disk tier: writing %r failed (%s); dropped from the disk tier", obj.key, exc)
            with self._cond:
                self.counters["disk_full" if full else "disk_errors"] += 1
                self.counters["disk_dropped"] += 1
                if self._objects.get(obj.key) is obj:
                    self._forget(obj)
            return
        with self._cond:
            if self._objects.get(obj.key) is not obj:  # evicted or replaced while it was being written
                os.unlink(tmp)
                return
            os.rename(tmp, os.path.join(self.path, obj.name))
            obj.record = Record(obj.key, obj.meta, obj.size, checksum, obj.version, obj.generation,
                                payload_offset(obj.key, obj.meta), obj.expires)
            self.counters["disk_writes"] += 1

    # ---- reads --------------------------------------------------------------------------------------
    def get(self, key: str) -> DiskObject | None:
        """The object stored as ``key``, or None (an expired one is dropped now)."""
        with self._cond:
            obj = self._objects.get(key)
            if obj is not None and obj.expired(time.time()):
                self._forget(obj)
                return None
            return obj

    def contains(self, key: str) -> bool:
        return self.get(key) is not None

    def is_current(self, obj: DiskObject) -> bool:
        """Whether ``obj`` (from ``get``) is still what the tier holds for its key: not removed, replaced,
        superseded by a newer version or evicted since."""
        with self._cond:
            return self._objects.get(obj.key) is obj

    def wants_promotion(self, key: str) -> bool:
        """Whether the next read of ``key`` is the one that should copy it back into memory."""
        obj = self.get(key)
        return obj is not None and obj.reads + 1 >= self.config.promote_after

    def read_into(self, obj: DiskObject, dst: memoryview) -> DiskObject:
        """Copy ``obj`` (from ``get``) into ``dst`` (at least ``obj.size`` bytes) and check its checksum.
        KeyNotFoundError when it is no longer stored (evicted, replaced or removed since); DiskReadError
        (the object is dropped) on an I/O error or corrupted bytes."""
        with self._cond:
            if self._objects.get(obj.key) is not obj:
                raise KeyNotFoundError(f"key {obj.key!r} not found")
            self._objects.move_to_end(obj.key)
            obj.reads += 1
            self.counters["disk_reads"] += 1
            if obj.record is None:  # still being written: the staged bytes are the object
                offset = payload_offset(obj.key, obj.meta)
                with memoryview(obj.staging()) as staged:
                    dst[:obj.size] = staged[offset:offset + obj.size]
                return obj
            try:
                fd, direct = open_record(os.path.join(self.path, obj.name))
            except OSError as exc:
                self._read_failed(obj, exc)
            bounce = self._buffer(min(obj.nbytes, _BOUNCE)) if direct else None
        try:
            with memoryview(bounce) if bounce is not None else contextlib.nullcontext() as view:
                read_payload(fd, obj.record, dst, view)
        except (OSError, RecordError) as exc:
            with self._cond:
                self._read_failed(obj, exc)
        finally:
            os.close(fd)
            if bounce is not None:
                with self._cond:
                    self._recycle(bounce)
        return obj

    def _read_failed(self, obj: DiskObject, exc: Exception) -> None:
        self.counters["disk_errors"] += 1
        if self._objects.get(obj.key) is obj:
            self._forget(obj)
        log.warning("disk tier: reading %r failed (%s); dropped", obj.key, exc)
        raise DiskReadError(f"the disk copy of {obj.key!r} is unreadable ({exc}); it was dropped") from None

    # ---- removal and listing ------------------------------------------------------------------------
    def discard(self, key: str) -> bool:
        with self._cond:
            obj = self._objects.get(key)
            self._forget(obj)
            return obj is not None

    def keys(self, prefix: str = "") -> list[str]:
        now = time.time()
        with self._cond:
            return [k for k, o in self._objects.items() if k.startswith(prefix) and not o.expired(now)]

    def _forget(self, obj: DiskObject | None) -> None:
        """Drop ``obj`` from the index and delete its file (a write in flight is discarded when it ends)."""
        if obj is None or self._objects.get(obj.key) is not obj:
            return
        del self._objects[obj.key]
        self._used -= obj.nbytes
        if obj.record is not None:
            try:
                os.unlink(os.path.join(self.path, obj.name))
            except FileNotFoundError:
                pass

    # ---- recovery -----------------------------------------------------------------------------------
    def _recover(self) -> dict[str, Any]:
        """Rebuild the index from the headers of the files in the directory (payloads are not read)."""
        started = time.perf_counter()
        records, dropped = scan(self.path)
        for record in records:
            obj = DiskObject(record.key, record.meta, record.size, record.version, record.generation,
                             record.file_bytes, record=record, expires=record.expires)
            self._objects[obj.key] = obj
            self._used += obj.nbytes
            self._generation = max(self._generation, obj.generation)
        self._make_room(0)
        seconds = time.perf_counter() - started
        out = {"objects": len(self._objects), "bytes": self._used, "dropped": dropped, "seconds": round(seconds, 6)}
        log.info("disk tier %s: recovered %d objects (%d bytes) in %.3f s; dropped %d torn or partial files",
                 self.path, out["objects"], out["bytes"], seconds, dropped)
        return out

    # ---- stats and lifecycle ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"disk_capacity_bytes": self.capacity, "disk_used_bytes": self._used,
                    "disk_objects": len(self._objects),
                    "disk_pending_writes": len(self._queue) + (self._staged > 0) + self._unsynced,
                    "disk_path": self.path, "disk_policy": self.config.policy.value,
                    "disk_recovery": dict(self.recovery), **self.counters}

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued write has reached the disk (or was dropped); False at timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._staged or self._unsynced:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued writes (up to ``timeout``), stop the writer and release the directory."""
        if self._lock_fd < 0:
            return
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(timeout)
        for buf in self._pool:
            self._recycle(buf)  # closes it (the tier is closing)
        self._pool.clear()
        os.close(self._lock_fd)
        self._lock_fd = -1
