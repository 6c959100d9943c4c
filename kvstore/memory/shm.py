"""POSIX shared memory: one ``/dev/shm`` mapping, created (0600, pre-faulted) by its owner or attached by others.

The memory primitive under the daemon's segments and index, and under the ``shm`` transport that maps them.
An owner holds an exclusive ``flock`` on its file for as long as it lives (the kernel drops it when the
process dies, in whatever PID namespace): that, not a pid, is what says a segment is still in use.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets


class SharedMemoryError(Exception):
    """A mapping cannot be created or attached as asked (bad name, wrong size)."""


class SharedMemoryUnavailable(SharedMemoryError):
    """The named segment cannot be opened here (gone, or not on this host)."""


SHM_DIR = "/dev/shm"
CREATING = ".kvstore-creating-"  # a segment's name while its owner sets it up, locked, before it is published
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
_PAGE = mmap.PAGESIZE


def _path(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise SharedMemoryError(f"invalid shared-memory name {name!r}")
    return os.path.join(SHM_DIR, name)


class SharedMemory:
    """One POSIX shared-memory mapping of ``size`` bytes, exposed as a writable memoryview ``buf``."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool, lock_fd: int | None = None):
        self.name, self.size, self._mm, self.owner = name, size, mm, owner
        self._lock_fd = lock_fd  # an owner's open file, flock'ed until close()
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, name: str, size: int, prefault: bool = True, unlink_now: bool = False) -> SharedMemory:
        """Create a new mapping readable and writable by this user only.

        ``prefault`` populates every page now, so the first put runs at warm-memory speed.
        ``unlink_now`` removes the name at once (an in-process store that nobody else maps)."""
        path = _path(name)
        fd, tmp = _create_locked(path)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if not unlink_now:
                os.link(tmp, path)  # published under its name already locked (fails if the name is taken)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        lock_fd: int | None = fd
        if unlink_now:
            os.close(fd)
            lock_fd = None
        shm = cls(name, size, mm, owner=not unlink_now, lock_fd=lock_fd)
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
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock: after unlink() when the owner removes it
            self._lock_fd = None
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


def _create_locked(path: str) -> tuple[int, str]:
    """A new 0600 file next to ``path`` under a temporary name, flock'ed: (fd, temporary path)."""
    for _ in range(8):
        tmp = os.path.join(os.path.dirname(path), f"{CREATING}{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a reaper opened it in the instant before our lock: pick another name
            os.close(fd)
            continue
        if os.path.exists(tmp):
            return fd, tmp
        os.close(fd)  # a reaper took and removed it first
    raise SharedMemoryError(f"cannot create {path}: its temporary file kept disappearing")


def try_lock(path: str) -> int | None:
    """An fd holding ``path``'s exclusive lock if nobody holds it (its owner is gone), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None  # gone, or another user's
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd
