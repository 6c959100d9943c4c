"""Requests and replies at the frame limits (issue 24, defects 5 and 6), against a real daemon: a batch over the
bound is refused before anything is sent (no desync, nothing reserved or quarantined); a reply that would not
fit in one frame is paged, or refused with a typed error on that request, never a dropped connection."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import child_env, short_tmpdir, wait_until

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


def test_stats_pages_its_connections_and_the_client_and_cli_show_them_all(daemon_factory):
    """300 connections, more than one stats reply carries (256): the daemon pages them by connection id (each
    page within a frame, ``connections_more`` until the last), ``stats()`` asks for every page and so does
    ``kvstore stats``; connections that close leave the listing."""
    d = daemon_factory(capacity="32MiB", args=["--max-connections-per-peer", "400"])
    names = [f"conn-{i:03d}-" + "\u20ac" * 200 for i in range(300)]
    clients = [d.connect("tcp", client_name=name) for name in names]
    try:
        with d.connect("shm", client_name="watcher") as s:
            stats = s.stats()
            assert stats["connections_total"] == 301 and "connections_more" not in stats
            ids = [c["id"] for c in stats["connections"]]
            assert ids == sorted(set(ids)) and len(ids) == 301
            shown = sorted(c["client"][:9] for c in stats["connections"] if c["client"].startswith("conn-"))
            assert shown == [name[:9] for name in names]
            assert all(len(c["client"]) < 200 for c in stats["connections"])  # cut: a page fits a frame
            for c in clients[:150]:
                c.close()
            assert wait_until(lambda: len(s.stats()["connections"]) == 151, 20)
            s.ping()
        listed = kv("stats", "--url", d.unix_url)
        assert listed.returncode == 0, listed.stderr.decode()
        lines = [line for line in listed.stdout.decode().splitlines() if line.startswith("client ")]
        assert len(lines) == 151, listed.stdout.decode()[-2000:]  # 150 open clients and the CLI's own
        assert sum("conn-" in line for line in lines) == 150
    finally:
        for c in clients:
            c.close()


def _meta_of(n: int) -> dict:
    """User metadata of about ``n`` bytes (strings of at most 16 KiB each: the per-value bound)."""
    return {"m": ["a" * 16000] * (n // 16000), "r": "b" * (n % 16000)}


def test_a_reply_over_the_daemons_frame_limit_is_a_typed_error_on_that_request_and_the_connection_lives(
        daemon_factory):
    """An object stored with large metadata under the default frame limit, kept by the disk tier, read back
    after a restart with ``--max-frame 256KiB``: the replies that carry its metadata (inspect, get) do not fit
    in a frame. Those requests get FrameTooLargeError; the same connection goes on (other objects read back,
    puts work) and so does the daemon for everyone else. A request over the daemon's limit is refused by the
    client, unsent (the daemon's hello says its limit)."""
    path = short_tmpdir()
    disk = ("--disk-path", path, "--disk-capacity", "64MiB", "--disk-policy", "write-through")
    try:
        d = daemon_factory(capacity="8MiB", args=disk)
        with d.connect("tcp") as s:
            s.put("big-meta", b"x" * 1000, meta=_meta_of(600_000))
            s.put("small", b"y")
            assert wait_until(lambda: s.stats()["disk_writes"] == 2, 60), s.stats()
        d.kill()
        again = daemon_factory(capacity="8MiB", args=(*disk, "--max-frame", "256KiB"))
        with again.connect("tcp") as s, again.connect("shm") as other:
            for _ in range(2):  # twice: the first refusal left the connection in step
                with pytest.raises(kvstore.FrameTooLargeError, match="exceeds the maximum of 262144"):
                    s.inspect("big-meta")
                with pytest.raises(kvstore.FrameTooLargeError, match="exceeds the maximum of 262144"):
                    s.get("big-meta")
            assert bytes(s.get("small")) == b"y" and s.keys() == ["big-meta", "small"]
            _still_usable(s, "fr-")
            with pytest.raises(kvstore.FrameTooLargeError, match="exceeds the maximum of 262144"):
                s.put("too-big", b"z", meta=_meta_of(300_000))
            _still_usable(s, "fr2-")
            assert not s.exists("too-big") and other.inspect("fr-after")["size"] == 5
        assert again.running()
    finally:
        subprocess.run(["rm", "-rf", path], check=False)


def test_max_frame_is_checked_when_the_daemon_is_configured():
    from kvstore.daemon.config import ServerConfig

    assert ServerConfig(max_frame=256 << 10).max_frame == 256 << 10
    for bad in (1000, (1 << 20) + 1, True, "1MiB"):
        with pytest.raises(kvstore.InvalidArgumentError, match="max frame"):
            ServerConfig(max_frame=bad)
