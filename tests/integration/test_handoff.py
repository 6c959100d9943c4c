"""KVHandoff: publish/fetch through embedded and daemon stores, mismatch, time-out, cancel, TTL reclaim,
a producer killed mid-publish, prefix lookup across processes, and fetching into reordered blocks."""

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

import handoff_child as child  # noqa: E402
import numpy as np
import pytest
import torch
from conftest import HELPERS, child_env, flip_byte, no_hang, wait_until  # noqa: E402

import kvstore
from kvstore.errors import HandoffChecksumError
from kvstore.handoff import KVHandoff, request_keys

LAYOUT = child.layout()
BS = LAYOUT.block_size



def stored(s) -> int:
    """Bytes of objects: a same-host client's arena (free space it allocates from itself) aside."""
    stats = s.stats()
    return stats["used_bytes"] - stats.get("arena_bytes", 0)

def zeros(num_blocks, layout=LAYOUT):
    return [torch.zeros(layout.cache_shape(num_blocks), dtype=layout.dtype) for _ in range(layout.num_layers)]


def blocks(caches, ids):
    return [c[:, ids].clone() for c in caches]


@pytest.fixture(params=["embedded", "daemon-shm", "daemon-tcp"])
def hstore(request, daemon_factory):
    if request.param == "embedded":
        s = kvstore.KVStore.embedded(capacity="64MiB")
    else:
        d = daemon_factory(capacity="64MiB")
        s = d.connect("shm" if request.param == "daemon-shm" else "tcp")
    yield s
    s.close()


def status_bytes(store, rid):
    return store.inspect(request_keys(rid)["status"])["reserved"]


def test_roundtrip_into_reordered_blocks(hstore):
    src = child.caches(12, seed=1)
    dst = zeros(12)
    h = KVHandoff(hstore, LAYOUT, chunk_blocks=2)
    tokens = list(range(5 * BS - 3))
    h.publish("r1", src, [7, 2, 9, 0, 4], num_tokens=len(tokens), token_ids=tokens).wait()
    meta = h.fetch("r1", dst, [11, 3, 5, 1, 8], num_tokens=len(tokens))
    assert meta.num_blocks == 5 and meta.fingerprint == LAYOUT.fingerprint()
    for c_src, c_dst in zip(src, dst, strict=True):
        assert torch.equal(c_dst[:, [11, 3, 5, 1, 8]], c_src[:, [7, 2, 9, 0, 4]])
        untouched = [b for b in range(12) if b not in (11, 3, 5, 1, 8)]
        assert torch.count_nonzero(c_dst[:, untouched]) == 0
    assert not hstore.exists(request_keys("r1")["meta"])
    # prefix-keyed chunks stay as prefix cache (another request may share them) until their TTL
    assert h.lookup(tokens) == len(tokens)
    assert [r["state"] for r in KVHandoff.requests(hstore)] == ["fetched"]


def test_request_scoped_chunks_released_after_fetch(hstore):
    h = KVHandoff(hstore, LAYOUT, chunk_blocks=2)
    base = stored(hstore)
    h.publish("r2", child.caches(8), [1, 2, 3], num_tokens=3 * BS).wait()  # no token ids: request-scoped keys
    h.fetch("r2", zeros(8), [4, 5, 6])
    # only the small status record is left (it outlives the request for `kvstore requests`)
    assert stored(hstore) == base + status_bytes(hstore, "r2")


def test_concurrent_requests_sharing_a_prefix(hstore):
    h = KVHandoff(hstore, LAYOUT, chunk_blocks=1)
    shared = list(range(3 * BS))
    src = child.caches(8, seed=11)
    h.publish("a", src, [0, 1, 2, 3], num_tokens=4 * BS, token_ids=shared + [1] * BS).wait()
    h.publish("b", src, [0, 1, 2, 4], num_tokens=4 * BS, token_ids=shared + [2] * BS).wait()
    dst_a, dst_b = zeros(8), zeros(8)
    h.fetch("a", dst_a, [7, 6, 5, 4])  # must not take away the chunks "b" shares with it
    h.fetch("b", dst_b, [0, 1, 2, 3])
    assert torch.equal(dst_b[0][:, [0, 1, 2, 3]], src[0][:, [0, 1, 2, 4]])


