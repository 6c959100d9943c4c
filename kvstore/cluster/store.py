"""ClusterStore: the KVStore API over a whole cluster — ``kvstore.connect("kvcluster://HOST:PORT/DB")``.

URL: ``kvcluster://[:PASSWORD@]REDIS_HOST:PORT/DB[?node=NAME&placement=local|balanced&replicas=N&namespace=NS
&peer_timeout=S]``;
``kvclusters://`` reaches Redis over TLS, ``kvcluster+sentinel://[:PASSWORD@]S1:26379,S2:26379/SERVICE/DB`` through
Sentinel; other query parameters go to the Redis client (e.g. ``ssl_ca_certs``).

Reads: a key the home daemon (the member on this host, or ``node=``) holds is copied through its shared-memory
index without any round trip while that daemon's process runs (``/proc``) and has re-checked its entries against
the directory since it was last stopped or stalled (the index's stop marks), checked after the copy; any other
key, and any key while that check fails, costs one directory lookup (one Redis round trip; ``batch_get_into`` and
``batch_exists`` share one per 512 keys) and copies only a version that lookup listed, straight from a node
holding it — one transfer, shared memory on this host, TCP elsewhere. So a read never returns what the directory
no longer held when the read began, even from a daemon stopped before it heard that the key was removed or
rewritten elsewhere (docs/cluster.md, "Consistency", for the milliseconds a running daemon takes to hear). A dead owner
with no live copy left: KeyNotFoundError, bounded by ``peer_timeout`` per owner tried (default the smaller of
``timeout`` and 5 s, the daemons' default; an unreachable node is skipped for a while after it timed out once).
Redis calls are bounded by ``timeout``.
Writes: placement ``local`` (default) writes into the home daemon at shared-memory speed; ``balanced`` (or no
member on this host) picks members weighted by free capacity. ``replicas=N`` writes N copies on distinct nodes
(fewer if fewer are live). The daemons publish directory entries themselves, after they committed.
Everything else (wait, remove, evict, keys, inspect, leases, zero-copy views) goes through the home daemon.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvstore.client.device import StagedDeviceMemory
from kvstore.client.store import KVStore, PutFlags
from kvstore.cluster.config import Names, check_name, open_redis, redact
from kvstore.cluster.directory import Directory, Entry
from kvstore.cluster.membership import MEMBERS_LUA, NodeRecord, members_args, parse_members, redis_failure
from kvstore.cluster.peers import NodeClient, PeerPool
from kvstore.core.digest import Digest
from kvstore.core.meta import ObjectMeta, validate_key
from kvstore.core.value import KVObject, Payload, writable_view
from kvstore.errors import (
    AuthenticationError,
    BufferTooSmallError,
    InvalidArgumentError,
    KeyNotFoundError,
    StoreConnectionError,
    StoreFullError,
    StoreTimeoutError,
    TransportError,
)
from kvstore.protocol.url import host_id

MEMBERS_MAX_AGE_S = 1.0
_OPTIONS = ("node", "placement", "replicas", "namespace", "peer_timeout")
_SCHEMES = {"kvcluster": "redis", "kvclusters": "rediss", "kvcluster+sentinel": "redis+sentinel"}


class Placement(Enum):
    LOCAL = "local"
    BALANCED = "balanced"


@dataclass(frozen=True, slots=True)
class ClusterURL:
    redis_url: str
    node: str | None = None
    placement: Placement = Placement.LOCAL
    replicas: int = 1
    namespace: str = "kvstore"
    peer_timeout: float | None = None

    @classmethod
    def parse(cls, url: str) -> ClusterURL:
        parts = urlsplit(url)
        scheme = _SCHEMES.get(parts.scheme)
        if scheme is None or not parts.hostname:
            raise InvalidArgumentError(f"cluster address must look like kvcluster://HOST:PORT/DB, got {redact(url)!r}")
        query = parse_qsl(parts.query, keep_blank_values=True)
        ours = {k: v for k, v in query if k in _OPTIONS}
        rest = urlencode([(k, v) for k, v in query if k not in _OPTIONS])
        return cls(redis_url=urlunsplit((scheme, parts.netloc, parts.path, rest, "")),
                   node=check_name(ours["node"], "node") if "node" in ours else None,
                   placement=_placement(ours.get("placement", "local")),
                   replicas=_replicas(ours.get("replicas", "1")),
                   namespace=check_name(ours.get("namespace", "kvstore"), "namespace"),
                   peer_timeout=_seconds(ours["peer_timeout"], "peer_timeout") if "peer_timeout" in ours else None)


def _seconds(value: Any, what: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(value, bool) or not 0 < seconds <= 3600:
        raise InvalidArgumentError(f"{what} must be between 0 and 3600 seconds, got {value!r}")
    return seconds


def _placement(value: Any) -> Placement:
    try:
        return value if isinstance(value, Placement) else Placement(value)
    except ValueError:
        raise InvalidArgumentError(f"placement must be 'local' or 'balanced', got {value!r}") from None


def _replicas(value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or not 1 <= n <= 16:
        raise InvalidArgumentError(f"replicas must be an int from 1 to 16, got {value!r}")
    return n


class ClusterStore(KVStore):
    def __init__(self, url: str, *, timeout: float = 10.0, transport: str = "auto", token: str | None = None,
                 client_name: str = "", node: str | None = None, placement: str | Placement | None = None,
                 replicas: int | None = None, peer_timeout: float | None = None, compression: str = "off"):
        opts = ClusterURL.parse(url)
        self.node = check_name(node, "node") if node is not None else opts.node
        self.placement = _placement(placement) if placement is not None else opts.placement
        self.replicas = _replicas(replicas) if replicas is not None else opts.replicas
        self.names, self.timeout, self.transport = Names(opts.namespace), timeout, transport
        self.redis_url = opts.redis_url
        self.host = host_id()
        self.producer = f"{self.host}:{os.getpid()}:cluster"
        self._redis = open_redis(opts.redis_url, timeout, asynchronous=False)
        self.directory = Directory(self._redis, self.names)
        self._members_script = self._redis.register_script(MEMBERS_LUA)
        if peer_timeout is not None:
            peer_timeout = _seconds(peer_timeout, "peer_timeout")
        self.peer_timeout = peer_timeout or opts.peer_timeout or min(timeout, 5.0)
        self.pool = PeerPool(transport=transport, timeout=timeout, read_timeout=self.peer_timeout, token=token,
                             client_name=client_name or f"pid-{os.getpid()}", compression=compression)
        self._lock = threading.Lock()
        self._members: dict[str, NodeRecord] = {}
        self._members_at = -math.inf
        self.member_reads = 0
        try:
            self._live(force=True)
        except BaseException:
            self.close()
            raise

    # ---- members ------------------------------------------------------------------------------------
    @property
    def redis_round_trips(self) -> int:
        return self.directory.round_trips + self.member_reads

    def _live(self, force: bool = False) -> dict[str, NodeRecord]:
        import redis

        with self._lock:
            if force or time.monotonic() - self._members_at > MEMBERS_MAX_AGE_S:
                try:
                    raw = self._members_script(args=members_args(self.names))
                except (redis.RedisError, OSError) as exc:
                    raise redis_failure(exc, self.redis_url) from None
                self.member_reads += 1
                self._members, self._members_at = parse_members(raw), time.monotonic()
                self.pool.prune({n: r.epoch for n, r in self._members.items()})
            return dict(self._members)

    def _usable(self) -> list[NodeRecord]:
        return [r for r in self._live().values() if not self.pool.suspected(r.node, r.epoch)]

    def _home(self, members: list[NodeRecord]) -> NodeRecord | None:
        if self.node is not None:
            return next((r for r in members if r.node == self.node), None)
        here = [r for r in members if r.host == self.host]
        return max(here, key=lambda r: r.free) if here else None

    def _home_or_any(self) -> NodeRecord:
        members = self._usable()
        record = self._home(members) or (max(members, key=lambda r: r.free) if members else None)
        if record is None:
            raise StoreConnectionError(f"no live kvstore node in the cluster at {redact(self.redis_url)}")
        return record

    def _targets(self) -> list[NodeRecord]:
        """Members to write to, best first: the home (placement local), then by free capacity (weighted draw)."""
        members = self._usable()
        home = self._home(members) if self.placement is Placement.LOCAL else None
        others = [r for r in members if r is not home]
        others.sort(key=lambda r: math.log(random.random() or 1e-300) / max(r.free, 1), reverse=True)
        return ([home] if home else []) + others

    def _on(self, record: NodeRecord | Entry, fn: Callable[[NodeClient], Any]) -> Any:
        with self.pool.use(record.node, record.epoch, record.addr) as client:
            return fn(client)

    def _delegate(self, fn: Callable[[NodeClient], Any]) -> Any:
        """Run ``fn`` on the home daemon (or any member), moving on once if it is gone."""
        for attempt in (0, 1):
            record = self._home_or_any()
            try:
                return self._on(record, fn)
            except StoreTimeoutError:
                raise
            except (StoreConnectionError, AuthenticationError):  # a refused home is skipped from now on
                if attempt:
                    raise
                self._live(force=True)
        raise AssertionError("unreachable")

    # ---- writes -------------------------------------------------------------------------------------
    def _put(self, meta: ObjectMeta, payload: Payload, digest: Digest, *, flags: PutFlags) -> ObjectMeta:
        return self._write(lambda c, f: c.put_prepared(meta, payload, digest, f), flags)

    def _put_many(self, items: list[tuple[ObjectMeta, Payload]], digests: list[Digest], *,
                  flags: PutFlags) -> list[ObjectMeta]:
        return self._write(lambda c, f: c.put_many_prepared(items, digests, f), flags)

    def _write(self, fn: Callable[[NodeClient, PutFlags], Any], flags: PutFlags) -> Any:
        targets = self._targets()
        if not targets:
            raise StoreConnectionError(f"no live kvstore node in the cluster at {redact(self.redis_url)}")
        results: list = []
        problems: list[Exception] = []
        for record in targets:
            if len(results) >= self.replicas:
                break
            # only the first copy decides if_absent: the others would find the first one in the directory
            f = flags if not results else replace(flags, if_absent=False)
            try:
                results.append(self._on(record, lambda c, f=f: fn(c, f)))
            except StoreTimeoutError:
                if not results:
                    raise  # it may or may not have been stored: let the caller decide
                problems.append(StoreTimeoutError(f"node {record.node} timed out"))
            except (StoreConnectionError, TransportError, StoreFullError, AuthenticationError) as exc:
                problems.append(exc)  # a refused node (wrong token, wrong address) is skipped from now on
        if not results:
            raise problems[-1]
        return results[0]

    # ---- reads --------------------------------------------------------------------------------------
    def _home_index(self, key: str, fit: Callable[[int], memoryview]) -> tuple[int, int, int] | None:
        home = self._home(self._usable())
        if home is None or home.host != self.host:
            return None
        try:
            return self._on(home, lambda c: c.read_index(key, fit))
        except (StoreConnectionError, TransportError, AuthenticationError):
            return None

    def _rank(self, entries: list[Entry]) -> list[Entry]:
        usable = [e for e in entries if not self.pool.suspected(e.node, e.epoch)]
        random.shuffle(usable)
        return sorted(usable, key=lambda e: (e.node != self.node, e.host != self.host))

    def _from_owner(self, key: str, entries: list[Entry], fn: Callable[[NodeClient, Entry], Any]) -> Any:
        ranked = self._rank(entries)
        problems = [f"node {e.node}: skipped, it timed out recently" for e in entries if e not in ranked]
        for entry in ranked:
            try:
                return self._on(entry, lambda c, entry=entry: fn(c, entry))
            except KeyNotFoundError:
                self._forget(entry)
            except (StoreConnectionError, TransportError, AuthenticationError) as exc:
                problems.append(f"node {entry.node}: {exc}")
        detail = f" (owners unreachable: {'; '.join(problems)})" if problems else ""
        raise KeyNotFoundError(f"key {key!r} not found in the cluster{detail}")

    def _forget(self, entry: Entry) -> None:
        import redis

        try:
            self.directory.forget(entry)
        except (redis.RedisError, OSError):
            pass

    def _lookup(self, keys: list[str]) -> dict[str, list[Entry]]:
        import redis

        try:
            return self.directory.lookup(keys)
        except (redis.RedisError, OSError) as exc:
            raise redis_failure(exc, self.redis_url) from None

    # A read of the home daemon's key is answered by its shared-memory index while its process runs and has
    # re-checked its entries since it was last stopped (checked after the copy: ``NodeClient.read_index``);
    # every other read starts with a directory lookup and copies only a version it lists. Either way the bytes
    # returned are a version the directory listed when the read began, or later.
    def _get_into(self, key: str, fit: Callable[[int], memoryview]) -> tuple[int, int | None]:
        hit = self._home_index(key, fit)
        if hit is not None:
            return hit[0], hit[2]
        meta = self._from_owner(key, self._lookup([key])[key], lambda c, e: c.fetch_into(key, fit, e))
        return meta.size, meta.checksum

    def batch_get_into(self, keys: Sequence[str], outs: Sequence[Any]) -> list[int]:
        """Like get_into for each key; the keys not read through the home daemon's index share one directory
        lookup (per 512)."""
        if len(keys) != len(outs):
            raise InvalidArgumentError(f"batch_get_into got {len(keys)} keys but {len(outs)} buffers")
        keys = [validate_key(k) for k in keys]
        fits = [_fitter(k, writable_view(o)) for k, o in zip(keys, outs, strict=True)]
        sizes: list[int | None] = []
        for key, fit in zip(keys, fits, strict=True):
            hit = self._home_index(key, fit)
            sizes.append(None if hit is None else hit[0])
        missing = [i for i, size in enumerate(sizes) if size is None]
        found = self._lookup([keys[i] for i in missing]) if missing else {}
        for i in missing:
            sizes[i] = self._from_owner(keys[i], found[keys[i]],
                                        lambda c, e, i=i: c.fetch_into(keys[i], fits[i], e)).size
        return sizes  # type: ignore[return-value]

    def _get(self, key: str, *, copy: bool) -> KVObject:
        if not copy:  # a view of memory on this host, leased: the home daemon resolves and holds it
            return self._delegate(lambda c: c.get(key, copy=False))
        return self._from_owner(key, self._lookup([key])[key], lambda c, e: c.fetch(key, e))

    def _lease(self, key: str) -> tuple[Any, ObjectMeta]:
        # A lease belongs to the connection that took it: keep that connection out of the pool until released.
        record = self._home_or_any()
        client = self.pool.checkout(record.node, record.epoch, record.addr)
        try:
            lease, meta = client.take_lease(key)
        except BaseException:
            self.pool.checkin(client)
            raise
        return (client, lease), meta

    def _release(self, handle: Any) -> None:
        client, lease = handle
        try:
            client.drop_lease(lease)
        except StoreConnectionError:
            pass  # the node is gone, and its leases with it
        finally:
            self.pool.checkin(client)

    # ---- metadata -----------------------------------------------------------------------------------
    def _exists(self, key: str) -> bool:
        return self._batch_exists([key])[0]

    def _batch_exists(self, keys: Sequence[str]) -> list[bool]:
        found = self._lookup(list(keys)) if keys else {}
        # a copy on a refused node (another token, or not the node it claims) cannot be read: it does not count
        return [any(not self.pool.refused(e.node, e.epoch) for e in found[k]) for k in keys]

    def _touch(self, keys: list[str], ttl: float) -> list[int | None]:
        return self._delegate(lambda c: c.touch(keys, ttl))  # the home daemon's copies

    def _evict(self, key: str) -> bool:
        return self._delegate(lambda c: c.evict(key))

    def _remove(self, key: str) -> bool:
        return self._delegate(lambda c: c.remove(key))

    def _wait(self, keys: Sequence[str], timeout: float) -> str | None:
        return self._delegate(lambda c: c.wait(list(keys), timeout))

    def keys(self, prefix: str = "") -> list[str]:
        return self._delegate(lambda c: c.keys(prefix))

    def _inspect(self, key: str) -> dict:
        return self._delegate(lambda c: c.inspect(key))

    def device_memory(self) -> StagedDeviceMemory:
        """Device values move through a host buffer (this store holds host memory only)."""
        return StagedDeviceMemory(self._put_many, self._get_into)

    def stats(self) -> dict:
        """Totals over the live members, each member's own stats under ``nodes``, and this client's counters."""
        per: dict[str, dict] = {}
        for record in self._live(force=True).values():
            try:
                per[record.node] = self._on(record, lambda c: c.stats())
            except (StoreConnectionError, TransportError, AuthenticationError) as exc:
                per[record.node] = {"error": str(exc)}
        out: dict = {name: sum(s.get(name, 0) for s in per.values())
                     for name in ("capacity_bytes", "used_bytes", "objects", "evictions", "expirations", "leases",
                                  "pending", "clients")}
        home = self._home(list(self._live().values()))
        out.update(nodes=per, transport=self.transport, cluster={
            "members": sorted(per), "home": home.node if home else None, "placement": self.placement.value,
            "replicas": self.replicas, "redis_round_trips": self.redis_round_trips, "refused": self.pool.refusals()})
        return out

    def close(self) -> None:
        self.pool.close()
        self._redis.close()


def _fitter(key: str, dst: memoryview) -> Callable[[int], memoryview]:
    def fit(size: int) -> memoryview:
        if size > len(dst):
            raise BufferTooSmallError(f"object {key!r} is {size} bytes but the buffer holds {len(dst)}",
                                      needed=size, got=len(dst))
        return dst

    return fit
