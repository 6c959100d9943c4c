"""GPU data paths: CUDA IPC into a daemon's GPU segments, device <-> host through shared memory, the GPU tier,
and path selection.

Three kinds of test:

* CPU: configuration, the refusal of ``--gpu-capacity`` without a GPU, path selection with a faked capability,
  value checks, the master's tiers, and that nothing GPU loads at import;
* fake GPU (CPU): the daemon and the clients use tests/helpers/fake_cuda.py as their CUDA runtime ("device
  memory" is shared memory, an IPC handle is its name, copies are memmove), which runs the whole protocol end
  to end: GPU tier, eviction, staging for host readers, the IPC mapping cache, pinning, two processes;
* real GPU (skipped without one): the same paths with torch CUDA tensors and kvstore._C_cuda.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import fake_cuda  # noqa: E402
import numpy as np
import pytest
import torch
from client_child import pattern  # noqa: E402
from conftest import HELPERS, Daemon, MiB, child_env, short_tmpdir, wait_until

import kvstore
from kvstore import BufferTooSmallError, InvalidArgumentError, KeyNotFoundError, ObjectTooLargeError, TransportError
from kvstore.cli.main import build_parser
from kvstore.core.master import Master, Tier
from kvstore.core.meta import ObjectMeta
from kvstore.daemon.server import Server, ServerConfig
from kvstore.transports.cuda_ipc import IPC_MAPPINGS, DeviceBuffer

pytestmark = pytest.mark.timeout(120)
HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")


def fake_dev(data: np.ndarray) -> DeviceBuffer:
    """A "device" buffer of the fake runtime over host memory."""
    return DeviceBuffer(data.ctypes.data, data.nbytes, 0, 0, fake_cuda, owner=data)


def data_of(key: str, size: int) -> np.ndarray:
    return np.frombuffer(pattern(key, size), np.uint8).copy()


# ---- daemons --------------------------------------------------------------------------------------------
class FakeGpuDaemon(Daemon):
    """``kvstore serve`` whose CUDA runtime is fake_cuda.py; stop() also checks its "GPU memory" was freed."""

    def command(self) -> list[str]:
        return [sys.executable, os.path.join(HELPERS, "fake_gpu_daemon.py"), *super().command()[4:]]

    def stop(self, *args, **kw) -> None:
        pid = self.proc.pid if self.proc is not None else None
        super().stop(*args, **kw)
        left = glob.glob(f"/dev/shm/{fake_cuda.PREFIX}{pid}-*")
        assert not left, f"daemon {pid} did not free its GPU segments: {left}"


def _factory(cls):
    workdir = short_tmpdir()
    started: list[Daemon] = []

    def make(capacity: str = "32MiB", gpu_capacity: str | None = "16MiB", args: tuple = ()) -> Daemon:
        extra = ("--gpu-capacity", gpu_capacity) if gpu_capacity else ()
        d = cls(workdir, capacity=capacity, args=(*extra, *args))
        started.append(d)
        return d.start()

    return make, started, workdir


@pytest.fixture
def fake_daemon():
    make, started, workdir = _factory(FakeGpuDaemon)
    yield make
    for d in started:
        d.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def gpu_daemon():
    pytest.importorskip("kvstore._C_cuda", reason="kvstore._C_cuda is not built")
    make, started, workdir = _factory(Daemon)
    yield make
    for d in started:
        d.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def shared_gpu_daemon(module_workdir):
    """One daemon with GPU segments for the round-trip tests of this module."""
    if not HAS_GPU:
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("kvstore._C_cuda", reason="kvstore._C_cuda is not built")
    d = Daemon(module_workdir, capacity="64MiB", args=("--gpu-capacity", "128MiB")).start()
    yield d
    assert d.running(), f"the GPU daemon died during the tests:\n{d.log()}"
    d.stop()


def run_child(*args: str, timeout: float = 60) -> str:
    out = subprocess.run([sys.executable, os.path.join(HELPERS, "cuda_child.py"), *args], capture_output=True,
                         text=True, env=child_env(), timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout.strip()


def settled(store: kvstore.KVStore) -> dict:
    """Stats once the daemon has processed this client's queued releases (sent ahead of the stats call)."""
    assert wait_until(lambda: store.stats()["leases"] == 0, 5.0)
    return store.stats()


