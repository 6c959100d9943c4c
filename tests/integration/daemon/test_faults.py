"""Faults with real processes: clients SIGKILLed mid-put or holding leases, a daemon SIGKILLed or frozen,
silent clients, graceful stops, and a soak of 8 client processes against a nearly full daemon.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
from client_child import pattern  # noqa: E402
from conftest import MiB, no_hang, pid_alive, shm_segments, wait_until
from stress_worker import check_value  # noqa: E402
from stress_worker import make_value as worker_make_value

import kvstore
from kvstore.core.meta import ObjectMeta
from kvstore.protocol import wire
from kvstore.protocol.url import host_id

pytestmark = pytest.mark.timeout(90)

BIG = 48 * MiB


# ---- a client dies mid-put -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,listener", [("put-region", "unix"), ("put-stream", "tcp"), ("put-stream", "unix")])
def test_client_killed_mid_put(daemon, spawn, mode, listener):
    key = f"fault/midput-{mode}-{listener}"
    with daemon.connect("tcp") as s:
        before = s.stats()
        url = daemon.unix_url if listener == "unix" else daemon.tcp_url
        child = spawn("client_child.py", mode, url, "shm" if mode == "put-region" else "tcp", key, BIG)
        child.expect("READY")
        during = s.stats()  # the daemon answers others while a put is half done
        assert during["pending"] == before["pending"] + 1, during
        assert during["used_bytes"] >= before["used_bytes"] + BIG, during
        assert not s.exists(key)
        with daemon.connect("shm") as other:  # and serves whole puts and gets meanwhile
            other.put("fault/bystander", b"b" * MiB)
            assert bytes(other.get("fault/bystander")) == b"b" * MiB
            assert other.remove("fault/bystander")
        child.kill()
        assert wait_until(lambda: s.stats()["pending"] == before["pending"], 10), s.stats()
        after = s.stats()
        assert after["used_bytes"] == before["used_bytes"], (before, after)
        assert not s.exists(key)
        assert key not in s.keys("fault/")
        with pytest.raises(kvstore.KeyNotFoundError):
            s.get(key)
        # the key is free to be written again, in full
        data = pattern(key, BIG)
        s.put(key, data)
        assert bytes(s.get(key)) == data
        assert s.remove(key)


def test_client_killed_mid_put_of_a_replacement_keeps_the_old_version(daemon, spawn):
    key = "fault/replace-midput"
    old = pattern("old", 3 * MiB)
    with daemon.connect("shm") as s:
        s.put(key, old)
        child = spawn("client_child.py", "put-region", daemon.unix_url, "shm", key, 8 * MiB)
        child.expect("READY")
        assert bytes(s.get(key)) == old  # the half-written version is invisible
        child.kill()
        assert wait_until(lambda: s.stats()["pending"] == 0, 10)
        assert bytes(s.get(key)) == old
        out = bytearray(3 * MiB)
        assert s.get_into(key, out) == 3 * MiB and bytes(out) == old
        assert s.remove(key)


# ---- a client dies holding a lease -----------------------------------------------------------------------
@pytest.mark.parametrize("mode,transport", [("lease", "tcp"), ("lease", "shm"), ("view", "shm")])
def test_client_killed_holding_a_lease(daemon, spawn, mode, transport):
    key = f"fault/leased-{mode}-{transport}"
    data = pattern(key, 2 * MiB)
    with daemon.connect("tcp") as s:
        s.put(key, data)
        base = s.stats()["leases"]
        child = spawn("client_child.py", mode, daemon.unix_url if transport == "shm" else daemon.tcp_url,
                      transport, key)
        child.expect("READY")
        assert s.stats()["leases"] == base + 1
        with pytest.raises(kvstore.ObjectBusyError):
            s.remove(key)
        with pytest.raises(kvstore.ObjectBusyError):
            s.evict(key)
        child.kill()
        assert wait_until(lambda: s.stats()["leases"] == base, 10), s.stats()
        assert bytes(s.get(key)) == data
        assert s.remove(key)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_ephemeral_object_goes_with_its_killed_writer(daemon, spawn, transport):
    key = f"fault/ephemeral-{transport}"
    with daemon.connect("tcp") as s:
        s.put("fault/durable", b"d" * 1000)
        before = s.stats()
        child = spawn("client_child.py", "ephemeral", daemon.unix_url if transport == "shm" else daemon.tcp_url,
                      transport, key, 2 * MiB)
        child.expect("READY")
        assert bytes(s.get(key)) == pattern(key, 2 * MiB)
        child.kill()
        assert wait_until(lambda: not s.exists(key), 10)
        assert wait_until(lambda: s.stats()["used_bytes"] == before["used_bytes"], 10), (before, s.stats())
        assert bytes(s.get("fault/durable")) == b"d" * 1000  # others' objects stay
        assert s.remove("fault/durable")


# ---- the daemon dies or freezes --------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_daemon_killed(daemon_factory):
    d = daemon_factory(capacity="16MiB")
    clients = {t: d.connect(t, timeout=3.0) for t in ("shm", "tcp")}
    for t, c in clients.items():
        c.put(f"k-{t}", pattern(t, 200_000))
    old_pid, old_segments = d.pid, shm_segments(d.pid)
    assert old_segments
    d.kill()
    for t, c in clients.items():
        for call in (lambda c=c: c.put("after", b"x" * 100_000), lambda c=c: c.stats(), lambda c=c: c.exists("k-tcp"),
                     lambda c=c: c.get("k-tcp")):
            with no_hang(f"a call over {t} to a killed daemon"), pytest.raises(ConnectionError) as info:
                call()
            assert isinstance(info.value, kvstore.StoreConnectionError)
        c.close()
    for url in (d.unix_url, d.tcp_url):
        with no_hang(f"a connect to a killed daemon at {url}"), pytest.raises(kvstore.StoreConnectionError):
            kvstore.connect(url, timeout=3.0)
    assert os.path.exists(d.unix_path)  # the stale socket file a SIGKILL leaves behind
    # a new daemon on the same addresses: the stale socket and the dead daemon's memory are dealt with
    d2 = daemon_factory(capacity="16MiB", unix_path=d.unix_path, port=d.port)
    for t in ("shm", "tcp"):
        with d2.connect(t) as c:
            assert not c.exists("k-tcp")  # a new, empty store
            c.put(f"new-{t}", pattern("new", 300_000))
            assert bytes(c.get(f"new-{t}")) == pattern("new", 300_000)
    assert shm_segments(old_pid) == [], "the new daemon did not reap the dead daemon's shared memory"


@pytest.mark.timeout(120)
def test_frozen_daemon_calls_time_out(daemon_factory):
    d = daemon_factory(capacity="8MiB")
    clients = {t: d.connect(t, timeout=1.0) for t in ("shm", "tcp")}
    for t, c in clients.items():
        c.put(f"k-{t}", b"v" * 200_000)
    d.send(signal.SIGSTOP)
    try:
        for t, c in clients.items():
            # StoreTimeoutError (or closed by a timed-out heartbeat)
            with no_hang(f"a put over {t} to a frozen daemon"), pytest.raises(ConnectionError) as info:
                c.put(f"k2-{t}", b"w" * 200_000)
            assert isinstance(info.value, kvstore.StoreConnectionError)
            with pytest.raises(ConnectionError):  # its reconnect times out as well
                c.stats()
            c.close()
        with no_hang("a connect to a frozen daemon"), pytest.raises(kvstore.StoreTimeoutError):
            kvstore.connect(d.unix_url, timeout=1.0)  # connect lands in the backlog; hello times out
    finally:
        d.send(signal.SIGCONT)
    with d.connect("shm") as c:  # thawed, it serves again; the timed-out clients' state is gone
        assert bytes(c.get("k-shm")) == b"v" * 200_000
        assert wait_until(lambda: c.stats()["pending"] == 0, 10)


# ---- liveness: heartbeats ---------------------------------------------------------------------------------
def test_silent_client_is_dropped(daemon_factory):
    """A connected client that stops heart-beating loses its pending puts and leases."""
    d = daemon_factory(capacity="8MiB", args=("--heartbeat-timeout", "1"))
    with d.connect("tcp") as s:
        s.put("held", b"h" * 1000)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(d.unix_path)
        try:
            for i, msg in enumerate([
                    {"op": "hello", "client": "silent", "transport": "shm", "host": host_id(), "pid": os.getpid(),
                     **d.hello_auth()},
                    {"op": "lease", "key": "held"},
                    {"op": "put", "key": "never", "size": MiB, "meta": ObjectMeta(key="never", size=MiB).to_wire(),
                     "mode": "region"}]):
                sock.sendall(wire.encode({"v": wire.VERSION, "id": i + 1, **msg}))
                assert read_reply(sock)["ok"]
            stats = s.stats()
            assert stats["leases"] == 1 and stats["pending"] == 1
            # the socket stays open, but nothing more comes from it
            assert wait_until(lambda: s.stats()["leases"] == 0 and s.stats()["pending"] == 0, 15), s.stats()
            assert s.remove("held")
            assert not s.exists("never")
        finally:
            sock.close()


def read_reply(sock: socket.socket) -> dict:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            assert chunk, "daemon closed the connection"
            buf += chunk
        return buf

    return wire.decode(exact(wire.frame_length(exact(4))))


def test_idle_client_stays_connected(daemon_factory):
    """The client library heart-beats on its own: an idle client is not dropped."""
    d = daemon_factory(capacity="8MiB", args=("--heartbeat-timeout", "1"))
    for t in ("shm", "tcp"):
        with d.connect(t) as s:
            s.put("idle", b"i" * 100)
            time.sleep(2.5)
            assert bytes(s.get("idle")) == b"i" * 100


def test_wait_longer_than_the_heartbeat_timeout(daemon_factory):
    """A client blocked in wait() is alive; it must not be dropped as silent."""
    d = daemon_factory(capacity="8MiB", args=("--heartbeat-timeout", "1"))
    with d.connect("shm") as s, d.connect("tcp") as writer:
        t0 = time.monotonic()
        assert s.wait(["late"], timeout=2.5) is None
        # a lower bound (load only makes it longer): the client sat in wait() past the 1 s heartbeat timeout
        assert time.monotonic() - t0 > 1.0
        threading.Timer(2.0, lambda: writer.put("late", b"at last")).start()
        assert s.wait(["late"], timeout=10) == "late"


# ---- graceful stop ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_graceful_stop_with_clients_attached(daemon_factory, sig):
    d = daemon_factory(capacity="8MiB")
    clients = [d.connect("shm"), d.connect("tcp")]
    clients[0].put("a", b"a" * 200_000)
    view = clients[0].get("a", copy=False)  # a zero-copy lease held while the daemon stops
    lease = clients[1].lease("a")
    lease.__enter__()
    d.stop(sig)  # asserts exit 0, socket and shared memory removed
    assert bytes(view) == b"a" * 200_000  # still mapped by this process: readable, never a crash
    for c in clients:
        with pytest.raises(ConnectionError):
            c.stats()
        c.close()


# ---- a daemon that exits with its owner (--exit-with) ----------------------------------------------------
OWNER = """
import subprocess, sys, time
daemon = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--listen", sys.argv[1], "--capacity",
                           "8MiB", "--exit-with", str(__import__("os").getpid())], start_new_session=True)
