"""Session: one client connection of the daemon — its lifecycle, the handshake, validation and dispatch, and the
store's ops. What it serves beyond those is in op groups it owns (handler objects over it as their narrow
:class:`~kvstore.daemon.context.SessionContext`): arenas (``ArenaOps``), the GPU path (``GpuOps``), the UCX path
(``UcxOps``), the disk tier (``DiskOps``); framing and payload bytes are its
:class:`~kvstore.daemon.connection.Connection`'s, compressed payloads its ``FrameOps``'.

A bad request gets an error reply and the connection stays usable; broken framing (an oversized or truncated
frame, a put whose payload cannot be skipped) closes the connection. Every other client is unaffected either way.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import xxhash

from kvstore.core.master import Lease, describe_replica
from kvstore.core.meta import ObjectMeta
from kvstore.daemon.arena_ops import ArenaOps
from kvstore.daemon.connection import INLINE_REPLY, Closed, Connection
from kvstore.daemon.context import client_of
from kvstore.daemon.disk_ops import DiskOps
from kvstore.daemon.frames import FrameOps
from kvstore.daemon.gpu_ops import GpuOps
from kvstore.daemon.guards import AuthDeadline, PeerGone
from kvstore.daemon.handshake import Handshake
from kvstore.daemon.limits import AuthBackoff, LogBudget
from kvstore.daemon.quarantine import MAPS_MEMORY, PidWatch, peer_cred, tcp_peer_cred
from kvstore.daemon.ucx_ops import UcxOps
from kvstore.errors import (
    AuthenticationError,
    ChecksumError,
    FrameTooLargeError,
    InvalidArgumentError,
    KVStoreError,
    ObjectTooLargeError,
    ProtocolError,
    ServerError,
    TransportError,
)
from kvstore.protocol import compression, wire

if TYPE_CHECKING:
    from kvstore.core.master import Master, Replica
    from kvstore.daemon.context import DaemonContext
    from kvstore.daemon.metrics import Metrics
    from kvstore.memory.segment import SegmentSet

log = logging.getLogger("kvstore.daemon.server")
_INLINE_REPLY = INLINE_REPLY  # the name the cluster's session imports


#: one daemon per process: these span its sessions, so that many connections of one peer share them
_FAILURE_LOG = LogBudget()  # refused requests: a few lines per peer every few seconds, the rest counted
_AUTH_BACKOFF = AuthBackoff()
#: (request id, validated fields) -> reply, or None when the handler sent its reply itself
Handler = Callable[[int, dict[str, Any]], Awaitable[dict[str, Any] | None]]
_Closed = Closed



def region_entry(lease: Lease, meta: ObjectMeta) -> dict[str, Any]:
    """One key's answer in a ``get_regions`` reply: where its leased bytes are (``meta`` describes them)."""
    replica = lease.replica
    return {"meta": meta.to_wire(), "segment": replica.segment, "offset": replica.offset, "size": meta.size,
            "lease": lease.id}


def region_error(exc: KVStoreError) -> dict[str, Any]:
    """One key's answer in a ``get_regions`` reply when it cannot be served: its typed error."""
    return {"error": getattr(exc, "code", "Server"), "message": str(exc)}