# ==== CPU ================================================================================================
def test_importing_the_library_loads_nothing_gpu():
    code = ("import sys, kvstore.client.remote, kvstore.daemon.server\nfrom kvstore import transports\n"
            "names = transports.names()\n"
            "print('torch' in sys.modules, 'kvstore._C_cuda' in sys.modules, 'cuda_ipc' in names)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True"]  # registered (torch is installed), not loaded


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_serve_refuses_gpu_capacity_without_a_gpu(short_dir):
    sock = os.path.join(short_dir, "kv.sock")
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix://{sock}",
                           "--capacity", "8MiB", "--gpu-capacity", "64MiB"], capture_output=True, text=True,
                          env=child_env(), cwd=short_dir, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--gpu-capacity" in proc.stderr and ("CUDA" in proc.stderr or "not built" in proc.stderr), proc.stderr
    assert not os.path.exists(sock), "the refused daemon left its socket"


@pytest.mark.parametrize("fields,match", [
    ({"gpu_capacity": -1}, "gpu capacity"),
    ({"gpu_capacity": True}, "gpu capacity"),
    ({"gpu_capacity": 1 << 20, "device": -1}, "device"),
    ({"gpu_capacity": 1 << 20, "device": True}, "device"),
    ({"device": 0}, "give --gpu-capacity"),
])
def test_gpu_options_are_validated(fields, match):
    with pytest.raises(InvalidArgumentError, match=match):
        ServerConfig(listen=("unix:///tmp/never-bound.sock",), **fields)


def test_serve_parses_gpu_options():
    args = build_parser().parse_args(["serve", "--gpu-capacity", "8GiB", "--device", "1"])
    assert (args.gpu_capacity, args.device) == ("8GiB", 1)
    args = build_parser().parse_args(["serve"])
    assert (args.gpu_capacity, args.device) == ("0", None)


@pytest.mark.parametrize("same_host", [True, False])
@pytest.mark.parametrize("daemon_has_gpu", [True, False])
@pytest.mark.parametrize("client_offers", [True, False])
def test_choose_transport_with_a_faked_gpu(same_host, daemon_has_gpu, client_offers):
    server = Server(ServerConfig(listen=("unix:///tmp/never-bound.sock",)))
    server.gpu = object() if daemon_has_gpu else None  # all choose_transport looks at
    host = server.host_id if same_host else "elsewhere/0"
    offered = ["shm", "tcp"] + (["cuda_ipc"] if client_offers else [])
    expected = ("cuda_ipc" if daemon_has_gpu and client_offers else "shm") if same_host else "tcp"
    assert server.choose_transport("auto", host, "peer", offered) == expected
    if not daemon_has_gpu:
        with pytest.raises(TransportError, match="not served.*--gpu-capacity"):
            server.choose_transport("cuda_ipc", host, "peer", offered)
    elif same_host:
        assert server.choose_transport("cuda_ipc", host, "peer", offered) == "cuda_ipc"
    else:
        with pytest.raises(TransportError, match="needs the client on the daemon's host"):
            server.choose_transport("cuda_ipc", host, "peer", offered)


def test_daemon_without_gpu_serves_no_cuda_ipc(daemon, prefix):
    with daemon.connect("shm") as s:
        assert "cuda_ipc" not in s.stats()["transports"] and "gpu" not in s.stats()
        s.put(prefix + "k", b"x" * 100)
        assert s.inspect(prefix + "k")["tier"] == "host"
        s.remove(prefix + "k")
    with kvstore.connect(daemon.unix_url) as s:
        assert s.transport == "shm"  # torch offers cuda_ipc, but this daemon has no GPU segments
    with pytest.raises(TransportError, match="--gpu-capacity"):
        kvstore.connect(daemon.unix_url, transport="cuda_ipc")


