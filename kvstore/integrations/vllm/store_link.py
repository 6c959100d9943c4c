"""StoreLink: one connector half's connection to the store, with deadlines, reconnects and fault counting.

Every store call of the connector goes through :meth:`StoreLink.client`. A fault of the connection (daemon
unreachable, killed, or past the deadline) closes the client, is counted, and logs one warning per outage;
the next call after ``retry_s`` seconds reconnects. The connector turns a fault into "recompute these
blocks" (loads, lookups) or "drop this save" (saves): a store fault never fails a vLLM request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.client.store import KVStore
from kvstore.errors import StoreConnectionError, TransportError

log = logging.getLogger("kvstore.integrations.vllm")

# What a lost or stuck store looks like to a caller: these close the client and count as one fault.
CONNECTION_ERRORS = (StoreConnectionError, TransportError, OSError)


class StoreUnavailable(Exception):
    """No client right now (the store is down and the retry interval has not passed)."""


class StoreLink:
    """Lazily connected client of ``url``; ``open`` is the factory (``kvstore.connect`` by default)."""

    def __init__(self, url: str, *, timeout: float, retry_s: float, name: str, transport: str = "auto",
                 open: Callable[[str, float, str], KVStore] | None = None):
        self.url = url
        self.transport = transport
        self.timeout = timeout
        self.retry_s = retry_s
        self.name = name
        self.faults = 0
        self._open = open or _connect
        self._client: KVStore | None = None
        self._down_since: float | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def connect(self) -> KVStore:
        """Connect now; raises the store's StoreConnectionError (with the URL) when it is unreachable."""
        with self._lock:
            if self._client is None:
                self._client = self._open(self.url, self.timeout, self.transport)
                if self._down_since is not None:
                    log.warning("kvstore %s: store at %s is reachable again after %.1f s; resuming loads and "
                                "saves", self.name, self.url, time.monotonic() - self._down_since)
                    self._down_since = None
            return self._client

    def client(self) -> KVStore:
        """The connected client, reconnecting if the last fault is ``retry_s`` old; StoreUnavailable if not."""
        if self._client is not None:
            return self._client
        if time.monotonic() < self._next_try:
            raise StoreUnavailable(self.url)
        try:
            return self.connect()
        except CONNECTION_ERRORS as exc:
            self.fault(exc)
            raise StoreUnavailable(self.url) from None

    @property
    def up(self) -> bool:
        return self._client is not None

    def fault(self, exc: BaseException) -> None:
        """Record a connection fault: close the client, warn once per outage, retry after ``retry_s``."""
        with self._lock:
            self.faults += 1
            client, self._client = self._client, None
            self._next_try = time.monotonic() + self.retry_s
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - the connection is already broken; closing is best effort
                pass
        if first:
            log.warning("kvstore %s: store at %s is unavailable (%s: %s); loads recompute and saves are "
                        "dropped until it is back (retrying every %.1f s; counted in the connector stats)",
                        self.name, self.url, type(exc).__name__, exc, self.retry_s)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _connect(url: str, timeout: float, transport: str) -> KVStore:
    import kvstore

    return kvstore.connect(url, timeout=timeout, transport=transport, client_name="vllm-connector")
