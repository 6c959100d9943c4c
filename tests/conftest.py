"""Shared fixtures: real ``kvstore serve`` daemons on temporary sockets, and the three kinds of store.

A daemon runs as a subprocess on a fresh Unix socket and a free loopback TCP port; the fixture waits until
both accept connections (bounded), and at teardown stops it with SIGTERM and asserts exit status 0, that
its socket file is gone and that no ``/dev/shm/kvstore-<pid>-*`` segment of it is left behind.

``store`` is parametrized over ``embedded``, ``daemon-shm`` (Unix socket, transport="shm") and
``daemon-tcp`` (tcp://, transport="tcp"). The daemon-backed kinds share one daemon per test module; every
test keys its objects under its own ``prefix`` and the fixture removes them afterwards. Tests that need an
empty store of a given size (eviction, capacity) use ``fresh_store``.
"""

from __future__ import annotations

import functools
import glob
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import paths as _paths
import pytest

import kvstore
from kvstore.testing import daemon as launcher

HELPERS = str(_paths.HELPERS)
STORE_KINDS = ("embedded", "daemon-shm", "daemon-tcp")
#: The backend contract suite (tests/integration/client/test_api.py) runs over these as well: a daemon over
#: UCX (skipped where ucxx is missing) and a two-member cluster (skipped without redis-server).
CONTRACT_KINDS = (*STORE_KINDS, "daemon-ucx", "cluster")
UCX_ARGS = ("--listen", "ucx://127.0.0.1:0")
MiB = 1 << 20


# ---- small utilities ----------------------------------------------------------------------------------
free_port = launcher.free_port
short_tmpdir = launcher.short_tmpdir
can_connect = launcher.can_connect


def shm_segments(pid: int) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/kvstore-{pid}-*"))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (a zombie has exited; its reaper has not
    collected it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] != "Z"  # the state follows the command name, which may hold ") "
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:  # there, but not readable from here
        return os.path.exists(f"/proc/{pid}")


session_token_file = launcher.process_token_file  # one token for the session's daemons ($KVSTORE_TOKEN_FILE)