def test_host_only_stores_refuse_memory_they_cannot_reach():
    with kvstore.KVStore.embedded(capacity="1MiB") as s:
        with pytest.raises(InvalidArgumentError, match="CPU tensor"):
            s.put("k", torch.empty(16, device="meta"))
        with pytest.raises(InvalidArgumentError, match="CPU tensor"):
            s.get_into("k", torch.empty(16, device="meta"))
        assert not s.exists("k")


def test_embedded_store_stages_device_memory_through_the_host():
    """The embedded store supplies device memory too (staged): put, batch_put and get_into of device buffers
    round-trip, with checksums recorded as for host values."""
    src, other = data_of("dev", 4096), data_of("host", 100)
    with kvstore.KVStore.embedded(capacity="1MiB") as s:
        assert s.device_memory() is not None and "staged" in s.device_memory().describe()
        meta = s.put("k", fake_dev(src))
        assert meta.size == src.nbytes and meta.checksum is not None
        s.batch_put([("a", fake_dev(src[:1000])), ("b", other)])
        out = np.zeros(4096, np.uint8)
        assert s.get_into("k", fake_dev(out), verify=True) == 4096 and np.array_equal(out, src)
        small = np.zeros(10, np.uint8)
        with pytest.raises(BufferTooSmallError):
            s.get_into("k", fake_dev(small))
        assert not small.any()
        assert bytes(s.get("a")) == src[:1000].tobytes() and bytes(s.get("b")) == other.tobytes()


def test_device_buffer_checks_its_fields_and_slices():
    with pytest.raises(ValueError, match="ptr"):
        DeviceBuffer(-1, 10, 0, 0, fake_cuda)
    with pytest.raises(ValueError, match="nbytes"):
        DeviceBuffer(4096, -1, 0, 0, fake_cuda)
    buf = DeviceBuffer(4096, 100, 0, 7, fake_cuda)
    part = buf[10:30]
    assert (part.ptr, len(part), part.stream) == (4106, 20, 7)
    assert len(buf[:500]) == 100
    with pytest.raises(ValueError, match="step"):
        buf[::2]


def _meta(key: str, size: int) -> ObjectMeta:
    return ObjectMeta(key=key, size=size)


def test_master_tiers_have_their_own_capacity_and_eviction():
    kib = 1024
    m = Master([100 * kib, 40 * kib], tiers=[Tier.HOST, Tier.GPU], high_watermark=0.9, low_watermark=0.5)
    c = m.register_client()
    for i in range(5):
        m.commit(m.begin_put(_meta(f"h{i}", 10 * kib), c).id)
    for i in range(10):
        r = m.begin_put(_meta(f"g{i}", 10 * kib), c, tier=Tier.GPU)
        assert m.tier_of(r) is Tier.GPU and r.segment == 1
        m.commit(r.id)
    stats = m.stats()
    assert stats["tiers"]["gpu"]["used_bytes"] <= 40 * kib and stats["evictions"] > 0
    assert all(m.exists(f"h{i}") for i in range(5)), "a GPU put evicted host objects"
    assert m.exists("g9") and stats["tiers"]["host"] == {"capacity_bytes": 100 * kib, "used_bytes": 50 * kib,
                                                        "segments": [0]}
    with pytest.raises(ObjectTooLargeError, match="gpu tier"):
        m.begin_put(_meta("big", 50_000), c, tier=Tier.GPU)
    host_only = Master([1000])
    with pytest.raises(InvalidArgumentError, match="no gpu memory"):
        host_only.begin_put(_meta("x", 10), host_only.register_client(), tier=Tier.GPU)
    with pytest.raises(ValueError, match="one Tier per segment"):
        Master([1000, 1000], tiers=[Tier.HOST])


