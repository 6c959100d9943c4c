"""Segment: host memory the store owns, backed by POSIX shared memory so same-host clients can map it.

Names are ``kvstore-<pid>-<nonce>-<n>`` (segments) and ``kvstore-<pid>-<nonce>-index``; the daemon unlinks
them at shutdown, and a daemon starting up unlinks those whose owner process is gone (a SIGKILLed daemon).
"Gone" is decided by the owner's flock on the file (see kvstore.memory.shm), never by the pid in the name:
two daemons sharing ``/dev/shm`` from different PID namespaces (containers with ``--ipc=host``) cannot see
each other's pids, but they see each other's locks.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Any

from kvstore.memory.shm import CREATING, SHM_DIR, SharedMemory, try_lock

PREFIX = "kvstore-"


@dataclass(slots=True, eq=False)
class Segment:
    id: int
    shm: SharedMemory

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def size(self) -> int:
        return self.shm.size

    def view(self, offset: int, length: int) -> memoryview:
        return self.shm.buf[offset:offset + length]

    def move(self, src: int, dst: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``src`` to ``dst`` inside this segment (a relocation by the master). The ranges
        may overlap: memoryview slice assignment is a memmove."""
        buf = self.shm.buf
        buf[dst:dst + nbytes] = buf[src:src + nbytes]

    def close(self, unlink: bool = True) -> None:
        if unlink and self.shm.owner:
            self.shm.unlink()
        self.shm.close()


class SegmentSet:
    """The segments of one store, created together under one name stem."""

    def __init__(self, sizes: list[int], *, private: bool = False):
        self.stem = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.segments: list[Segment] = []
        try:
            for i, size in enumerate(sizes):
                self.segments.append(Segment(i, SharedMemory.create(f"{self.stem}-{i}", size, unlink_now=private)))
        except BaseException:
            self.close()
            raise

    def __getitem__(self, i: int) -> Segment:
        return self.segments[i]

    def move(self, segment: int, src: int, dst: int, nbytes: int) -> None:
        """The master's mover (:data:`kvstore.core.master.Mover`) for these segments."""
        self.segments[segment].move(src, dst, nbytes)

    def describe(self) -> list[list[Any]]:
        """[[id, name, size], ...] for clients to map."""
        return [[s.id, s.name, s.size] for s in self.segments]

    def close(self) -> None:
        for seg in self.segments:
            seg.close()
        self.segments = []


def reap_orphans() -> list[str]:
    """Unlink kvstore shared memory whose owner is gone: nobody holds its lock, and the pid in its name (when
    it names one) is not a live process here. Returns the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith((PREFIX, CREATING)):
            continue
        pid_text = name[len(PREFIX):].split("-", 1)[0] if name.startswith(PREFIX) else ""
        if pid_text.isdigit() and _alive(int(pid_text)):
            continue  # also spares a live daemon of an older version, which holds no lock
        path = os.path.join(SHM_DIR, name)
        fd = try_lock(path)
        if fd is None:
            continue  # a live owner, here or in another PID namespace (or not ours to remove)
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
