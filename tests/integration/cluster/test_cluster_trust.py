"""The cluster under attack and faults, with real processes (the fixtures of ``test_cluster``: a real
redis-server and three ``kvstore serve --cluster`` daemons):

- write access to Redis is not a key to the cluster: a forged node record pointing at a listener gets no token
  (challenge-response both ways), a record advertising another node's address is refused (node identity in
  the handshake), and a member with another token is skipped by puts and reads and shown in stats;
- a Redis stall longer than the node TTL loses no object (a node cut off from Redis keeps its objects and
  epoch, and takes back what the directory says nobody superseded);
- a stopped owner never serves a key removed or rewritten elsewhere meanwhile, neither to a cluster client
  homed on it (its shared-memory index answers only for the version the directory lists) nor to its own plain
  clients (they ask the daemon, which cannot answer while stopped: a typed error within their timeout).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace

import msgpack
import pytest
from cluster_procs import NS, TTL, Cluster, ClusterDaemon, payload
from conftest import child_env, free_port, short_tmpdir, wait_until

import kvstore
from kvstore.cluster.daemon.session import INDEX_LEASE_S
from kvstore.cluster.directory import decode_entry, encode_entry
from kvstore.core.meta import ObjectMeta

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster():
    workdir = short_tmpdir()
    c = Cluster(workdir)
    yield c
    c.close()
    shutil.rmtree(workdir, ignore_errors=True)


class Listener:
    """A TCP listener that records every byte it receives and answers each frame as a daemon would, with a
    nonce, a node id and a proof it cannot really make (it does not know the token)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.received = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                try:
                    chunk = conn.recv(65536)
                except OSError:
                    return
                if not chunk:
                    return
                with self._lock:
                    self.received += chunk
                buf += chunk
                while len(buf) >= 4 and len(buf) >= 4 + struct.unpack("<I", buf[:4])[0]:
                    n = struct.unpack("<I", buf[:4])[0]
                    request, buf = msgpack.unpackb(buf[4:4 + n], raw=False), buf[4 + n:]
                    reply = {"v": 1, "id": request.get("id", 0), "ok": True, "nonce": os.urandom(32),
                             "node": "EVIL", "proof": os.urandom(32)}
                    body = msgpack.packb(reply, use_bin_type=True)
                    conn.sendall(struct.pack("<I", len(body)) + body)

    def close(self) -> None:
        self.sock.close()


def forge(cluster, node: str, addr: str, keys: tuple[str, ...] = (), epoch: str = "forged-1") -> None:
    """What anyone with write access to Redis can do: a node record and directory entries naming it."""
    rds = cluster.redis.client()
    rds.hset(f"{NS}:node:{node}", mapping={"epoch": epoch, "addr": addr, "host": "elsewhere", "transports": "tcp",
                                            "capacity": 1 << 30, "used": 0, "ttl_ms": 600_000})
    rds.expire(f"{NS}:node:{node}", 600)
    rds.sadd(f"{NS}:nodes", node)
    for key in keys:
        rds.hset(f"{NS}:obj:{key}", node, encode_entry(epoch, ObjectMeta(key=key, size=5, checksum=1, version=1)))


def token(daemon) -> bytes:
    with open(daemon.token_file, "rb") as f:
        return f.read().strip()


def test_forged_record_gets_no_token_and_no_read(cluster):
    listener = Listener()
    try:
        forge(cluster, "EVIL", listener.addr, ("evil/k",))
        c, plain_b = cluster.client("C"), cluster.daemon_client("B", "tcp")
        outcomes = []
        for reader in (c, plain_b):
            try:
                reader.get("evil/k")
                outcomes.append("served")
            except Exception as exc:  # checked below, after what the listener saw
                outcomes.append(type(exc).__name__)
        assert wait_until(lambda: len(listener.received) > 0, 10)  # it was contacted...
        assert token(cluster.nodes["A"]) not in bytes(listener.received)  # ...and never saw the token
        assert outcomes == ["KeyNotFoundError", "KeyNotFoundError"]
        assert "EVIL" in c.stats()["cluster"]["refused"]
        assert wait_until(lambda: "EVIL" in plain_b.stats()["cluster"]["refused"], 10)
    finally:
        listener.close()


