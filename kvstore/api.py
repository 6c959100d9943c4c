"""``kvstore.connect``: a client of a ``kvstore serve`` daemon, or of a cluster of them."""

from __future__ import annotations

from kvstore.client import registry
from kvstore.client.store import KVStore
from kvstore.protocol.url import default_url


def connect(url: str | None = None, *, timeout: float = 10.0, transport: str = "auto", token: str | None = None,
            client_name: str = "") -> KVStore:
    """Connect to a ``kvstore serve`` daemon at ``unix:///path`` or ``tcp://host:port``, or to a cluster of
    them at ``kvcluster://[:PASSWORD@]REDIS_HOST:PORT/DB`` (``kvclusters://`` for Redis over TLS; options
    ``?node=NAME&placement=local|balanced&replicas=N``, see kvstore.cluster.store). Without ``url``:
    ``$KVSTORE_URL``, else the daemon's default socket (``$XDG_RUNTIME_DIR/kvstore.sock``, else
    ``/tmp/kvstore-<uid>/kvstore.sock``).

    ``token``: the daemon's token (default: read from ``$KVSTORE_TOKEN_FILE`` if set). Over a Unix socket the
    client first checks that the daemon runs as this user (or root): AuthenticationError otherwise.

    ``transport``: "auto" (shm when the daemon shares this host, else tcp), "shm" or "tcp". Every call is
    bounded by ``timeout`` seconds; past it, StoreTimeoutError (a ConnectionError)."""
    if url is None:
        url = default_url()
    backend = registry.backend(registry.backend_for_url(url))
    return backend(url, timeout=timeout, transport=transport, token=token, client_name=client_name)