# ==== fake GPU (runs on CPU) ===============================================================================
@pytest.mark.parametrize("size", [0, 1, 4096, 64 * 1024 + 1, 3 * MiB + 5])
def test_fake_cuda_ipc_roundtrip_through_the_gpu_tier(fake_daemon, size):
    d = fake_daemon()
    with kvstore.connect(d.unix_url) as s:
        assert s.transport == "cuda_ipc"
        src = data_of("k", size)
        meta = s.put("k", fake_dev(src))
        assert (meta.size, meta.checksum) == (size, None)  # device puts record no checksum
        info = s.inspect("k")
        assert (info["tier"], info["client_transport"]) == ("gpu", "cuda_ipc")
        out = np.full(size + 3, 7, np.uint8)
        assert s.get_into("k", fake_dev(out)) == size
        assert out[:size].tobytes() == src.tobytes() and out[size:].tolist() == [7, 7, 7]
        stats = settled(s)
        assert stats["tiers"]["gpu"]["used_bytes"] >= size and stats["tiers"]["host"]["used_bytes"] == 0
        assert stats["transport"] == "cuda_ipc" and stats["device_path"].startswith("cuda_ipc")
        assert [c["transport"] for c in stats["connections"]] == ["cuda_ipc"]


def test_fake_host_readers_get_gpu_objects_staged_by_the_daemon(fake_daemon):
    d = fake_daemon()
    src = data_of("g", 2 * MiB)
    with kvstore.connect(d.unix_url) as s, d.connect("shm") as shm, d.connect("tcp") as tcp:
        s.put("g", fake_dev(src))
        for store in (s, shm):
            out = np.zeros(2 * MiB, np.uint8)
            assert store.get_into("g", out) == 2 * MiB and np.array_equal(out, src)
            assert np.array_equal(np.asarray(store.get("g")), src)
        assert np.array_equal(np.asarray(tcp.get("g")), src)
        small = data_of("small", 1000)
        s.put("small", fake_dev(small))
        assert bytes(tcp.get("small")) == small.tobytes()  # inline stream reply
        with shm.get("g", copy=False) as view:  # zero-copy: the staging region is held with the lease
            assert np.array_equal(np.asarray(view), src)
            assert shm.stats()["pending"] == 1
        stats = settled(shm)
        assert (stats["pending"], stats["tiers"]["host"]["used_bytes"]) == (0, 0), "staging space leaked"


def test_fake_gpu_tier_evicts_gpu_objects_only(fake_daemon):
    d = fake_daemon(capacity="8MiB", gpu_capacity="4MiB")
    with kvstore.connect(d.unix_url) as s:
        for i in range(2):
            s.put(f"host{i}", pattern(f"host{i}", MiB))
        for i in range(8):
            s.put(f"gpu{i}", fake_dev(data_of(f"gpu{i}", MiB)))
        stats = s.stats()
        assert stats["evictions"] > 0
        assert stats["tiers"]["gpu"]["used_bytes"] <= stats["tiers"]["gpu"]["capacity_bytes"]
        assert stats["capacity_bytes"] == 12 * MiB
        assert all(s.exists(f"host{i}") for i in range(2)), "GPU puts evicted host objects"
        out = np.zeros(MiB, np.uint8)
        s.get_into("gpu7", fake_dev(out))
        assert np.array_equal(out, data_of("gpu7", MiB))
        with pytest.raises(KeyNotFoundError):
            s.get_into("gpu0", fake_dev(out))
        with pytest.raises(ObjectTooLargeError, match="gpu tier"):
            s.put("huge", fake_dev(np.zeros(5 * MiB, np.uint8)))


def test_fake_shm_connection_moves_device_buffers_through_pinned_host_memory(fake_daemon):
    d = fake_daemon(gpu_capacity=None)  # a daemon without GPU segments
    before = dict(fake_cuda.calls)
    with kvstore.connect(d.unix_url) as s:
        assert s.transport == "shm"
        src = data_of("h", 3 * MiB)
        s.put("h", fake_dev(src))
        assert s.inspect("h")["tier"] == "host"
        assert np.array_equal(np.asarray(s.get("h")), src)  # an ordinary host object
        out = np.zeros(3 * MiB, np.uint8)
        s.get_into("h", fake_dev(out))
        assert np.array_equal(out, src)
        assert s.stats()["device_path"] == "shm: device<->host copies through shared memory (pinned)"
        assert len(fake_cuda.registered) == 1 and list(fake_cuda.registered.values()) == [32 * MiB]
    assert fake_cuda.registered == {}, "a segment was left registered after close"
    assert fake_cuda.calls["host_register"] - before.get("host_register", 0) == 1


