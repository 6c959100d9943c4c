"""A ``kvstore serve`` daemon started for one run on a private Unix socket, and stopped (SIGTERM) after it."""

from __future__ import annotations

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

    @property
    def url(self) -> str:
        if self._dir is None:
            raise RuntimeError("the daemon is not started")
        return f"unix://{self._dir}/kv.sock"

    def start(self) -> StoreDaemon:
        self._dir = tempfile.mkdtemp(prefix="pd-kvstore-")
        cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", self.url, "--capacity", self.capacity]
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
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
