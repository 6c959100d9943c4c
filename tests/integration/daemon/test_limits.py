"""Issue 11's daemon limits, with real processes: unauthenticated connections (frame cap, auth deadline,
connection caps), descriptor exhaustion, clients gone during wait(), stalled transfers, and per-client caps.
Every test also checks that the daemon keeps serving a well-behaved client.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys

import pytest
from client_child import pattern  # noqa: E402
from conftest import Daemon, MiB, child_env, hello_proof, wait_until

import kvstore
from kvstore.core.meta import ObjectMeta
from kvstore.protocol import wire
from kvstore.protocol.url import host_id

pytestmark = pytest.mark.timeout(120)


def _raw(d: Daemon, unix: bool = False, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX if unix else socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(15)
    sock.connect(d.unix_path if unix else ("127.0.0.1", d.port))
    return sock


def _send(sock: socket.socket, rid: int, **msg) -> None:
    sock.sendall(wire.encode({"v": wire.VERSION, "id": rid, **msg}))


def _hello(sock: socket.socket, transport: str = "tcp") -> dict:
    def call(message: dict) -> dict:
        _send(sock, 0, **message)
        return _reply(sock)

    _send(sock, 1, op="hello", client="raw", transport=transport, host=host_id(), pid=os.getpid(),
          **hello_proof(call, _token()))
    return _reply(sock)


def _token() -> str | None:
    """The session's daemon token (the fixtures' daemons require it on tcp://)."""
    path = os.environ.get("KVSTORE_TOKEN_FILE")
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def _reply(sock: socket.socket) -> dict:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("daemon closed the connection")
            buf += chunk
        return buf

    return wire.decode(exact(wire.frame_length(exact(4))))


def _closed_by_daemon(sock: socket.socket) -> bool:
    """True once the daemon has closed the connection (reads EOF or a reset), False if it stays open."""
    try:
        while True:
            data = sock.recv(1 << 16)
            if not data:
                return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


# ---- defect 3: unauthenticated connections --------------------------------------------------------------
def test_preauth_frames_are_capped_and_unauthenticated_connections_dropped(daemon_factory):
    d = daemon_factory(capacity="8MiB", args=("--auth-timeout", "1"))
    with d.connect("tcp") as good:
        big = [_raw(d) for _ in range(20)]
        for sock in big:
            sock.sendall(wire.LENGTH.pack(wire.MAX_FRAME))  # "a 1 MiB frame follows", then silence
        idle = [_raw(d, unix=i % 2 == 0) for i in range(20)]  # never say anything
        good.ping()
        assert all(_closed_by_daemon(s) for s in big)  # refused at the header: no 1 MiB buffer each
        assert all(_closed_by_daemon(s) for s in idle)  # dropped at the auth deadline
        for s in big + idle:
            s.close()
        assert "did not authenticate within" in d.log() and "before authentication" in d.log()
        good.put("still", b"serving")
        assert bytes(good.get("still")) == b"serving"
        authenticated = _raw(d)
        assert _hello(authenticated)["ok"]  # hello in time: kept past the deadline, large frames allowed
        _send(authenticated, 2, op="ls", prefix="x" * 4000, limit=10)
        assert _reply(authenticated)["ok"]
        authenticated.close()


def test_connection_caps_per_peer_and_total(daemon_factory):
    d = daemon_factory(capacity="8MiB", args=("--max-connections-per-peer", "10", "--max-connections", "16"))
    with d.connect("shm") as good:  # a Unix-socket peer (its uid): counted apart from TCP addresses
        tcp = [_raw(d) for _ in range(14)]
        closed = [s for s in tcp if _hello_fails(s)]
        assert len(closed) == 4, f"{len(closed)} of 14 TCP connections from one address refused"
        assert "--max-connections-per-peer 10" in d.log()
        unix = [_raw(d, unix=True) for _ in range(8)]  # 10 TCP + 1 good + 8 > 16 in all
        refused = [s for s in unix if _hello_fails(s)]
        assert len(refused) == 3 and "--max-connections 16" in d.log()
        good.put("k", b"v")  # the daemon serves its clients throughout
        for s in tcp + unix:
            s.close()
        assert wait_until(lambda: _can_hello(d), 10)  # and takes new ones once connections go


def _hello_fails(sock: socket.socket) -> bool:
    try:
        return not _hello(sock)["ok"]
    except (ConnectionError, TimeoutError):
        return True


def _can_hello(d: Daemon) -> bool:
    sock = _raw(d)
    try:
        return not _hello_fails(sock)
    finally:
        sock.close()


# ---- defect 4: out of file descriptors --------------------------------------------------------------------
def test_accept_survives_running_out_of_descriptors(daemon_factory):
    d = daemon_factory(capacity="8MiB")
    limit = len(os.listdir(f"/proc/{d.pid}/fd")) + 16
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (limit, limit))  # the daemon child's limit
    flood = []
    for _ in range(100):  # more than the daemon has descriptors for
        try:
            flood.append(_raw(d))
        except OSError:
            break
    assert wait_until(lambda: len(os.listdir(f"/proc/{d.pid}/fd")) >= limit, 10)  # out of descriptors
    for s in flood:
        s.close()
    for transport in ("tcp", "shm"):  # both listeners serve again once descriptors free up
        assert wait_until(lambda t=transport: _works(d, t), 20), d.log()
    assert d.running() and "backing off" in d.log()