def test_fake_tcp_refuses_device_buffers_before_sending(fake_daemon):
    d = fake_daemon()
    with d.connect("tcp") as s:
        with pytest.raises(InvalidArgumentError, match="moves host memory only.*tcp"):
            s.put("k", fake_dev(np.zeros(100, np.uint8)))
        with pytest.raises(InvalidArgumentError, match="moves host memory only"):
            s.get_into("k", fake_dev(np.zeros(100, np.uint8)))
        assert not s.exists("k") and s.stats()["pending"] == 0
        assert s.stats()["device_path"].startswith("none")


def test_fake_ipc_handles_open_once_per_process(fake_daemon):
    d = fake_daemon()
    opened = fake_cuda.calls["ipc_open"]
    closed = fake_cuda.calls["ipc_close"]
    a, b = kvstore.connect(d.unix_url), kvstore.connect(d.unix_url)
    a.put("a", fake_dev(data_of("a", 5000)))
    b.put("b", fake_dev(data_of("b", 5000)))
    out = np.zeros(5000, np.uint8)
    b.get_into("a", fake_dev(out))
    assert np.array_equal(out, data_of("a", 5000))
    assert fake_cuda.calls["ipc_open"] - opened == 1 and IPC_MAPPINGS.count() == 1
    a.close()
    assert IPC_MAPPINGS.count() == 1 and fake_cuda.calls["ipc_close"] == closed
    b.close()
    assert IPC_MAPPINGS.count() == 0 and fake_cuda.calls["ipc_close"] - closed == 1


def test_fake_cuda_ipc_between_two_processes(fake_daemon):
    d = fake_daemon()
    assert run_child("put", d.unix_url, "from-child", str(MiB + 3), "fake", "auto") == "DONE cuda_ipc"
    with kvstore.connect(d.unix_url) as s:
        out = np.zeros(MiB + 3, np.uint8)
        s.get_into("from-child", fake_dev(out))
        assert out.tobytes() == pattern("from-child", MiB + 3)
        s.put("from-parent", fake_dev(data_of("from-parent", 2 * MiB)))
    assert run_child("get", d.unix_url, "from-parent", str(2 * MiB), "fake", "auto") == "MATCH cuda_ipc"


def test_fake_batch_put_mixes_device_and_host_values(fake_daemon):
    d = fake_daemon()
    with kvstore.connect(d.unix_url) as s:
        metas = s.batch_put([("dev", fake_dev(data_of("dev", 200_000))), ("host", pattern("host", 200_000))])
        assert [m.checksum is None for m in metas] == [True, False]
        assert [s.inspect(k)["tier"] for k in ("dev", "host")] == ["gpu", "host"]
        out = np.zeros(200_000, np.uint8)
        s.get_into("host", fake_dev(out), verify=True)  # host-put: verified by copying back
        assert out.tobytes() == pattern("host", 200_000)
        assert s.get_into("dev", fake_dev(out), verify=True) == 200_000  # no checksum to check


def test_fake_buffer_too_small_leaves_nothing_held(fake_daemon):
    d = fake_daemon()
    with kvstore.connect(d.unix_url) as s:
        s.put("k", fake_dev(data_of("k", 10_000)))
        with pytest.raises(BufferTooSmallError, match="10000 bytes"):
            s.get_into("k", fake_dev(np.zeros(9_999, np.uint8)))
        stats = settled(s)
        assert (stats["leases"], stats["pending"]) == (0, 0)


