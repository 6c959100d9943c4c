"""A daemon on host a, clients on host b across a shaped link (tcp://): what crosses, and what a fault leaves.

Faults are injected while a payload is on the wire: the link is slowed to 0.1 Gbit/s so that a 16 MiB
transfer takes over a second, then cut (``ip link set ... down``) or the daemon is killed. No timing is
asserted beyond "did not hang": each client must fail with a typed error within a bound of its timeout.
"""

from __future__ import annotations

import signal
import time

import pytest
from host_fleet import finish, two_hosts

MiB = 1 << 20
SLOW_GBIT = 0.1
TIMEOUT = 3.0
HANG = TIMEOUT * 3 + 5  # "did not hang": the error arrived in a bounded time


@pytest.fixture(scope="module")
def fleet():
    yield from two_hosts()


@pytest.fixture
def slow_link(fleet):
    fleet.link.shape(SLOW_GBIT)
    yield fleet.link
    fleet.link.set_up(True)
    fleet.link.shape(1)


def test_auto_picks_tcp_across_hosts_and_shm_on_the_daemons_host(fleet):
    assert fleet.client(fleet.b, fleet.tcp_url, "transport") == [{"transport": "tcp"}]
    assert fleet.client(fleet.a, fleet.unix_url, "transport") == [{"transport": "shm"}]
    refused = fleet.client(fleet.b, fleet.tcp_url, "transport", "--transport", "shm")
    assert refused[0]["error"] == "TransportError"


def test_bytes_put_on_one_host_read_on_the_other(fleet):
    for size in (1000, 3 * MiB + 7):
        assert fleet.client(fleet.a, fleet.unix_url, "put", f"x/{size}", size, 5)[-1] == {"ok": True}
        assert fleet.client(fleet.b, fleet.tcp_url, "get", f"x/{size}", size, 5)[-1] == {"ok": True, "equal": True}
        assert fleet.client(fleet.b, fleet.tcp_url, "put", f"y/{size}", size, 6)[-1] == {"ok": True}
        assert fleet.client(fleet.a, fleet.unix_url, "get", f"y/{size}", size, 6)[-1] == {"ok": True, "equal": True}


def test_handoff_prefill_on_a_decode_on_b(fleet):
    assert fleet.client(fleet.a, fleet.unix_url, "publish", "r1", 24, 3) == [{"published": "r1"}]
    assert fleet.client(fleet.b, fleet.tcp_url, "fetch", "r1", 24, 3) == [{"equal": True}]


def test_link_down_mid_put_is_a_typed_error_and_nothing_is_visible(fleet, slow_link):
    proc = fleet.start_client(fleet.b, fleet.tcp_url, "put", "cut/put", 16 * MiB, 7, timeout=TIMEOUT)
    time.sleep(0.3)  # some of the payload is on its way
    slow_link.set_up(False)
    result = finish(proc, HANG)[-1]
    assert result["error"] in ("StoreTimeoutError", "StoreConnectionError"), result
    assert result["seconds"] < HANG
    slow_link.set_up(True)
    assert fleet.client(fleet.b, fleet.tcp_url, "exists", "cut/put") == [{"exists": False}]
    stats = fleet.wait_settled()
    assert stats["pending"] == 0 and stats["leases"] == 0  # the daemon cut the stalled transfer


def test_link_down_mid_get_is_a_typed_error_and_the_object_survives(fleet, slow_link):
    assert fleet.client(fleet.a, fleet.unix_url, "put", "cut/get", 16 * MiB, 8)[-1] == {"ok": True}
    proc = fleet.start_client(fleet.b, fleet.tcp_url, "get", "cut/get", 16 * MiB, 8, timeout=TIMEOUT)
    time.sleep(0.3)
    slow_link.set_up(False)
    result = finish(proc, HANG)[-1]
    assert result["error"] in ("StoreTimeoutError", "StoreConnectionError"), result
    assert result["seconds"] < HANG
    slow_link.set_up(True)
    stats = fleet.wait_settled()
    assert stats["leases"] == 0  # the lease went with the cut session
    slow_link.shape(1)
    assert fleet.client(fleet.b, fleet.tcp_url, "get", "cut/get", 16 * MiB, 8)[-1] == {"ok": True, "equal": True}


def test_daemon_killed_mid_fetch(fleet, slow_link):
    """Last in the module: it restarts the daemon."""
    assert fleet.client(fleet.a, fleet.unix_url, "put", "kill/get", 16 * MiB, 9)[-1] == {"ok": True}
    proc = fleet.start_client(fleet.b, fleet.tcp_url, "get", "kill/get", 16 * MiB, 9, timeout=TIMEOUT)
    time.sleep(0.3)
    fleet.daemon.send_signal(signal.SIGKILL)
    fleet.daemon.wait(10)
    result = finish(proc, HANG)[-1]
    assert result["error"] in ("StoreConnectionError", "StoreTimeoutError"), result
    assert result["seconds"] < HANG
    fleet.start_daemon()  # a fresh daemon on the same address: the key is gone, a miss, never stale bytes
    missing = fleet.client(fleet.b, fleet.tcp_url, "get", "kill/get", 16 * MiB, 9)
    assert missing[-1]["error"] == "KeyNotFoundError"