def child_env() -> dict:
    """The environment of a test's child process: this checkout first on PYTHONPATH, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    root = str(_paths.ROOT)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


#: How long one call may take before a test says it hung. Far above every timeout the tests configure
#: (≤ 5 s), so a slow, loaded 2-core machine never trips it: tests assert behaviour (which error, which
#: event), never speed; only a call that would not return is caught here, with a message, before the per-test
#: timeout kills the run.
HANG_S = 30.0


@contextmanager
def no_hang(what: str, limit: float = HANG_S) -> Iterator[None]:
    """A "did not hang" bound on the block: AssertionError naming ``what`` if it took over ``limit`` s."""
    deadline = time.monotonic() + limit
    yield
    assert time.monotonic() < deadline, f"{what} took over {limit} s: it hung"


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def hello_proof(call: Callable[[dict], dict], token: str | None) -> dict:
    """Ask for a challenge over ``call`` and return the hello field that answers it (nothing without a token)."""
    from kvstore.protocol import credentials

    if token is None:
        return {}
    nonce = credentials.new_nonce()
    reply = call({"op": "challenge", "nonce": nonce})
    return {"proof": credentials.proof(token, "client", nonce, reply["nonce"], reply["node"])}


# ---- the daemon ---------------------------------------------------------------------------------------
class Daemon(launcher.Daemon):
    """One ``kvstore serve`` subprocess listening on a Unix socket and a loopback TCP port, started by the
    library's launcher (:mod:`kvstore.testing.daemon`), with the suite's checks: a failed start and an unclean
    stop (exit status not 0, a socket file or shared memory left) are test failures (AssertionError).

    ``args`` are extra serve flags and ``env`` additions to :func:`child_env`; ``token_file`` is passed as
    ``--token-file`` (default: the session's, :func:`session_token_file`), ``insecure=True`` as
    ``--insecure`` instead. ``connect`` sends the token."""

    def __init__(self, workdir: str, *, capacity: str = "64MiB", args: tuple[str, ...] = (),
                 unix_path: str | None = None, port: int | None = None, metrics_port: int | None = None,
                 token_file: str | None = None, insecure: bool = False, env: dict[str, str] | None = None):
        super().__init__(workdir, capacity=capacity, args=tuple(args), env={**child_env(), **(env or {})},
                         log_level="info", unix_path=unix_path, port=port, metrics_port=metrics_port,
                         token_file=token_file, insecure=insecure)

    def hello_auth(self, call: Callable[[dict], dict] | None = None) -> dict:
        """The credentials of a hand-made hello: with ``call`` (request -> reply on the connection that will
        say hello), the proof answering a challenge; without, the token in clear (accepted on a Unix socket
        only, as an older client's)."""
        return {"token": self.token} if call is None else hello_proof(call, self.token)

    def start(self, timeout: float = 30.0) -> Daemon:
        try:
            return super().start(timeout)
        except launcher.DaemonStartError as exc:
            raise AssertionError(str(exc)) from None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        """Stop gracefully and check that the daemon cleaned up after itself."""
        if self.proc is None or self.stopped:
            return
        pid = self.proc.pid
        try:
            rc = self.terminate(sig, timeout)
        except TimeoutError as exc:
            raise AssertionError(str(exc)) from None
        assert rc == 0, f"daemon {pid} exited with {rc} after {signal.Signals(sig).name}:\n{self.log()}"
        assert self.leftovers() == [], f"daemon {pid} left behind {self.leftovers()}"


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A short temporary directory for one test (socket paths), removed afterwards."""
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def module_workdir() -> Iterator[str]:
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(module_workdir) -> Iterator[Daemon]:
    """One 64 MiB daemon shared by a test module (tests isolate themselves with key prefixes)."""
    d = Daemon(module_workdir, capacity="64MiB").start()
    yield d
    assert d.running(), f"the module daemon died during the tests:\n{d.log()}"
    d.stop()


@pytest.fixture
def daemon_factory() -> Iterator[Callable[..., Daemon]]:
    """Start extra daemons for one test (Daemon(...) keyword arguments); each is stopped and checked after."""
    workdir = short_tmpdir()
    started: list[Daemon] = []

    def make(**kw) -> Daemon:
        d = Daemon(kw.pop("workdir", workdir), **kw)
        started.append(d)
        return d.start()

    yield make
    failures = []
    for d in started:
        try:
            d.stop()
        except AssertionError as exc:
            failures.append(str(exc))
    shutil.rmtree(workdir, ignore_errors=True)
    assert not failures, "\n".join(failures)


@functools.cache
def ucx_missing() -> str | None:
    """Why the ucx transport cannot load here (None: it can); asked on first use (it imports ucxx)."""
    from kvstore import transports
    from kvstore.transports.ucx import load

    try:
        load()
    except transports.TransportUnavailable as exc:
        return str(exc)
    return None


def _module_ucx_daemon(workdir: str, capacity: str) -> Iterator[Daemon]:
    if ucx_missing() is not None:
        pytest.skip(f"ucx transport unavailable: {ucx_missing()}")
    d = Daemon(workdir, capacity=capacity, args=UCX_ARGS).start()
    yield d
    assert d.running(), f"the module daemon died during the tests:\n{d.log()}"
    d.stop()


@pytest.fixture(scope="module")
def ucx_daemon(module_workdir) -> Iterator[Daemon]:
    """One 256 MiB daemon with a UCX listener shared by a test module (skipped where ucxx is missing)."""
    yield from _module_ucx_daemon(module_workdir, "256MiB")


@pytest.fixture(scope="module")
def contract_ucx_daemon(module_workdir) -> Iterator[Daemon]:
    """Like ``daemon`` (64 MiB), with a UCX listener: the contract suite's ``daemon-ucx`` kind."""
    yield from _module_ucx_daemon(module_workdir, "64MiB")


def _cluster_procs():
    """tests/helpers/cluster_procs (it imports redis), or a skip without redis or redis-server."""
    pytest.importorskip("redis", reason="the redis Python client is not installed (pip install redis)")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (apt-get install -y redis-server)")
    import cluster_procs

    return cluster_procs


@pytest.fixture(scope="module")
def contract_cluster(module_workdir):
    """A redis-server and two cluster members, A and B, shared by a test module."""
    c = _cluster_procs().Cluster(module_workdir, names="AB")
    yield c
    c.close()


# ---- stores -------------------------------------------------------------------------------------------
@pytest.fixture
def prefix(request) -> str:
    """Unique key prefix for one test (module daemons are shared)."""
    return f"{request.node.originalname}-{uuid.uuid4().hex[:8]}/"


@pytest.fixture(params=STORE_KINDS)
def store_kind(request) -> str:
    return request.param


def open_client(kind: str, request, second: bool = False) -> kvstore.KVStore:
    """A client of the module's shared store of ``kind`` (not embedded); ``second``: for the cluster, one
    whose home is the other member (so its reads of the first one's objects cross nodes)."""
    if kind == "embedded":
        raise ValueError("an embedded store has no second client")
    if kind == "cluster":
        return request.getfixturevalue("contract_cluster").client("B" if second else "A")
    if kind == "daemon-ucx":
        return request.getfixturevalue("contract_ucx_daemon").connect("ucx")
    return request.getfixturevalue("daemon").connect("shm" if kind == "daemon-shm" else "tcp")


def child_address(kind: str, request) -> tuple[str, str]:
    """(url, transport) a child process connects with to the module's shared store of ``kind``."""
    if kind == "cluster":
        return request.getfixturevalue("contract_cluster").url + "?node=B", "auto"
    if kind == "daemon-ucx":
        return request.getfixturevalue("contract_ucx_daemon").unix_url, "ucx"
    d = request.getfixturevalue("daemon")
    return (d.unix_url, "shm") if kind == "daemon-shm" else (d.tcp_url, "tcp")


@pytest.fixture
def store(request, store_kind, prefix) -> Iterator[kvstore.KVStore]:
    if store_kind == "embedded":
        s = kvstore.KVStore.embedded(capacity="64MiB")
    else:
        s = open_client(store_kind, request)
    yield s
    if store_kind != "embedded":
        try:
            for key in s.keys(prefix):
                try:
                    s.remove(key)
                except kvstore.KVStoreError:
                    pass
        except kvstore.StoreConnectionError:
            pass
    s.close()


@pytest.fixture
def client_factory(request, store_kind, store) -> Callable[[], kvstore.KVStore]:
    """Another client of the same store as ``store`` (embedded: the same object, shared by threads)."""
    opened: list[kvstore.KVStore] = []

    def make() -> kvstore.KVStore:
        if store_kind == "embedded":
            return store
        c = open_client(store_kind, request, second=True)
        opened.append(c)
        return c

    yield make
    for c in opened:
        c.close()


@pytest.fixture
def fresh_store(request, store_kind, daemon_factory) -> Iterator[Callable[..., kvstore.KVStore]]:
    """An empty store of ``capacity`` of the parametrized kind (a new daemon for the daemon kinds, a new
    one-member cluster for the cluster)."""
    opened: list[kvstore.KVStore] = []
    clusters: list = []
    workdir = short_tmpdir()

    def make(capacity: str = "8MiB", high_watermark: float = 0.9, low_watermark: float = 0.8) -> kvstore.KVStore:
        watermarks = ("--high-watermark", str(high_watermark), "--low-watermark", str(low_watermark))
        if store_kind == "embedded":
            s = kvstore.KVStore.embedded(capacity=capacity, high_watermark=high_watermark,
                                         low_watermark=low_watermark)
        elif store_kind == "cluster":
            clusters.append(_cluster_procs().Cluster(workdir, names="A", capacity=capacity, args=watermarks))
            s = clusters[-1].client("A")
        elif store_kind == "daemon-ucx":
            if ucx_missing() is not None:
                pytest.skip(f"ucx transport unavailable: {ucx_missing()}")
            s = daemon_factory(capacity=capacity, args=(*UCX_ARGS, *watermarks)).connect("ucx")
        else:
            s = daemon_factory(capacity=capacity, args=watermarks).connect(
                "shm" if store_kind == "daemon-shm" else "tcp")
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()
    for c in clusters:
        c.close()
    shutil.rmtree(workdir, ignore_errors=True)


# ---- child processes ----------------------------------------------------------------------------------
class Child:
    """A helper script from tests/helpers run as a separate process, talking line by line on stdout."""

    def __init__(self, script: str, *args: str):
        self.proc = subprocess.Popen([sys.executable, os.path.join(HELPERS, script), *map(str, args)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())

    def expect(self, word: str, timeout: float = 20.0) -> str:
        """Wait (bounded) for a stdout line starting with ``word``; return it."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            line = fd.readline().decode(errors="replace").strip()
            if not line:
                if self.proc.poll() is not None:
                    break
                continue
            if line.startswith(word):
                return line
        self.kill()
        raise AssertionError(f"child {self.proc.args} did not print {word!r} within {timeout} s; "
                             f"stderr:\n{self.proc.stderr.read().decode(errors='replace')[-4000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def wait(self, timeout: float = 30.0) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


@pytest.fixture
def spawn() -> Iterator[Callable[..., Child]]:
    children: list[Child] = []

    def make(script: str, *args) -> Child:
        c = Child(script, *args)
        children.append(c)
        return c

    yield make
    for c in children:
        c.kill()
        for stream in (c.proc.stdout, c.proc.stderr):
            stream.close()


def flip_byte(daemon_pid: int, store: kvstore.KVStore, key: str, at: int = 100) -> None:
    """Corrupt one byte of a committed object in place, in the daemon's shared-memory segment (as a failing
    DIMM or a stray write would), without telling the daemon."""
    info = store.inspect(key)
    names = sorted(n for n in os.listdir("/dev/shm")
                   if n.startswith(f"kvstore-{daemon_pid}-") and n.endswith(f"-{info['segment']}"))
    assert names, f"no shared-memory segment {info['segment']} of daemon {daemon_pid}"
    with open(os.path.join("/dev/shm", names[0]), "r+b") as f:
        f.seek(info["offset"] + at)
        byte = f.read(1)
        f.seek(info["offset"] + at)
        f.write(bytes([byte[0] ^ 0xFF]))



# ---- scheduling: the heaviest files first -------------------------------------------------------------
def _heavy_seconds(item: pytest.Item) -> float:
    mark = item.get_closest_marker("heavy")
    return float(mark.args[0]) if mark is not None and mark.args else 0.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files marked ``heavy(seconds)`` (they start real vLLM engines) run first, the longest first; every other
    file keeps its place after them, and tests keep their order within a file. Under ``-n 2 --dist loadfile``
    the two workers take whole files in this order, so the long engine files overlap each other and the
    short ones fill in around them, instead of an engine file starting last and running alone."""
    weight: dict[str, float] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        weight[path] = max(weight.get(path, 0.0), _heavy_seconds(item))
    order = {path: i for i, path in enumerate(weight)}
    items.sort(key=lambda it: (-weight[it.nodeid.split("::", 1)[0]], order[it.nodeid.split("::", 1)[0]]))
