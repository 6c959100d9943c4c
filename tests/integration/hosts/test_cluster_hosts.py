"""Cluster mode across two namespace hosts: Redis and a daemon on host a, a daemon on host b, node to node over
the shaped link. Clients talk to their own host's daemon (Unix socket, shared memory); a key put on one host
is read on the other through a ``peer_get`` across the link. Redis restarted empty: remote reads miss with a
typed error meanwhile, and find the key again once the daemons have republished. A peer daemon killed while its
bytes cross gives the reader a typed error within a bound of its timeout, and the reading daemon keeps nothing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

import pytest
from host_fleet import Fleet, child_env, finish

from kvstore.testing import hosts as H

MiB = 1 << 20
REDIS_PORT = 6379
TIMEOUT = 3.0
HANG = TIMEOUT * 3 + 10

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                                reason="redis-server / redis-cli are not on PATH (apt-get install -y redis-server)")


class ClusterFleet(Fleet):
    """Redis on a's end of the link; one ``kvstore serve --cluster`` per host, advertising its end of the link."""

    daemons: dict[str, subprocess.Popen]

    def redis_url(self) -> str:
        return f"redis://{self.link.address(self.a)}:{REDIS_PORT}/0"

    def start_redis(self) -> None:
        self.redis = self.a.popen(["redis-server", "--port", str(REDIS_PORT), "--bind", self.link.address(self.a),
                                   "--save", "", "--appendonly", "no", "--dir", "/tmp", "--protected-mode", "no"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        assert self.a.wait_listening(REDIS_PORT, 30, self.redis), "redis-server did not start on host a"

    def start_node(self, host: H.Host) -> None:
        addr = f"tcp://{self.link.address(host)}:7070"
        cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", self.unix_url, "--listen", addr,
               "--token-file", "/tmp/token", "--capacity", "128MiB", "--log-level", "warning",
               "--cluster", self.redis_url(), "--node-id", f"n{host.name}", "--advertise", addr,
               "--node-ttl", "3", "--peer-timeout", "2", "--transfer-timeout", "2"]
        with open(host.path("/tmp/daemon.log"), "ab") as log:
            self.daemons[host.name] = host.popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # registered in Redis: the cluster can find it
            pid = host.run(["redis-cli", "-h", self.link.address(self.a), "-p", str(REDIS_PORT), "hget",
                            f"kvstore:node:n{host.name}", "pid"], check=False).stdout.strip()
            if pid == str(self.daemons[host.name].pid):
                return
            assert self.daemons[host.name].poll() is None, self.log(host)
            time.sleep(0.2)
        raise AssertionError(f"node n{host.name} did not register:\n{self.log(host)}")

    def log(self, host: H.Host) -> str:
        with open(host.path("/tmp/daemon.log"), errors="replace") as f:
            return f.read()

    def node_stats(self, host: H.Host) -> dict:
        return self.client(host, self.unix_url, "stats")[0]


@pytest.fixture(scope="module")
def cluster():
    reason = H.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with H.Hosts(("a", "b"), rate_gbit=1) as hosts:
        token = secrets.token_hex(16)
        for host in hosts.hosts.values():
            fd = os.open(host.path("/tmp/token"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, token.encode())
            os.close(fd)
        fleet = ClusterFleet(hosts, hosts.link("a", "b"))
        fleet.daemons = {}
        fleet.start_redis()
        fleet.start_node(fleet.a)
        fleet.start_node(fleet.b)
        yield fleet
        for name, proc in fleet.daemons.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0, fleet.log(hosts[name])


def test_a_key_put_on_one_host_is_read_on_the_other(cluster):
    a, b, url = cluster.a, cluster.b, cluster.unix_url
    for size in (1000, 3 * MiB + 5):
        assert cluster.client(a, url, "transport") == [{"transport": "shm"}]  # each client on its own host
        assert cluster.client(a, url, "put", f"c/{size}", size, 11)[-1] == {"ok": True}
        assert cluster.client(b, url, "get", f"c/{size}", size, 11)[-1] == {"ok": True, "equal": True}
        assert cluster.client(b, url, "put", f"d/{size}", size, 12)[-1] == {"ok": True}
        assert cluster.client(a, url, "get", f"d/{size}", size, 12)[-1] == {"ok": True, "equal": True}


def test_handoff_prefill_on_a_decode_on_b_through_their_own_daemons(cluster):
    assert cluster.client(cluster.a, cluster.unix_url, "publish", "cr1", 24, 4) == [{"published": "cr1"}]
    assert cluster.client(cluster.b, cluster.unix_url, "fetch", "cr1", 24, 4) == [{"equal": True}]


def test_redis_restarted_empty_across_hosts(cluster):
    """Remote reads miss (a typed error, bounded) while Redis is gone; once it is back, empty, the daemons
    republish what they hold and b finds a's key again."""
    a, b, url = cluster.a, cluster.b, cluster.unix_url
    assert cluster.client(a, url, "put", "r/k", 2 * MiB, 14)[-1] == {"ok": True}
    cluster.redis.kill()
    cluster.redis.wait(10)
    missed = cluster.client(b, url, "get", "r/k", 2 * MiB, 14, timeout=TIMEOUT)[-1]
    assert missed.get("error") in ("KeyNotFoundError", "StoreTimeoutError", "StoreConnectionError"), missed
    assert missed["seconds"] < HANG
    cluster.start_redis()
    deadline = time.monotonic() + 30
    while True:
        got = cluster.client(b, url, "get", "r/k", 2 * MiB, 14, timeout=TIMEOUT)[-1]
        if got.get("ok") or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got == {"ok": True, "equal": True}, got


def test_owner_killed_while_its_bytes_cross_the_link(cluster):
    """Last in the module: it kills a's daemon."""
    a, b, url = cluster.a, cluster.b, cluster.unix_url
    assert cluster.client(a, url, "put", "k/big", 16 * MiB, 13)[-1] == {"ok": True}
    cluster.link.shape(0.1)  # 16 MiB take over a second to cross
    try:
        proc = cluster.start_client(b, url, "get", "k/big", 16 * MiB, 13, timeout=TIMEOUT)
        time.sleep(0.3)
        cluster.daemons["a"].send_signal(signal.SIGKILL)
        result = finish(proc, HANG)[-1]
    finally:
        cluster.link.shape(1)
    assert result.get("error") in ("KeyNotFoundError", "StoreConnectionError", "StoreTimeoutError",
                                   "TransportError"), result
    assert result["seconds"] < HANG
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = cluster.node_stats(b)
        if stats["pending"] == 0 and stats["leases"] == 0:
            break
        time.sleep(0.3)
    assert stats["pending"] == 0 and stats["leases"] == 0  # b's daemon kept no half-fetched copy
    deadline = time.monotonic() + 15  # the dead owner's entry stops counting once its record lapses (node TTL)
    while cluster.client(b, url, "exists", "k/big") != [{"exists": False}]:
        assert time.monotonic() < deadline, "a dead owner's key still exists after its node TTL"
        time.sleep(0.5)