def _works(d: Daemon, transport: str) -> bool:
    try:
        with d.connect(transport, timeout=2.0) as c:
            c.put("k", b"v")
            return bytes(c.get("k")) == b"v"
    except kvstore.StoreConnectionError:
        return False


# ---- defect 7: a client gone during wait() ---------------------------------------------------------------
def test_client_gone_during_wait_is_dropped_at_once(daemon_factory):
    d = daemon_factory(capacity="8MiB")
    with d.connect("tcp") as good:
        base = good.stats()["clients"]
        waiters = []
        for i in range(10):
            sock = _raw(d, unix=i % 2 == 0)
            assert _hello(sock)["ok"]
            _send(sock, 2, op="wait", keys=["never"], timeout=3600.0)
            waiters.append(sock)
        assert wait_until(lambda: good.stats()["clients"] == base + 10, 10)
        for sock in waiters:
            sock.close()
        assert wait_until(lambda: good.stats()["clients"] == base, 10), good.stats()
        assert wait_until(lambda: len(good.stats()["connections"]) == 1, 10), good.stats()["connections"]
        other = _raw(d)  # a wait whose client stays still gets its answer
        assert _hello(other)["ok"]
        _send(other, 2, op="wait", keys=["soon"], timeout=30.0)
        good.put("soon", b"here")
        assert _reply(other)["value"] == "soon"
        other.close()
    # a client gone during a wait is a normal disconnect, never an internal error (issue 24, defect 7)
    assert d.log().count("closed its connection during a wait") == 10, d.log()
    assert "crashed" not in d.log() and "Traceback" not in d.log(), d.log()


# ---- defect 8: stalled transfers ---------------------------------------------------------------------------
def test_stalled_tcp_put_is_aborted(daemon_factory, spawn):
    d = daemon_factory(capacity="64MiB", args=("--transfer-timeout", "1"))
    with d.connect("tcp") as good:
        before = good.stats()
        child = spawn("client_child.py", "put-stream", d.tcp_url, "tcp", "stalled", 32 * MiB)
        child.expect("READY")  # sent half its payload, then stopped sending
        assert good.stats()["pending"] == 1
        assert wait_until(lambda: good.stats()["pending"] == 0, 15), good.stats()
        assert good.stats()["used_bytes"] == before["used_bytes"]  # the reservation is freed
        assert "made no progress" in d.log()
        good.put("stalled", pattern("stalled", MiB))  # the key is free to be written
        assert bytes(good.get("stalled")) == pattern("stalled", MiB)


def test_paused_tcp_reader_is_cut_and_its_lease_released(daemon_factory):
    d = daemon_factory(capacity="128MiB", args=("--transfer-timeout", "1"))
    with d.connect("tcp") as good:
        good.put("big", pattern("big", 48 * MiB))
        reader = _raw(d, rcvbuf=4096)
        assert _hello(reader)["ok"]
        _send(reader, 2, op="get", key="big", mode="stream")  # and never read the reply: a paused reader
        assert wait_until(lambda: good.stats()["leases"] == 1, 10)
        with pytest.raises(kvstore.ObjectBusyError):
            good.remove("big")
        assert wait_until(lambda: good.stats()["leases"] == 0, 15), good.stats()
        assert good.remove("big")  # no longer pinned by the stalled stream
        reader.close()


# ---- caps: pending bytes and leases per client ---------------------------------------------------------------
def test_pending_bytes_over_the_cap_never_evict(daemon_factory):
    d = daemon_factory(capacity="64MiB", args=("--max-pending-bytes", "16MiB"))
    with d.connect("tcp") as good:
        for i in range(12):  # 48 MiB of committed data
            good.put(f"c/{i}", pattern(f"c/{i}", 4 * MiB))
        hog = _raw(d)
        assert _hello(hog)["ok"]
        refused, evictions = None, None
        for i in range(8):  # reserve 8 MiB at a time, commit never
            meta = ObjectMeta(key=f"p/{i}", size=8 * MiB)
            _send(hog, 2 + i, op="put", key=meta.key, size=meta.size, meta=meta.to_wire(), mode="stream", defer=True)
            hog.sendall(bytes(8 * MiB))
            reply = _reply(hog)
            if (i + 1) * 8 * MiB > 16 * MiB and evictions is None:
                evictions = good.stats()["evictions"]  # from here on, reservations may not evict
            if not reply["ok"]:
                refused = reply
                break
        assert refused is not None and refused["error"] == "QuotaExceeded", refused
        assert "max-pending-bytes" in refused["message"]
        assert good.stats()["evictions"] == evictions  # refused rather than evicting committed data
        hog.close()
        assert wait_until(lambda: good.stats()["pending"] == 0, 10)
        good.put("after", pattern("after", 4 * MiB))  # the daemon serves its clients throughout


