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
    io.put_packed(block_store, ["blockio/c"], io.pack([5]))  # the asynchronous saver's path: the same bytes
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


def test_async_saver_writes_off_thread_and_drops_beyond_its_bound():
    from kvstore.integrations.vllm.saver import AsyncSaver
    from kvstore.integrations.vllm.stats import Counters

    store = kvstore.KVStore.embedded(capacity="16MiB")
    counts = Counters()

    def count(**deltas):
        for k, v in deltas.items():
            setattr(counts, k, getattr(counts, k) + v)

    src_whole, src = caches(1)
    io = BlockIO(src, LAYOUT)
    link = StoreLink("embedded://", timeout=2.0, retry_s=60, name="test", open=lambda *a: store)
    saver = AsyncSaver(io, link, count, ttl=None, max_bytes=3 * LAYOUT.block_nbytes)
    saver.submit([("blockio/s0", 0), ("blockio/s1", 1)])
    src_whole.zero_()  # the cache may be reused as soon as submit returns: the blocks were packed
    assert saver.drain(10.0)
    saver.submit([("blockio/s2", 2), ("blockio/s3", 3), ("blockio/s4", 4), ("blockio/s5", 5)])  # over the bound
    assert saver.drain(10.0)
    assert (counts.saved_blocks, counts.dropped_saves) == (2, 4)
    _, dst = caches(2)
    assert BlockIO(dst, LAYOUT).load(store, [("blockio/s0", 9)]).loaded == 1
    assert not torch.equal(dst[0][9], torch.zeros_like(dst[0][9]))
    saver.close(5.0)


def test_async_saver_counts_a_dead_store_as_dropped():
    from kvstore.integrations.vllm.saver import AsyncSaver
    from kvstore.integrations.vllm.stats import Counters

    counts = Counters()

    def count(**deltas):
        for k, v in deltas.items():
            setattr(counts, k, getattr(counts, k) + v)

    def refuse(*args):
        raise kvstore.StoreConnectionError("no daemon")

    _, src = caches(1)
    saver = AsyncSaver(BlockIO(src, LAYOUT), StoreLink("unix:///none", timeout=1.0, retry_s=60, name="test",
                                                        open=refuse), count, ttl=None)
    saver.submit([("blockio/d0", 0)])
    assert saver.drain(10.0)
    assert counts.dropped_saves == 1 and counts.saved_blocks == 0
    saver.close(5.0)
