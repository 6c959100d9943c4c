"""A real ``kvstore serve`` daemon for tests of code that uses kvstore (and for the project's own tests and
benchmarks): started as a subprocess on a fresh Unix socket and a free loopback TCP port, stopped at the end.

    from kvstore.testing.daemon import Daemon

    with Daemon(capacity="256MiB") as d:          # returns once the daemon serves; SIGTERM at exit
        with d.connect() as store:                # shared memory over d.unix_url; d.connect("tcp") for TCP
            store.put("k", b"v")
    assert d.exit_code == 0 and d.leftovers() == []   # a clean stop: no socket file, no shared memory left

A pytest fixture is three lines (``yield Daemon(...).start()``, then ``stop()``). The daemon runs in its own
session (a Ctrl-C meant for the test runner does not kill it half-way), in ``workdir`` (a fresh short directory
under /tmp unless given; removed at stop if it was made here), with its output in ``log_path``
(:meth:`Daemon.log` reads its end: put it in your failure messages). It counts as started once every address
it listens on accepts a connection and, at log level info or debug, it has logged that it is serving (from
then on a SIGTERM is a graceful stop). Serve flags beyond the common ones go in ``args``; the child's
environment in ``env``.

A TCP listener needs a token (docs/security.md): unless given ``token_file`` or ``insecure=True``, a daemon
with TCP uses this process's token file (:func:`process_token_file`), which clients started here find through
``$KVSTORE_TOKEN_FILE``; :meth:`Daemon.connect` sends it.
"""

from __future__ import annotations

import atexit
import glob
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.client.store import KVStore


