"""Defect 2 of issue 11, with real processes: the lock-free same-host read must never serve a dead daemon's
data, neither after the daemon is SIGKILLed nor after a new daemon on the same socket holds a new version.
"""

from __future__ import annotations

import signal

import pytest
from client_child import pattern  # noqa: E402

import kvstore

pytestmark = pytest.mark.timeout(120)

SIZE = 256 << 10


@pytest.mark.parametrize("verify", [False, True])
def test_lock_free_read_fails_once_its_daemon_is_gone(daemon_factory, verify):
    d = daemon_factory(capacity="16MiB")
    old = pattern("old", SIZE)
    reader, idle = d.connect("shm", timeout=3.0), d.connect("shm", timeout=3.0)
    reader.put("k", old)
    out = bytearray(SIZE)
    assert reader.get_into("k", out, verify=verify) == SIZE and out == old  # served by the index
    d.kill()
    with pytest.raises(kvstore.StoreConnectionError):
        reader.get_into("k", out, verify=verify)
    # a new daemon on the same socket, holding a new version under the same key
    d2 = daemon_factory(capacity="16MiB", unix_path=d.unix_path, port=d.port)
    with d2.connect("shm") as writer:
        new = pattern("new", SIZE)
        writer.put("k", new)
        for client in (reader, idle):  # idle: its first call since the old daemon died
            buf = bytearray(SIZE)
            with pytest.raises(kvstore.StoreConnectionError):
                client.get_into("k", buf, verify=verify)
            assert buf == bytes(SIZE)  # nothing written: never the old bytes
            client.close()
        with d2.connect("shm") as fresh:  # a new client of the new daemon reads the new version
            assert fresh.get_into("k", out, verify=verify) == SIZE and out == new


def test_lock_free_read_of_a_stopped_daemon_fails(daemon_factory):
    """A daemon stopped cleanly marks its index dead: a client that still maps it falls back and fails."""
    d = daemon_factory(capacity="16MiB")
    c = d.connect("shm", timeout=3.0)
    c.put("k", pattern("k", SIZE))
    out = bytearray(SIZE)
    assert c.get_into("k", out) == SIZE
    d.stop(signal.SIGTERM)
    with pytest.raises(kvstore.StoreConnectionError):
        c.get_into("k", out)
    c.close()
