"""BlockIO and StoreLink against real stores: blocks round-trip as opaque bytes (every layer), a missing or
corrupt block is a per-block failure, a killed daemon fails the rest of the load and is one fault, and the
link reconnects once the daemon is back. No vLLM needed (torch only)."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from test_keys import LAYOUT  # noqa: E402
from vllm_runner import flip_bytes, segment_address  # noqa: E402

import kvstore  # noqa: E402
from kvstore.errors import UnsupportedKVCacheError  # noqa: E402
from kvstore.integrations.vllm.block_io import BlockIO  # noqa: E402
from kvstore.integrations.vllm.store_link import StoreLink, StoreUnavailable  # noqa: E402

NUM_BLOCKS = 16


def caches(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One allocation viewed as one cache per layer, as vLLM's CPU backend lays it out."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn((LAYOUT.num_layers, NUM_BLOCKS, *LAYOUT.page_shape), generator=g).to(torch.bfloat16)
    return whole, [whole[i] for i in range(LAYOUT.num_layers)]


@pytest.fixture(params=["embedded", "daemon-shm", "daemon-tcp"])
def block_store(request):
    if request.param == "embedded":
        s = kvstore.KVStore.embedded(capacity="16MiB")
    else:
        d = request.getfixturevalue("daemon")
        s = d.connect("shm" if request.param == "daemon-shm" else "tcp")
    yield s
    for key in s.keys("blockio/"):
        s.remove(key)
    s.close()


@pytest.mark.parametrize("leased", [False, True], ids=["staged", "leased"])
def test_blocks_round_trip_every_layer(block_store, leased):
    src_whole, src = caches(1)
    io = BlockIO(src, LAYOUT)
    assert io.save(block_store, [("blockio/a", 3), ("blockio/b", 11)]) == 2 * LAYOUT.block_nbytes
    io.save(block_store, [("blockio/c", 5)], ttl=60.0, pin=True)  # a hand-off block: the same bytes
    dst_whole, dst = caches(2)
    before = dst_whole.clone()
    result = BlockIO(dst, LAYOUT, leased_loads=leased).load(block_store, [("blockio/a", 0), ("blockio/b", 7),
                                                                          ("blockio/c", 8)])
    assert (result.loaded, result.failed_blocks, result.nbytes) == (3, (), 3 * LAYOUT.block_nbytes)
    assert torch.equal(dst_whole[:, 0], src_whole[:, 3]) and torch.equal(dst_whole[:, 7], src_whole[:, 11])
    assert torch.equal(dst_whole[:, 8], src_whole[:, 5])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (0, 7, 8)]
    assert torch.equal(dst_whole[:, untouched], before[:, untouched])


@pytest.mark.parametrize("leased", [False, True], ids=["staged", "leased"])
def test_missing_block_fails_alone(block_store, leased):
    _, src = caches(1)
    BlockIO(src, LAYOUT).save(block_store, [("blockio/good", 1)])
    _, dst = caches(3)
    result = BlockIO(dst, LAYOUT, leased_loads=leased).load(block_store, [("blockio/good", 2), ("blockio/none", 4)])
    assert result.loaded == 1 and result.failed_blocks == (4,) and result.missing == 1


@pytest.mark.parametrize("leased", [False, True], ids=["staged", "leased"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_block_damaged_after_commit_fails_its_checksum(daemon, transport, leased):
    s = daemon.connect(transport)
    src_whole, src = caches(1)
    BlockIO(src, LAYOUT).save(s, [(f"blockio/{transport}/a", 1), (f"blockio/{transport}/b", 2)])
    info = s.inspect(f"blockio/{transport}/a")
    flip_bytes(daemon.pid, segment_address(daemon.pid, info["segment"]) + info["offset"] + 100, 4)
    dst_whole, dst = caches(3)
    result = BlockIO(dst, LAYOUT, leased_loads=leased).load(s, [(f"blockio/{transport}/a", 5),
                                                                (f"blockio/{transport}/b", 6)])
    assert result.failed_blocks == (5,) and result.checksum_errors == 1 and result.loaded == 1
    assert torch.equal(dst_whole[:, 6], src_whole[:, 2])
    # the corrupt object is removed (the next lookup misses and vLLM recomputes it); the good one stays
    assert result.corrupt_removed == 1 and result.corrupt_keys == [f"blockio/{transport}/a"]
    assert not s.exists(f"blockio/{transport}/a") and s.exists(f"blockio/{transport}/b")
    for key in s.keys(f"blockio/{transport}/"):
        s.remove(key)
    s.close()


def test_cache_of_another_geometry_is_refused():
    whole = torch.zeros((NUM_BLOCKS, 2, 4, 64), dtype=torch.bfloat16)
    with pytest.raises(UnsupportedKVCacheError, match=r"expected \[num_blocks, 2, 4, 128\]"):
        BlockIO([whole, whole], LAYOUT)
    with pytest.raises(UnsupportedKVCacheError, match="dtype torch.float32 differs from the expected bfloat16"):
        BlockIO([torch.zeros((NUM_BLOCKS, *LAYOUT.page_shape))] * 2, LAYOUT)
    with pytest.raises(UnsupportedKVCacheError, match="moves CPU and CUDA caches, got meta"):
        BlockIO([torch.zeros((NUM_BLOCKS, *LAYOUT.page_shape), dtype=torch.bfloat16, device="meta")] * 2, LAYOUT)


@pytest.mark.parametrize("leased", [False, True], ids=["staged", "leased"])
def test_killed_daemon_fails_the_rest_of_the_load(daemon_factory, leased):
    d = daemon_factory(capacity="16MiB")
    s = d.connect("tcp", timeout=2.0)
    _, src = caches(1)
    BlockIO(src, LAYOUT).save(s, [(f"blockio/{i}", i) for i in range(4)])
    d.kill()
    _, dst = caches(2)
    result = BlockIO(dst, LAYOUT, leased_loads=leased).load(s, [(f"blockio/{i}", i) for i in range(4)])
    assert result.connection_lost and result.failed_blocks == (0, 1, 2, 3) and result.loaded == 0
    s.close()


def test_link_warns_once_per_outage_and_reconnects(daemon_factory, short_dir, caplog):
    d = daemon_factory(capacity="16MiB")
    link = StoreLink(d.unix_url, timeout=2.0, retry_s=0.0, name="test", transport="tcp")
    link.client().put("blockio/x", b"1")
    port = d.port
    d.kill()
    caplog.set_level(logging.WARNING, logger="kvstore.integrations.vllm")
    for _ in range(3):
        try:
            link.client().exists("blockio/x")
        except StoreUnavailable:
            pass
        except kvstore.StoreConnectionError as exc:
            link.fault(exc)
    assert not link.up and link.faults >= 2
    assert sum("is unavailable" in r.getMessage() for r in caplog.records) == 1
    back = daemon_factory(capacity="16MiB", unix_path=d.unix_path, port=port)
    assert link.client().exists("blockio/x") is False  # a fresh daemon: reconnected, empty
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    link.close()
    assert back.running()


def counter():
    from kvstore.integrations.vllm.stats import Counters

    counts = Counters()

    def count(req_id=None, **deltas):  # the saver also names the request and its pending bytes
        for k, v in deltas.items():
            if hasattr(counts, k):
                setattr(counts, k, getattr(counts, k) + v)

    return counts, count


def test_async_saver_reads_the_cache_off_thread_and_reports_requests_once_saved(daemon):
    from kvstore.integrations.vllm.saver import AsyncSaver

    store = daemon.connect("shm")
    counts, count = counter()
    src_whole, src = caches(1)
    io = BlockIO(src, LAYOUT)
    link = StoreLink(daemon.unix_url, timeout=5.0, retry_s=60, name="test")
    saver = AsyncSaver(io, link, count, ttl=None, max_bytes=3 * LAYOUT.block_nbytes)
    saver.submit("r1", [("blockio/s0", 0), ("blockio/s1", 1)], pin=True, ttl=60.0)
    assert saver.wait_for(["r1"], 30.0) and saver.finished(["r1", "r2"]) == {"r1", "r2"}
    saver.submit("r2", [(f"blockio/s{i}", i) for i in range(2, 6)])  # over the bound: dropped, not queued
    assert saver.drain(10.0)
    assert (counts.saved_blocks, counts.dropped_saves) == (2, 4)
    info = store.inspect("blockio/s0")
    assert info["pinned"] and info["ttl_s"] == 60.0  # a hand-off block: never evicted, then expires
    _, dst = caches(2)
    assert BlockIO(dst, LAYOUT).load(store, [("blockio/s1", 9)]).loaded == 1
    assert torch.equal(dst[0][9], src_whole[0][1])  # gathered straight from the cache: the same bytes
    saver.close(5.0)
    for key in store.keys("blockio/"):
        store.remove(key)
    store.close()


def test_async_saver_counts_a_dead_store_as_dropped_and_still_reports_the_request():
    from kvstore.integrations.vllm.saver import AsyncSaver

    counts, count = counter()

    def refuse(*args):
        raise kvstore.StoreConnectionError("no daemon")

    _, src = caches(1)
    saver = AsyncSaver(BlockIO(src, LAYOUT), StoreLink("unix:///none", timeout=1.0, retry_s=60, name="test",
                                                        open=refuse), count, ttl=None)
    saver.submit("r1", [("blockio/d0", 0)])
    assert saver.wait_for(["r1"], 10.0) and saver.finished(["r1"]) == {"r1"}
    assert counts.dropped_saves == 1 and counts.saved_blocks == 0
    saver.close(5.0)


def test_async_loader_reports_every_request_once_with_its_failed_blocks(daemon_factory):
    from kvstore.integrations.vllm.loader import AsyncLoader

    d = daemon_factory(capacity="16MiB")
    s = d.connect("tcp", timeout=2.0)
    src_whole, src = caches(1)
    BlockIO(src, LAYOUT).save(s, [("blockio/l0", 0), ("blockio/l1", 1)])
    dst_whole, dst = caches(2)
    loader = AsyncLoader(BlockIO(dst, LAYOUT), StoreLink(d.unix_url, timeout=2.0, retry_s=60, name="test",
                                                         transport="tcp"))
    loader.submit("r1", [("blockio/l0", 4), ("blockio/gone", 5), ("blockio/l1", 6)])
    done = wait_done(loader, 1)
    assert [r for r, _ in done] == ["r1"] and done[0][1].failed_blocks == (5,) and done[0][1].loaded == 2
    assert torch.equal(dst_whole[:, 4], src_whole[:, 0]) and torch.equal(dst_whole[:, 6], src_whole[:, 1])
    d.kill()  # a daemon killed before (or during) a load: every block fails, the request is still reported
    loader.submit("r2", [("blockio/l0", 7), ("blockio/l1", 8)])
    loader.submit("r3", [("blockio/l0", 9)])
    done = wait_done(loader, 2)
    assert sorted(r for r, _ in done) == ["r2", "r3"]
    assert sorted(b for _, result in done for b in result.failed_blocks) == [7, 8, 9]
    assert loader.take() == [] and loader.in_flight == 0
    loader.close(5.0)
    s.close()


def wait_done(loader, n: int) -> list:
    import time

    done: list = []
    deadline = time.monotonic() + 60
    while len(done) < n and time.monotonic() < deadline:
        done += loader.take()
        time.sleep(0.01)
    return done


def test_async_loader_of_a_consumer_unpins_the_hand_off_blocks_it_loaded(daemon_factory):
    from kvstore.integrations.vllm.loader import AsyncLoader

    counts, count = counter()  # imports vLLM: slow on a loaded machine, so before the TTL starts
    d = daemon_factory(capacity="16MiB")
    s = d.connect("tcp", timeout=2.0)
    _, src = caches(1)
    BlockIO(src, LAYOUT).save(s, [("blockio/p0", 0), ("blockio/p1", 1), ("blockio/p2", 2)], ttl=3600.0, pin=True)
    assert s.stats()["pinned_objects"] == 3
    _, dst = caches(2)
    loader = AsyncLoader(BlockIO(dst, LAYOUT), StoreLink(d.unix_url, timeout=2.0, retry_s=60, name="test",
                                                         transport="tcp"), unpin=True, count=count)
    loader.submit("r1", [("blockio/p0", 4), ("blockio/gone", 5), ("blockio/p1", 6)])
    assert wait_done(loader, 1)[0][1].loaded == 2
    loader.close(5.0)  # the unpin follows the report on the loader thread: closing waits for it
    assert counts.unpinned_blocks == 2
    stats = s.stats()
    assert stats["pinned_objects"] == 1  # the block nobody loaded stays pinned until its TTL
    assert not s.inspect("blockio/p0")["pinned"] and s.inspect("blockio/p2")["pinned"]
    assert s.inspect("blockio/p1")["ttl_s"] == 3600.0
    s.close()
