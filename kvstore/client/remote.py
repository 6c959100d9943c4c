"""RemoteStore: a client of ``kvstore serve`` over a Unix socket or TCP, with a pluggable data path.

Small objects (up to ``INLINE_MAX``) travel inline on the control connection: one round trip. Larger ones
take the negotiated transport (``shm``: one copy into or out of the mapped segment). On the same host a
``get_into`` first tries the daemon's shared-memory index: no round trip at all (a cluster member's index only
while the member runs and has re-checked its entries since it last stopped: ``kvstore.memory.procstate``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore import transports
from kvstore.client.arena import ArenaWriter, check_commit_size, commit_fits
from kvstore.client.compression import WirePolicy
from kvstore.client.device import DirectDeviceMemory
from kvstore.client.handshake import say_hello
from kvstore.client.rpc import Connection
from kvstore.client.staging import Staged
from kvstore.client.store import KVStore, PutFlags
from kvstore.core.digest import Digest
from kvstore.core.meta import ObjectMeta
from kvstore.core.value import KVObject, Payload
from kvstore.errors import (
    InvalidArgumentError,
    KVStoreError,
    ObjectTooLargeError,
    QuotaExceededError,
    StoreConnectionError,
    TransportError,
)
from kvstore.memory.device import DeviceBuffer
from kvstore.memory.index import IndexReader
from kvstore.memory.procstate import ProcessGate
from kvstore.memory.shm import SharedMemory, SharedMemoryError
from kvstore.protocol import wire
from kvstore.protocol.credentials import env_token
from kvstore.protocol.url import Endpoint, host_id
from kvstore.transports.base import TransportFailure, TransportUnavailable
from kvstore.transports.cuda_ipc import device_path
from kvstore.transports.shm import ShmTransport
from kvstore.transports.tcp import StreamTransport

INLINE_MAX = 64 << 10
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
        self._inline = StreamTransport()
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

    def _open(self, name: str, transport: str) -> dict:
        """Connect, say hello and set up the data path the daemon chose; TransportError if it cannot be
        mapped (the connection is closed then)."""
        self._conn = Connection(self.endpoint, self.timeout)
        try:
            hello = say_hello(self._conn, self._token, self._hello_fields(name, transport), self.expected_node)
            self.transport, self._name, self._generation = hello["transport"], name, hello.get("generation")
            segments = {sid: (seg, size) for sid, seg, size in hello["segments"]}
            self._data = transports.get(self.transport)(segments)
            if isinstance(self._data, ShmTransport):  # shm, and cuda_ipc (which maps the same memory)
                try:
                    self._index_shm = SharedMemory.attach(*hello["index"])
                except BaseException:
                    self._data.close()
                    raise
                # trusted only while it shows this daemon's generation alive and heart-beating (a cluster node
                # gives a short lease: a stopped node must not serve what the others superseded meanwhile)
                lease = hello.get("index_lease_s") or max(5.0, float(hello["heartbeat_s"]))
                self._index = IndexReader(self._index_shm.buf, self._data.region, hello.get("generation"),
                                          stale_after=float(lease))
                # a cluster member's index shows what it holds, not what the directory still lists: a member
                # stopped before it heard of a removal or a newer write elsewhere would show the old version,
                # so its plain clients ask it (a stopped member cannot answer: a timeout, never stale bytes)
                # unless they can see from here that it runs and re-checked its entries since it last stopped
                self._index_direct = bool(hello.get("index_direct", True))
                if not self._index_direct and hello.get("index_gate"):
                    self._index_gate = ProcessGate.open(hello["index_gate"])
                if hello.get("arena_bytes"):
                    self._arenas = ArenaWriter(self._conn, self._data, hello["arena_bytes"])
        except (TransportFailure, SharedMemoryError) as exc:
            self._conn.close()
            raise TransportError(str(exc)) from None
        except BaseException:
            self._conn.close()
            raise
        self._conn.reconnects_with(self._reauth)
        return hello

    @staticmethod
    def _hello_fields(name: str, transport: str) -> dict:
        return {"client": name, "transport": transport, "host": host_id(), "pid": os.getpid(),
                "transports": transports.names()}

    def _reauth(self, channel) -> None:
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

    def _path(self, size: int):
        return self._inline if size <= INLINE_MAX else self._data

    def _call(self, op: str, **fields: Any) -> Any:
        return self._conn.call({"op": op, **fields}).get("value")

    # ---- primitives ---------------------------------------------------------------------------------
    def _put(self, meta: ObjectMeta, payload: Payload, digest: Digest, *, flags: PutFlags) -> ObjectMeta:
        if self._arena_fits(meta, payload):
            slot = self._arenas.take(meta.size)
            if slot is not None:
                try:
                    self._arenas.write(slot, digest)
                except BaseException:
                    self._arenas.returned(slot)
                    raise
                reply = self._arenas.commit([self._arenas.entry(slot, meta, digest())], [slot], **_flags(flags))
                return meta.with_commit(digest(), reply["versions"][0], reply["created"][0])
        reply = self._send_put(meta, payload, digest, flags, defer=False)
        return meta.with_commit(digest(), reply["version"], reply["created"])

    def _quota_retry(self, send: Callable[[], dict]) -> dict:
        """``send()`` a put outside the arenas; if the daemon refuses it for this client's quota, which counts the
        client's idle arenas too, give those back and send it once more (the refused request stored nothing)."""
        try:
            return send()
        except QuotaExceededError:
            if self._arenas is None or not self._arenas.retire_idle():
                raise
        return send()

    def _arena_fits(self, meta: ObjectMeta, payload: Payload | None = None) -> bool:
        return self._arenas is not None and self._arenas.fits(meta.size) and \
            (payload is None or not isinstance(payload.view, DeviceBuffer))

    def _put_many_arena(self, items: list[tuple[ObjectMeta, Payload]], digests: list[Digest], flags: PutFlags
                        ) -> list[ObjectMeta] | None:
        """batch_put through the arenas: every object copied, then one commit. None if a slot is not to be had."""
        slots = []
        try:
            for (meta, _), digest in zip(items, digests, strict=True):
                slot = self._arenas.take(meta.size)
                if slot is None:
                    for s in slots:
                        self._arenas.returned(s)
                    return None
                slots.append(slot)
                self._arenas.write(slot, digest)
        except BaseException:
            for s in slots:
                self._arenas.returned(s)
            raise
        entries = [self._arenas.entry(slot, meta, digest()) for slot, (meta, _), digest in zip(slots, items, digests,
                                                                                             strict=True)]
        reply = self._arenas.commit(entries, slots, **_flags(flags))
        return [meta.with_commit(digest(), v, c)
                for (meta, _), digest, v, c in zip(items, digests, reply["versions"], reply["created"], strict=True)]

    def _send_put(self, meta: ObjectMeta, payload: Payload, digest: Digest, flags: PutFlags, defer: bool) -> dict:
        if meta.size > self.capacity:
            raise ObjectTooLargeError(f"value of {meta.size} bytes exceeds the store's capacity of {self.capacity}")
        request = {"op": "put", "key": meta.key, "size": meta.size, "meta": meta.to_wire(),
                   "if_absent": flags.if_absent, "pin": flags.pin, "ephemeral": flags.ephemeral, "defer": defer}
        try:
            if isinstance(payload.view, DeviceBuffer):  # routed here by device_memory().put_many
                return self._direct_device().put(request, payload.view, digest)
            path = self._path(meta.size)
            if path is self._data and isinstance(path, StreamTransport):
                codec = self.wire.choose()
                if codec is not None:
                    request["compress"] = codec
                started = time.perf_counter()
                reply = self._quota_retry(lambda: path.put(self._conn, request, payload.view, digest))
                self.wire.observe(meta.size, time.perf_counter() - started, codec, payload.view)
                return reply
            return self._quota_retry(lambda: path.put(self._conn, request, payload.view, digest))
        except TransportFailure as exc:
            raise TransportError(f"put of {meta.key!r} failed on the {self.transport} path: {exc}") from None

    def _put_many(self, items: list[tuple[ObjectMeta, Payload]], digests: list[Digest], *,
                  flags: PutFlags) -> list[ObjectMeta]:
        self._check_batch(len(items), "batch_put")  # every path here (device put_many too) before a byte is sent
        if all(self._arena_fits(m, p) for m, p in items) and commit_fits([m for m, _ in items]):
            done = self._put_many_arena(items, digests, flags)
            if done is not None:
                return done
        pending: list[dict] = []
        try:
            for (meta, payload), digest in zip(items, digests, strict=True):
                pending.append(self._send_put(meta, payload, digest, flags, defer=True))
            reply = self._conn.call({"op": "commit_many", "put_ids": [p["put_id"] for p in pending],
                                     "checksums": [p.get("checksum") for p in pending]})
        except BaseException:
            if not self._conn.closed:
                for p in pending[:len(pending)]:
                    try:
                        self._conn.call({"op": "abort", "put_id": p["put_id"]})
                    except Exception:
                        pass  # already aborted by a failed commit_many, or the connection is gone
            raise
        return [meta.with_commit(digest(), v, c)
                for (meta, _), digest, v, c in zip(items, digests, reply["versions"], reply["created"], strict=True)]

    def _reserve(self, meta: ObjectMeta, flags: PutFlags) -> tuple[Any, memoryview]:
        if meta.size > self.capacity:  # first: a staging buffer of any size is not even tried
            raise ObjectTooLargeError(f"value of {meta.size} bytes exceeds the store's capacity of {self.capacity}")
        if not isinstance(self._data, ShmTransport):  # tcp, ucx: a staging buffer sent at commit
            return super()._reserve(meta, flags)
        if self._arena_fits(meta):  # no round trip: the commit is the only one
            slot = self._arenas.take(meta.size)
            if slot is not None:
                try:
                    return ("arena", slot, flags), self._arenas.view(slot)
                except BaseException:
                    self._arenas.returned(slot)
                    raise
        reply = self._quota_retry(lambda: self._conn.call(
            {"op": "put", "key": meta.key, "size": meta.size, "meta": meta.to_wire(), "if_absent": flags.if_absent,
             "pin": flags.pin, "ephemeral": flags.ephemeral, "defer": True, "mode": "region"}))
        try:
            view = self._data.region(reply["segment"], reply["offset"], meta.size)
        except BaseException:
            self._abort_reserved([("region", reply["put_id"])], quiet=True)
            raise
        return ("region", reply["put_id"]), view

    def _commit_reserved(self, handles: list[Any], metas: list[ObjectMeta], checksums: list[int]
                         ) -> list[ObjectMeta]:
        if not handles or isinstance(handles[0], Staged):
            return super()._commit_reserved(handles, metas, checksums)
        arena = [h for h in handles if h[0] == "arena"]
        if arena:
            check_commit_size(metas)
            entries = [self._arenas.entry(h[1], meta, c) if h[0] == "arena" else {"put_id": h[1], "checksum": c}
                       for h, meta, c in zip(handles, metas, checksums, strict=True)]
            reply = self._arenas.commit(entries, [h[1] for h in arena], **_flags(arena[0][2]), give_back=False)
            return [meta.with_commit(c, v, t) for meta, c, v, t in
                    zip(metas, checksums, reply["versions"], reply["created"], strict=True)]
        reply = self._conn.call({"op": "commit_many", "put_ids": [h[1] for h in handles],
                                 "checksums": list(checksums)})
        return [meta.with_commit(c, v, t) for meta, c, v, t in
                zip(metas, checksums, reply["versions"], reply["created"], strict=True)]

    def _abort_reserved(self, handles: list[Any], quiet: bool = False) -> None:
        if not handles or isinstance(handles[0], Staged):
            return super()._abort_reserved(handles, quiet)
        for h in handles:
            if h[0] == "arena":
                self._arenas.returned(h[1])
        if self._conn.closed:
            return  # the daemon revoked them when the connection dropped
        for h in handles:
            if h[0] == "arena":
                continue
            try:
                self._conn.call({"op": "abort", "put_id": h[1]})
            except KVStoreError:
                if not quiet:
                    raise

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

    def _read(self, key: str, dst: Callable[[dict], memoryview], path) -> dict:
        request = {"op": "get", "key": key}
        codec = self.wire.choose() if isinstance(path, StreamTransport) else None
        if codec is not None:
            request["compress"] = codec
        landed: list[memoryview] = []

        def into(reply: dict) -> memoryview:
            landed.append(dst(reply))
            return landed[0]

        started = time.perf_counter()
        try:
            reply = path.get_into(self._conn, request, into)
        except TransportFailure as exc:
            raise TransportError(f"get of {key!r} failed on the {self.transport} path: {exc}") from None
        if codec is not None or isinstance(path, StreamTransport):
            size = reply.get("frames") or reply.get("stream") or 0
            self.wire.observe(size, time.perf_counter() - started, codec, landed[0][:size] if landed else None)
        return reply

    def _get(self, key: str, *, copy: bool) -> KVObject:
        if not isinstance(self._data, ShmTransport):
            # A copy is the caller's for good: fresh memory. A zero-copy object here is a client buffer (the
            # daemon's memory cannot be mapped) that nobody else writes while it is held; it is taken warm from
            # the staging pool and goes back there when released.
            pool = self._staging_pool()
            holder: dict = {}

            def fit(r: dict) -> memoryview:
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
            region = self._data.region(reply["segment"], reply["offset"], reply["size"])
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

    def _lease(self, key: str) -> tuple[Any, ObjectMeta]:
        reply = self._conn.call({"op": "lease", "key": key})
        return reply["lease"], ObjectMeta.from_wire(reply["meta"])

    def _release(self, handle: Any) -> None:
        if not self._conn.closed:
            self._conn.call({"op": "release", "lease": handle})

    # ---- metadata -----------------------------------------------------------------------------------
    def _exists(self, key: str) -> bool:
        return self._call("exists", key=key)

    def _batch_exists(self, keys: Sequence[str]) -> list[bool]:
        # read-only, so a long list is split transparently into requests the daemon takes
        keys = list(keys)
        return [found for start in range(0, max(len(keys), 1), wire.MAX_BATCH)
                for found in self._call("batch_exists", keys=keys[start:start + wire.MAX_BATCH])]

    def _evict(self, key: str) -> bool:
        return self._call("evict", key=key)

    def _remove(self, key: str) -> bool:
        return self._call("remove", key=key)

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

    def _inspect(self, key: str) -> dict:
        info = self._call("inspect", key=key)
        info["client_transport"] = self.transport
        return info

    def stats(self) -> dict:
        out = self._call("stats")
        out["transport"] = self.transport
        out["compression"] = self.wire.describe()
        device = self.device_memory()
        out["device_path"] = device.describe() if device is not None else "none: this path moves host memory only"
        return out

    # ---- device memory ------------------------------------------------------------------------------
    def device_memory(self) -> DirectDeviceMemory | None:
        if self._device is None and not self._device_reason:
            try:
                path = device_path(self._data)
            except TransportUnavailable as exc:
                self._device_reason = f"{exc}; this connection uses {self.transport}"
                return None
            self._device = DirectDeviceMemory(path, self._conn, self._put_many, self.transport,
                                              owned=path is not self._data)
        return self._device

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
        if self._device is not None:  # unpins shared memory: before the transport unmaps it
            self._device.close()
            self._device = None
        self._data.close()
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


def _flags(flags: PutFlags) -> dict:
    return {"if_absent": flags.if_absent, "pin": flags.pin, "ephemeral": flags.ephemeral}


__all__ = ["RemoteStore", "StoreConnectionError"]
