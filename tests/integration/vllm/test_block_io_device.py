"""BlockIO's device path (kvstore.integrations.vllm.device_io) without a GPU: "device" memory is host memory
handed to a real daemon's store as DeviceBuffers with the fake CUDA runtime (tests/helpers/fake_cuda.py), so
the store's own device path runs (one copy per block into the region reserved in shared memory, which the client
registers once per segment). Caches are shaped as vLLM 0.32 allocates them (interleaved BLHNC, token-major
LBNHC, MLA). On a GPU the same round trip runs on real CUDA caches. No vLLM needed."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

import fake_cuda  # noqa: E402

import kvstore  # noqa: E402
from kvstore.errors import DeviceCopyError  # noqa: E402
from kvstore.integrations.vllm.block_io import BlockIO  # noqa: E402
from kvstore.integrations.vllm.keys import CacheLayout  # noqa: E402
from kvstore.integrations.vllm.saver import AsyncSaver  # noqa: E402
from kvstore.integrations.vllm.store_link import StoreLink  # noqa: E402

L, NB, H, N, D = 3, 12, 2, 16, 64


def layout_of(kind: str, page_shape: tuple[int, ...], dtype: str = "bfloat16") -> CacheLayout:
    return CacheLayout(backend="CUDA/auto", packing="kv-content", cache_layout="", dtype=dtype,
                       kv_cache_dtype="auto", block_size=N, num_layers=L, num_kv_heads=H, head_size=D,
                       page_shape=page_shape, model="/models/tiny", revision="", tp_rank=0, tp_size=1, kind=kind)


def vllm_caches(name: str, seed: int, device: str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor], CacheLayout]:
    """(the allocation, one [B, H, N, C] view per layer as vLLM 0.32 makes them, the matching CacheLayout)."""
    g = torch.Generator().manual_seed(seed)
    if name == "BLHNC":  # block-outermost: each block holds every layer's page; layers interleave
        raw = torch.randn((NB, L, H, N, 2 * D), generator=g).to(torch.bfloat16).to(device)
        return raw, [raw[:, i] for i in range(L)], layout_of("vllm_hnc", (H, N, 2 * D))
    if name == "LBNHC":  # vLLM's default: token-major pages under the logical [B, H, N, C] view
        raw = torch.randn((L, NB, N, H, 2 * D), generator=g).to(torch.bfloat16).to(device)
        return raw, [raw[i].transpose(1, 2) for i in range(L)], layout_of("vllm_nhc", (N, H, 2 * D))
    raw = torch.randn((L, NB, 1, N, 576), generator=g).to(torch.bfloat16).to(device)  # MLA, LBHNC
    return raw, [raw[i] for i in range(L)], layout_of("mla", (N, 576))


def blocks_of(views: list[torch.Tensor], block_id: int) -> list[torch.Tensor]:
    return [v[block_id] for v in views]


class FakeDevice:
    """Host memory posing as device memory, copied by the fake CUDA runtime."""

    runtime, index, stream_handle = fake_cuda, 0, 7

    def __init__(self, out_of_memory: bool = False):
        self.out_of_memory = out_of_memory
        self.stream_entries: list[tuple[bool, bool]] = []

    def empty(self, shape, dtype):
        if self.out_of_memory:
            raise torch.OutOfMemoryError("fake CUDA: out of memory allocating the staging buffer")
        return torch.empty(shape, dtype=dtype)

    def ids(self, block_ids):
        return torch.tensor(list(block_ids), dtype=torch.int64)

    @contextlib.contextmanager
    def on_stream(self, *, after_engine: bool, before_engine: bool):
        self.stream_entries.append((after_engine, before_engine))
        yield


@pytest.fixture(params=["shm"])
def store(request):
    if request.param == "embedded":
        s = kvstore.KVStore.embedded(capacity="16MiB")
    else:
        s = request.getfixturevalue("daemon").connect(request.param)
    yield s
    for key in s.keys("devio/"):
        s.remove(key)
    s.close()


@pytest.mark.parametrize("store", ["shm", "tcp", "embedded"], indirect=True)
@pytest.mark.parametrize("name", ["BLHNC", "LBNHC", "MLA"])
def test_device_blocks_round_trip_through_pinned_shared_memory(store, name):
    _, src, layout = vllm_caches(name, 1)
    before_calls = dict(fake_cuda.calls)
    device = FakeDevice()
    io = BlockIO(src, layout, device=device)
    keys = [(f"devio/{name}/{b}", b) for b in (3, 11, 0)]
    assert io.save(store, keys) == 3 * layout.block_nbytes
    calls = {k: v - before_calls.get(k, 0) for k, v in fake_cuda.calls.items()}
    # one device-to-host copy per block straight into its reserved view, one wait for all of them
    assert calls["memcpy_async"] == 3 and calls["event_synchronize"] == 1
    if getattr(store, "transport", None) == "shm":  # the store's own memory: its segment registered once
        assert io.device.pinned == 3 and "pinned" in store.stats()["device_path"]
        assert calls.get("host_register", 0) <= 1
    assert device.stream_entries == [(True, False)]  # waited for the engine's stream, on ours
    _, dst, _ = vllm_caches(name, 2)
    before = [v.clone() for v in dst]
    out = FakeDevice()
    result = BlockIO(dst, layout, device=out).load(store, [(k, b + 1 if b < 11 else 5) for k, b in keys])
    assert (result.loaded, result.failed_blocks, result.nbytes) == (3, (), 3 * layout.block_nbytes)
    assert out.stream_entries == [(True, True)]  # the engine's stream waits for the loaded blocks
    assert fake_cuda.calls["memcpy_async"] - before_calls.get("memcpy_async", 0) == 6
    for (_, b), target in zip(keys, (4, 5, 1), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(blocks_of(dst, target), blocks_of(src, b), strict=True))
    untouched = [b for b in range(NB) if b not in (4, 5, 1)]
    assert all(torch.equal(v[untouched], w[untouched]) for v, w in zip(dst, before, strict=True))


def test_device_and_host_engines_exchange_blocks(store):
    """Bytes are the packed kind's, not the path's: a device save loads into a CPU engine and back."""
    _, src, layout = vllm_caches("LBNHC", 3)
    BlockIO(src, layout, device=FakeDevice()).save(store, [("devio/x/7", 7)])
    _, host_dst, _ = vllm_caches("LBNHC", 4)
    assert BlockIO(host_dst, layout).load(store, [("devio/x/7", 2)]).loaded == 1
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(host_dst, 2), blocks_of(src, 7), strict=True))
    BlockIO(host_dst, layout).save(store, [("devio/x/host", 2)])
    _, dev_dst, _ = vllm_caches("LBNHC", 5)
    assert BlockIO(dev_dst, layout, device=FakeDevice()).load(store, [("devio/x/host", 9)]).loaded == 1
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(dev_dst, 9), blocks_of(src, 7), strict=True))


def test_a_missing_block_fails_alone_and_device_faults_fail_the_request(store):
    _, src, layout = vllm_caches("BLHNC", 8)
    BlockIO(src, layout, device=FakeDevice()).save(store, [("devio/f/1", 1)])
    _, dst, _ = vllm_caches("BLHNC", 9)
    result = BlockIO(dst, layout, device=FakeDevice()).load(store, [("devio/f/1", 2), ("devio/f/none", 3)])
    assert (result.loaded, result.failed_blocks, result.missing) == (1, (3,), 1)
    oom = BlockIO(dst, layout, device=FakeDevice(out_of_memory=True))
    with pytest.raises(DeviceCopyError, match="device error while saving 1 block"):
        oom.save(store, [("devio/f/oom", 1)])
    assert not store.exists("devio/f/oom")  # the reservation was aborted
    result = oom.load(store, [("devio/f/1", 4), ("devio/f/1", 5)])
    assert (result.loaded, result.failed_blocks) == (0, (4, 5))  # vLLM recomputes them; nothing raised


def test_asynchronous_saver_drops_a_save_whose_device_copy_fails(daemon):
    """The saver thread counts a failed device gather as a dropped save; the engine's step goes on."""
    _, src, layout = vllm_caches("BLHNC", 12)
    counts: dict[str, float] = {}
    link = StoreLink(daemon.unix_url, timeout=5.0, retry_s=1.0, name="test", transport="shm")

    def count(req_id: str | None = None, **d: float) -> None:  # the per-request records are the saver's
        counts.update({k: counts.get(k, 0) + v for k, v in d.items()})

    saver = AsyncSaver(BlockIO(src, layout, device=FakeDevice(out_of_memory=True)), link, count, ttl=None)
    try:
        saver.submit("r1", [("devio/s/1", 1), ("devio/s/2", 2)])
        # both saves dropped, and the bytes they held as pending given back
        assert saver.drain(10.0) and counts == {"dropped_saves": 2, "save_pending_bytes": 0}
    finally:
        saver.close(5.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["BLHNC", "LBNHC", "MLA"])
def test_cuda_caches_round_trip(store, name):
    _, src, layout = vllm_caches(name, 10, "cuda")
    io = BlockIO(src, layout)
    assert io.device is not None
    io.save(store, [(f"devio/cuda/{name}", 6)])
    _, dst, _ = vllm_caches(name, 11, "cuda")
    assert BlockIO(dst, layout).load(store, [(f"devio/cuda/{name}", 2)]).loaded == 1
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(dst, 2), blocks_of(src, 6), strict=True))