def test_layout_mismatch_leaves_cache_untouched(hstore):
    KVHandoff(hstore, LAYOUT).publish("r", child.caches(4), [0, 1], num_tokens=2 * BS).wait()
    other = kvstore.KVLayout(**{**child.LAYOUT, "dtype": "float16"})
    dst = [torch.full(other.cache_shape(4), 3.0, dtype=torch.float16) for _ in range(other.num_layers)]
    with pytest.raises(kvstore.LayoutMismatchError, match="dtype.*float32.*float16"):
        KVHandoff(hstore, other).fetch("r", dst, [0, 1])
    assert all(torch.all(c == 3.0) for c in dst)
    dst32 = [c.float() for c in dst]
    with pytest.raises(kvstore.LayoutMismatchError, match="2 blocks.*3 block ids"):
        KVHandoff(hstore, LAYOUT).fetch("r", dst32, [0, 1, 2])
    with pytest.raises(kvstore.LayoutMismatchError, match="32 tokens.*expects 31"):
        KVHandoff(hstore, LAYOUT).fetch("r", dst32, [0, 1], num_tokens=31)
    assert all(torch.all(c == 3.0) for c in dst32)


def test_timeout(hstore):
    with no_hang("a fetch with a 0.5 s timeout"), pytest.raises(kvstore.HandoffTimeoutError):
        KVHandoff(hstore, LAYOUT).fetch("never", zeros(2), [0], timeout=0.5)


def test_fetch_is_woken_by_publish(hstore):
    h = KVHandoff(hstore, LAYOUT)
    src, dst, got = child.caches(4, seed=3), zeros(4), {}
    waiter = threading.Thread(target=lambda: got.setdefault("meta", h.fetch("late", dst, [2, 3], timeout=10)))
    waiter.start()
    time.sleep(0.3)
    KVHandoff(hstore, LAYOUT).publish("late", src, [0, 1], num_tokens=2 * BS).wait()
    waiter.join(10)
    assert got["meta"].request_id == "late"
    assert torch.equal(dst[0][:, [2, 3]], src[0][:, [0, 1]])


def test_cancel_reclaims_at_once_and_aborts_waiters(hstore):
    h = KVHandoff(hstore, LAYOUT)
    base = stored(hstore)
    h.publish("c", child.caches(8), list(range(6)), num_tokens=6 * BS).wait()
    assert stored(hstore) > base + 6 * LAYOUT.block_nbytes
    h.cancel("c")
    extra = status_bytes(hstore, "c") + hstore.inspect(request_keys("c")["cancel"])["reserved"]
    assert stored(hstore) == base + extra
    with pytest.raises(kvstore.HandoffAbortedError, match="cancelled"):
        h.fetch("c", zeros(8), list(range(6)), timeout=2)
    states = {r["request_id"]: r["state"] for r in KVHandoff.requests(hstore)}
    assert states["c"] == "cancelled"


def test_unfetched_request_reclaimed_at_ttl(hstore):
    h = KVHandoff(hstore, LAYOUT, status_ttl=30)
    base = stored(hstore)
    h.publish("old", child.caches(4), [0, 1, 2], num_tokens=3 * BS, ttl=0.5).wait()
    assert hstore.exists(request_keys("old")["meta"])
    assert wait_until(lambda: stored(hstore) == base + status_bytes(hstore, "old"), timeout=10)
    assert not hstore.exists(request_keys("old")["meta"])
    assert {r["request_id"]: r["state"] for r in KVHandoff.requests(hstore)}["old"] == "expired"


def test_prefix_lookup_across_processes_and_fetch_prefix(daemon_factory):
    d = daemon_factory(capacity="64MiB")
    store = d.connect("shm")
    h = KVHandoff(store, LAYOUT, chunk_blocks=1)
    prompt = [(7 * i) % 1000 for i in range(4 * BS + 5)]
    src = child.caches(8, seed=5)
    h.publish("p", src, [4, 5, 6, 7, 0], num_tokens=len(prompt), token_ids=prompt).wait()
    h.fetch("p", zeros(8), [0, 1, 2, 3, 4], keep=True)  # keep the chunks for reuse
    longer = prompt[:3 * BS] + [1, 2, 3] * 9  # shares exactly three whole blocks
    assert h.lookup(prompt) == len(prompt)
    assert h.lookup(longer) == 3 * BS
    # another process (different PYTHONHASHSEED) computes the same keys
    env = child_env()
    env["PYTHONHASHSEED"] = "12345"
    out = subprocess.run([sys.executable, os.path.join(HELPERS, "handoff_child.py"), "lookup", d.unix_url,
                          ",".join(map(str, longer))], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == 3 * BS
    dst = zeros(8)
    assert h.fetch_prefix(longer, dst, [1, 3, 5, 7]) == 3 * BS
    for c_src, c_dst in zip(src, dst, strict=True):
        assert torch.equal(c_dst[:, [1, 3, 5]], c_src[:, [4, 5, 6]])
        assert torch.count_nonzero(c_dst[:, 7]) == 0
    store.close()


def test_producer_killed_mid_publish_leaves_nothing(daemon_factory):
    d = daemon_factory(capacity="256MiB")
    store = d.connect("shm")
    base = stored(store)
    proc = subprocess.Popen([sys.executable, os.path.join(HELPERS, "handoff_child.py"), "publish", d.unix_url,
                             "dead", "1500"], env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "publishing"
        # kill while chunks are still being reserved and written (1500 one-block chunks of 128 KiB): the
        # producer holds its claim from the start
        keys = request_keys("dead")
        assert wait_until(lambda: store.exists(keys["claim"]) and store.stats()["pending"] > 0, timeout=20,
                          interval=0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    keys = request_keys("dead")
    with pytest.raises(kvstore.HandoffAbortedError, match="went away|cancelled|disappeared"):
        KVHandoff(store, LAYOUT).fetch("dead", zeros(2), [0], timeout=5)
    assert not store.exists(keys["meta"]) and not store.exists(keys["claim"])
    assert wait_until(lambda: store.stats()["pending"] == 0, timeout=5)
    assert stored(store) == base + status_bytes(store, "dead")
    assert {r["request_id"]: r["state"] for r in KVHandoff.requests(store)}["dead"] == "aborted"
    store.close()


def test_bad_arguments(hstore):
    h = KVHandoff(hstore, LAYOUT)
    with pytest.raises(ValueError, match="need 2 blocks"):
        h.publish("x", child.caches(4), [0], num_tokens=BS + 1)
    with pytest.raises(kvstore.InvalidArgumentError):
        h.publish("a/b", child.caches(4), [0], num_tokens=BS)
    with pytest.raises(ValueError, match="token_ids has 3"):
        h.publish("x", child.caches(4), [0], num_tokens=BS, token_ids=[1, 2, 3])


def _corrupt(path, daemon, store, key, at):
    """Flip one byte of a committed chunk where it is stored, without telling the store: the daemon's shared
    segment (shm and tcp clients of one daemon), or the embedded store's own memory (via its zero-copy view)."""
    if daemon is not None:
        flip_byte(daemon.pid, store, key, at=at)
        return
    with store.get(key, copy=False) as obj:
        address = np.frombuffer(memoryview(obj), dtype=np.uint8).ctypes.data + at
        ctypes.c_ubyte.from_address(address).value ^= 0xFF


@pytest.fixture(params=["embedded", "daemon-shm", "daemon-tcp"])
def corruptible(request, daemon_factory):
    """(path, daemon or None, store) for the corruption tests."""
    if request.param == "embedded":
        with kvstore.KVStore.embedded(capacity="64MiB") as s:
            yield request.param, None, s
        return
    d = daemon_factory(capacity="64MiB")
    with d.connect("shm" if request.param == "daemon-shm" else "tcp") as s:
        yield request.param, d, s


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "python-fallback"])
def test_a_corrupted_chunk_is_detected_on_fetch_and_reported_as_failed_blocks(corruptible, fused, monkeypatch):
    """A byte flipped in a stored chunk (bad memory, a stray writer): fetch raises HandoffChecksumError naming
    the chunk, with that chunk's blocks and every later one as failed_blocks (the engine recomputes them) and the
    earlier, verified ones as loaded_blocks; verify=False would have taken the bad bytes as valid."""
    if fused:
        monkeypatch.delenv("KVSTORE_NO_FUSED_HASH", raising=False)
        if kvstore.ops.fused_checksums() is not None:
            pytest.skip(kvstore.ops.fused_checksums())
    else:
        monkeypatch.setenv("KVSTORE_NO_FUSED_HASH", "1")
    path, daemon, store = corruptible
    h = KVHandoff(store, LAYOUT, chunk_blocks=2)
    src = child.caches(10)
    meta = h.publish("bad", src, [0, 1, 2, 3, 4, 5], num_tokens=6 * BS).wait()
    _corrupt(path, daemon, store, meta.chunk_keys[1], at=7)
    dst = zeros(10)
    with pytest.raises(HandoffChecksumError, match="checksum") as info:
        h.fetch("bad", dst, [4, 5, 6, 7, 8, 9], timeout=5)
    err = info.value
    assert isinstance(err, kvstore.ChecksumError) and isinstance(err, kvstore.HandoffAbortedError)
    assert err.key == meta.chunk_keys[1] and meta.chunk_keys[1] in str(err)
    assert err.failed_blocks == (6, 7, 8, 9) and err.loaded_blocks == (4, 5)
    for c_src, c_dst in zip(src, dst, strict=True):
        assert torch.equal(c_dst[:, [4, 5]], c_src[:, [0, 1]])  # the verified chunk before it is loaded
        assert torch.count_nonzero(c_dst[:, [8, 9]]) == 0  # nothing after the bad chunk was written
        assert torch.count_nonzero(c_dst[:, :4]) == 0
    # the fused scatter wrote the bad chunk before its hash was known, hence "failed"; the fallback did not
    assert any(torch.count_nonzero(c[:, [6, 7]]) for c in dst) == fused
    # the check is what caught it: unverified, the same request loads corrupt pages without complaint
    h.fetch("bad", dst, [4, 5, 6, 7, 8, 9], timeout=5, verify=False)
    assert not all(torch.equal(c_dst[:, [6, 7]], c_src[:, [2, 3]]) for c_src, c_dst in zip(src, dst, strict=True))


def test_a_corrupted_prefix_chunk_fails_fetch_prefix(corruptible):
    path, daemon, store = corruptible
    h = KVHandoff(store, LAYOUT, chunk_blocks=1)
    tokens = list(range(3 * BS))
    src = child.caches(6, seed=3)
    meta = h.publish("pre", src, [0, 1, 2], num_tokens=len(tokens), token_ids=tokens).wait()
    _corrupt(path, daemon, store, meta.chunk_keys[2], at=1)
    dst = zeros(6)
    with pytest.raises(HandoffChecksumError) as info:
        h.fetch_prefix(tokens, dst, [3, 4, 5])
    assert info.value.key == meta.chunk_keys[2]
    assert info.value.failed_blocks == (5,) and info.value.loaded_blocks == (3, 4)


@pytest.mark.parametrize("bad", [[0.9, 1.9, 2.9], torch.tensor([0.9, 1.9, 2.9]), torch.tensor([True, False, True]),
                                 [True, False, True], __import__("numpy").array([0.5, 1.5, 2.5])],
                         ids=["float-list", "float-tensor", "bool-tensor", "bool-list", "float-numpy"])
def test_non_integer_block_ids_are_refused_before_anything_is_consumed(hstore, bad):
    h = KVHandoff(hstore, LAYOUT, chunk_blocks=2)
    src = child.caches(8, seed=5)
    with pytest.raises(TypeError, match="float|bool"):
        h.publish("nf-pub", src, bad, num_tokens=3 * BS)
    h.publish("nf", src, [1, 2, 3], num_tokens=3 * BS).wait()
    dst = zeros(8)
    with pytest.raises(TypeError, match="float|bool") as info:
        h.fetch("nf", dst, bad)
    assert "dtype" in str(info.value) or "at index" in str(info.value)
    assert all(torch.count_nonzero(c) == 0 for c in dst)  # nothing written
    h.fetch("nf", dst, [4, 5, 6])  # the request was not consumed
    for c_src, c_dst in zip(src, dst, strict=True):
        assert torch.equal(c_dst[:, [4, 5, 6]], c_src[:, [1, 2, 3]])


def test_fetching_twice_says_already_fetched(hstore):
    h = KVHandoff(hstore, LAYOUT, chunk_blocks=2)
    h.publish("twice", child.caches(8), [1, 2], num_tokens=2 * BS).wait()
    h.fetch("twice", zeros(8), [3, 4])
    with pytest.raises(kvstore.HandoffAbortedError, match="already fetched") as info:
        h.fetch("twice", zeros(8), [3, 4], timeout=2.0)
    assert "went away" not in str(info.value)


def test_a_second_producer_of_a_prefix_never_replaces_its_chunks(hstore):
    """Two prefill workers publish the same tokens with numerically different KV: the chunks the first stored
    stay, its request fetches byte-exact, and the second request records (and gets) those same chunks."""
    tokens = list(range(4 * BS))
    first, second = child.caches(8, seed=1), child.caches(8, seed=2)
    h = KVHandoff(hstore, LAYOUT, chunk_blocks=2)
    h.publish("one", first, [0, 1, 2, 3], num_tokens=len(tokens), token_ids=tokens).wait()
    h.publish("two", second, [0, 1, 2, 3], num_tokens=len(tokens), token_ids=tokens).wait()
    for rid in ("one", "two"):
        dst = zeros(8)
        h.fetch(rid, dst, [4, 5, 6, 7], num_tokens=len(tokens))
        for got, want in zip(blocks(dst, [4, 5, 6, 7]), blocks(first, [0, 1, 2, 3]), strict=True):
            assert torch.equal(got, want), rid


def test_concurrent_producers_of_a_prefix_agree_on_one_copy_of_each_chunk(hstore):
    """Two prefill workers publish the same prefix at the same moment, with different bytes. Each chunk is
    stored once (the first commit wins, chunk by chunk, so a prefix may hold chunks of both: each is a valid KV
    of its tokens) and never replaced: both requests record the same versions and fetch (no
    HandoffChecksumError) the same bytes, each chunk byte-exact one producer's."""
    first, second = child.caches(8, seed=1), child.caches(8, seed=2)
    for trial in range(6):
        tokens = [trial * 1000 + t for t in range(4 * BS)]
        producers = [KVHandoff(hstore, LAYOUT, chunk_blocks=2) for _ in range(2)]
        barrier = threading.Barrier(2)
        metas = {}

        def publish(i, h, src, tokens=tokens, barrier=barrier, metas=metas, trial=trial):
            barrier.wait()
            metas[i] = h.publish(f"t{trial}-{i}", src, [0, 1, 2, 3], num_tokens=len(tokens), token_ids=tokens).wait()

        threads = [threading.Thread(target=publish, args=(i, h, src))
                   for i, (h, src) in enumerate(zip(producers, (first, second), strict=True))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(metas) == 2 and metas[0].checksums == metas[1].checksums, trial
        got = []
        for i in range(2):
            dst = zeros(8)
            producers[0].fetch(f"t{trial}-{i}", dst, [4, 5, 6, 7], num_tokens=len(tokens))
            got.append(dst)
        for chunk in ([4, 5], [6, 7]):
            mine = blocks(got[0], chunk)
            assert all(torch.equal(a, b) for a, b in zip(mine, blocks(got[1], chunk), strict=True)), (trial, chunk)
            assert any(all(torch.equal(a, b) for a, b in zip(mine, blocks(src, [b - 4 for b in chunk]), strict=True))
                       for src in (first, second)), (trial, chunk)


def test_a_chunk_stored_again_after_eviction_is_not_taken_for_the_version_a_request_references(hstore):
    """A prefix chunk evicted under a published request and stored again by another producer (other bytes):
    the first request's fetch says its chunk is gone (HandoffAbortedError, not a checksum failure, nothing
    written); the second request fetches its own mix: the first's chunk 0 it referenced, its own chunk 1."""
    tokens = list(range(4 * BS))
    first, second = child.caches(8, seed=1), child.caches(8, seed=2)
    h = KVHandoff(hstore, LAYOUT, chunk_blocks=2)
    one = h.publish("one", first, [0, 1, 2, 3], num_tokens=len(tokens), token_ids=tokens).wait()
    assert hstore.evict(one.chunk_keys[1])
    h.publish("two", second, [0, 1, 2, 3], num_tokens=len(tokens), token_ids=tokens).wait()
    dst = zeros(8)
    with pytest.raises(kvstore.HandoffAbortedError, match="not the version") as info:
        h.fetch("one", dst, [4, 5, 6, 7], num_tokens=len(tokens))
    assert not isinstance(info.value, HandoffChecksumError)
    assert all(torch.count_nonzero(c) == 0 for c in dst)
    h.fetch("two", dst, [4, 5, 6, 7], num_tokens=len(tokens))
    for c_dst, c_first, c_second in zip(dst, first, second, strict=True):
        assert torch.equal(c_dst[:, [4, 5]], c_first[:, [0, 1]]) and torch.equal(c_dst[:, [6, 7]], c_second[:, [2, 3]])


def test_a_later_request_that_references_a_prefix_chunk_keeps_it_for_its_own_ttl(hstore):
    """A chunk lives as long as the latest request that references it: a second producer of the same prefix
    (a longer TTL) refreshes the chunks the first stored, which outlive the first request's TTL and are the
    second request's KV."""
    tokens = list(range(4 * BS))
    first, second = child.caches(8, seed=1), child.caches(8, seed=2)
    h = KVHandoff(hstore, LAYOUT, chunk_blocks=2)
    one = h.publish("short", first, [0, 1, 2, 3], num_tokens=len(tokens), token_ids=tokens, ttl=1.0).wait()
    assert all(hstore.inspect(key)["expires_in_s"] <= 1.0 for key in one.chunk_keys)
    h.publish("long", second, [0, 1, 2, 3], num_tokens=len(tokens), token_ids=tokens, ttl=120.0).wait()
    assert all(hstore.inspect(key)["expires_in_s"] > 60 for key in one.chunk_keys)
    time.sleep(1.5)  # past the first request's TTL
    assert h.lookup(tokens) == len(tokens)
    dst = zeros(8)
    h.fetch("long", dst, [4, 5, 6, 7], num_tokens=len(tokens))
    for got, want in zip(blocks(dst, [4, 5, 6, 7]), blocks(first, [0, 1, 2, 3]), strict=True):
        assert torch.equal(got, want)


def test_a_salted_or_adapter_prefix_is_its_own():
    """cache_salt and the LoRA adapter are part of the prefix keys (as in the vLLM connector): a salted publish
    is found only with that salt, and only its blocks are fetched."""
    store = kvstore.KVStore.embedded(capacity="16MiB")
    h = KVHandoff(store, LAYOUT, chunk_blocks=1)
    prompt = list(range(2 * BS))
    src = child.caches(4, seed=7)
    h.publish("salted", src, [2, 3], num_tokens=len(prompt), token_ids=prompt, cache_salt="tenant-a").wait()
    assert h.lookup(prompt) == 0 and h.lookup(prompt, adapter="sql@/a") == 0
    assert h.lookup(prompt, cache_salt="tenant-b") == 0
    assert h.lookup(prompt, cache_salt="tenant-a") == len(prompt)
    dst = zeros(4)
    assert h.fetch_prefix(prompt, dst, [0, 1]) == 0
    assert h.fetch_prefix(prompt, dst, [0, 1], cache_salt="tenant-a") == len(prompt)
    for c_src, c_dst in zip(src, dst, strict=True):
        assert torch.equal(c_dst[:, [0, 1]], c_src[:, [2, 3]])
    store.close()
