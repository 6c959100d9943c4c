"""Peers: connections to other cluster members, pooled per (node, boot epoch), and the member-local ops.

A ``NodeClient`` is a RemoteStore of one member that reads only what that member holds itself (``peer_get``):
the serving daemon never resolves the key again through the directory, so a stale entry cannot bounce a
request between nodes. On the same host the data path is the member's shared memory (its index answers without
a round trip: for a key of the home member while it runs and has re-checked its entries since it last stopped,
else for the version a directory lookup just listed); elsewhere the stream path over TCP, straight into the
caller's buffer. Connections of an epoch that is gone (the member restarted) are never reused: an old
mapping would show the old daemon's memory.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from kvstore.client.remote import RemoteStore
from kvstore.client.store import PutFlags
from kvstore.core.digest import Digest
from kvstore.core.meta import ObjectMeta
from kvstore.core.value import KVObject, Payload
from kvstore.errors import AuthenticationError, StoreConnectionError, TransportError


class NodeClient(RemoteStore):
    def __init__(self, node: str, epoch: str, addr: str, read_timeout: float | None = None, **options):
        self.node, self.epoch, self.read_timeout = node, epoch, read_timeout
        self.expected_node = node  # the daemon at addr must prove it is this node (and knows the token)
        self.last_codec: str | None = None  # how the last fetch_into's payload came (None: uncompressed)
        super().__init__(addr, **options)

    def read_index(self, key: str, fit: Callable[[int], memoryview]) -> tuple[int, int, int] | None:
        """Copy ``key`` through the member's shared-memory index, no round trip at all: (size, version,
        checksum), or None when there is no index here (another host), it does not list the key, or the member
        may show what the directory no longer holds (stopped now or during the copy, or not re-checked since it
        last stopped: the gate and the stop marks, ``kvstore.memory.procstate``)."""
        if self._index_gate is None:
            return None  # it cannot be seen from here whether the member runs: ask the directory first
        return self._read_index(key, fit)

    def fetch_into(self, key: str, alloc: Callable[[int], memoryview], expect=None) -> ObjectMeta:
        """Copy the member's own copy of ``key`` into ``alloc(size)``; return its metadata.

        ``expect`` (a directory entry) lets a same-host read skip the round trip when the index shows that
        very version, and gives the checksum of that version (the directory's, for ``verify``). The index is
        read for no other version: what it shows may be what the directory no longer holds (a member stopped
        before it heard of a removal or a newer write elsewhere), the entry just read is not.
        KeyNotFoundError if the member does not hold the key."""
        if expect is not None and self._index is not None:
            hit = self._index.read_into(key, alloc, expect.version)
            if hit is not None and hit[0] == expect.size:
                return expect.meta
        try:
            with self._conn.bounded(self.read_timeout):  # a stalled owner costs the peer timeout, not more
                # over tcp the payload comes as lz4 frames when this connection's wire policy says it pays
                reply = self._read(key, lambda r: alloc(r["meta"]["size"]), self._data, op="peer_get")
        except TransportError as exc:
            raise TransportError(f"node {self.node}: {exc}") from None
        self.last_codec = reply.get("codec")
        meta = ObjectMeta.from_wire(reply["meta"])
        if not reply.get("stream") and not reply.get("frames") and "segment" not in reply:
            alloc(meta.size)  # a zero-byte object still checks the buffer
        if expect is not None and meta.version == expect.version:
            # the version the directory lists: ``verify`` checks the bytes against the directory's checksum, not
            # against what the serving node says of them
            meta = replace(meta, checksum=expect.meta.checksum)
        return meta

    def fetch(self, key: str, expect=None) -> KVObject:
        """A private copy of the member's ``key``."""
        holder: dict = {}

        def alloc(size: int) -> memoryview:
            if "buf" not in holder or len(holder["buf"]) != size:
                holder["buf"] = bytearray(size)
            return memoryview(holder["buf"])

        meta = self.fetch_into(key, alloc, expect)
        return KVObject.wrap(holder.get("buf", bytearray()), meta)

    def evict_local(self, key: str) -> bool:
        return bool(self._conn.call({"op": "peer_evict", "key": key}).get("value"))

    # The cluster client prepares values once and hands them to the member that stores them.
    def put_prepared(self, meta: ObjectMeta, payload: Payload, digest: Digest, flags: PutFlags) -> ObjectMeta:
        """Store an already validated and encoded value (see ``KVStore._prepare``)."""
        return self._put(meta, payload, digest, flags=flags)

    def put_many_prepared(self, items: list[tuple[ObjectMeta, Payload]], digests: list[Digest],
                          flags: PutFlags) -> list[ObjectMeta]:
        return self._put_many(items, digests, flags=flags)

    def take_lease(self, key: str) -> tuple[int, ObjectMeta]:
        """A lease on ``key`` held by this connection until ``drop_lease``."""
        return self._lease(key)

    def drop_lease(self, lease: int) -> None:
        self._release(lease)


class PeerPool:
    """Idle NodeClients per (node, epoch), created on demand; thread-safe. A node that timed out is
    ``suspect`` for a while (its entries are skipped, so a stopped node costs one timeout, not one per get). A
    node that failed the handshake (another token, or another daemon at its address) is ``refused`` for the
    rest of its boot epoch: skipped by reads and writes, and listed by ``refusals()`` for the operator."""

    def __init__(self, *, transport: str, timeout: float, token: str | None, client_name: str,
                 suspect_s: float | None = None, idle_per_node: int = 4, read_timeout: float | None = None,
                 compression: str = "off"):
        """``timeout`` bounds every call to a member; ``read_timeout`` (shorter) the reads of its objects;
        ``compression``: the tcp path's wire policy for reads of members' objects (kvstore.client.compression),
        per pooled connection."""
        self.options = dict(transport=transport, timeout=timeout, token=token, client_name=client_name,
                            read_timeout=read_timeout, compression=compression)
        self.suspect_s = suspect_s or timeout
        self.idle_per_node = idle_per_node
        self._idle: dict[tuple[str, str], list[NodeClient]] = {}
        self._suspect: dict[str, tuple[str, float]] = {}
        self._refused: dict[str, tuple[str, str]] = {}  # node -> (epoch, why)
        self._lock = threading.Lock()
        self._closed = False

    @contextlib.contextmanager
    def use(self, node: str, epoch: str, addr: str) -> Iterator[NodeClient]:
        """A client of ``node`` for the duration of the block. A broken connection is closed, not reused;
        connection failures and timeouts mark the node suspect."""
        client = self.checkout(node, epoch, addr)
        try:
            yield client
        except (StoreConnectionError, TransportError):
            self.suspect(node, epoch)
            client.close()
            raise
        except BaseException:
            self._give(client)
            raise
        else:
            self._give(client)

    def checkout(self, node: str, epoch: str, addr: str) -> NodeClient:
        """A client kept out of the pool until ``checkin`` (e.g. while it holds a lease)."""
        client = self._take(node, epoch)
        if client is None:
            try:
                client = NodeClient(node, epoch, addr, **self.options)
            except AuthenticationError as exc:
                with self._lock:
                    self._refused[node] = (epoch, f"{addr}: {exc}")
                raise
            except (StoreConnectionError, TransportError):
                self.suspect(node, epoch)
                raise
        return client

    def refused(self, node: str, epoch: str) -> bool:
        with self._lock:
            mark = self._refused.get(node)
            return mark is not None and mark[0] == epoch

    def refusals(self) -> dict[str, str]:
        """Nodes refused in the handshake (node -> why), for stats and metrics."""
        with self._lock:
            return {node: why for node, (_, why) in self._refused.items()}

    def checkin(self, client: NodeClient) -> None:
        self._give(client)

    def _take(self, node: str, epoch: str) -> NodeClient | None:
        with self._lock:
            idle = self._idle.get((node, epoch))
            while idle:
                client = idle.pop()
                if not not client.connected:
                    return client
                client.close()
        return None

    def _give(self, client: NodeClient) -> None:
        with self._lock:
            idle = self._idle.setdefault((client.node, client.epoch), [])
            if self._closed or not client.connected or len(idle) >= self.idle_per_node:
                extra = client
            else:
                idle.append(client)
                extra = None
        if extra is not None:
            extra.close()

    def suspect(self, node: str, epoch: str, seconds: float | None = None) -> None:
        with self._lock:
            self._suspect[node] = (epoch, time.monotonic() + (seconds or self.suspect_s))

    def suspected(self, node: str, epoch: str) -> bool:
        """Skip this node for now: it timed out recently, or it was refused in this epoch."""
        with self._lock:
            refused = self._refused.get(node)
            if refused is not None and refused[0] == epoch:
                return True
            mark = self._suspect.get(node)
            if mark is None:
                return False
            if mark[0] != epoch or time.monotonic() > mark[1]:
                del self._suspect[node]
                return False
            return True

    def prune(self, live: dict[str, str]) -> None:
        """Close the connections of members that are gone or rebooted (``live``: node -> epoch)."""
        with self._lock:
            for node in [n for n, (epoch, _) in self._refused.items() if live.get(n) != epoch]:
                del self._refused[node]  # restarted (perhaps with the right token) or gone: ask again
            dead = [k for k in self._idle if live.get(k[0]) != k[1]]
            clients = [c for k in dead for c in self._idle.pop(k)]
        for client in clients:
            client.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for client in clients:
            client.close()
