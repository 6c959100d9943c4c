"""POSIX shared memory: one ``/dev/shm`` mapping, created (0600, pre-faulted) by its owner or attached by others.

The memory primitive under the daemon's segments and index, and under the ``shm`` transport that maps them.
"""

from __future__ import annotations

import mmap
import os


class SharedMemoryError(Exception):
    """A mapping cannot be created or attached as asked (bad name, wrong size)."""


class SharedMemoryUnavailable(SharedMemoryError):
    """The named segment cannot be opened here (gone, or not on this host)."""


SHM_DIR = "/dev/shm"
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_PAGE = mmap.PAGESIZE


def _path(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise SharedMemoryError(f"invalid shared-memory name {name!r}")
    return os.path.join(SHM_DIR, name)


class SharedMemory:
    """One POSIX shared-memory mapping of ``size`` bytes, exposed as a writable memoryview ``buf``."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool):
        self.name, self.size, self._mm, self.owner = name, size, mm, owner
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, name: str, size: int, prefault: bool = True, unlink_now: bool = False) -> SharedMemory:
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
    def attach(cls, name: str, size: int) -> SharedMemory:
        """Map an existing segment created by the daemon (page tables populated up front)."""
        try:
            fd = os.open(_path(name), os.O_RDWR)
        except OSError as exc:
            raise SharedMemoryUnavailable(f"cannot open shared-memory segment {name!r}: {exc}") from exc
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise SharedMemoryError(f"segment {name!r} is {actual} bytes, expected {size}")
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
