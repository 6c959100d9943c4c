"""ClusterConfig: how one daemon joins a cluster; Names: the Redis keys of one cluster namespace; and opening
the Redis client. AUTH and TLS ride in the URL (``redis://:password@host:port/db``, ``rediss://...``); with
Sentinel, ``redis+sentinel://[:password@]sentinel1:26379,sentinel2:26379/SERVICE[/db]`` finds the current
master through the sentinels and follows failovers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

from kvstore.errors import InvalidArgumentError, MissingExtraError
from kvstore.protocol.compression import CODECS
from kvstore.protocol.url import Endpoint

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel")
PEER_TRANSPORTS = ("auto", "tcp", "shm", "ucx")
COMPRESSION_MODES = ("off", "auto", *CODECS)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(value: object, what: str) -> str:
    """Node ids and namespaces: 1-128 chars of letters, digits, '.', '_', '-' (they become parts of Redis keys)."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise InvalidArgumentError(f"{what} must be 1-128 letters, digits, '.', '_' or '-', got {value!r}")
    return value


def check_redis_url(url: object) -> str:
    if not isinstance(url, str) or urlsplit(url).scheme not in REDIS_SCHEMES:
        raise InvalidArgumentError(f"cluster address must be a redis://, rediss://, unix:// or redis+sentinel:// "
                                   f"URL, got {url!r}")
    if url.startswith("redis+sentinel:"):
        sentinel_parts(url)
    return url


def sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """``redis+sentinel://[:password@]h1:26379,h2:26379/SERVICE[/db]`` -> (sentinels, service, db, password)."""
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    password = unquote(auth.split(":", 1)[1]) if ":" in auth else None
    path = [p for p in parts.path.split("/") if p]
    try:
        sentinels = [(h.rsplit(":", 1)[0], int(h.rsplit(":", 1)[1]) if ":" in h else 26379)
                     for h in hosts.split(",") if h]
        db = int(path[1]) if len(path) > 1 else 0
    except ValueError:
        sentinels, db = [], -1
    if not sentinels or not path or db < 0:
        raise InvalidArgumentError(f"a Sentinel address looks like redis+sentinel://h1:26379,h2:26379/SERVICE/0, "
                                   f"got {redact(url)!r}")
    return sentinels, path[0], db, password


def redact(url: str) -> str:
    """The URL with its password hidden, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


@dataclass(frozen=True, slots=True)
class Names:
    """Redis key names of one cluster. The Lua scripts build the same names from the namespace."""

    namespace: str = "kvstore"

    def obj(self, key: str) -> str:
        return f"{self.namespace}:obj:{key}"

    def node(self, node_id: str) -> str:
        return f"{self.namespace}:node:{node_id}"

    @property
    def nodes(self) -> str:
        return f"{self.namespace}:nodes"

    @property
    def marker(self) -> str:
        return f"{self.namespace}:cluster"

    @property
    def seq(self) -> str:
        return f"{self.namespace}:seq"

    @property
    def channel(self) -> str:
        return f"{self.namespace}:events"


@dataclass(frozen=True)
class ClusterConfig:
    """``node_ttl``: seconds a node record lives without a heartbeat (heartbeats every third of it);
    ``peer_timeout``: bound on one call to another daemon; ``redis_timeout``: bound on one Redis command;
    ``directory_sync``: a put's reply waits (at most ``peer_timeout``) until its directory entry is written, so
    a reader on another node finds it as soon as the put returns; ``peer_compression``: lz4 on the tcp path of
    reads from other nodes ("off", "lz4", "lz4-shuffle", "auto": only while measured to pay)."""

    redis_url: str
    node_id: str
    advertise: str
    node_ttl: float = 10.0
    peer_timeout: float = 5.0
    redis_timeout: float = 2.0
    namespace: str = "kvstore"
    peer_transport: str = "auto"
    directory_sync: bool = True
    peer_compression: str = "off"

    def __post_init__(self) -> None:
        check_redis_url(self.redis_url)
        check_name(self.node_id, "node id")
        check_name(self.namespace, "cluster namespace")
        ep = Endpoint.parse(self.advertise)
        if ep.scheme != "tcp":
            raise InvalidArgumentError(f"--advertise must be a tcp:// address other nodes can reach, "
                                       f"got {self.advertise!r}")
        for name in ("node_ttl", "peer_timeout", "redis_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise InvalidArgumentError(f"{name} must be between 0 and 3600 seconds, got {value!r}")
        if self.node_ttl < 0.3:
            raise InvalidArgumentError(f"node_ttl must be at least 0.3 s, got {self.node_ttl}")
        if self.peer_transport not in PEER_TRANSPORTS:
            raise InvalidArgumentError(f"peer transport must be one of {PEER_TRANSPORTS}, got {self.peer_transport!r}")
        if self.peer_compression not in COMPRESSION_MODES:
            raise InvalidArgumentError(f"peer compression must be one of {list(COMPRESSION_MODES)}, got "
                                       f"{self.peer_compression!r}")

    @property
    def names(self) -> Names:
        return Names(self.namespace)

    @property
    def heartbeat_period(self) -> float:
        return self.node_ttl / 3

    @property
    def cutoff_grace(self) -> float:
        """How long the directory keeps a lapsed node's entries dormant: a node cut off from Redis for up to
        this long takes back, with their versions, the objects nobody superseded or removed meanwhile."""
        return max(300.0, 30 * self.node_ttl)


def require_redis() -> None:
    """MissingExtraError unless the ``cluster`` extra (the redis client) is installed."""
    try:
        import redis  # noqa: F401
    except ImportError:
        raise MissingExtraError("cluster mode needs the 'cluster' extra (the redis client): "
                                "pip install 'kvstore[cluster]'") from None


def open_redis(url: str, timeout: float, *, asynchronous: bool, pubsub: bool = False):
    """A Redis client for ``url`` whose every command is bounded by ``timeout`` seconds. A pub/sub client waits
    for messages without a read timeout and pings its connection instead."""
    require_redis()
    import redis
    from redis.backoff import NoBackoff

    check_redis_url(url)
    # One retry, on a broken connection only: a pooled connection is stale after a Redis restart or
    # failover. A timeout is not retried, so one command stays bounded by ``timeout``.
    options = {"socket_connect_timeout": timeout, "health_check_interval": max(1.0, timeout),
               "retry_on_error": [redis.ConnectionError]}
    if not pubsub:
        options["socket_timeout"] = timeout
    if url.startswith("redis+sentinel:"):
        return _through_sentinel(url, timeout, asynchronous, options)
    if asynchronous:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry as AsyncRetry

        return aioredis.from_url(url, retry=AsyncRetry(NoBackoff(), 1, (redis.ConnectionError,)), **options)
    from redis.retry import Retry

    return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 1, (redis.ConnectionError,)), **options)


def _through_sentinel(url: str, timeout: float, asynchronous: bool, options: dict):
    import redis
    from redis.backoff import NoBackoff

    sentinels, service, db, password = sentinel_parts(url)
    probe = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if asynchronous:
        from redis.asyncio.retry import Retry as AsyncRetry
        from redis.asyncio.sentinel import Sentinel as AsyncSentinel

        return AsyncSentinel(sentinels, sentinel_kwargs=probe).master_for(
            service, db=db, password=password, retry=AsyncRetry(NoBackoff(), 1, (redis.ConnectionError,)), **options)
    from redis.retry import Retry
    from redis.sentinel import Sentinel

    return Sentinel(sentinels, sentinel_kwargs=probe).master_for(
        service, db=db, password=password, retry=Retry(NoBackoff(), 1, (redis.ConnectionError,)), **options)
