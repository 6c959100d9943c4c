"""Same-host data path: POSIX shared memory the daemon owns and its clients map.

``SharedMemory`` creates (0600, pre-faulted) or attaches one ``/dev/shm`` mapping. ``ShmTransport`` is the
client side: a put asks the daemon for a region, copies the caller's bytes into it once and commits; a
get_into leases the object, copies it out once and releases the lease without waiting for the reply.
"""

from __future__ import annotations

import mmap
import os
from typing import Callable

from transports.base import Channel, TransportFailure, TransportUnavailable, register

SHM_DIR = "/dev/shm"
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_PAGE = mmap.PAGESIZE


def _path(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise TransportFailure(f"invalid shared-memory name {name!r}")
    return os.path.join(SHM_DIR, name)


class SharedMemory:
    """One POSIX shared-memory mapping of ``size`` bytes, exposed as a writable memoryview ``buf``."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool):
        self.name, self.size, self._mm, self.owner = name, size, mm, owner
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, name: str, size: int, prefault: bool = True, unlink_now: bool = False) -> "SharedMemory":
        """Create a new mapping readable and writable by this user only.

        ``prefault`` populates every page now, so the first put runs at warm-memory speed.
        ``unlink_now`` removes the name at once (an in-process store that nobody else maps)."""
        path = _path(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        if unlink_now:
            os.unlink(path)
        shm = cls(name, size, mm, owner=not unlink_now)
        if prefault:
            shm.prefault()
        return shm

    @classmethod
    def attach(cls, name: str, size: int) -> "SharedMemory":
        """Map an existing segment created by the daemon (page tables populated up front)."""
        try:
            fd = os.open(_path(name), os.O_RDWR)
        except OSError as exc:
            raise TransportUnavailable(f"cannot open shared-memory segment {name!r}: {exc}") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise TransportFailure(f"segment {name!r} is {actual} bytes, expected {size}")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, size, mm, owner=False)

    def prefault(self) -> None:
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            for offset in range(0, self.size, _PAGE):  # older kernels: touch one byte per page
                self.buf[offset] = 0

    def close(self) -> None:
        self.buf.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when the last view does

    def unlink(self) -> None:
        try:
            os.unlink(_path(self.name))
        except FileNotFoundError:
            pass


def copy(dst: memoryview, src: memoryview) -> None:
    """One memcpy between two byte views of equal length."""
    dst[:] = src


class ShmTransport:
    """Client side of the same-host path. ``segments`` maps segment id -> (name, size) from the daemon."""

    name = "shm"

    def __init__(self, segments: dict[int, tuple[str, int]]):
        self._segments = dict(segments)
        self._maps: dict[int, SharedMemory] = {}

    def region(self, segment: int, offset: int, length: int) -> memoryview:
        seg = self._maps.get(segment)
        if seg is None:
            try:
                name, size = self._segments[segment]
            except KeyError:
                raise TransportFailure(f"daemon named unknown segment {segment}") from None
            seg = self._maps[segment] = SharedMemory.attach(name, size)
        if offset < 0 or length < 0 or offset + length > seg.size:
            raise TransportFailure(f"region [{offset}, +{length}) outside segment {segment} of {seg.size} bytes")
        return seg.buf[offset:offset + length]

    def put(self, channel: Channel, request: dict, src: memoryview, checksum: Callable[[], int]) -> dict:
        reply = channel.call({**request, "mode": "region"})
        try:
            dst = self.region(reply["segment"], reply["offset"], len(src))
            copy(dst, src)
            dst.release()
        except BaseException:
            channel.call({"op": "abort", "put_id": reply["put_id"]})
            raise
        if request.get("defer"):  # the caller commits a whole batch at once
            return {"put_id": reply["put_id"], "checksum": checksum()}
        return channel.call({"op": "commit", "put_id": reply["put_id"], "checksum": checksum()})

    def get_into(self, channel: Channel, request: dict, dst: Callable[[dict], memoryview]) -> dict:
        reply = channel.call({**request, "mode": "region"})
        try:
            out = dst(reply)
            src = self.region(reply["segment"], reply["offset"], reply["size"])
            copy(out[:reply["size"]], src)
            src.release()
        finally:
            channel.call({"op": "release", "lease": reply["lease"], "noreply": True})
        return reply

    def close(self) -> None:
        for seg in self._maps.values():
            seg.close()
        self._maps.clear()


register("shm", ShmTransport)