print(daemon.pid, flush=True)
time.sleep(3600)
"""


def test_daemon_exits_with_its_owner_when_the_owner_is_killed(tmp_path):
    """``--exit-with PID``: when the owner dies (even SIGKILLed: no cleanup of its own), the daemon it started
    stops gracefully: its socket and shared memory are removed and nothing outlives the owner."""
    import subprocess
    import sys

    sock = tmp_path / "owned.sock"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, f"unix://{sock}"], stdout=subprocess.PIPE, text=True)
    try:
        daemon_pid = int(owner.stdout.readline())
        assert wait_until(lambda: sock.exists(), 30), "the daemon did not start listening"
        with kvstore.connect(f"unix://{sock}") as s:
            s.put("owned/a", b"x" * 1000)
            assert shm_segments(daemon_pid)
        owner.kill()
        owner.wait()
        with no_hang("the daemon's exit after its owner's"):
            assert wait_until(lambda: not pid_alive(daemon_pid), 30), "the daemon outlived its owner"
        assert not sock.exists() and shm_segments(daemon_pid) == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        owner.stdout.close()


@pytest.mark.parametrize("pid", ["0", "-3", "abc"])
def test_exit_with_refuses_what_is_not_a_process_id(tmp_path, pid):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix://{tmp_path}/x.sock",
                          "--exit-with", pid], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "exit-with" in out.stderr


# ---- soak: 8 processes against a nearly full daemon -------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_soak_eight_clients_nearly_full(daemon_factory, spawn):
    """Values come in two KV-chunk-like size classes (8 KiB inline, 256 KiB over shm/tcp): with freely mixed
    sizes a non-moving allocator fragments and LRU eviction settles the fill well below the watermark."""
    capacity, seconds, keyspace, max_size = 32 * MiB, 20, 512, 256 << 10
    d = daemon_factory(capacity="32MiB", args=("--high-watermark", "0.99", "--low-watermark", "0.97"))
    with d.connect("shm") as s:  # fill to the watermark before the clients start
        rng = np.random.default_rng(0)
        i = 0
        while s.stats()["evictions"] == 0:
            key = f"stress/{i % keyspace}"
            s.put(key, make_value(key, rng))
            i += 1
        start = s.stats()
        workers = [spawn("stress_worker.py", d.unix_url if w % 2 == 0 else d.tcp_url,
                         "shm" if w % 2 == 0 else "tcp", seconds, 1000 + w, keyspace, max_size) for w in range(8)]
        for w in workers:
            w.expect("READY", timeout=60)
        fill, rss = [], []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            fill.append(s.stats()["used_bytes"] / capacity)
            rss.append(d.rss_bytes())
            time.sleep(0.25)
        reports = []
        for w in workers:
            rc, out, err = w.wait(timeout=90)
            assert rc == 0, f"worker exited {rc}:\n{err[-3000:]}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
        unexpected = [u for r in reports for u in r["unexpected"]]
        assert not unexpected, "\n".join(unexpected[:10])
        totals = {k: sum(r["counts"][k] for r in reports) for k in reports[0]["counts"]}
        assert totals["put"] > 100 and totals["verified"] > 100, totals
        assert d.running(), d.log()
        final = s.stats()
        assert final["evictions"] > start["evictions"] + 100, (start, final)  # the run evicted all along
        assert wait_until(lambda: s.stats()["leases"] == 0 and s.stats()["pending"] == 0, 10), s.stats()
        # kept above 90 % full for most of the run, never above capacity
        assert max(fill) <= 1.0
        fill.sort()
        assert fill[len(fill) // 2] >= 0.9, f"median fill {fill[len(fill) // 2]:.2f} (min {fill[0]:.2f}): {final}"
        assert max(rss) <= capacity + 200 * MiB, f"daemon RSS peaked at {max(rss) / MiB:.0f} MiB"
        # whatever is stored now is exactly what some writer wrote
        for key in s.keys("stress/"):
            try:
                problem = check_value(key, s.get(key))
            except kvstore.KeyNotFoundError:
                continue
            assert problem is None, problem


def make_value(key: str, rng: np.random.Generator) -> bytes:
    return worker_make_value(key, rng, 256 << 10)
