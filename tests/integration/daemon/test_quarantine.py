"""Defect 1 of issue 11, with real processes: a same-host client paused in the middle of a large put, while it
holds a zero-copy view, must corrupt nothing once the daemon has revoked it, and the space it may still
touch comes back only when its process is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from client_child import pattern  # noqa: E402
from conftest import MiB, child_env, hello_proof, wait_until
from test_bad_input import CLOSED, RawClient

import kvstore
from kvstore.protocol.url import host_id

pytestmark = pytest.mark.timeout(120)

BIG = 24 * MiB
CHUNK = 2 * MiB


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _fill(store: kvstore.KVStore, rounds: int) -> list[str]:
    """Put CHUNK-sized objects until the store has cycled through its space ``rounds`` times."""
    keys, capacity = [], store.stats()["capacity_bytes"]
    for i in range(rounds * capacity // CHUNK):
        key = f"fill/{i}"
        store.put(key, pattern(key, CHUNK))
        keys.append(key)
    return keys


def test_paused_client_corrupts_nothing_and_its_space_returns_when_it_exits(daemon_factory, spawn):
    d = daemon_factory(capacity="64MiB", args=("--heartbeat-timeout", "1"))
    with d.connect("shm") as other:
        other.put("held", pattern("held", CHUNK))
        child = spawn("client_child.py", "paused-put", d.unix_url, "shm", "held", BIG)
        child.expect("READY")
        assert wait_until(lambda: _stopped(child.proc.pid), 10)
        # the heartbeat expires: the daemon revokes the paused client's put and lease
        assert wait_until(lambda: other.stats()["pending"] == 0 and other.stats()["leases"] == 0, 20), other.stats()
        keys = _fill(other, rounds=2)  # another client fills the store, evicting all along
        assert other.stats()["evictions"] > 0
        child.proc.send_signal(signal.SIGCONT)
        _, commit, view = child.expect("RESULT").split()
        assert commit == "refused"  # its put was revoked
        assert view == "same"  # the zero-copy object never changed under its holder
        out, stored = bytearray(CHUNK), 0
        for key in keys + ["held"]:  # every committed object reads back right through plain get_into
            try:
                n = other.get_into(key, out)
            except kvstore.KeyNotFoundError:
                continue  # evicted
            assert n == CHUNK and bytes(out) == pattern(key, CHUNK), f"{key} was overwritten"
            stored += 1
        assert stored >= 10
        stats = other.stats()  # still alive: its space is still held, not handed out again
        assert stats.get("quarantined_bytes", 0) >= BIG + CHUNK, stats
        child.kill()
        assert wait_until(lambda: other.stats()["quarantined_bytes"] == 0, 10), other.stats()
        for key in other.keys(""):
            other.remove(key)
        # all reclaimed (but the free space of the other client's own arena)
        assert wait_until(lambda: other.stats()["used_bytes"] == other.stats()["arena_bytes"], 10), other.stats()
        other.put("whole", pattern("whole", 56 * MiB))  # and usable again
        assert bytes(other.get("whole")) == pattern("whole", 56 * MiB)


def test_view_of_a_disconnected_live_client_never_changes(daemon_factory, spawn):
    """Revoked by a disconnect (its connection lost, its process alive): its zero-copy view keeps its bytes."""
    d = daemon_factory(capacity="32MiB")
    with d.connect("shm") as other:
        other.put("held", pattern("held", CHUNK))
        child = spawn("client_child.py", "view-dropped", d.unix_url, "shm", "held")
        child.expect("READY")
        assert wait_until(lambda: other.stats()["leases"] == 0, 10)  # revoked
        assert other.remove("held")  # gone from the store, but its bytes stay where the view reads them
        _fill(other, rounds=2)
        child.proc.send_signal(signal.SIGUSR1)
        assert child.expect("VIEW") == "VIEW same"
        assert other.stats().get("quarantined_bytes") == CHUNK
        child.kill()
        assert wait_until(lambda: other.stats()["quarantined_bytes"] == 0, 10), other.stats()


def test_quarantine_is_bounded_per_client(daemon_factory, spawn):
    """A client may hold (and so keep quarantined) at most --max-held-bytes, beyond its first object."""
    d = daemon_factory(capacity="64MiB", args=("--max-held-bytes", "8MiB"))
    with d.connect("shm") as s:
        for i in range(3):
            s.put(f"obj/{i}", pattern(f"obj/{i}", 4 * MiB))
        views = [s.get("obj/0", copy=False), s.get("obj/1", copy=False)]
        with pytest.raises(kvstore.QuotaExceededError, match="max-held-bytes"):
            s.get("obj/2", copy=False)
        assert s.stats()["leases"] == 2  # refused without a lease left behind
        for v in views:
            v.release()
        assert bytes(s.get("obj/2")) == pattern("obj/2", 4 * MiB)  # once released, it reads again


# ---- issue 24, defect 1: same-host clients over TCP ------------------------------------------------------------
_KILLED_CLIENT = """
import os, signal, sys
import kvstore
s = kvstore.connect(sys.argv[1], token=sys.argv[2], timeout=10)
s.put("k%d" % os.getpid(), b"x" * 1024)
print(s.stats()["transport"], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_sigkilled_same_host_tcp_clients_strand_nothing(daemon_factory):
    """Twelve clients on the daemon's host, connected by tcp://127.0.0.1 (transport auto: they get shm and an
    arena), put 1 KiB and are SIGKILLed: once they are gone nothing stays quarantined and the space is usable."""
    d = daemon_factory(capacity="128MiB")
    transports = []
    for _ in range(12):
        child = subprocess.run([sys.executable, "-c", _KILLED_CLIENT, d.tcp_url, d.token], env=child_env(),
                               capture_output=True, timeout=60)
        assert child.returncode == -signal.SIGKILL, child.stderr.decode()
        transports.append(child.stdout.decode().strip())
    assert transports == ["shm"] * 12  # verified same-host clients keep the shared-memory path
    with d.connect("shm") as s:
        assert wait_until(lambda: s.stats()["quarantined_bytes"] == 0, 20), s.stats()
        s.put("big", b"y" * (40 * MiB))
        assert s.get_into("big", bytearray(40 * MiB)) == 40 * MiB


def test_second_hello_cannot_switch_a_tcp_session_to_shm(daemon_factory):
    d = daemon_factory(capacity="32MiB")
    c = RawClient(d.tcp_url)
    try:
        assert c.hello(transport="tcp", **hello_proof(c.call, d.token))["transport"] == "tcp"
        reply = c.call({"op": "hello", "client": "raw-test", "transport": "shm", "host": host_id(),
                        "pid": os.getpid(), **hello_proof(c.call, d.token)})
        assert reply != CLOSED and reply["ok"] is False and reply["error"] == "InvalidArgument", reply
        assert "second hello" in reply["message"]
        again = c.call({"op": "hello", "client": "raw-test", "transport": "tcp", "host": host_id(),
                        **hello_proof(c.call, d.token)})
        assert again["ok"] and again["transport"] == "tcp"  # the same transport: still allowed
        with d.connect("shm") as s:
            clients = [x for x in s.stats()["connections"] if x["client"] == "raw-test"]
            assert [x["transport"] for x in clients] == ["tcp"], clients
    finally:
        c.close()