def test_fake_gpu_version_replaces_an_indexed_host_version(fake_daemon):
    """The shared-memory index must stop showing a key once its live version moved to the GPU tier."""
    d = fake_daemon()
    with d.connect("shm") as shm, kvstore.connect(d.unix_url) as s:
        shm.put("k", pattern("old", 4096))
        out = np.zeros(4096, np.uint8)
        shm.get_into("k", out)  # served from the index
        s.put("k", fake_dev(data_of("new", 4096)))
        assert shm._index.find("k") is None, "a GPU-resident object was published in the shared-memory index"
        shm.get_into("k", out)
        assert out.tobytes() == pattern("new", 4096)


def test_fake_writer_gone_before_commit_leaves_nothing(fake_daemon):
    """A cuda_put reserves GPU space that only a commit makes visible; the connection ending first frees it.
    The cuda ops are refused on a connection that is not cuda_ipc."""
    from kvstore.client.rpc import Connection
    from kvstore.protocol.url import Endpoint, host_id

    d = fake_daemon()
    meta = ObjectMeta(key="half", size=MiB).to_wire()
    put = {"op": "cuda_put", "key": "half", "size": MiB, "meta": meta}
    with d.connect("shm") as watcher:
        conn = Connection(Endpoint.parse(d.unix_url), 10.0)
        conn.call({"op": "hello", "transport": "shm", "host": host_id(), **d.hello_auth()})
        with pytest.raises(TransportError, match="need the cuda_ipc transport"):
            conn.call(put)
        conn.close()
        conn = Connection(Endpoint.parse(d.unix_url), 10.0)
        conn.call({"op": "hello", "transport": "cuda_ipc", "host": host_id(), "transports": ["cuda_ipc"],
                   **d.hello_auth()})
        reply = conn.call(put)
        assert reply["tier"] == "gpu" and watcher.stats()["pending"] == 1
        conn.close()  # gone without committing
        assert wait_until(lambda: watcher.stats()["pending"] == 0, 5.0)
        stats = watcher.stats()
        assert stats["tiers"]["gpu"]["used_bytes"] == 0 and not watcher.exists("half")


def test_fake_inspect_cli_shows_tier_and_path(fake_daemon):
    d = fake_daemon()
    with kvstore.connect(d.unix_url) as s:
        s.put("k", fake_dev(data_of("k", 4096)))
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "inspect", "--url", d.unix_url, "k", "--json"],
                         capture_output=True, text=True, env=child_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert (info["tier"], info["client_transport"]) == ("gpu", "cuda_ipc")


# ==== real GPU ===========================================================================================
@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("numel", [0, 1000, 3 * MiB + 1])
def test_gpu_cuda_ipc_roundtrip(shared_gpu_daemon, dtype, numel):
    d = shared_gpu_daemon
    gen = torch.Generator(device="cuda").manual_seed(numel)
    src = torch.randint(-100, 100, (numel,), device="cuda", generator=gen).to(dtype).reshape(-1, 1)
    with kvstore.connect(d.unix_url) as s:
        assert s.transport == "cuda_ipc"
        meta = s.put("k", src)
        assert (meta.kind, meta.dtype, meta.shape) == ("torch", str(dtype).removeprefix("torch."), (numel, 1))
        assert s.inspect("k")["tier"] == "gpu"
        out = torch.empty_like(src)
        assert s.get_into("k", out) == src.numel() * src.element_size()
        assert torch.equal(out, src)
        assert torch.equal(s.get("k").tensor(), src.cpu())  # a host read: staged by the daemon


@pytest.mark.cuda
@needs_gpu
def test_gpu_cuda_ipc_between_two_processes(gpu_daemon):
    d = gpu_daemon(capacity="64MiB", gpu_capacity="128MiB")
    assert run_child("put", d.unix_url, "from-child", str(8 * MiB + 3), "cuda", "auto") == "DONE cuda_ipc"
    with kvstore.connect(d.unix_url) as s:
        out = torch.empty(8 * MiB + 3, dtype=torch.uint8, device="cuda")
        s.get_into("from-child", out)
        assert out.cpu().numpy().tobytes() == pattern("from-child", 8 * MiB + 3)
        s.put("from-parent", torch.from_numpy(data_of("from-parent", 5 * MiB)).cuda())
    assert run_child("get", d.unix_url, "from-parent", str(5 * MiB), "cuda", "auto") == "MATCH cuda_ipc"


