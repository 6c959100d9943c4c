"""Arenas of same-host clients (kvstore.core.arena, kvstore.client.arena), with real daemons: a shm put is
one copy into client-allocated arena space and one commit; the daemon refuses ranges that are not the
client's free arena space, returns arenas at close, and quarantines them while a revoked client's process lives.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from client_child import pattern  # noqa: E402
from conftest import MiB, wait_until

import kvstore
from kvstore.core.meta import ObjectMeta
from kvstore.errors import ArenaError, KeyExistsError

pytestmark = pytest.mark.timeout(120)


def _raw(store: kvstore.KVStore, request: dict) -> dict:
    return store._conn.call(request)


def _arena(store: kvstore.KVStore) -> tuple[int, int, int]:
    """(id, segment offset, size) of the client's newest arena, as the daemon granted it."""
    arena = store._arenas._arenas[-1]
    return arena.id, arena.base, arena.local.capacity


def _entry(arena: int, offset: int, key: str, size: int) -> dict:
    return {"arena": arena, "offset": offset, "checksum": None, "meta": ObjectMeta(key, size).to_wire()}


@pytest.mark.parametrize("size", [0, 4096, 3 * MiB])
def test_arena_put_round_trips_bytes_and_metadata(daemon_factory, size):
    d = daemon_factory(capacity="64MiB", args=("--arena-size", "4MiB"))
    with d.connect("shm") as s:
        value = np.frombuffer(pattern("k", size), dtype=np.uint8)
        meta = s.put("k", value, meta={"layer": 3})
        assert s.stats()["arenas"] == 1  # it went through an arena
        obj = s.get("k")
        assert bytes(obj) == value.tobytes() and obj.meta.user == {"layer": 3}
        assert obj.meta.dtype == meta.dtype is not None and obj.meta.shape == (size,)
        assert obj.meta.checksum == meta.checksum and obj.meta.version == meta.version
        assert s.get("k", verify=True) is not None  # the recorded checksum is the bytes' own
        with d.connect("tcp") as remote:  # and another client, through the daemon, sees the same
            assert bytes(remote.get("k")) == value.tobytes()


def test_refused_ranges_store_nothing_and_keep_the_arena(daemon_factory):
    d = daemon_factory(capacity="64MiB", args=("--arena-size", "1MiB"))
    with d.connect("shm") as a, d.connect("shm") as b:
        a.put("first", b"x" * 5000)
        b.put("theirs", b"y" * 100)
        aid, base, size = _arena(a)
        bid, bbase, _ = _arena(b)
        first = a.inspect("first")
        cases = {"outside": (aid, base + size - 64, 4096), "committed": (aid, first["offset"], 100),
                 "other client's": (bid, bbase + 8192, 100), "unknown": (999999, base, 100)}
        before = a.stats()
        for what, (arena, offset, n) in cases.items():
            with pytest.raises(ArenaError):
                _raw(a, {"op": "arena_commit", "entries": [_entry(arena, offset, f"bad/{what}", n)]})
        after = a.stats()
        assert not any(a.exists(f"bad/{w}") for w in cases)
        assert (after["objects"], after["used_bytes"], after["arena_bytes"]) == \
            (before["objects"], before["used_bytes"], before["arena_bytes"])
        assert bytes(a.get("first")) == b"x" * 5000 and bytes(b.get("theirs")) == b"y" * 100
        a.put("after", b"z" * 10)  # the client's arena still works
        assert bytes(a.get("after")) == b"z" * 10


def test_if_absent_refusal_frees_nothing_stored(daemon_factory):
    d = daemon_factory(capacity="64MiB")
    with d.connect("shm") as s:
        s.put("k", b"old")
        with pytest.raises(KeyExistsError):
            s.put("k", b"new", if_absent=True)
        assert bytes(s.get("k")) == b"old"
        s.put("k2", b"fine", if_absent=True)  # the refused slot went back to the client's arena
        assert bytes(s.get("k2")) == b"fine"


def test_arena_returned_on_close(daemon_factory):
    d = daemon_factory(capacity="64MiB", args=("--arena-size", "8MiB"))
    with d.connect("shm") as watcher:
        with d.connect("shm") as s:
            s.put("k", b"v" * 1000)
            assert watcher.stats()["arena_bytes"] >= 8 * MiB - 1024
        stats = watcher.stats()
        assert stats["arenas"] == 0 and stats["arena_bytes"] == 0 and stats["quarantined_bytes"] == 0
        assert stats["used_bytes"] == 1024  # only the object is left


