"""Writes in place: reserve / batch_reserve / reservation on every backend, with real daemons for the daemon
kinds. The view handed out is the object's own segment memory on the embedded store and over shm."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import xxhash
from conftest import MiB, child_env, wait_until

import kvstore
from kvstore import ChecksumError, InvalidArgumentError, InvalidKeyError, StoreConnectionError


def _filled(n: int, seed: int = 1) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


def test_reserve_commits_at_exit(store, store_kind, prefix):
    data = _filled(200_000)
    with store.reserve(prefix + "a", len(data), meta={"who": "test"}, ttl=60) as buf:
        assert len(buf) == len(data) and not buf.readonly and buf.contiguous
        assert not store.exists(prefix + "a"), "visible before commit"
        buf[:] = data
    obj = store.get(prefix + "a")
    assert bytes(obj) == data
    assert obj.meta.checksum == xxhash.xxh3_64_intdigest(data) and obj.meta.user == {"who": "test"}
    assert obj.meta.ttl == 60


def test_the_view_is_segment_memory_where_the_store_is_mapped(store, store_kind, prefix):
    with store.reserve(prefix + "m", 4096) as buf:
        staged = isinstance(buf.obj, bytearray)
        buf[:] = b"\x07" * 4096
    assert staged == (store_kind == "daemon-tcp"), f"{store_kind}: view over {type(buf.obj).__name__}"


def test_an_exception_inside_aborts(store, prefix):
    def stored():  # bytes of objects: a same-host client's arena (its own free space) aside
        stats = store.stats()
        return stats["used_bytes"] - stats.get("arena_bytes", 0)

    used = stored()
    with pytest.raises(RuntimeError, match="boom"):
        with store.reserve(prefix + "x", 1 * MiB) as buf:
            buf[:4] = b"half"
            raise RuntimeError("boom")
    assert not store.exists(prefix + "x")
    assert wait_until(lambda: store.stats()["pending"] == 0 and stored() == used, 5)


def test_staging_buffers_are_reused_and_their_old_bytes_never_leak_into_objects(store, store_kind, prefix):
    """On the paths that send the bytes at commit, a reservation's buffer is reused by the next one of the same
    size (warm pages); each object still holds exactly what its filler wrote, and the checksum is the bytes'."""
    size = 1 * MiB
    views = []
    for i in range(3):
        data = _filled(size, seed=i)
        with store.reserve(prefix + f"s{i}", size) as buf:
            views.append(buf.obj)
            buf[:] = data
        obj = store.get(prefix + f"s{i}", verify=True)
        assert bytes(obj) == data and obj.meta.checksum == xxhash.xxh3_64_intdigest(data)
    if store_kind == "daemon-tcp":
        assert views[0] is views[1] is views[2], "the staging buffer was not reused"
    with pytest.raises(RuntimeError):
        with store.reserve(prefix + "aborted", size) as buf:
            buf[:] = b"\xee" * size
            raise RuntimeError("abort")
    with store.reserve(prefix + "after", size) as buf:  # reuses the aborted buffer where staged
        buf[:] = b"\x01" * size
    assert bytes(store.get(prefix + "after", verify=True)) == b"\x01" * size
    assert not store.exists(prefix + "aborted")


def test_zero_copy_reads_over_a_socket_reuse_warm_buffers_only_after_release(store, store_kind, prefix):
    """Over tcp a copy=False object is a client buffer from the pool: it never changes while held (another read
    takes another buffer), and goes back to the pool at release; copy=True objects are never pooled."""
    a, b = _filled(MiB, seed=5), _filled(MiB, seed=6)
    store.put(prefix + "za", a)
    store.put(prefix + "zb", b)
    first = store.get(prefix + "za", copy=False)
    second = store.get(prefix + "zb", copy=False)  # while the first is held: a different buffer
    assert bytes(first) == a and bytes(second) == b
    if store_kind == "daemon-tcp":
        pool = store._staging_pool()
        idle = pool.idle_bytes
        second.release()
        first.release()
        assert pool.idle_bytes == idle + 2 * MiB  # both buffers back in the pool
        third = store.get(prefix + "zb", copy=False)
        assert pool.idle_bytes == idle + MiB and bytes(third) == b  # one taken out again, filled anew
        kept = store.get(prefix + "za")  # copy=True: the caller's for good, not from the pool
        assert pool.idle_bytes == idle + MiB and bytes(kept) == a
        third.release()
        assert pool.idle_bytes == idle + 2 * MiB
        assert bytes(kept) == a
    else:
        first.release()
        second.release()