def test_record_advertising_another_nodes_address_is_refused(cluster):
    forge(cluster, "FAKE", cluster.nodes["A"].tcp_url)
    homed = cluster.client("FAKE")  # a client that believes FAKE is its home node
    homed.put("id/k", b"must not land on A in FAKE's name")
    stats = homed.stats()["cluster"]
    assert "FAKE" in stats["refused"] and "FAKE" not in cluster.entries("id/k")
    assert bytes(cluster.client("C").get("id/k")) == b"must not land on A in FAKE's name"


def test_member_with_another_token_is_skipped_and_shown(cluster, tmp_path):
    other = tmp_path / "other-token"
    other.write_text("not-the-cluster-token\n")
    other.chmod(0o600)
    d = ClusterDaemon(cluster.workdir, cluster.redis, cluster.redis.url, "D", token_file=str(other),
                      metrics_port=free_port())
    cluster.nodes["D"] = d
    d.start()
    with d.connect("tcp", token="not-the-cluster-token", timeout=5) as own:
        own.put("wt/on-d", b"only D can read this")
    everywhere = cluster.client(placement="balanced", replicas=4)
    everywhere.put("wt/k", b"on every member that proves the token")
    assert set(cluster.entries("wt/k")) == {"A", "B", "C"}
    plain_a = cluster.daemon_client("A")
    with pytest.raises(kvstore.KeyNotFoundError):
        everywhere.get("wt/on-d")
    with pytest.raises(kvstore.KeyNotFoundError):
        plain_a.get("wt/on-d")
    assert "D" in everywhere.stats()["cluster"]["refused"]
    assert not everywhere.exists("wt/on-d") and not plain_a.exists("wt/on-d")  # listed, but nobody can read it
    assert wait_until(lambda: "D" in plain_a.stats()["cluster"]["refused"], 4 * TTL), cluster.logs()
    shown = subprocess.run([sys.executable, "-m", "kvstore.cli", "stats", "--url", cluster.nodes["A"].unix_url],
                           capture_output=True, text=True, timeout=60, env=child_env())
    assert shown.returncode == 0 and "REFUSED peer  D:" in shown.stdout, shown.stdout + shown.stderr

    def metrics() -> str:  # D, in turn, refuses every member that cannot prove its token
        return urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()

    assert wait_until(lambda: 'kvstore_cluster_refused_peers{node="A"} 1.0' in metrics(), 4 * TTL), metrics()


def test_redis_stall_longer_than_the_node_ttl_loses_nothing(cluster):
    a, b = cluster.client("A"), cluster.client("B")
    values = {f"stall/{n}/{i}": payload(f"stall/{n}/{i}", 3000 * (i + 1)) for n in "AB" for i in range(5)}
    for key, value in values.items():
        (a if "/A/" in key else b).put(key, value)
    plain_a = cluster.daemon_client("A")
    rds = cluster.redis.client()
    epochs = {n: cluster.nodes[n].record(rds)["epoch"] for n in "AB"}
    cluster.redis.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(3 * TTL)  # the condition under test: Redis frozen for longer than the node TTL
        plain_a.put("stall/during", b"put while Redis was frozen")
        time.sleep(TTL)
    finally:
        cluster.redis.proc.send_signal(signal.SIGCONT)
    values["stall/during"] = b"put while Redis was frozen"
    c = cluster.client("C")

    def all_readable() -> bool:
        try:
            return all(bytes(c.get(k)) == v for k, v in values.items())
        except kvstore.KeyNotFoundError:
            return False

    assert wait_until(all_readable, 6 * TTL, interval=0.2), cluster.logs()
    assert {n: cluster.nodes[n].record(rds)["epoch"] for n in "AB"} == epochs  # same epoch: not a rejoin
    counters = plain_a.stats()["cluster"]
    assert counters["lapses"] == 0 and counters["resumes"] >= 1, counters


def test_verify_compares_fetched_bytes_with_the_directorys_checksum(cluster):
    cluster.client("A").put("v/k", b"the bytes A holds")
    rds = cluster.redis.client()
    entry = decode_entry("v/k", "A", rds.hget(f"{NS}:obj:v/k", "A"), "", "")
    wrong = replace(entry.meta, checksum=entry.meta.checksum ^ 1)  # the directory's record of that version
    rds.hset(f"{NS}:obj:v/k", "A", encode_entry(entry.epoch, wrong))
    over_tcp = kvstore.connect(cluster.url + "?node=C", transport="tcp", timeout=5)  # bytes from A's stream path
    cluster.stores.append(over_tcp)
    for reader in (over_tcp, cluster.client("C"), cluster.daemon_client("B", "tcp")):
        assert bytes(reader.get("v/k")) == b"the bytes A holds"  # unverified reads are served
        with pytest.raises(kvstore.ChecksumError):
            reader.get_into("v/k", bytearray(64), verify=True)
        with pytest.raises(kvstore.ChecksumError):
            reader.get("v/k", verify=True)