def test_leases_per_client_are_capped(daemon_factory):
    d = daemon_factory(capacity="8MiB", args=("--max-leases", "8"))
    with d.connect("tcp") as c, d.connect("tcp") as other:
        c.put("k", b"v" * 1000)
        held = [c.lease("k") for _ in range(8)]
        for lease in held:
            lease.__enter__()
        with pytest.raises(kvstore.QuotaExceededError, match="max-leases"):
            with c.lease("k"):
                pass
        with pytest.raises(kvstore.QuotaExceededError, match="max-leases"):  # another connection of this process
            with other.lease("k"):  # shares it (another process has its own: test_leases_are_capped_per_process)
                pass
        for lease in held:
            lease.__exit__(None, None, None)
        with c.lease("k"):
            pass


# ---- issue 24: quotas per peer (one process), not only per connection --------------------------------------
_GREEDY = """
import sys
import kvstore
url, token, sessions, size, leases = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
stores = [kvstore.connect(url, token=token, transport="shm") for _ in range(sessions)]
held, results = [], []
for i, s in enumerate(stores):
    batch = s.reservation()
    try:
        batch.add("greedy/%d" % i, size)
        held.append(batch)
        results.append("ok")
    except kvstore.QuotaExceededError:
        results.append("quota")
    for j in range(leases):
        try:
            held.append(s.lease("shared"))
            held[-1].__enter__()
            results.append("lease")
        except kvstore.QuotaExceededError:
            results.append("lease-quota")
print(" ".join(results), flush=True)
sys.stdin.read()
"""


def _greedy(d: Daemon, sessions: int, size: int, leases: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _GREEDY, d.unix_url, d.token, str(sessions), str(size),
                             str(leases)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env())


def test_eight_sessions_of_one_process_share_one_quota(daemon_factory):
    """Eight sessions of one process reserve 30 MiB each of a 256 MiB daemon: together they are held to one
    client's limits (3/4 of the capacity held), so another client's puts still fit."""
    d = daemon_factory(capacity="256MiB")
    with d.connect("shm") as other:
        for i in range(12):
            other.put(f"mine/{i}", pattern(f"mine/{i}", 8 * MiB))
        greedy = _greedy(d, sessions=8, size=30 * MiB)
        try:
            results = greedy.stdout.readline().decode().split()
            assert results.count("ok") * 30 * MiB <= 192 * MiB and "quota" in results, results
            other.put("legit", pattern("legit", 4 * MiB))
            assert bytes(other.get("legit")) == pattern("legit", 4 * MiB)
        finally:
            greedy.communicate(b"", timeout=30)


def test_leases_are_capped_per_process(daemon_factory):
    d = daemon_factory(capacity="32MiB", args=("--max-leases", "8"))
    with d.connect("tcp") as other:
        other.put("shared", b"x" * 1024)
        greedy = _greedy(d, sessions=4, size=1024, leases=4)
        try:
            results = greedy.stdout.readline().decode().split()
            assert results.count("lease") == 8 and results.count("lease-quota") == 8, results
            assert other.stats()["leases"] == 8
        finally:
            greedy.communicate(b"", timeout=30)


# ---- issue 24: refused requests and wrong tokens do not flood the log ----------------------------------------
def test_a_flood_of_refused_requests_is_logged_a_few_lines_at_a_time(daemon_factory):
    d = daemon_factory(capacity="8MiB")
    sock = _raw(d)
    assert _hello(sock)["ok"]
    for i in range(2000):
        _send(sock, 10 + i, op="exists", key="")  # InvalidKey, each
        assert _reply(sock)["error"] == "InvalidKey"
    sock.close()
    with d.connect("tcp") as s:
        s.ping()
        with pytest.raises(kvstore.KeyNotFoundError):
            s.get("missing")
    lines = [line for line in d.log().splitlines() if " failed: " in line]
    assert 2 <= len(lines) <= 40, f"{len(lines)} lines"
    assert "missing" in d.log()  # a new session's first refusal is always logged


def test_wrong_tokens_are_answered_later_and_later(daemon_factory):
    """A guesser answers the challenge with another token's proof (kvstore's own client stops earlier: the
    daemon's proof does not match its token); each refused hello from that peer is answered later."""
    d = daemon_factory(capacity="8MiB")
    for _ in range(4):
        sock = _raw(d)
        try:
            def call(message: dict, sock: socket.socket = sock) -> dict:
                _send(sock, 0, **message)
                return _reply(sock)

            _send(sock, 1, op="hello", client="guess", transport="tcp", host=host_id(), pid=os.getpid(),
                  **hello_proof(call, "wrong"))
            reply = _reply(sock)
            assert reply["ok"] is False and reply["error"] == "Authentication", reply
        finally:
            sock.close()
    with d.connect("tcp") as s:  # the right token is served at once
        s.ping()
    delays = [line.rsplit("answered after ", 1)[1].split()[0] for line in d.log().splitlines()
              if "wrong token" in line and "answered after" in line]
    assert delays == ["0.1", "0.2", "0.4", "0.8"], delays  # doubling for each failure in a row from one peer