def test_batch_reserve_is_all_or_nothing(store, prefix):
    keys = [prefix + f"b{i}" for i in range(3)]
    with store.batch_reserve([(k, 1000 + i) for i, k in enumerate(keys)]) as bufs:
        for i, buf in enumerate(bufs):
            buf[:] = bytes([i]) * len(buf)
    assert [bytes(store.get(k)) for k in keys] == [bytes([i]) * (1000 + i) for i in range(3)]
    with pytest.raises(InvalidKeyError):
        with store.batch_reserve([(prefix + "c0", 10), ("", 10)]):
            pass
    with pytest.raises(ValueError, match="fail"):
        with store.batch_reserve([(prefix + "c1", 10), (prefix + "c2", 10)]) as (a, b):
            a[:] = b"1" * 10
            raise ValueError("fail")
    assert store.batch_exists([prefix + "c0", prefix + "c1", prefix + "c2"]) == [False, False, False]
    assert wait_until(lambda: store.stats()["pending"] == 0, 5)


def test_a_filler_supplies_the_checksum(store, store_kind, prefix):
    data = _filled(5000)
    batch = store.reservation()
    batch.add(prefix + "ok", len(data), kind="bytes")[:] = data
    batch.add(prefix + "lie", len(data))[:] = data
    if store_kind == "daemon-tcp":
        # the staged bytes travel to the daemon, which hashes them as they land: a checksum they do not match
        # is refused at commit, and the batch stays all-or-nothing
        with pytest.raises(ChecksumError, match="nothing was stored"):
            batch.commit([xxhash.xxh3_64_intdigest(data), 12345])
        assert store.batch_exists([prefix + "ok", prefix + "lie"]) == [False, False]
        assert wait_until(lambda: store.stats()["pending"] == 0, 5)
        return
    # where the view is the object's own memory nobody reads it at commit: the filler's checksum is recorded,
    # and a verified read catches a wrong one
    metas = batch.commit([xxhash.xxh3_64_intdigest(data), 12345])
    assert [m.checksum for m in metas] == [xxhash.xxh3_64_intdigest(data), 12345]
    assert bytes(store.get(prefix + "ok", verify=True)) == data
    with pytest.raises(ChecksumError):
        store.get(prefix + "lie", verify=True)
    with pytest.raises(InvalidArgumentError, match="already committed"):
        batch.commit()


def test_bad_sizes_are_refused_before_anything_is_reserved(store, prefix):
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(InvalidArgumentError, match="nbytes"):
            with store.reserve(prefix + "bad", bad):
                pass
    with store.reserve(prefix + "empty", 0) as buf:
        assert len(buf) == 0
    assert bytes(store.get(prefix + "empty")) == b""


_CHILD = textwrap.dedent("""
    import sys, kvstore
    s = kvstore.connect(sys.argv[1], transport=sys.argv[2])
    with s.reserve("killed/inside", 4 << 20) as buf:
        buf[: 1 << 20] = b"\\x01" * (1 << 20)
        print("inside", flush=True)
        sys.stdin.readline()  # killed here
""")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_client_killed_inside_reserve_leaves_nothing(daemon_factory, transport):
    d = daemon_factory(capacity="16MiB")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, d.unix_url, transport], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=child_env(), text=True)
    try:
        assert child.stdout.readline().strip() == "inside"
        with d.connect("shm") as s:
            if transport == "shm":  # the space is reserved in the daemon while the child writes
                assert s.stats()["pending"] == 1
            child.kill()
            child.wait(10)
            assert wait_until(lambda: s.stats()["pending"] == 0 and s.stats()["used_bytes"] == 0, 10)
            assert not s.exists("killed/inside")
    finally:
        child.kill()


def test_a_daemon_killed_inside_reserve_fails_the_commit(daemon_factory):
    d = daemon_factory(capacity="16MiB")
    s = d.connect("shm", timeout=3)
    try:
        with pytest.raises(StoreConnectionError):
            with s.reserve("gone", 1 * MiB) as buf:
                buf[:] = b"\x02" * MiB
                d.kill()
    finally:
        s.close()


def test_cluster_and_embedded_share_the_contract():
    """The staged default (used by the cluster client) commits through the backend's batch put."""
    with kvstore.KVStore.embedded(capacity="4MiB") as s:
        with s.batch_reserve([("p", 3), ("q", 4)]) as (p, q):
            p[:], q[:] = b"abc", b"defg"
        assert bytes(s.get("p")) + bytes(s.get("q")) == b"abcdefg"
