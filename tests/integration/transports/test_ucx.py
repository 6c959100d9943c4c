"""The ucx transport through a real daemon (``--listen ucx://127.0.0.1:0``): round trips byte-exact, batch puts,
clients on different transports sharing objects, a client killed mid-transfer, the daemon killed, and the
path chosen for every combination of request, host and what each end has.

Both ways of connecting are exercised on this one host: ``address`` (worker addresses exchanged over the
control connection: shared memory, what a same-host client gets) and ``listener`` (the daemon's UCX listener
with peer-failure handling: TCP here, verbs on RDMA hosts; what a client on another host gets).
Everything that needs UCX is skipped, with the reason, when ucxx cannot be loaded.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import UCX_ARGS, MiB, no_hang, ucx_missing, wait_until
from paths import ROOT

import kvstore
from kvstore import InvalidArgumentError, KeyNotFoundError, TransportError, transports
from kvstore.daemon.server import Server, ServerConfig

pytestmark = pytest.mark.timeout(120)


UCX_MISSING = ucx_missing()
needs_ucx = pytest.mark.skipif(UCX_MISSING is not None, reason=f"ucx transport unavailable: {UCX_MISSING}")


def pattern(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(size * 7919 + seed).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture(params=["address", "listener"])
def via(request, monkeypatch) -> str:
    monkeypatch.setenv("KVSTORE_UCX_CONNECT", request.param)
    return request.param


@pytest.fixture
def ucx_store(ucx_daemon, via, prefix):
    s = ucx_daemon.connect("ucx")
    yield s
    try:
        for key in s.keys(prefix):
            s.remove(key)
    except kvstore.KVStoreError:
        pass
    s.close()


# ---- data through the daemon ------------------------------------------------------------------------
@needs_ucx
@pytest.mark.parametrize("size", [1, 4 << 10, (64 << 10) + 1, 1 * MiB + 3, 32 * MiB])
def test_put_get_get_into_byte_exact(ucx_store, prefix, size):
    value = pattern(size)
    meta = ucx_store.put(prefix + "k", value)
    assert meta.size == size
    out = np.zeros(size + 5, dtype=np.uint8)
    assert ucx_store.get_into(prefix + "k", out, verify=True) == size
    assert np.array_equal(out[:size], value) and not out[size:].any()
    assert bytes(ucx_store.get(prefix + "k", verify=True)) == value.tobytes()


@needs_ucx
def test_path_is_reported(ucx_store, via):
    ucx_store.put("path-probe", pattern(1 * MiB))  # the first transfer connects the UCX endpoint
    mine = [c for c in ucx_store.stats()["connections"] if c["transport"] == "ucx"]
    assert mine and all(f"ucx by {via}" in c["path"] for c in mine), mine
    assert ucx_store.stats()["transports"] == ["shm", "tcp", "ucx"]
    assert ucx_store.inspect("path-probe")["client_transport"] == "ucx"
    ucx_store.remove("path-probe")


@needs_ucx
def test_batch_put_and_batch_get_into(ucx_store, prefix):
    sizes = [100, 200 << 10, 3 * MiB, 17]
    items = [(f"{prefix}{i}", pattern(n, i)) for i, n in enumerate(sizes)]
    metas = ucx_store.batch_put(items)
    assert [m.size for m in metas] == sizes
    outs = [np.zeros(n, dtype=np.uint8) for n in sizes]
    assert ucx_store.batch_get_into([k for k, _ in items], outs) == sizes
    for (_, v), out in zip(items, outs, strict=True):
        assert np.array_equal(out, v)


@needs_ucx
def test_get_into_too_small_buffer_keeps_the_connection_usable(ucx_store, prefix):
    ucx_store.put(prefix + "big", pattern(2 * MiB))
    with pytest.raises(kvstore.BufferTooSmallError):
        ucx_store.get_into(prefix + "big", np.zeros(MiB, dtype=np.uint8))
    out = np.zeros(2 * MiB, dtype=np.uint8)
    assert ucx_store.get_into(prefix + "big", out) == 2 * MiB and np.array_equal(out, pattern(2 * MiB))
    assert ucx_store.stats()["leases"] == 0


@needs_ucx
def test_missing_key(ucx_store, prefix):
    with pytest.raises(KeyNotFoundError):
        ucx_store.get_into(prefix + "absent", np.zeros(10, dtype=np.uint8))


@needs_ucx
def test_short_message_is_refused_and_never_visible(ucx_store, prefix):
    """A put whose message is shorter than the object (bytes that did not all arrive) is aborted."""
    transport = ucx_store._data
    full = transport._array
    transport._array = lambda view: full(view[:len(view) // 2] if len(view) > MiB else view)
    with pytest.raises(TransportError, match="sent .* bytes for a"):
        ucx_store.put(prefix + "short", pattern(4 * MiB))
    transport._array = full
    assert not ucx_store.exists(prefix + "short")
    assert wait_until(lambda: ucx_store.stats()["pending"] == 0, 5)
    ucx_store.put(prefix + "after", pattern(4 * MiB))  # the connection reconnects and works
    assert ucx_store.exists(prefix + "after")


@needs_ucx
def test_ucx_and_tcp_and_shm_clients_share_objects(ucx_daemon, via, prefix):
    with ucx_daemon.connect("ucx") as u, ucx_daemon.connect("tcp") as t, ucx_daemon.connect("shm") as s:
        assert (u.transport, t.transport, s.transport) == ("ucx", "tcp", "shm")
        for writer, name in ((u, "from-ucx"), (t, "from-tcp"), (s, "from-shm")):
            writer.put(prefix + name, pattern(5 * MiB, len(name)))
        for reader in (u, t, s):
            for name in ("from-ucx", "from-tcp", "from-shm"):
                out = np.zeros(5 * MiB, dtype=np.uint8)
                reader.get_into(prefix + name, out, verify=True)
                assert np.array_equal(out, pattern(5 * MiB, len(name))), (reader.transport, name)
        for name in ("from-ucx", "from-tcp", "from-shm"):
            u.remove(prefix + name)


# ---- faults -------------------------------------------------------------------------------------------
@needs_ucx
@pytest.mark.parametrize("size", [8 * MiB, 64 * MiB])
def test_client_killed_mid_transfer_leaves_nothing(daemon_factory, via, spawn, size):
    d = daemon_factory(capacity="128MiB", args=UCX_ARGS)
    child = spawn("ucx_child.py", "stall", d.unix_url, "victim", size)
    assert child.expect("READY", timeout=30) == "READY in-flight"  # killed with its send not complete
    with d.connect("tcp") as observer:
        assert observer.stats()["pending"] == 1 and observer.stats()["used_bytes"] >= size
        child.kill()
        assert wait_until(lambda: observer.stats()["pending"] == 0 and observer.stats()["used_bytes"] == 0, 10), \
            observer.stats()
        assert not observer.exists("victim")
    # the daemon is unharmed: another ucx client writes and reads the same key
    with d.connect("ucx") as again:
        again.put("victim", pattern(size))
        out = np.zeros(size, dtype=np.uint8)
        again.get_into("victim", out)
        assert np.array_equal(out, pattern(size))
    assert d.running()


@needs_ucx
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_client_killed_at_any_point_of_a_put_loop(daemon_factory, via, spawn, seed):
    """Killed wherever it is (control round trip, rendezvous, bytes moving, commit): afterwards nothing is
    pending, and the key is either absent or a whole committed version that verifies."""
    from client_child import pattern as child_pattern

    size = 16 * MiB
    d = daemon_factory(capacity="128MiB", args=UCX_ARGS)
    child = spawn("ucx_child.py", "loop", d.unix_url, "looped", size)
    child.expect("PUT 1", timeout=30)
    time.sleep(np.random.default_rng(seed).uniform(0, 0.03))
    child.kill()
    with d.connect("tcp") as observer:
        assert wait_until(lambda: observer.stats()["pending"] == 0, 10), observer.stats()
        assert observer.stats()["objects"] == 1  # at least one put had committed before the kill
        assert bytes(observer.get("looped", verify=True)) == child_pattern("looped", size)
        observer.remove("looped")
        assert wait_until(lambda: observer.stats()["used_bytes"] == 0, 5), observer.stats()


@needs_ucx
def test_daemon_killed_client_errors_within_its_timeout(daemon_factory, via):
    d = daemon_factory(capacity="64MiB", args=UCX_ARGS)
    store = d.connect("ucx", timeout=3.0)
    store.put("k", pattern(2 * MiB))
    d.kill()
    for op in (lambda: store.put("k2", pattern(2 * MiB)), lambda: store.get_into("k", np.zeros(2 * MiB, np.uint8))):
        with no_hang("a UCX call to a killed daemon"), pytest.raises(ConnectionError):
            op()
    store.close()


@needs_ucx
def test_daemon_killed_mid_transfer_over_the_listener(daemon_factory, monkeypatch):
    """With peer-failure handling (the cross-host path) a transfer the daemon dies under ends in a
    ConnectionError within the client's timeout. (Same-host endpoints have no failure handling: see
    kvstore/transports/ucx.py for why that path trades this for shared memory.)"""
    monkeypatch.setenv("KVSTORE_UCX_CONNECT", "listener")
    d = daemon_factory(capacity="256MiB", args=UCX_ARGS)
    store = d.connect("ucx", timeout=3.0)
    value = pattern(64 * MiB)
    store.put("warm", value)
    killer = threading.Timer(0.3, d.kill)
    killer.start()
    with no_hang("UCX puts while the daemon dies"), pytest.raises(ConnectionError):
        for i in range(1000):
            store.put(f"k{i % 2}", value)
    killer.join()
    store.close()


# ---- path selection -----------------------------------------------------------------------------------
@needs_ucx
def test_auto_on_the_same_host_is_shm(ucx_daemon):
    for url in (ucx_daemon.unix_url, ucx_daemon.tcp_url):
        with kvstore.connect(url) as s:
            assert s.transport == "shm"


@needs_ucx
def test_auto_from_another_host_prefers_ucx_then_tcp(ucx_daemon, monkeypatch):
    monkeypatch.setattr("kvstore.client.remote.host_id", lambda: "elsewhere/0")
    with kvstore.connect(ucx_daemon.tcp_url) as s:
        assert s.transport == "ucx"
        s.put("remote-k", pattern(3 * MiB))  # UCX by the listener: the daemon sees another host
        assert [c["path"] for c in s.stats()["connections"] if c["transport"] == "ucx"] \
            == ["ucx by listener, peer-failure handling (tcp or verbs)"]
        out = np.zeros(3 * MiB, dtype=np.uint8)
        s.get_into("remote-k", out)
        assert np.array_equal(out, pattern(3 * MiB))
        s.remove("remote-k")
    monkeypatch.setattr(transports, "names", lambda: ["shm", "tcp"])  # a client without ucxx
    with kvstore.connect(ucx_daemon.tcp_url) as s:
        assert s.transport == "tcp"


def test_explicit_ucx_to_a_daemon_without_it_fails_at_connect(daemon):
    with pytest.raises(TransportError, match=r"'ucx' is not served here.*--listen ucx://"):
        daemon.connect("ucx")


def test_ucx_url_is_not_a_control_address():
    with pytest.raises(InvalidArgumentError, match="UCX data endpoint"):
        kvstore.connect("ucx://127.0.0.1:1")


def test_a_ucx_endpoint_alone_is_refused():
    with pytest.raises(InvalidArgumentError, match="data endpoint"):
        ServerConfig(listen=("ucx://127.0.0.1:7000",))


@pytest.mark.parametrize("same_host", [True, False])
@pytest.mark.parametrize("daemon_has_ucx", [True, False])
@pytest.mark.parametrize("client_has_ucx", [True, False])
def test_choose_transport_table(same_host, daemon_has_ucx, client_has_ucx):
    server = Server(ServerConfig(listen=("unix:///tmp/never-bound.sock",)))
    server.ucx = object() if daemon_has_ucx else None
    host = server.host_id if same_host else "elsewhere/0"
    offered = ["shm", "tcp"] + (["ucx"] if client_has_ucx else [])
    expected_auto = "shm" if same_host else ("ucx" if daemon_has_ucx and client_has_ucx else "tcp")
    assert server.choose_transport("auto", host, "peer", offered) == expected_auto
    assert server.choose_transport("tcp", host, "peer", offered) == "tcp"
    if daemon_has_ucx:
        assert server.choose_transport("ucx", host, "peer", offered) == "ucx"
    else:
        with pytest.raises(TransportError, match="not served"):
            server.choose_transport("ucx", host, "peer", offered)
    if same_host:
        assert server.choose_transport("shm", host, "peer", offered) == "shm"
    else:
        with pytest.raises(TransportError, match="needs the client on the daemon's host"):
            server.choose_transport("shm", host, "peer", offered)
    with pytest.raises(TransportError, match="not served"):
        server.choose_transport("cuda_ipc", host, "peer", offered)


def test_registry_without_ucxx_says_how_to_install_it():
    """Without ucxx the library still imports and works; asking for "ucx" is a clear TransportUnavailable."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from kvstore import transports\n"
            "print(transports.names())\n"
            "try:\n    transports.get('ucx')\n"
            "except transports.TransportUnavailable as e:\n    print('UNAVAILABLE', e)\n")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "['shm', 'tcp']" in out.stdout
    assert "UNAVAILABLE transport 'ucx' is unavailable" in out.stdout and "pip install" in out.stdout


