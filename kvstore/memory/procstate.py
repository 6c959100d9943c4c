"""Whether a process on this host is running, read from ``/proc/<pid>/status`` without asking it.

A cluster member's same-host readers copy from its shared-memory index without a round trip only while the
member runs: a stopped member (SIGSTOP, a tracer) hears no removals and no newer writes elsewhere, so what its
index shows may be gone from the directory. ``ProcessGate`` is checked after each such copy (with the index's
stop marks, ``kvstore.memory.index``): the process must not be stopped or traced (``State`` T or t), not dead
(Z, X, or the file unreadable: a process that exited reads ESRCH through the descriptor opened while it lived,
so a recycled pid is never mistaken for it), and must have no SIGCONT pending (it was continued but has not run
its handler yet, which marks its index as needing a re-check). One ``pread`` of the file (~1.4 KB), ~12 us.
"""

from __future__ import annotations

import os
import signal
from typing import Any

_CONT = 1 << (signal.SIGCONT - 1)
_NOT_RUNNING = frozenset(b"TtZXx")


def running(status: bytes) -> bool:
    """From the text of ``/proc/<pid>/status``: the process runs (or sleeps) and has no SIGCONT pending."""
    state = status.find(b"\nState:\t")
    if state < 0 or status[state + 8] in _NOT_RUNNING:
        return False
    for field in (b"\nSigPnd:\t", b"\nShdPnd:\t"):
        at = status.find(field)
        if at < 0:
            return False
        end = status.find(b"\n", at + 1)
        if int(status[at + len(field):end if end > 0 else None], 16) & _CONT:
            return False
    return True


def pid_namespace() -> tuple[int, int] | None:
    """(device, inode) of this process's pid namespace, or None where /proc does not show it."""
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def start_time(pid: int | str = "self") -> int | None:
    """The process's start time (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


class ProcessGate:
    """``gate()``: the process is running (see ``running``). Opened once; false for good once it exited."""

    def __init__(self, pid: int):
        self.pid = pid
        self._fd: int | None = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)

    @classmethod
    def open(cls, info: dict[str, Any]) -> ProcessGate | None:
        """The gate for a daemon's hello ``index_gate`` ({pid, pid_ns, start}), or None when it cannot be
        checked from here: another pid namespace, no /proc, or the pid is not (or no longer) that daemon."""
        try:
            pid, ns, start = int(info["pid"]), info.get("pid_ns"), info.get("start")
        except (KeyError, TypeError, ValueError):
            return None
        here = pid_namespace()
        if here is None or ns is None or list(here) != list(ns) or start is None:
            return None
        try:
            gate = cls(pid)
        except OSError:
            return None
        if start_time(pid) != start:  # checked after the open: the descriptor now pins that very process
            gate.close()
            return None
        return gate

    def __call__(self) -> bool:
        if self._fd is None:
            return False
        try:
            return running(os.pread(self._fd, 4096, 0))
        except OSError:  # ESRCH: it exited
            return False

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
