"""A ``kvstore serve`` daemon started for one run on a private Unix socket, and stopped (SIGTERM) after it.

The process is :class:`kvstore.testing.daemon.Daemon` (the one launcher); this adds the run's view of it."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import kvstore
from benchmarks.common.daemon import Daemon


class StoreDaemon(Daemon):
    """``with StoreDaemon(capacity="2GiB", log_path=...) as d: d.url`` -> ``unix:///tmp/.../kv-xxxx.sock``."""

    def __init__(self, capacity: str = "2GiB", log_path: Path | None = None, ready_timeout_s: float = 30.0):
        super().__init__(capacity=capacity, tcp=False, log_path=log_path, log_level="info")
        self.ready_timeout_s = ready_timeout_s

    def start(self, timeout: float | None = None) -> StoreDaemon:
        super().start(self.ready_timeout_s if timeout is None else timeout)
        try:
            self._await_handshake()
        except BaseException:
            self.stop()
            raise
        return self

    def _await_handshake(self) -> None:
        """Accepting connections is not yet serving: wait for one client to complete its hello."""
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                kvstore.connect(self.url, timeout=2.0).close()
                return
            except kvstore.StoreConnectionError as exc:
                if time.monotonic() > deadline or not self.running():
                    raise TimeoutError(f"kvstore serve not ready on {self.url} after {self.ready_timeout_s} s: "
                                       f"{exc}\n--- daemon log ---\n{self.log(2000)}") from None
            time.sleep(0.05)

    def stop(self, sig: int | None = None, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after 10 s; returns the exit code (None if it never started)."""
        try:
            return super().stop(sig or signal.SIGTERM, timeout)
        except TimeoutError:
            return self.exit_code  # killed after the timeout; the run still has its figures