@pytest.mark.cuda
@needs_gpu
def test_gpu_segments_evict_and_account(gpu_daemon):
    d = gpu_daemon(capacity="16MiB", gpu_capacity="8MiB")
    with kvstore.connect(d.unix_url) as s, d.connect("tcp") as tcp:
        s.put("host", pattern("host", MiB))
        tensors = [torch.full((MiB,), i, dtype=torch.uint8, device="cuda") for i in range(12)]
        for i, t in enumerate(tensors):
            s.put(f"gpu{i}", t)
        stats = s.stats()
        assert stats["evictions"] > 0 and stats["gpu"]["capacity_bytes"] == 8 * MiB
        assert stats["tiers"]["gpu"]["used_bytes"] <= 8 * MiB and stats["capacity_bytes"] == 24 * MiB
        assert s.exists("host")
        out = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        s.get_into("gpu11", out)
        assert torch.equal(out, tensors[11])
        assert bytes(tcp.get("gpu11")) == bytes([11]) * MiB  # tcp reader: staged stream


@pytest.mark.cuda
@needs_gpu
def test_gpu_copies_follow_the_callers_stream(shared_gpu_daemon):
    """A put must copy after the work queued before it on the caller's stream, and a get_into after the
    work queued on it before, and be complete on return: a copy on any other stream would race the sleeps."""
    n = 32 * MiB
    expected = ((torch.arange(n, device="cuda") * 3 + 1) % 251).to(torch.uint8)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with kvstore.connect(shared_gpu_daemon.unix_url) as s, torch.cuda.stream(side):
        src = torch.zeros(n, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before src gets its bytes
        src.copy_(expected)
        s.put("stream-k", src)
        out = torch.zeros(n, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(200_000_000)
        out.fill_(7)  # would land after the copy if the copy did not wait for it
        s.get_into("stream-k", out)
        host = out.cpu()  # on `side`, after the get_into
        s.remove("stream-k")
    assert torch.equal(host, expected.cpu())


@pytest.mark.cuda
@needs_gpu
def test_gpu_device_host_through_shared_memory(daemon, prefix):
    pytest.importorskip("kvstore._C_cuda", reason="kvstore._C_cuda is not built")
    with kvstore.connect(daemon.unix_url) as s:
        assert s.transport == "shm"  # the module daemon has no GPU segments
        src = torch.randn(1024, 1024, device="cuda", dtype=torch.float16)
        s.put(prefix + "h", src)
        assert s.inspect(prefix + "h")["tier"] == "host"
        assert torch.equal(s.get(prefix + "h").tensor(), src.cpu())
        out = torch.empty_like(src)
        s.get_into(prefix + "h", out)
        assert torch.equal(out, src)
        assert s.stats()["device_path"].endswith("(pinned)")
        s.remove(prefix + "h")


@pytest.mark.cuda
@needs_gpu
def test_gpu_non_contiguous_put_and_verify(gpu_daemon):
    d = gpu_daemon(capacity="16MiB", gpu_capacity="64MiB")
    with kvstore.connect(d.unix_url) as s:
        t = torch.randn(256, 512, device="cuda").t()
        meta = s.put("t", t)
        assert meta.shape == (512, 256)
        out = torch.empty(512, 256, device="cuda")
        s.get_into("t", out)
        assert torch.equal(out, t)
        with pytest.raises(InvalidArgumentError, match="contiguous"):
            s.get_into("t", torch.empty(256, 512, device="cuda").t())
        s.put("host", pattern("host", 4096))
        dev = torch.empty(4096, dtype=torch.uint8, device="cuda")
        s.get_into("host", dev, verify=True)  # host tier into device memory, checksum verified
        assert dev.cpu().numpy().tobytes() == pattern("host", 4096)