# ---- what the UCX listener answers ----------------------------------------------------------------------
def _non_loopback_address() -> str | None:
    import ipaddress
    import socket

    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        infos = []
    for info in infos:
        if not ipaddress.ip_address(info[4][0]).is_loopback:
            return info[4][0]
    for target in ("10.254.254.254", "192.0.2.1"):  # no packet is sent: connect() only picks an interface
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((target, 9))
            except OSError:
                continue
            addr = probe.getsockname()[0]
            if not ipaddress.ip_address(addr).is_loopback:
                return addr
    return None


class _RecordingChannel:
    timeout = 3.0

    def __init__(self):
        self.calls: list[dict] = []

    def call(self, request: dict, **kw) -> dict:
        self.calls.append(request)
        return {"ok": True}


@needs_ucx
def test_listener_on_loopback_refuses_connections_to_other_addresses(ucx_daemon):
    """--listen ucx://127.0.0.1:P serves 127.0.0.1 only, although ucxx itself listens on every interface."""
    import re

    from kvstore.transports.base import TransportFailure
    from kvstore.transports.ucx import UcxTransport

    other = _non_loopback_address()
    if other is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    found = re.search(r"UCX data endpoint on port (\d+)", ucx_daemon.log())
    assert found, ucx_daemon.log()
    port = int(found.group(1))
    client = UcxTransport(connect="listener")
    channel = _RecordingChannel()
    client.timeout = 3.0
    try:
        with pytest.raises(TransportFailure):
            client._open_endpoint(channel, {"via": "listener", "host": other, "port": port})
    finally:
        client.close()
    assert channel.calls == [], "the daemon's listener answered a connection to a non-loopback address"
    assert wait_until(lambda: f"refused a UCX connection to {other}" in ucx_daemon.log(), 10), ucx_daemon.log()
    with ucx_daemon.connect("ucx") as s:  # the loopback address it was given still works, by the listener too
        s.put("after-refusal", pattern(2 * MiB))
        s.remove("after-refusal")


@needs_ucx
def test_ucx_listener_needs_a_token_like_tcp(short_dir):
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--capacity", "4MiB", "--listen",
                           f"unix://{short_dir}/u.sock", *UCX_ARGS], capture_output=True, text=True, timeout=60,
                          cwd=short_dir, env={**__import__("conftest").child_env()})
    assert proc.returncode != 0
    assert "ucx://127.0.0.1:0" in proc.stderr and "token" in proc.stderr, proc.stderr
