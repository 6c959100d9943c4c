"""Requests and replies at the frame limits (issue 24, defects 5 and 6), against a real daemon: a batch over the
bound is refused before anything is sent (no desync, nothing reserved or quarantined); a reply that would not
fit in one frame is paged, or refused with a typed error on that request, never a dropped connection."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import child_env

import kvstore

BATCH = 4096  # kvstore.protocol.wire.MAX_BATCH: objects one request may name

pytestmark = pytest.mark.timeout(120)


def _still_usable(s: kvstore.KVStore, prefix: str) -> None:
    s.ping()
    s.put(f"{prefix}after", b"after")
    assert bytes(s.get(f"{prefix}after")) == b"after"
    stats = s.stats()
    assert stats["pending"] == 0 and stats.get("quarantined_bytes", 0) == 0, stats


# ---- defect 6: batches over the bound ----------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("n", [BATCH + 1, 2 * BATCH + 1])
def test_batch_put_over_the_bound_is_refused_before_anything_is_sent(daemon, prefix, transport, n):
    with daemon.connect(transport) as s:
        items = [(f"{prefix}{i}", b"v%d" % i) for i in range(n)]
        with pytest.raises(kvstore.InvalidArgumentError, match="at most 4096"):
            s.batch_put(items)
        assert s.keys(prefix) == []
        _still_usable(s, prefix)
        assert len(s.batch_put(items[:BATCH])) == BATCH  # at the bound: one atomic batch
        assert s.batch_exists([k for k, _ in items]) == [True] * BATCH + [False] * (n - BATCH)
        for key in s.keys(prefix):
            s.remove(key)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_reservation_and_wait_over_the_bound_are_refused(daemon, prefix, transport):
    with daemon.connect(transport) as s:
        with pytest.raises(kvstore.InvalidArgumentError, match="at most 4096"):
            with s.batch_reserve([(f"{prefix}{i}", 8) for i in range(BATCH + 1)]):
                pass
        with pytest.raises(kvstore.InvalidArgumentError, match="at most 4096"):
            with s.reservation() as batch:
                for i in range(BATCH + 1):
                    batch.add(f"{prefix}{i}", 8)[:] = b"12345678"
        with pytest.raises(kvstore.InvalidArgumentError, match="at most 4096"):
            s.wait([f"{prefix}w{i}" for i in range(2 * BATCH + 1)], timeout=0.1)
        assert s.keys(prefix) == []
        _still_usable(s, prefix)
        s.remove(f"{prefix}after")


# ---- defect 5: replies over one frame ----------------------------------------------------------------------
def kv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, timeout=120,
                          env=child_env())


def test_listings_past_one_frame_are_paged(daemon_factory):
    """18,000 keys of 68 bytes (1.2 MiB of names): ls, keys() and requests (which lists hf/) get them all."""
    d = daemon_factory(capacity="64MiB")
    names = [f"hf/{i:05d}/chunk/".ljust(68, "x") for i in range(18_000)]
    with d.connect("shm") as s:
        for start in range(0, len(names), BATCH):
            s.batch_put([(k, b"") for k in names[start:start + BATCH]])
        assert s.keys("hf/") == names
        assert s.keys() == names
        assert s.keys("hf/17999") == names[-1:]
    with d.connect("tcp") as s:
        assert s.keys() == names
    listed = kv("ls", "--url", d.unix_url)
    assert listed.returncode == 0, listed.stderr.decode()
    assert listed.stdout.decode().split() == names
    requests = kv("requests", "--url", d.unix_url, "--json")
    assert requests.returncode == 0, requests.stderr.decode()
    assert json.loads(requests.stdout) == []


def test_stats_with_many_long_client_names(daemon_factory):
    """96 connections named with 12 KiB each would make a 1.1 MiB stats reply: names are cut, stats works."""
    d = daemon_factory(capacity="32MiB")
    long_name = "\u20ac" * 4096
    clients = [d.connect("tcp", client_name=long_name) for _ in range(96)]
    try:
        with d.connect("shm") as s:
            stats = s.stats()
            assert stats["connections_total"] == 97
            named = [c for c in stats["connections"] if c["client"].startswith("\u20ac")]
            assert len(named) == 96 and all(len(c["client"]) < 200 for c in named)
            s.ping()
        shown = kv("stats", "--url", d.unix_url)
        assert shown.returncode == 0, shown.stderr.decode()
        assert clients[0].stats()["connections_total"] >= 96
    finally:
        for c in clients:
            c.close()
