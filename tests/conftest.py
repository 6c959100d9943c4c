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

import glob
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator

import paths as _paths
import pytest

import kvstore

HELPERS = str(_paths.HELPERS)
STORE_KINDS = ("embedded", "daemon-shm", "daemon-tcp")
MiB = 1 << 20


# ---- small utilities ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def short_tmpdir() -> str:
    """A short directory under /tmp: Unix socket paths are limited to ~107 bytes."""
    return tempfile.mkdtemp(prefix="kvs-", dir="/tmp")


def shm_segments(pid: int) -> list[str]:
    return sorted(glob.glob(f"/dev/shm/kvstore-{pid}-*"))


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    root = str(_paths.ROOT)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def can_connect(family: int, address) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(address)
        except OSError:
            return False
    return True


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# ---- the daemon ---------------------------------------------------------------------------------------
class Daemon:
    """One ``kvstore serve`` subprocess listening on a Unix socket and a loopback TCP port."""

    def __init__(self, workdir: str, *, capacity: str = "64MiB", args: tuple[str, ...] = (),
                 unix_path: str | None = None, port: int | None = None, metrics_port: int | None = None,
                 token_file: str | None = None):
        self.workdir = workdir
        self.capacity = capacity
        self.args = tuple(args)
        self.unix_path = unix_path or os.path.join(workdir, f"kv-{uuid.uuid4().hex[:8]}.sock")
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self.metrics_port = metrics_port
        self.token_file = token_file
        self.log_path = os.path.join(workdir, f"daemon-{uuid.uuid4().hex[:8]}.log")
        self.proc: subprocess.Popen | None = None
        self.stopped = False

    @property
    def unix_url(self) -> str:
        return f"unix://{self.unix_path}"

    @property
    def tcp_url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", self.unix_url, "--listen", self.tcp_url,
               "--capacity", self.capacity, "--log-level", "info"]
        if self.metrics_port is not None:
            cmd += ["--metrics-port", str(self.metrics_port)]
        if self.token_file is not None:
            cmd += ["--token-file", self.token_file]
        return cmd + list(self.args)

    def start(self, timeout: float = 30.0) -> Daemon:
        for attempt in range(3):
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                         env=child_env(), start_new_session=True)
            log.close()
            self.stopped = False
            if self._wait_ready(timeout):
                return self
            if "Address already in use" in self.log() and not self._fixed_port and attempt < 2:
                self.port = free_port()  # lost a race for the port with another process: try another
                continue
            break
        self.kill()
        raise AssertionError(f"daemon did not become ready within {timeout} s:\n{self.log()}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if (can_connect(socket.AF_UNIX, self.unix_path)
                    and can_connect(socket.AF_INET, ("127.0.0.1", self.port))):
                return True
            time.sleep(0.05)
        return False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-6000:]
        except OSError:
            return "<no log>"

    def connect(self, transport: str = "shm", timeout: float = 10.0, **kw) -> kvstore.KVStore:
        url = self.tcp_url if transport == "tcp" else self.unix_url
        return kvstore.connect(url, transport=transport, timeout=timeout, **kw)

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")

    def send(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        """Stop gracefully and check that the daemon cleaned up after itself."""
        if self.proc is None or self.stopped:
            return
        self.stopped = True
        pid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon {pid} did not exit within {timeout} s of {signal.Signals(sig).name}:\n"
                                 f"{self.log()}") from None
        assert rc == 0, f"daemon {pid} exited with {rc} after {signal.Signals(sig).name}:\n{self.log()}"
        assert shm_segments(pid) == [], f"daemon {pid} left shared memory behind: {shm_segments(pid)}"
        assert not os.path.exists(self.unix_path), f"daemon {pid} left its socket {self.unix_path}"

    def kill(self) -> None:
        """SIGKILL (no cleanup expected)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.stopped = True


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


# ---- stores -------------------------------------------------------------------------------------------
@pytest.fixture
def prefix(request) -> str:
    """Unique key prefix for one test (module daemons are shared)."""
    return f"{request.node.originalname}-{uuid.uuid4().hex[:8]}/"


@pytest.fixture(params=STORE_KINDS)
def store_kind(request) -> str:
    return request.param


def _open(kind: str, d: Daemon | None, **kw) -> kvstore.KVStore:
    if kind == "embedded":
        raise ValueError("an embedded store has no second client")
    return d.connect("shm" if kind == "daemon-shm" else "tcp", **kw)


@pytest.fixture
def store(request, store_kind, prefix) -> Iterator[kvstore.KVStore]:
    if store_kind == "embedded":
        s = kvstore.KVStore.embedded(capacity="64MiB")
    else:
        s = _open(store_kind, request.getfixturevalue("daemon"))
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
        c = _open(store_kind, request.getfixturevalue("daemon"))
        opened.append(c)
        return c

    yield make
    for c in opened:
        c.close()


@pytest.fixture
def fresh_store(request, store_kind, daemon_factory) -> Iterator[Callable[..., kvstore.KVStore]]:
    """An empty store of ``capacity`` of the parametrized kind (a new daemon for the daemon kinds)."""
    opened: list[kvstore.KVStore] = []

    def make(capacity: str = "8MiB", high_watermark: float = 0.9, low_watermark: float = 0.8) -> kvstore.KVStore:
        if store_kind == "embedded":
            s = kvstore.KVStore.embedded(capacity=capacity, high_watermark=high_watermark,
                                         low_watermark=low_watermark)
        else:
            d = daemon_factory(capacity=capacity, args=("--high-watermark", str(high_watermark),
                                                        "--low-watermark", str(low_watermark)))
            s = _open(store_kind, d)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


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