def test_arena_quarantined_while_a_paused_client_lives_then_freed(daemon_factory, spawn):
    d = daemon_factory(capacity="64MiB", args=("--heartbeat-timeout", "1", "--arena-size", "8MiB"))
    with d.connect("shm") as other:
        child = spawn("client_child.py", "arena", d.unix_url, "shm", "child/k", 4096)
        arena_bytes = int(child.expect("READY").split()[1])
        assert arena_bytes >= 8 * MiB - 4096
        os.kill(child.proc.pid, signal.SIGSTOP)
        # the heartbeat expires: the daemon revokes the client, but its process may still write into the arena
        assert wait_until(lambda: other.stats()["arenas"] == 0, 20), other.stats()
        stats = other.stats()
        assert stats["quarantined_bytes"] >= 8 * MiB - 4096 and stats["used_bytes"] >= 8 * MiB, stats
        child.kill()
        assert wait_until(lambda: other.stats()["quarantined_bytes"] == 0, 10), other.stats()
        assert other.stats()["used_bytes"] <= 4096  # the arena is free again (the committed object may remain)


def test_reserve_commit_and_abort_use_the_arena(daemon_factory):
    d = daemon_factory(capacity="64MiB", args=("--arena-size", "4MiB"))
    with d.connect("shm") as s:
        with s.reserve("r", 1000) as view:
            view[:] = b"r" * 1000
        assert bytes(s.get("r")) == b"r" * 1000
        assert s.stats()["arenas"] == 1 and s.stats()["pending"] == 0  # no region put was made
        free = s.stats()["arena_bytes"]
        with pytest.raises(RuntimeError), s.reserve("gone", 2000) as view:
            view[:10] = b"0123456789"
            raise RuntimeError("abort")
        assert not s.exists("gone") and s.stats()["arena_bytes"] == free
        with s.reserve("again", 2000) as view:  # the aborted space is reused
            view[:] = b"a" * 2000
        assert bytes(s.get("again")) == b"a" * 2000


def test_batch_reserve_is_all_or_nothing_with_arenas(daemon_factory):
    d = daemon_factory(capacity="64MiB", args=("--arena-size", "4MiB"))
    with d.connect("shm") as s:
        items = [("a", 100), ("big", 5 * MiB), ("b", 200)]  # "big" does not fit an arena: a region put
        with pytest.raises(RuntimeError), s.batch_reserve(items) as views:
            views[0][:] = b"a" * 100
            raise RuntimeError("abort")
        assert not any(s.exists(k) for k, _ in items) and s.stats()["pending"] == 0
        # a commit the daemon refuses (the arena was released behind the client's back) makes nothing visible
        with pytest.raises(ArenaError), s.batch_reserve(items) as views:
            _raw(s, {"op": "arena_release", "arenas": s._arenas.ids})
        assert not any(s.exists(k) for k, _ in items) and s.stats()["pending"] == 0
        s._arenas.forget()
        with s.batch_reserve(items) as views:
            for i, v in enumerate(views):
                v[:] = bytes([i + 1]) * len(v)
        assert [bytes(s.get(k))[:1] for k, _ in items] == [b"\1", b"\2", b"\3"]
        assert s.stats()["pending"] == 0


def test_batch_put_commits_through_one_arena_commit(daemon_factory):
    d = daemon_factory(capacity="64MiB")
    with d.connect("shm") as s:
        items = [(f"bp/{i}", pattern(f"bp/{i}", 1000 + i)) for i in range(50)]
        s.batch_put(items)
        assert all(bytes(s.get(k)) == v for k, v in items)
        assert s.stats()["arenas"] == 1 and s.stats()["pending"] == 0


@pytest.mark.parametrize("how", ["put", "reserve"])
def test_a_put_at_the_clients_limit_is_not_refused_for_its_idle_arenas(daemon_factory, how):
    """Arenas count in the client's held bytes; an object as large as the whole limit (too large for an arena)
    still goes in: the client gives its idle arenas back and the daemon takes the put."""
    d = daemon_factory(capacity="64MiB", args=("--arena-size", "4MiB", "--max-held-bytes", "24MiB"))
    big = pattern("big", 24 * MiB)
    with d.connect("shm") as s:
        s.put("small", b"s" * 5000)
        assert s.stats()["arenas"] == 1
        if how == "put":
            s.put("big", big)
        else:
            with s.reserve("big", len(big)) as buf:
                buf[:] = big
        assert bytes(s.get("big", verify=True)) == big
        assert bytes(s.get("small")) == b"s" * 5000
        s.put("after", b"a" * 5000)  # a later small put gets an arena again
        assert bytes(s.get("after")) == b"a" * 5000
