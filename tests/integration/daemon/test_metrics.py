"""Prometheus metrics of a daemon started with ``--metrics-port``."""

from __future__ import annotations

import socket
import urllib.request
from itertools import pairwise

import pytest
from conftest import Daemon, MiB, free_port, wait_until
from prometheus_client.parser import text_string_to_metric_families

import kvstore
from kvstore.protocol import wire

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def metered(module_workdir):
    port = free_port()
    d = Daemon(module_workdir, capacity="16MiB", metrics_port=port).start()
    assert wait_until(lambda: _reachable(port), 10), d.log()
    yield d
    d.stop()


def _reachable(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
        return True
    except OSError:
        return False


def scrape(d) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_ops_by_kind_and_result(metered):
    before = scrape(metered)
    with metered.connect("tcp") as s:
        s.put("m/a", b"a" * 1000)
        s.get("m/a")
        with pytest.raises(kvstore.KeyNotFoundError):
            s.get("m/missing")
        s.exists("m/a")
        s.remove("m/a")
    after = scrape(metered)
    delta = lambda op, result: (value(after, "kvstore_ops_total", op=op, result=result)  # noqa: E731
                                - value(before, "kvstore_ops_total", op=op, result=result))
    assert delta("put", "ok") == 1
    assert delta("get", "ok") == 1
    assert delta("get", "KeyNotFound") == 1
    assert delta("exists", "ok") == 1
    assert delta("remove", "ok") == 1
    assert delta("hello", "ok") == 1


def test_bad_requests_are_counted(metered):
    before = scrape(metered)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(metered.unix_path)
    sock.sendall(wire.encode({"v": wire.VERSION, "id": 1, "op": "frobnicate"}))
    sock.recv(4096)
    sock.close()
    after = scrape(metered)
    assert value(after, "kvstore_ops_total", op="unknown", result="Protocol") == \
        value(before, "kvstore_ops_total", op="unknown", result="Protocol") + 1


def test_latency_histograms(metered):
    with metered.connect("shm") as s:
        for i in range(5):
            s.put(f"m/lat{i}", b"x" * 100_000)
            s.get(f"m/lat{i}")
        samples = scrape(metered)
        for i in range(5):
            s.remove(f"m/lat{i}")
    for op in ("arena_commit", "get"):  # a shm put is one commit of space from the client's arena
        count = value(samples, "kvstore_op_seconds_count", op=op)
        assert count >= 5, (op, count)
        assert value(samples, "kvstore_op_seconds_bucket", op=op, le="+Inf") == count
        assert value(samples, "kvstore_op_seconds_sum", op=op) > 0
        buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in samples.items()
                         if name == "kvstore_op_seconds_bucket" and dict(labels)["op"] == op)
        assert len(buckets) >= 5
        assert all(a[1] <= b[1] for a, b in pairwise(buckets))  # cumulative


@pytest.mark.parametrize("size", [100, 200_000])
def test_bytes_in_and_out_over_tcp(metered, size):
    with metered.connect("tcp") as s:
        before = scrape(metered)
        s.put(f"m/bytes{size}", b"b" * size)
        mid = scrape(metered)
        s.get(f"m/bytes{size}")
        out = bytearray(size)
        s.get_into(f"m/bytes{size}", out)
        after = scrape(metered)
        s.remove(f"m/bytes{size}")
    assert value(mid, "kvstore_bytes_in_total") - value(before, "kvstore_bytes_in_total") == size
    assert value(after, "kvstore_bytes_out_total") - value(mid, "kvstore_bytes_out_total") == 2 * size


def test_bytes_in_over_shm(metered):
    with metered.connect("shm") as s:
        before = scrape(metered)
        s.put("m/shm-in", b"s" * MiB)
        after = scrape(metered)
        s.remove("m/shm-in")
    assert value(after, "kvstore_bytes_in_total") - value(before, "kvstore_bytes_in_total") == MiB


def test_capacity_used_objects_and_leases(metered):
    with metered.connect("shm") as s:
        s.put("m/used", b"u" * MiB)
        with s.lease("m/used"):
            samples = scrape(metered)
            stats = s.stats()
            assert value(samples, "kvstore_leases") == stats["leases"] == 1
        assert value(samples, "kvstore_capacity_bytes") == 16 * MiB
        assert value(samples, "kvstore_used_bytes") == stats["used_bytes"] >= MiB
        assert value(samples, "kvstore_objects") == stats["objects"] >= 1
        assert value(scrape(metered), "kvstore_leases") == 0
        s.remove("m/used")


def test_evictions(metered):
    with metered.connect("tcp") as s:
        before = value(scrape(metered), "kvstore_evictions")
        for i in range(24):  # 24 MiB through a 16 MiB store
            s.put(f"m/ev{i}", bytes([i]) * MiB)
        samples = scrape(metered)
        stats = s.stats()
        assert value(samples, "kvstore_evictions") == stats["evictions"] > before
        for key in s.keys("m/ev"):
            s.remove(key)
