"""``kvstore.connect``: a client of a ``kvstore serve`` daemon, or of a cluster of them."""

from __future__ import annotations

from kvstore.client import registry
from kvstore.client.store import KVStore
from kvstore.errors import InvalidArgumentError
from kvstore.protocol.url import default_url


def connect(url: str | None = None, *, timeout: float = 10.0, transport: str = "auto", token: str | None = None,
            client_name: str = "", compression: str = "off") -> KVStore:
    """Connect to a ``kvstore serve`` daemon at ``unix:///path`` or ``tcp://host:port``, or to a cluster of
    them at ``kvcluster://[:PASSWORD@]REDIS_HOST:PORT/DB`` (``kvclusters://`` for Redis over TLS; options
    ``?node=NAME&placement=local|balanced&replicas=N``, see kvstore.cluster.store). Without ``url``:
    ``$KVSTORE_URL``, else the daemon's default socket (``$XDG_RUNTIME_DIR/kvstore.sock``, else
    ``/tmp/kvstore-<uid>/kvstore.sock``).

    ``token``: the daemon's token (default: read from ``$KVSTORE_TOKEN_FILE`` if set). Over a Unix socket the
    client first checks that the daemon runs as this user (or root): AuthenticationError otherwise.

    ``transport``: "auto" (shm when the daemon shares this host, else tcp), "shm" or "tcp". Every call is
    bounded by ``timeout`` seconds; past it, StoreTimeoutError (a ConnectionError).

    ``compression``: payloads of the tcp path as lz4 frames (docs/cluster.md "When compression pays"): "off"
    (default), "lz4", "lz4-shuffle" (bytes of 2-byte elements grouped first), or "auto" (compress only while
    this connection measures that it pays: link slower than lz4 on this data, and the data compresses).
    Checksums stay those of the uncompressed bytes; a corrupted frame is a ChecksumError."""
    if url is None:
        url = default_url()
    name = registry.backend_for_url(url)
    backend = registry.backend(name)
    if compression != "off":  # a tcp stream path is what compresses (kvstore.client.compression): one daemon's,
        if name not in ("remote", "cluster"):  # or a cluster client's reads from its members
            raise InvalidArgumentError(f"compression={compression!r} is supported on a daemon's tcp:// or unix:// "
                                       f"address, not on {url}")
        return backend(url, timeout=timeout, transport=transport, token=token, client_name=client_name,
                       compression=compression)
    return backend(url, timeout=timeout, transport=transport, token=token, client_name=client_name)