def test_stopped_owner_never_serves_superseded_or_removed_objects_to_same_host_readers(cluster):
    a = cluster.client("A")
    a.put("st/k1", b"old")
    a.put("st/k2", b"removed")
    homed, plain_a = cluster.client("A"), cluster.daemon_client("A", "shm")  # both read A's shared-memory index
    for reader in (homed, plain_a):
        buf = bytearray(64)
        assert bytes(buf[:reader.get_into("st/k1", buf)]) == b"old"
    cluster.nodes["A"].send(signal.SIGSTOP)
    try:
        b = cluster.client("B")
        b.put("st/k1", b"new, written on B")
        assert b.remove("st/k2") is True
        time.sleep(INDEX_LEASE_S + 0.5)  # the condition under test: A's index lease ran out while it was stopped
        seen = []
        for reader in (homed, plain_a):
            for key in ("st/k1", "st/k2"):
                buf = bytearray(64)
                try:
                    seen.append((key, bytes(buf[:reader.get_into(key, buf)])))
                except (kvstore.KeyNotFoundError, kvstore.StoreConnectionError) as exc:
                    seen.append((key, type(exc).__name__))
        assert ("st/k1", b"old") not in seen and ("st/k2", b"removed") not in seen, seen
        assert ("st/k1", b"new, written on B") in seen and ("st/k2", "KeyNotFoundError") in seen, seen
    finally:
        cluster.nodes["A"].send(signal.SIGCONT)


def _outcome(read) -> object:
    """What one read gave: its bytes, or the name of the typed error it raised; bounded (did not hang)."""
    began = time.monotonic()
    try:
        return read()
    except kvstore.KVStoreError as exc:
        return type(exc).__name__
    finally:
        assert time.monotonic() - began < 30, "a read of a stopped owner's key hung"


@pytest.mark.parametrize("reader_kind", ["cluster", "daemon-shm"])
def test_stopped_owner_index_never_answers_for_a_key_removed_or_rewritten_meanwhile(cluster, reader_kind):
    """Read at once, inside A's index lease: A's shared-memory index still shows both old versions."""
    a = cluster.client("A")
    for key, value in (("sr/rewritten", b"old"), ("sr/removed", b"removed"), ("sr/kept", b"kept")):
        a.put(key, value)
    if reader_kind == "cluster":
        reader = cluster.client("A")  # homed on A: A's index is its first choice for A's keys
    else:
        reader = cluster.nodes["A"].connect("shm", timeout=2)
        cluster.stores.append(reader)

    def get(key: str) -> object:
        buf = bytearray(64)
        return bytes(buf[:reader.get_into(key, buf)])

    def batch() -> object:
        outs = [bytearray(64) for _ in range(3)]
        sizes = reader.batch_get_into(["sr/kept", "sr/rewritten", "sr/removed"], outs)
        return [bytes(o[:n]) for o, n in zip(outs, sizes, strict=True)]

    assert [get(k) for k in ("sr/rewritten", "sr/removed", "sr/kept")] == [b"old", b"removed", b"kept"]
    b = cluster.client("B")
    assert b.exists("sr/kept")  # connected before A stops
    cluster.nodes["A"].send(signal.SIGSTOP)
    try:
        b.put("sr/rewritten", b"new, written on B")
        assert b.remove("sr/removed") is True
        seen = {key: _outcome(lambda key=key: get(key)) for key in ("sr/rewritten", "sr/removed")}
        seen["batch"] = _outcome(batch)
        seen["kept"] = _outcome(lambda: get("sr/kept"))
    finally:
        cluster.nodes["A"].send(signal.SIGCONT)
    assert seen["sr/rewritten"] != b"old" and seen["sr/removed"] != b"removed", seen
    assert seen["batch"] not in ([b"kept", b"old", b"removed"], [b"kept", b"new, written on B", b"removed"]), seen
    if reader_kind == "cluster":  # the directory has the answers: B's version, and no such key
        assert seen["sr/rewritten"] == b"new, written on B" and seen["sr/removed"] == "KeyNotFoundError", seen
        assert seen["batch"] == "KeyNotFoundError", seen  # the removed key fails the batch
        assert seen["kept"] in (b"kept", "KeyNotFoundError"), seen  # A's index, or A unreachable
    else:  # a plain client asks A, which cannot answer while stopped: a typed error within the client's timeout
        assert set(seen.values()) <= {"StoreTimeoutError", "StoreConnectionError"}, seen
    # A resumed (it may have been stopped past its TTL: then it dropped everything and rejoined): the plain client
    # reads again (a new connection), and neither reader sees an old version
    assert wait_until(lambda: _outcome(lambda: get("sr/rewritten")) == b"new, written on B", 30), cluster.logs()
    assert _outcome(lambda: get("sr/removed")) == "KeyNotFoundError"
    assert _outcome(lambda: get("sr/kept")) in (b"kept", "KeyNotFoundError")