class Session:
    def __init__(self, ctx: DaemonContext, sock: socket.socket, peer: str):
        self.ctx, self.sock, self.peer = ctx, sock, peer
        self.loop = asyncio.get_running_loop()
        self.client: int | None = None
        self.name = ""
        self.transport = "none"
        self.client_host = ""
        self.busy = False
        self._unread_payload = False
        self.cred = peer_cred(sock)  # Unix sockets: the peer's pid and uid, from the kernel
        self.peer_key = f"uid:{self.cred.uid}" if self.cred is not None else peer.rsplit(":", 1)[0]
        self.handshake = Handshake(ctx.config.token, ctx.node_id, local=self.cred is not None)
        self._auth = AuthDeadline(self.loop, self._auth_expired)
        self._watch: PidWatch | None = None  # the client's process, once it authenticates on a mapping transport
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._refused = 0  # requests refused with a typed error
        self.conn = Connection(self.loop, sock, peer, self._bytes_out, max_frame=ctx.config.max_frame)
        self.frames = FrameOps(self.conn)
        self.ucx = UcxOps(self)
        self.gpu = GpuOps(self)
        self.arena = ArenaOps(self, self.ucx)
        self.disk = DiskOps(self, ctx.disk, get=self.op_get, lease=self.op_lease, inspect=self.op_inspect,
                            touch=self.op_touch, get_regions=self.op_get_regions) \
            if ctx.disk is not None else None  # with --disk-path
        self._handlers = self.handlers()

    # ---- what the op groups see of the daemon (SessionContext) -----------------------------------------
    @property
    def master(self) -> Master:
        return self.ctx.master

    @property
    def segments(self) -> SegmentSet:
        return self.ctx.segments

    @property
    def metrics(self) -> Metrics:
        return self.ctx.metrics

    def _bytes_out(self, n: int) -> None:
        self.ctx.metrics.bytes_out(n)

    @property
    def data_path(self) -> str:
        """How this client's payloads move, for stats and ``kvstore stats``."""
        return self.ucx.data_path

    def stalled_for(self, now: float) -> float:
        """Seconds the running payload transfer has gone without a byte moving (0 when none runs)."""
        return self.conn.clock.stalled_for(now)

    # ---- authentication deadline ----------------------------------------------------------------------
    def _auth_expired(self, seconds: float) -> None:
        if self.client is None:
            log.warning("client %s did not authenticate within %.1f s (--auth-timeout); closing connection",
                        self.peer, seconds)
            self.close()

    async def _send(self, message: dict[str, Any], payload: memoryview | None = None) -> None:
        await self.conn.send(message, payload)

    # ---- loop ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        self._task = asyncio.current_task()
        self._auth.start(self.ctx.config.auth_timeout)
        try:
            while not self.ctx.draining:
                try:
                    message = await self.conn.read_frame(
                        self.ctx.config.max_frame if self.client is not None else wire.MAX_PREAUTH_FRAME)
                except ProtocolError as exc:  # oversized frame: the stream cannot be resynchronised
                    log.warning("client %s: %s; closing connection", self.peer, exc)
                    await self._send(wire.error_reply(0, exc))
                    break
                if message is None:
                    break
                self.busy = True
                try:
                    await self._dispatch(message)
                finally:
                    self.busy = False
        except _Closed as exc:
            if str(exc):
                log.warning("client %s: %s; closing connection", self.peer, exc)
        except PeerGone as exc:
            log.info("%s", exc)
        except (ConnectionError, OSError) as exc:
            log.info("client %s disconnected: %s", self.peer, exc)
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._auth.cancel()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()  # first: the daemon's own stream copy stops before its space can be reused
        self.ucx.close_data()  # cancel UCX transfers into segment memory before their space is freed
        if self.client is not None:
            puts, leases = self.ctx.quarantine.revoke(self.client, self._watch, self.transport in MAPS_MEMORY,
                                                      self.peer)
            self._watch = None
            if puts or leases:
                log.info("client %s gone: revoked %d pending puts, released %d leases", self.peer, puts, leases)
            self.client = None
        elif self._watch is not None:
            self._watch.close()
            self._watch = None
        self.ctx.session_closed(self)
        try:
            self.sock.close()
        except OSError:
            pass

    async def _dispatch(self, message: dict[str, Any]) -> None:
        started = time.perf_counter()
        raw_id, raw_op = message.get("id"), message.get("op")
        rid = raw_id if isinstance(raw_id, int) else 0
        op = raw_op if isinstance(raw_op, str) else "?"
        self._unread_payload = op == "put" and message.get("mode") == "stream"
        try:
            op, rid, fields = wire.validate(message)
            if self.client is None and op not in wire.PREAUTH_OPS:
                raise AuthenticationError("the first request on a connection must be hello")
            if self.client is not None:
                self.master.heartbeat(self.client)
            handler = self._handlers.get(op)
            if handler is None:
                raise ProtocolError(f"op {op!r} is not served by this daemon")
            reply = await handler(rid, fields)
            result = "ok"
        except (_Closed, PeerGone, ConnectionError):  # the peer went away: a disconnect, not a failed request
            raise
        except KVStoreError as exc:
            result = exc.code
            reply = await self._refuse(rid, op, message, exc)
        except Exception as exc:  # a bug: report it, keep serving everyone
            result = "Server"
            log.exception("client %s op %s crashed", self.peer, op)
            reply = wire.error_reply(rid, ServerError(f"internal error in {op}: {type(exc).__name__}: {exc}"))
        self.metrics.op(op if op in wire.SCHEMA else "unknown", result, time.perf_counter() - started)
        if reply is not None and not message.get("noreply"):
            try:
                await self._send(reply)
            except FrameTooLargeError as exc:  # nothing was sent: the request gets the error, the connection lives
                log.warning("client %s op %s: reply not sent: %s", self.peer, op, exc)
                await self._send(wire.error_reply(rid, exc))

    async def _refuse(self, rid: int, op: str, message: dict[str, Any], exc: KVStoreError) -> dict[str, Any]:
        """The error reply of a refused request, logged within the peer's budget (a session's first refusal
        always; then a few a peer every few seconds, the rest counted). A refused hello token is answered after
        the peer's back-off, and an authentication failure ends the session."""
        auth = isinstance(exc, AuthenticationError)
        delay = _AUTH_BACKOFF.failed(self.peer_key) if auth and op == "hello" else 0.0  # guessing costs time
        held = _FAILURE_LOG.take(self.peer_key) if self._refused else 0
        self._refused += 1
        if held is not None:
            log.info("client %s op %s failed: %s%s%s", self.peer, op, exc,
                     f" (answered after {delay:.1f} s)" if delay else "",
                     f" ({held} more refused requests of this peer not logged)" if held else "")
        reply = wire.error_reply(rid, exc)
        if self._unread_payload:
            await self._drain_put(message, exc)
        if auth:
            await asyncio.sleep(delay)
            await self._send(reply)
            raise _Closed("authentication failed") from None
        return reply

    async def _drain_put(self, message: dict[str, Any], exc: Exception) -> None:
        """A refused stream put still has its payload in flight: skip it, or close if it cannot be trusted."""
        self._unread_payload = False
        size = message.get("size")
        if isinstance(exc, ObjectTooLargeError) or not isinstance(size, int) or isinstance(size, bool) \
                or size < 0 or size > self.master.capacity:
            await self._send(wire.error_reply(message.get("id", 0) if isinstance(message.get("id"), int) else 0,
                                              exc))
            raise _Closed(f"refused a streamed put ({exc}); payload cannot be skipped safely")
        if message.get("compress") in compression.CODECS and size >= compression.MIN_SIZE:
            try:
                await self.frames.skip_frames(size)  # a compressed payload: as frames, whose lengths only they know
            except ProtocolError as bad:
                raise _Closed(f"refused a compressed put ({exc}) whose frames cannot be skipped: {bad}") from None
        else:
            await self.conn.skip(size)

    def _ok(self, rid: int, **fields: Any) -> dict[str, Any]:
        return wire.ok_reply(rid, **fields)

    # ---- ops ----------------------------------------------------------------------------------------
    def handlers(self) -> dict[str, Handler]:
        """The ops this session serves, each with its handler. Every op's fields are declared in
        ``kvstore.protocol.wire.SCHEMA``; an op declared there but absent here gets a ProtocolError."""
        table: dict[str, Handler] = {
            "challenge": self.op_challenge, "hello": self.op_hello, "ping": self.op_ping, "put": self.op_put,
            "commit": self.op_commit,
            "commit_many": self.op_commit_many, "abort": self.op_abort, "get": self.op_get,
            "release": self.op_release, "lease": self.op_lease, "exists": self.op_exists,
            "batch_exists": self.op_batch_exists, "evict": self.op_evict, "remove": self.op_remove,
            "unpin": self.op_unpin, "get_regions": self.op_get_regions,
            "inspect": self.op_inspect, "stats": self.op_stats, "ls": self.op_ls, "wait": self.op_wait,
            "touch": self.op_touch,
        }
        table.update(self.gpu.handlers())  # the GPU data path (kvstore.daemon.gpu_ops)
        table.update(self.ucx.handlers())  # the UCX data path (kvstore.daemon.ucx_ops)
        table.update(self.arena.handlers())  # same-host clients' arenas (arena_ops)
        if self.disk is not None:
            table.update(self.disk.handlers())  # with --disk-path: the read ops also look on disk (disk_ops)
        return table

    async def op_challenge(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        return self._ok(rid, **self.handshake.challenge(f["nonce"]))

    async def op_hello(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        server = self.ctx
        self.handshake.check_hello(f)
        host = await self._verified_host(f["host"])
        transport = server.choose_transport(f["transport"], host, self.peer, f["transports"])
        if self.client is not None and transport != self.transport:  # the watch below is set up once, at the first
            raise InvalidArgumentError(f"a second hello cannot switch this connection from {self.transport} to "
                                       f"{transport}; open a new connection")
        self.transport, self.client_host = transport, host
        if self.client is None:
            self._auth.cancel()
            if self.transport in MAPS_MEMORY:  # _verified_host made sure the pid is known
                self._watch = PidWatch(self._known_pid())  # watched from now: a recycled pid is never mistaken for it
            self.client = server.master.register_client(f["client"], peer=self._quota_peer())
            self.conn.authenticated()  # the full-size buffer
        self.name = f["client"] or self.peer
        return self._ok(rid, client_id=self.client, transport=self.transport, host=server.host_id,
                        segments=server.segments.describe(), index=server.index_info(),
                        capacity=server.master.capacity, max_frame=server.config.max_frame,
                        heartbeat_s=server.config.heartbeat_timeout, pid=server.pid, generation=server.generation,
                        arena_bytes=server.config.arena_size if self.transport in ("shm", "cuda_ipc") else 0,
                        transports=list(server.served_transports))

    async def _verified_host(self, claimed: str) -> str:
        """The client's host as far as the daemon can tell: a claim to be on the daemon's own host counts only
        once the client's process is known (SO_PEERCRED, or the TCP peer found in /proc), because a client that
        maps the segments must be watched for its quarantine to end; otherwise "" (a remote client)."""
        if claimed != self.ctx.host_id:
            return claimed
        if self.cred is None and self.sock.family != socket.AF_UNIX:
            self.cred = await self.loop.run_in_executor(None, tcp_peer_cred, self.sock)
        return claimed if self.cred is not None and self.cred.pid is not None else ""

    def _quota_peer(self) -> str:
        """Whose sessions share the per-client limits as well as each having them: one process where the kernel
        named it (uid and pid), else a Unix-socket user or a TCP address."""
        if self.cred is not None and self.cred.pid is not None:
            return f"uid {self.cred.uid} pid {self.cred.pid}"
        return self.peer_key

    def _known_pid(self) -> int:
        if self.cred is None or self.cred.pid is None:
            raise AuthenticationError(f"client {self.peer}: its process is not known, so it cannot map memory")
        return self.cred.pid

    async def op_ping(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        return self._ok(rid)

    async def op_put(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        meta = ObjectMeta.from_wire(f["meta"])
        if meta.key != f["key"] or meta.size != f["size"]:
            raise InvalidArgumentError(f"put of {f['key']!r}: meta names key {meta.key!r} size {meta.size}, "
                                       f"request says size {f['size']}")
        if f["mode"] == "region":
            self.require_shm()  # before anything is reserved
        if f["checksum"] is not None:
            meta = replace(meta, checksum=f["checksum"])
        master = self.master
        replica = master.begin_put(meta, client_of(self), if_absent=f["if_absent"], pin=f["pin"],
                                   ephemeral=f["ephemeral"])
        if f["mode"] == "region":
            return self._ok(rid, put_id=replica.id, segment=replica.segment, offset=replica.offset)
        if f["mode"] == "ucx":
            return self.ucx.put_reply(rid, replica)
        hasher = xxhash.xxh3_64()
        try:
            region = self.segments[replica.segment].view(replica.offset, meta.size)
            self._unread_payload = False
            if f["compress"] is not None and meta.size >= compression.MIN_SIZE:
                await self._frames_in(region, hasher)
            else:
                await self.conn.read_into(region, hasher)
            region.release()
            checksum = hasher.intdigest()
            if f["checksum"] is not None and f["checksum"] != checksum:
                raise ChecksumError(f"put of {meta.key!r}: the {meta.size} bytes received hash to {checksum:#x}, "
                                    f"the client sent {f['checksum']:#x}; nothing was stored")
        except BaseException:
            if self.client is not None:
                master.abort(replica.id)
            raise
        self.metrics.bytes_in(meta.size)
        if f["defer"]:
            replica.meta = replace(replica.meta, checksum=checksum)  # what landed is what is recorded
            return self._ok(rid, put_id=replica.id, checksum=checksum)
        return self._committed(rid, master.commit(replica.id, checksum), checksum=checksum)

    async def op_commit(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        master = self.master
        replica = master.pending(f["put_id"])
        if replica.client != self.client:
            raise InvalidArgumentError(f"put {f['put_id']} belongs to another client")
        await self.ucx.landed([f["put_id"]])
        self.metrics.bytes_in(replica.size)
        return self._committed(rid, master.commit(f["put_id"], f["checksum"]))

    async def op_commit_many(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        master = self.master
        for pid in f["put_ids"]:
            if master.pending(pid).client != self.client:
                raise InvalidArgumentError(f"put {pid} belongs to another client")
        await self.ucx.landed(f["put_ids"])
        replicas = master.commit_many(f["put_ids"], f["checksums"])
        return self._ok(rid, versions=[r.meta.version for r in replicas], created=[r.meta.created for r in replicas])

    def _committed(self, rid: int, replica: Replica, **fields: Any) -> dict[str, Any]:
        return self._ok(rid, version=replica.meta.version, created=replica.meta.created, **fields)

    async def op_abort(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        if self.master.pending(f["put_id"]).client != self.client:
            raise InvalidArgumentError(f"put {f['put_id']} belongs to another client")
        self.ucx.cancel_landing(f["put_id"])
        self.master.abort(f["put_id"])
        return self._ok(rid)

    async def op_get(self, rid: int, f: dict[str, Any]) -> dict[str, Any] | None:
        master = self.master
        if f["mode"] == "region":
            self.require_shm()  # before the lease is taken
        lease = master.lease(f["key"], client_of(self))
        replica = lease.replica
        if self.gpu.on_gpu(replica):  # these paths cannot map GPU memory: the daemon copies it to the host
            return await self.gpu.staged_get(rid, f, lease)
        if f["mode"] == "region":
            return self._ok(rid, meta=replica.meta.to_wire(), segment=replica.segment, offset=replica.offset,
                            size=replica.size, lease=lease.id)
        if f["mode"] == "ucx" and replica.size > INLINE_REPLY:
            return self.ucx.get_reply(rid, lease)
        try:
            region = self.segments[replica.segment].view(replica.offset, replica.size)
            await self.frames.send_object(rid, replica.meta.to_wire(), region, f["compress"])
            region.release()
        finally:
            if self.client is not None:
                master.release(lease.id)
        return None

    async def _frames_in(self, region: memoryview, hasher: xxhash.xxh3_64) -> None:
        try:
            await self.frames.read_frames_into(region, hasher)
        except ProtocolError as exc:  # a bad frame header: the stream cannot be resynchronised
            await self._send(wire.error_reply(0, exc))
            raise _Closed(f"refused a compressed put: {exc}") from None

    async def op_release(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        self.master.release(f["lease"], client=self.client)
        self.gpu.drop_staging(f["lease"])
        return self._ok(rid)

    async def op_lease(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        lease = self.master.lease(f["key"], client_of(self))
        return self._ok(rid, lease=lease.id, meta=lease.replica.meta.to_wire())

    async def op_exists(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        return self._ok(rid, value=self.master.exists(f["key"]))

    async def op_batch_exists(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        return self._ok(rid, value=[self.master.exists(k) for k in f["keys"]])

    async def op_get_regions(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        """Lease every key and say where its bytes are (shm clients map them); a key that cannot be served
        this way (absent, on the GPU tier, over the lease quota) gets its error instead, and the others
        their leases."""
        self.require_shm()
        out: list[dict[str, Any]] = []
        for key in f["keys"]:
            try:
                lease = self.master.lease(key, client_of(self))
            except KVStoreError as exc:
                out.append(region_error(exc))
                continue
            replica = lease.replica
            if self.gpu.on_gpu(replica):
                self.master.release(lease.id)
                out.append({"error": "InvalidArgument", "message": f"object {key!r} is in GPU memory; get it "
                            "on its own"})
                continue
            out.append(region_entry(lease, replica.meta))
        return self._ok(rid, value=out)

    async def op_unpin(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        return self._ok(rid, value=sum(self.master.unpin(k) for k in f["keys"]))

    async def op_evict(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        return self._ok(rid, value=self.master.evict(f["key"]))

    async def op_remove(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        return self._ok(rid, value=self.master.remove(f["key"]))

    async def op_inspect(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        master = self.master
        replica = master.lookup(f["key"])
        return self._ok(rid, value={**describe_replica(replica, master.clock()), "tier": master.tier_of(replica).value})

    async def op_touch(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        # the shared-memory index keeps the earlier expiry: past it, a lock-free reader asks the daemon instead
        touched = [self.master.touch(key, f["ttl"]) for key in f["keys"]]
        return self._ok(rid, value=[None if r is None else r.meta.checksum for r in touched])  # 4096 fit a frame

    async def op_stats(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        return self._ok(rid, value=self.ctx.stats(f["after"], f["limit"]))

    async def op_ls(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        keys = self.master.keys(f["prefix"])
        page, more = wire.page_of_keys(keys, f["after"], f["limit"], self.ctx.config.max_frame // 2)
        return self._ok(rid, value=page, total=len(keys), more=more)

    async def op_wait(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        # watch the connection meanwhile: a client gone mid-wait frees its session at once
        return self._ok(rid, value=await self.conn.watching_peer(self.ctx.wait_for(f["keys"], f["timeout"])))

    def require_shm(self) -> None:
        if self.transport not in ("shm", "cuda_ipc"):  # both map the daemon's shared memory
            raise TransportError(f"region mode needs the shm transport; this connection uses {self.transport}")
