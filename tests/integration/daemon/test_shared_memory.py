"""Ownership of shared memory across PID namespaces, and the ``auto`` transport when it cannot be mapped.

A daemon decides that a segment in /dev/shm was left by a dead daemon from the segment's lock (its owner holds
an flock for its lifetime), not from the pid in its name: a daemon in another PID namespace (containers
sharing /dev/shm) has pids this one cannot see.
"""

from __future__ import annotations

import glob
import logging
import os
import subprocess
import sys

import pytest
from conftest import HELPERS, Daemon, shm_segments

import kvstore

pytestmark = pytest.mark.timeout(90)


def unused_pid() -> int:
    """A pid no process has here now (a child that has exited and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class ForeignPidDaemon(Daemon):
    """A daemon whose segment names carry ``foreign_pid``, as seen from another PID namespace."""

    def __init__(self, workdir: str, foreign_pid: int, **kw):
        super().__init__(workdir, **kw)
        self.foreign_pid = foreign_pid

    def command(self) -> list[str]:
        cmd = super().command()
        return [cmd[0], os.path.join(HELPERS, "foreign_pid_daemon.py"), str(self.foreign_pid), *cmd[4:]]


def test_daemon_does_not_reap_a_live_daemon_in_another_pid_namespace(daemon_factory, short_dir):
    pid = unused_pid()
    live = ForeignPidDaemon(short_dir, pid, capacity="8MiB").start()
    try:
        with live.connect("shm") as s:  # the hello reply comes once the memory is set up
            s.put("kept", b"k" * 300_000)
        segments = glob.glob(f"/dev/shm/kvstore-{pid}-*")
        assert len(segments) == 2, segments  # the segment and the index, named for a pid that is not running
        other = daemon_factory(capacity="4MiB")  # starts up and reaps what dead daemons left
        with other.connect("shm") as s:
            s.ping()  # it has started up, reaping done
        removed = [line for line in other.log().splitlines() if "left by a dead daemon" in line]
        assert not [line for line in removed if f"kvstore-{pid}-" in line], removed
        if sorted(glob.glob(f"/dev/shm/kvstore-{pid}-*")) != sorted(segments):
            # not the daemon under test (its log says so): a daemon of an older version, sharing this host's
            # /dev/shm, that judges by pid
            pytest.skip("another daemon on this host (an older version) removed the live daemon's segments")
        with live.connect("shm") as s:  # a new same-host client of the live daemon
            assert s.transport == "shm"
            assert bytes(s.get("kept")) == b"k" * 300_000
            s.put("more", b"m" * 300_000)
    finally:
        live.stop()
    assert glob.glob(f"/dev/shm/kvstore-{pid}-*") == []


def test_segments_of_a_killed_daemon_are_still_reaped(daemon_factory):
    dead = daemon_factory(capacity="4MiB")
    with dead.connect("shm") as s:
        s.ping()  # its memory is set up
    old_pid = dead.pid
    assert shm_segments(old_pid)
    dead.kill()
    daemon_factory(capacity="4MiB")
    assert shm_segments(old_pid) == []


def test_auto_falls_back_to_tcp_when_the_segments_cannot_be_opened(daemon_factory, caplog):
    d = daemon_factory(capacity="4MiB")
    with d.connect("shm") as s:
        s.put("v", b"v" * 200_000)
    for path in shm_segments(d.pid):  # what a reaper in another namespace did before the fix
        os.unlink(path)
    with pytest.raises(kvstore.TransportError):
        d.connect("shm")
    with caplog.at_level(logging.WARNING, logger="kvstore.client"):
        with d.connect("auto") as s:
            assert s.transport == "tcp"
            assert bytes(s.get("v")) == b"v" * 200_000
    assert any("falling back to tcp" in r.getMessage() for r in caplog.records), caplog.records