def test_reads_that_waited_through_a_stop_are_answered_with_what_the_directory_lists(cluster):
    """Plain clients' reads sent to A while it is stopped wait for it; when it resumes they are answered only
    after A re-checked its entries, even if the events of the removal and the newer write are not read yet."""
    a = cluster.client("A")
    a.put("rq/rewritten", b"old")
    a.put("rq/removed", b"removed")
    readers = {key: cluster.nodes["A"].connect("shm", timeout=30) for key in ("rq/rewritten", "rq/removed")}
    cluster.stores.extend(readers.values())
    assert [bytes(r.get(k)) for k, r in readers.items()] == [b"old", b"removed"]
    catch_ups = readers["rq/removed"].stats()["cluster"]["catch_ups"]
    b = cluster.client("B")
    assert b.exists("rq/removed")  # connected before A stops
    seen: dict[str, object] = {}
    threads = [threading.Thread(target=lambda k=k, r=r: seen.__setitem__(k, _outcome(lambda: bytes(r.get(k)))))
               for k, r in readers.items()]
    cluster.nodes["A"].send(signal.SIGSTOP)
    try:
        b.put("rq/rewritten", b"new, written on B")
        assert b.remove("rq/removed") is True
        for t in threads:
            t.start()
        time.sleep(0.5)  # the condition under test: the reads reach A while it is stopped
    finally:
        cluster.nodes["A"].send(signal.SIGCONT)
    for t in threads:
        t.join(60)
    assert seen == {"rq/rewritten": b"new, written on B", "rq/removed": "KeyNotFoundError"}, seen
    assert readers["rq/removed"].stats()["cluster"]["catch_ups"] > catch_ups


def test_unix_client_reconnects_after_a_timed_out_remote_get(cluster):
    cluster.client("B").put("rc/b", b"on B")
    plain_a = cluster.nodes["A"].connect("shm", timeout=0.7)  # shorter than the daemon's Redis timeout (1 s)
    cluster.stores.append(plain_a)
    plain_a.put("rc/a", b"on A")
    cluster.redis.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(kvstore.StoreTimeoutError):
            plain_a.get("rc/b")  # the daemon waits on the directory longer than this client waits on it
    finally:
        cluster.redis.proc.send_signal(signal.SIGCONT)
    assert bytes(plain_a.get("rc/a")) == b"on A"  # a new connection, authenticated again
    assert bytes(plain_a.get("rc/b")) == b"on B"
    assert plain_a._conn.reconnects == 1


def test_cluster_client_read_from_a_stalled_owner_is_bounded_by_the_peer_timeout(cluster):
    cluster.client("A").put("pt/a", b"on A")
    c = kvstore.connect(cluster.url + "?node=C", transport="tcp", timeout=20)  # peer timeout: 5 s by default
    cluster.stores.append(c)
    assert bytes(c.get("pt/a")) == b"on A"
    cluster.nodes["A"].send(signal.SIGSTOP)
    try:
        began = time.monotonic()
        with pytest.raises(kvstore.KeyNotFoundError):
            c.get("pt/a")
        assert time.monotonic() - began < 5.0 + 4, "the read waited for the client timeout (20 s)"
    finally:
        cluster.nodes["A"].send(signal.SIGCONT)
