"""RemoteStore: a client of ``kvstore serve`` over a Unix socket or TCP, with a pluggable data path.

Small objects (up to ``INLINE_MAX``) travel inline on the control connection: one round trip. Larger ones
take the negotiated transport (``shm``: one copy into or out of the mapped segment). On the same host a
``get_into`` first tries the daemon's shared-memory index: no round trip at all (a cluster member's index only
while the member runs and has re-checked its entries since it last stopped: ``kvstore.memory.procstate``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore import transports
from kvstore.client import writes
from kvstore.client.arena import ArenaWriter
from kvstore.client.compression import WirePolicy
from kvstore.client.device import DirectDeviceMemory
from kvstore.client.handshake import say_hello
from kvstore.client.rpc import Caller, Connection
from kvstore.client.store import KVStore, PutFlags
from kvstore.core.digest import Digest
from kvstore.core.meta import ObjectMeta
from kvstore.core.value import KVObject, Payload
from kvstore.errors import InvalidArgumentError, KVStoreError, StoreConnectionError, TransportError, error_from_wire
from kvstore.memory.index import IndexReader
from kvstore.memory.procstate import ProcessGate
from kvstore.memory.shm import SharedMemory, SharedMemoryError
from kvstore.protocol import wire
from kvstore.protocol.credentials import env_token
from kvstore.protocol.url import Endpoint, host_id
from kvstore.transports.base import DevicePath, Regions, Transport, TransportFailure, TransportUnavailable

INLINE_MAX = writes.INLINE_MAX
log = logging.getLogger("kvstore.client")


class RemoteStore(KVStore):
    #: the cluster node id expected at this address (a NodeClient's); the handshake refuses another daemon
    expected_node: str | None = None
    max_batch = wire.MAX_BATCH  # what one request to the daemon may name

    def __init__(self, url: str, *, timeout: float = 10.0, transport: str = "auto", token: str | None = None,
                 client_name: str = "", compression: str = "off"):
        self.endpoint = Endpoint.parse(url)
        self.wire = WirePolicy(compression)  # lz4 on the tcp path's payloads: off, lz4, lz4-shuffle or auto
        if self.endpoint.scheme == "ucx":
            raise InvalidArgumentError(f"{url} is a daemon's UCX data endpoint; connect to its unix:// or tcp:// "
                                       "address with transport='ucx'")
        self.timeout = timeout
        self._token = token if token is not None else env_token()
        self._waiter: Connection | None = None  # wait() blocks on its own connection
        self._waiter_lock = threading.Lock()
        self._index: IndexReader | None = None
        self._index_shm: SharedMemory | None = None
        self._index_direct = True  # whether a get may answer from the index without asking anyone
        self._index_gate: ProcessGate | None = None  # a cluster member's: read its index only while it runs
        self._device: DirectDeviceMemory | None = None  # built on first use of device memory
        self._device_reason = ""  # why this connection cannot move device memory, once known
        self._inline: Transport = transports.get("tcp")({})  # the stream path: small objects, whatever the data path
        self._regions: Regions | None = None  # the daemon's memory mapped here (same-host paths)
        self._arenas: ArenaWriter | None = None  # shm: puts allocate from daemon-granted space, one round trip
        name = client_name or f"pid-{os.getpid()}"
        try:
            hello = self._open(name, transport)
        except TransportError as exc:
            if transport != "auto":
                raise
            # the daemon's memory cannot be mapped from here (removed, another mount namespace): the stream
            # path through the daemon still works, only slower
            log.warning("%s: cannot use the same-host path (%s); falling back to tcp", url, exc)
            hello = self._open(name, "tcp")
        self.capacity = hello["capacity"]
        self.client_id = hello["client_id"]
        self.producer = f"{host_id()}:{os.getpid()}:{self.client_id}"
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(hello["heartbeat_s"] / 3,),
                                           name="kvstore-heartbeat", daemon=True)
        self._heartbeat.start()

    def _open(self, name: str, transport: str) -> dict[str, Any]:
        """Connect, say hello and set up the data path the daemon chose and this connection's write strategy;
        TransportError if the path cannot be mapped (the connection is closed then)."""
        self._conn = Connection(self.endpoint, self.timeout)
        self._index = self._arenas = None  # nothing of an earlier attempt (auto's fallback to tcp)
        try:
            hello = say_hello(self._conn, self._token, self._hello_fields(name, transport), self.expected_node)
            self.transport, self._name, self._generation = hello["transport"], name, hello.get("generation")
            self._conn.max_frame = min(hello.get("max_frame", wire.MAX_FRAME), wire.MAX_FRAME)  # its --max-frame
            segments = {sid: (seg, size) for sid, seg, size in hello["segments"]}
            self._data: Transport = transports.get(self.transport)(segments)
            self._regions = self._data.regions()  # shm, and cuda_ipc (which maps the same memory)
            if self._regions is not None:
                self._map(hello, self._regions)
            puts = writes.TransportPuts(self._conn, self._data, self._inline, capacity=hello["capacity"],
                                        wire=self.wire, device=self._device_path,
                                        relieve=self._arenas.retire_idle if self._arenas is not None else None)
            self._writes = writes.choose(puts, self._conn, self._regions, self._arenas, self._staging_pool)
        except (TransportFailure, SharedMemoryError) as exc:
            self._conn.close()
            raise TransportError(str(exc)) from None
        except BaseException:
            self._conn.close()
            raise
        self._conn.reconnects_with(self._reauth)
        return hello

    def _map(self, hello: dict[str, Any], regions: Regions) -> None:
        """The same-host extras: the daemon's shared-memory index, and its arenas when it grants them."""
        try:
            self._index_shm = SharedMemory.attach(*hello["index"])
        except BaseException:
            self._data.close()
            raise
        # trusted only while it shows this daemon's generation alive and heart-beating (a cluster node gives a
        # short lease: a stopped node must not serve what the others superseded meanwhile)
        lease = hello.get("index_lease_s") or max(5.0, float(hello["heartbeat_s"]))
        self._index = IndexReader(self._index_shm.buf, regions.region, hello.get("generation"),
                                  stale_after=float(lease))
        # a cluster member's index shows what it holds, not what the directory still lists: a member stopped
        # before it heard of a removal or a newer write elsewhere would show the old version, so its plain
        # clients ask it (a stopped member cannot answer: a timeout, never stale bytes) unless they can see
        # from here that it runs and re-checked its entries since it last stopped
        self._index_direct = bool(hello.get("index_direct", True))
        if not self._index_direct and hello.get("index_gate"):
            self._index_gate = ProcessGate.open(hello["index_gate"])
        if hello.get("arena_bytes"):
            self._arenas = ArenaWriter(self._conn, regions, hello["arena_bytes"])

    @staticmethod
    def _hello_fields(name: str, transport: str) -> dict[str, Any]:
        return {"client": name, "transport": transport, "host": host_id(), "pid": os.getpid(),
                "transports": transports.names()}

    def _reauth(self, channel: Caller) -> None:
        """A failure (a timed-out call) closed the control connection: say hello again on the new one. Only to
        the same daemon (generation) on the same data path: the mapped segments and the index stay valid. What
        the old connection held (leases, pending puts, arenas) the daemon revoked with it."""
        hello = say_hello(channel, self._token, self._hello_fields(self._name, self.transport), self.expected_node)
        if hello.get("generation") != self._generation or hello.get("transport") != self.transport:
            raise StoreConnectionError(f"the daemon at {self.endpoint} restarted since this client connected: "
                                       "open a new client")
        self.client_id = hello["client_id"]
        if self._arenas is not None:
            self._arenas.forget()
        log.info("%s: reconnected after a failed call (client id %s)", self.endpoint, self.client_id)

    def _beat(self, period: float) -> None:
        while not self._stop.wait(period):
            waiter = self._waiter
            if waiter is not None and not waiter.closed:
                # the wait() connection too: idle between waits for longer than the daemon's heartbeat
                # timeout, it would be dropped and the next wait would fail
                try:
                    waiter.try_call({"op": "ping"})
                except Exception:
                    pass  # closed now: the next wait() opens another
            try:
                self._conn.try_call({"op": "ping"})
            except Exception:
                continue  # the next real call reports the failure (and reconnects)

    def _call(self, op: str, **fields: Any) -> Any:
        return self._conn.call({"op": op, **fields}).get("value")

    # ---- primitives ---------------------------------------------------------------------------------
    # Writes: the connection's write strategy (kvstore/client/writes.py) holds the one put sequence.
    def _put(self, meta: ObjectMeta, payload: Payload, digest: Digest, *, flags: PutFlags) -> ObjectMeta:
        return self._writes.put(meta, payload, digest, flags)

    def _put_many(self, items: list[tuple[ObjectMeta, Payload]], digests: list[Digest], *,
                  flags: PutFlags) -> list[ObjectMeta]:
        self._check_batch(len(items), "batch_put")  # every path here (device put_many too) before a byte is sent
        return self._writes.put_many(items, digests, flags)

    def _reserve(self, meta: ObjectMeta, flags: PutFlags) -> tuple[Any, memoryview]:
        return self._writes.reserve(meta, flags)

    def _commit_reserved(self, handles: list[Any], metas: list[ObjectMeta], checksums: list[int | None]
                         ) -> list[ObjectMeta]:
        if not handles:
            return []
        return self._writes.commit(handles, metas, checksums)

    def _abort_reserved(self, handles: list[Any], quiet: bool = False) -> None:
        if handles:
            self._writes.abort(handles, quiet)

    def _read_index(self, key: str, fit: Callable[[int], memoryview]) -> tuple[int, int, int] | None:
        """Copy ``key`` through the daemon's shared-memory index without a round trip: (size, version,
        checksum), or None (not there, not trusted now, or a cluster member that may not be caught up)."""
        if self._index is None or not (self._index_direct or self._index_gate is not None):
            return None
        # no round trip, so check the daemon's life here: a dead daemon's index must never answer
        self._conn.check_alive()
        return self._index.read_into(key, fit, gate=self._index_gate)

    def _get_into(self, key: str, fit: Callable[[int], memoryview]) -> tuple[int, int | None]:
        hit = self._read_index(key, fit)
        if hit is not None:  # the index keeps "no checksum" (objects put from device memory) as 0
            return hit[0], hit[2] or None
        reply = self._read(key, lambda r: fit(r["meta"]["size"]), self._data)
        meta = reply["meta"]
        if not reply.get("stream"):
            fit(meta["size"])  # a zero-byte object still checks the buffer
        return meta["size"], meta["checksum"]

    def _read(self, key: str, dst: Callable[[dict[str, Any]], memoryview], path: Transport,
              op: str = "get") -> dict[str, Any]:
        """One read of ``key`` by ``op`` over ``path``, its payload compressed when the wire policy says so."""
        request: dict[str, Any] = {"op": op, "key": key}
        codec = self.wire.choose() if path.on_connection else None
        if codec is not None:
            request["compress"] = codec
        landed: list[memoryview] = []

        def into(reply: dict[str, Any]) -> memoryview:
            landed.append(dst(reply))
            return landed[0]

        started = time.perf_counter()
        try:
            reply = path.get_into(self._conn, request, into)
        except TransportFailure as exc:
            raise TransportError(f"get of {key!r} failed on the {self.transport} path: {exc}") from None
        if codec is not None or path.on_connection:
            size = reply.get("frames") or reply.get("stream") or 0
            self.wire.observe(size, time.perf_counter() - started, codec, landed[0][:size] if landed else None)
        return reply

    def _get(self, key: str, *, copy: bool) -> KVObject:
        regions = self._regions
        if regions is None:
            # A copy is the caller's for good: fresh memory. A zero-copy object here is a client buffer (the
            # daemon's memory cannot be mapped) that nobody else writes while it is held; it is taken warm from
            # the staging pool and goes back there when released.
            pool = self._staging_pool()
            holder: dict[str, Any] = {}

            def fit(r: dict[str, Any]) -> memoryview:
                size = r["meta"]["size"]
                holder["raw"] = pool.take(size) if not copy else bytearray(size)
                return memoryview(holder["raw"])

            try:
                reply = self._read(key, fit, self._data)
            except BaseException:
                if not copy and "raw" in holder:
                    pool.give(holder["raw"])
                raise
            raw = holder.get("raw", bytearray())
            meta = ObjectMeta.from_wire(reply["meta"])
            if copy:
                return KVObject.wrap(raw, meta)
            return KVObject.wrap(raw, meta, on_release=lambda: pool.give(raw))
        reply = self._conn.call({"op": "get", "key": key, "mode": "region"})
        meta = ObjectMeta.from_wire(reply["meta"])
        try:
            region = regions.region(reply["segment"], reply["offset"], reply["size"])
        except BaseException:
            self._conn.queue_release(reply["lease"])
            raise
        if not copy:
            lease = reply["lease"]
            return KVObject.wrap(region, meta, on_release=lambda: self._conn.queue_release(lease))
        try:
            return KVObject.wrap(bytearray(region), meta)
        finally:
            region.release()
            self._conn.queue_release(reply["lease"])

    def send_releases(self) -> None:
        self._conn.send_releases()

    def _get_many_views(self, keys: list[str]) -> list[KVObject | KVStoreError]:
        regions = self._regions
        if regions is None or not keys:  # not mapped here: one read per key
            return super()._get_many_views(keys)
        replies = self._call("get_regions", keys=keys)
        out: list[KVObject | KVStoreError] = []
        for key, reply in zip(keys, replies, strict=True):
            if "error" in reply:
                out.append(error_from_wire(reply["error"], reply.get("message", key)))
                continue
            lease = reply["lease"]
            try:
                region = regions.region(reply["segment"], reply["offset"], reply["size"])
            except Exception as exc:  # noqa: BLE001 - this key fails; the others' leases stand
                self._conn.queue_release(lease)
                out.append(TransportError(f"object {key!r}: cannot map its region ({exc})"))
                continue
            out.append(KVObject.wrap(region, ObjectMeta.from_wire(reply["meta"]),
                                     on_release=functools.partial(self._conn.queue_release, lease)))
        return out

    def _lease(self, key: str) -> tuple[Any, ObjectMeta]:
        reply = self._conn.call({"op": "lease", "key": key})
        return reply["lease"], ObjectMeta.from_wire(reply["meta"])

    def _release(self, handle: Any) -> None:
        if not self._conn.closed:
            self._conn.call({"op": "release", "lease": handle})

    # ---- metadata -----------------------------------------------------------------------------------
    def _exists(self, key: str) -> bool:
        return bool(self._call("exists", key=key))

    def _batch_exists(self, keys: Sequence[str]) -> list[bool]:
        # read-only, so a long list is split transparently into requests the daemon takes
        keys = list(keys)
        return [found for start in range(0, max(len(keys), 1), wire.MAX_BATCH)
                for found in self._call("batch_exists", keys=keys[start:start + wire.MAX_BATCH])]

    def _unpin(self, keys: list[str]) -> int:
        return sum(self._call("unpin", keys=keys[start:start + wire.MAX_BATCH])
                   for start in range(0, len(keys), wire.MAX_BATCH))

    def _evict(self, key: str) -> bool:
        return bool(self._call("evict", key=key))

    def _touch(self, keys: list[str], ttl: float) -> list[int | None]:
        return list(self._call("touch", keys=keys, ttl=ttl))

    def _remove(self, key: str) -> bool:
        return bool(self._call("remove", key=key))

    def _wait(self, keys: Sequence[str], timeout: float) -> str | None:
        # A wait may block for its whole timeout: it gets a connection of its own (opened on first use), so
        # it neither holds up this client's other calls nor starves its heartbeat.
        with self._waiter_lock:
            if self._waiter is None or self._waiter.closed:
                waiter = Connection(self.endpoint, self.timeout)
                try:
                    say_hello(waiter, self._token, {"client": f"{self.producer}/wait", "transport": "tcp",
                                                    "host": host_id(), "pid": os.getpid()}, self.expected_node)
                except BaseException:
                    waiter.close()
                    raise
                self._waiter = waiter
            return self._waiter.call({"op": "wait", "keys": list(keys), "timeout": timeout},
                                     timeout=timeout + self.timeout).get("value")

    def keys(self, prefix: str = "") -> list[str]:
        # page by page: a listing of any size crosses in frames under the frame limit
        out: list[str] = []
        request = {"op": "ls", "prefix": prefix}
        while True:
            reply = self._conn.call(request)
            out += reply["value"]
            if not reply.get("more") or not reply["value"]:
                return out
            request["after"] = reply["value"][-1]

    def _inspect(self, key: str) -> dict[str, Any]:
        info: dict[str, Any] = self._call("inspect", key=key)
        info["client_transport"] = self.transport
        return info

    def stats(self) -> dict[str, Any]:
        """The daemon's stats, with every connection (asked for page by page)."""
        out: dict[str, Any] = self._call("stats")
        connections: list[dict[str, Any]] = out.get("connections", [])
        while out.pop("connections_more", False) and connections:
            page = self._call("stats", after=connections[-1]["id"])
            connections += page["connections"]
            out["connections_more"] = page.get("connections_more", False) and bool(page["connections"])
        out["connections"] = connections
        out["transport"] = self.transport
        out["compression"] = self.wire.describe()
        device = self.device_memory()
        out["device_path"] = device.describe() if device is not None else "none: this path moves host memory only"
        return out

    # ---- device memory ------------------------------------------------------------------------------
    def device_memory(self) -> DirectDeviceMemory | None:
        if self._device is None and not self._device_reason:
            try:
                path = self._data.device_path()
            except TransportUnavailable as exc:
                self._device_reason = f"{exc}; this connection uses {self.transport}"
                return None
            self._device = DirectDeviceMemory(path, self._conn, self._put_many, self.transport)
        return self._device

    def _device_path(self) -> DevicePath:
        """What moves device payloads on this connection (InvalidArgumentError, before anything is sent, where
        nothing can)."""
        return self._direct_device().path

    def _direct_device(self) -> DirectDeviceMemory:
        device = self.device_memory()
        if device is None:
            raise InvalidArgumentError(self._device_reason)
        return device

    def _device_refusal(self) -> str:
        return self._device_reason or super()._device_refusal()

    @property
    def connected(self) -> bool:
        """False once the control connection is closed (by us, the daemon, or a failure)."""
        return not self._conn.closed

    def ping(self) -> None:
        self._call("ping")

    def close(self) -> None:
        if self._conn.closed and self._stop.is_set():
            return
        self._stop.set()
        if self._arenas is not None:
            self._arenas.release()
        self._conn.close()
        if self._waiter is not None:
            self._waiter.close()
        if self._device is not None:
            self._device.close()
            self._device = None
        self._data.close()  # unpins the shared memory device copies pinned, then unmaps it
        if self._index_gate is not None:
            self._index_gate.close()
            self._index_gate = None
        if self._index_shm is not None:
            self._index = None
            self._index_shm.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


__all__ = ["RemoteStore", "StoreConnectionError"]
