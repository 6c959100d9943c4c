"""Cluster mode across two namespace hosts: Redis and a daemon on host a, a daemon on host b, node to node over
the shaped link. Clients talk to their own host's daemon (Unix socket, shared memory); a key put on one host
is read on the other through a ``peer_get`` across the link. Redis restarted empty: remote reads miss with a
typed error meanwhile, and find the key again once the daemons have republished. A peer daemon killed while its
bytes cross gives the reader a typed error within a bound of its timeout, and the reading daemon keeps nothing.
"""

from __future__ import annotations

import shutil
import signal
import time

import pytest
from host_cluster import cluster_fleet
from host_fleet import finish

MiB = 1 << 20
TIMEOUT = 3.0
HANG = TIMEOUT * 3 + 10

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                                reason="redis-server / redis-cli are not on PATH (apt-get install -y redis-server)")


@pytest.fixture(scope="module")
def cluster():
    with cluster_fleet() as fleet:
        yield fleet


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