class DaemonStartError(RuntimeError):
    """``kvstore serve`` exited or did not accept connections in time; the message ends with its log."""


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (another process may still take it: see ``start``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def short_tmpdir(prefix: str = "kvs-") -> str:
    """A short directory under /tmp: Unix socket paths are limited to ~107 bytes."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


def project_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment with the project that ``kvstore`` was imported from first on PYTHONPATH (a child
    then runs the same checkout), unbuffered output, and ``extra`` on top."""
    import kvstore

    root = str(Path(kvstore.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def process_token_file() -> str:
    """The token file of the daemons this process starts: ``$KVSTORE_TOKEN_FILE`` if it names a file, else a
    new 0600 file under /tmp (removed at exit) that ``$KVSTORE_TOKEN_FILE`` then names, so that
    ``kvstore.connect`` here, and in child processes that inherit the environment, sends its token."""
    path = os.environ.get("KVSTORE_TOKEN_FILE")
    if path and os.path.isfile(path):
        return path
    fd, path = tempfile.mkstemp(prefix="kvs-token-", dir="/tmp")  # created 0600
    try:
        os.write(fd, secrets.token_hex(16).encode())
    finally:
        os.close(fd)
    os.environ["KVSTORE_TOKEN_FILE"] = path
    atexit.register(_remove_quietly, path)
    return path


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def can_connect(family: int, address: str | tuple[str, int]) -> bool:
    """Whether a stream socket of ``family`` connects to ``address`` within a second."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(address)
        except OSError:
            return False
    return True


class Daemon:
    """One ``kvstore serve`` subprocess on a Unix socket and/or a loopback TCP port.

    ``args``: more serve flags (``("--gpu-capacity", "1GiB")``); ``env``: the child's whole environment
    (default :func:`project_env`); ``port``: a fixed TCP port (default: a free one, re-chosen if another
    process takes it first); ``log_path``: where its output goes (default: a file in ``workdir``);
    ``token_file`` / ``insecure``: how its TCP listener is protected (default: :func:`process_token_file`);
    ``exit_with_parent``: the daemon stops when this process exits (``--exit-with``), so a test run that is
    killed or times out leaves no daemon behind.
    """

    def __init__(self, workdir: str | None = None, *, capacity: str = "64MiB", unix: bool = True,
                 tcp: bool = True, args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 log_level: str = "info", log_path: str | os.PathLike[str] | None = None, unix_path: str | None = None,
                 port: int | None = None, metrics_port: int | None = None, token_file: str | None = None,
                 insecure: bool = False, exit_with_parent: bool = True):
        if not (unix or tcp):
            raise ValueError("a daemon needs at least one address: unix=True or tcp=True")
        self._own_workdir = workdir is None
        self.workdir = workdir if workdir is not None else short_tmpdir()
        self.capacity, self.args, self.env, self.log_level = capacity, tuple(args), env, log_level
        self.unix_path = (unix_path or os.path.join(self.workdir, f"kv-{uuid.uuid4().hex[:8]}.sock")) if unix \
            else None
        self._fixed_port = port is not None
        self.port = (port if port is not None else free_port()) if tcp else None
        self.metrics_port = metrics_port
        self.insecure = insecure
        #: the daemon stops when this process exits (``--exit-with``), even if it is killed or times out first
        self.exit_with_parent = exit_with_parent
        self.token_file = token_file if token_file is not None or insecure or not tcp else process_token_file()
        self.log_path = str(log_path or os.path.join(self.workdir, f"daemon-{uuid.uuid4().hex[:8]}.log"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopped = False
        self.exit_code: int | None = None  # set by stop(); 0 is a clean shutdown

    # -- addresses -------------------------------------------------------------------------------------------
    @property
    def unix_url(self) -> str:
        if self.unix_path is None:
            raise ValueError("this daemon does not listen on a Unix socket (unix=False)")
        return f"unix://{self.unix_path}"

    @property
    def tcp_url(self) -> str:
        if self.port is None:
            raise ValueError("this daemon does not listen on TCP (tcp=False)")
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The Unix URL when there is one, else the TCP one."""
        return self.unix_url if self.unix_path is not None else self.tcp_url

    @property
    def token(self) -> str | None:
        """The token clients must send (None without one)."""
        if self.token_file is None:
            return None
        with open(self.token_file) as f:
            return f.read().strip()

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the daemon is not started")
        return self.proc.pid

    # -- the process -----------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "kvstore.cli", "serve"]
        if self.unix_path is not None:
            cmd += ["--listen", self.unix_url]
        if self.port is not None:
            cmd += ["--listen", self.tcp_url]
        cmd += ["--capacity", self.capacity, "--log-level", self.log_level]
        if self.metrics_port is not None:
            cmd += ["--metrics-port", str(self.metrics_port)]
        if self.token_file is not None:
            cmd += ["--token-file", self.token_file]
        if self.insecure:
            cmd += ["--insecure"]
        if self.exit_with_parent:
            cmd += ["--exit-with", str(os.getpid())]
        return cmd + list(self.args)

    def start(self, timeout: float = 30.0) -> Daemon:
        """Start and wait (at most ``timeout`` s) until it accepts connections; DaemonStartError otherwise."""
        env = dict(self.env) if self.env is not None else project_env()
        for attempt in range(3):
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                             env=env, start_new_session=True)
            self.stopped = False
            if self._wait_ready(timeout):
                return self
            if "Address already in use" in self.log() and not self._fixed_port and self.port and attempt < 2:
                self.port = free_port()  # lost a race for the port with another process: try another
                continue
            break
        self.kill()
        raise DaemonStartError(f"kvstore serve did not become ready within {timeout} s:\n{self.log()}")

    def _wait_ready(self, timeout: float) -> bool:
        # the listeners accept before the memory is set up; "serving" is logged (at info) once start-up is done
        # and the signal handlers are installed: a SIGTERM from then on is a graceful stop
        deadline = time.monotonic() + timeout
        logs_serving = self.log_level in ("debug", "info")
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if ((self.unix_path is None or can_connect(socket.AF_UNIX, self.unix_path))
                    and (self.port is None or can_connect(socket.AF_INET, ("127.0.0.1", self.port)))
                    and (not logs_serving or " serving " in self.log())):
                return True
            time.sleep(0.05)
        return False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, limit: int = 6000) -> str:
        """The last ``limit`` characters of its output."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-limit:]
        except OSError:
            return "<no log>"

    def send(self, sig: int) -> None:
        if self.proc is None:
            raise RuntimeError("the daemon is not started")
        self.proc.send_signal(sig)

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Send ``sig`` and wait for the exit; returns the exit code (None if never started).

        After ``timeout`` s it is killed and TimeoutError raised (with its log)."""
        if self.proc is None or self.stopped:
            return self.exit_code
        self.stopped = True
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.exit_code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.exit_code = self.proc.wait()
            raise TimeoutError(f"daemon {self.proc.pid} did not exit within {timeout} s of "
                               f"{signal.Signals(sig).name}:\n{self.log()}") from None
        return self.exit_code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """:meth:`terminate`, then remove ``workdir`` if it was made here; returns the exit code."""
        try:
            return self.terminate(sig, timeout)
        finally:
            if self._own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL (no cleanup expected)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            # a daemon still populating its memory exits once the kernel is done with the page it faults in;
            # on a loaded machine that can take seconds
            self.exit_code = self.proc.wait(60)
        self.stopped = True

    def leftovers(self) -> list[str]:
        """What a stopped daemon left behind that a clean stop removes: its Unix socket file and its
        ``/dev/shm/kvstore-<pid>-*`` segments (empty after a graceful stop; not after :meth:`kill`)."""
        left = sorted(glob.glob(f"/dev/shm/kvstore-{self.pid}-*"))
        if self.unix_path is not None and os.path.exists(self.unix_path):
            left.append(self.unix_path)
        return left

    # -- clients ---------------------------------------------------------------------------------------------
    def connect(self, transport: str = "shm", timeout: float = 10.0, *, token: str | None = None,
                client_name: str = "", compression: str = "off") -> KVStore:
        """A client of this daemon (:func:`kvstore.connect`): ``transport="tcp"`` over its TCP address,
        otherwise over its Unix socket (``"shm"``: shared memory); sends ``token``, by default the daemon's.
        ``compression``: the payload codec on the tcp path (off, lz4, lz4-shuffle, auto)."""
        from kvstore.api import connect

        url = self.tcp_url if transport == "tcp" else self.unix_url
        return connect(url, transport=transport, timeout=timeout, token=token if token is not None else self.token,
                       client_name=client_name, compression=compression)

    # -- what it uses ----------------------------------------------------------------------------------------
    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds it has used so far (Linux /proc), or None if unreadable."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError, RuntimeError):
            return None

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"/proc/{self.pid}/status has no VmRSS line")

    def __enter__(self) -> Daemon:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
