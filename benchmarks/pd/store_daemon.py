"""A ``kvstore serve`` daemon started for one run on a private Unix socket, and stopped (SIGTERM) after it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class StoreDaemon:
    """``with StoreDaemon(capacity="2GiB", log_path=...) as d: d.url`` -> ``unix:///tmp/.../kv.sock``."""

    def __init__(self, capacity: str = "2GiB", log_path: Path | None = None, ready_timeout_s: float = 30.0):
        self.capacity = capacity
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self._dir: str | None = None
        self._proc: subprocess.Popen | None = None
        self._log = None
        self.exit_code: int | None = None  # set by stop(); 0 is a clean shutdown

    @property
    def url(self) -> str:
        if self._dir is None:
            raise RuntimeError("the daemon is not started")
        return f"unix://{self._dir}/kv.sock"

    def start(self) -> StoreDaemon:
        import kvstore

        self._dir = tempfile.mkdtemp(prefix="pd-kvs-", dir="/tmp")  # Unix socket paths are limited to ~107 bytes
        cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", self.url, "--capacity", self.capacity]
        root = str(Path(kvstore.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._await_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _await_ready(self) -> None:
        import kvstore

        deadline = time.monotonic() + self.ready_timeout_s
        sock = Path(self._dir, "kv.sock")
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"kvstore serve exited with code {self._proc.returncode}{self._log_tail()}")
            if sock.exists():
                try:
                    kvstore.connect(self.url, timeout=2.0).close()
                    return
                except kvstore.StoreConnectionError as exc:
                    last_error = exc
            time.sleep(0.05)
        raise TimeoutError(f"kvstore serve not ready on {self.url} after {self.ready_timeout_s} s: "
                           f"{last_error}{self._log_tail()}")

    def _log_tail(self) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        return "\n--- daemon log ---\n" + Path(self.log_path).read_text(errors="replace")[-2000:]

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds the daemon has used so far (Linux /proc), or None if unreadable."""
        if self._proc is None:
            return None
        try:
            fields = Path(f"/proc/{self._proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return None

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 10 s; returns the exit code."""
        code = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=5)
            code, self._proc = self._proc.returncode, None
            self.exit_code = code
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        return code

    def __enter__(self) -> StoreDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
