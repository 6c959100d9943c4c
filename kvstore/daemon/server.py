"""Server: the ``kvstore serve`` daemon — listeners, segments, the shared-memory index, housekeeping and a
graceful shutdown. One asyncio loop (uvloop when installed) owns the master, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Coroutine
from os.path import dirname
from typing import TYPE_CHECKING, Any

from kvstore.core.master import LRUPolicy, Master, Replica, Tier
from kvstore.daemon.config import ServerConfig
from kvstore.daemon.disk_io import DiskService
from kvstore.daemon.limits import ConnectionLimits
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.quarantine import Quarantine
from kvstore.daemon.session import Session
from kvstore.daemon.ucx_ops import start_ucx
from kvstore.errors import InvalidArgumentError, TransportError
from kvstore.gpu.memory import GpuMemory
from kvstore.memory import index as shm_index
from kvstore.memory.segment import SegmentSet, reap_orphans
from kvstore.memory.shm import SharedMemory
from kvstore.protocol.credentials import ensure_private_dir
from kvstore.protocol.url import Endpoint, host_id, runtime_dir
from kvstore.transports.tcp import tune

if TYPE_CHECKING:
    from kvstore.transports.ucx_server import UcxDataServer

log = logging.getLogger("kvstore.daemon.server")
#: connections in one stats reply (and one per 4 KiB of --max-frame): names cut to 128 characters, 4 bytes
#: each at most, fit a frame
CONNECTIONS_PAGE = 256
SERVED_TRANSPORTS = ("shm", "tcp")  # always served; "ucx" too while a --listen ucx:// endpoint runs, and
#                                     "cuda_ipc" while the daemon holds GPU segments (--gpu-capacity)
#: transport="auto": the first of these that the daemon serves and the client offers. "cuda_ipc" (offered by
#: clients with torch) hands host buffers on to the shm path itself, so it goes first.
SAME_HOST_PREFERENCE = ("cuda_ipc", "shm")
REMOTE_PREFERENCE = ("ucx", "tcp")
SAME_HOST_ONLY = ("shm", "cuda_ipc")  # they map the daemon's memory
#: accept() errors that mean "out of descriptors or memory for now": back off and retry, never stop listening
_ACCEPT_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_SERVE_HINTS = {"ucx": " (start it with --listen ucx://host:port)", "cuda_ipc": " (start it with --gpu-capacity)"}


class _Publisher:
    """Master listener: forwards to the server's ``on_published`` / ``on_unpublished`` hooks."""

    def __init__(self, server: Server):
        self.server = server

    def published(self, replica: Replica) -> None:
        self.server.on_published(replica)

    def unpublished(self, replica: Replica) -> None:
        self.server.on_unpublished(replica)

    def moving(self, replica: Replica) -> None:
        self.server.on_moving(replica)

    def moved(self, replica: Replica) -> None:
        self.server.on_moved(replica)


class Server:
    """The daemon. Extension points for subclasses (e.g. a cluster node): ``session_class``,
    ``on_published`` / ``on_unpublished`` (called synchronously by the master on the loop), and
    ``start`` / ``shutdown`` (call super)."""

    session_class: type[Session] = Session
    node_id = ""  # a cluster member's node id (proven in the handshake, kvstore.daemon.handshake)
    # Created by start(), once the listeners are bound (a daemon that cannot listen leaves no memory behind);
    # sessions see them through the DaemonContext protocol (kvstore.daemon.context).
    master: Master
    segments: SegmentSet
    index: shm_index.IndexWriter
    metrics: Metrics
    quarantine: Quarantine

    def __init__(self, config: ServerConfig):
        self.config = config
        self.host_id = host_id()
        self.pid = os.getpid()
        self.generation = int.from_bytes(os.urandom(8), "little") | 1  # this daemon's life, as its index shows it
        self.sessions: set[Session] = set()
        self.session_ids: dict[Session, int] = {}  # in the order they came: what stats pages its connections by
        self._session_serials = itertools.count(1)
        self.connections = ConnectionLimits(config.limits)
        self.ucx: UcxDataServer | None = None  # while a --listen ucx:// endpoint runs
        self.gpu: GpuMemory | None = None  # with --gpu-capacity
        self.disk: DiskService | None = None  # with --disk-path
        self.waiters: dict[str, list[asyncio.Future[str]]] = {}
        self.draining = False
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = asyncio.Event()
        self._owner_fd: int | None = None  # a pidfd of the --exit-with process

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        if cfg.insecure and cfg.token is None:
            log.warning("--insecure: TCP/UCX listeners take no token; anyone who can reach them can read, write "
                        "and remove every object")
        self._bind_all()  # first: a daemon that cannot listen must not leave memory behind
        for name in reap_orphans():
            log.info("removed shared memory %s left by a dead daemon", name)
        try:
            self._create_memory()
            self.metrics = Metrics(self.stats if cfg.metrics_port is not None else None)
            if cfg.metrics_port is not None:
                self.metrics.serve(cfg.metrics_port)
            self._start_data_endpoints()
        except BaseException:
            self._close_listeners()
            self._release_memory()
            raise
        loop = asyncio.get_running_loop()
        for lsock, ep in zip(self._listeners, cfg.control_endpoints, strict=True):
            self._spawn(self._accept(lsock, ep))
        self._spawn(self._housekeeping())
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        if cfg.exit_with is not None:
            self._watch_owner(loop, cfg.exit_with)
        log.info("serving %s, capacity %d bytes, segments %s", ", ".join(map(str, cfg.endpoints)), cfg.capacity,
                 [s.name for s in self.segments.segments])

    def _watch_owner(self, loop: asyncio.AbstractEventLoop, pid: int) -> None:
        """Stop as on SIGTERM once process ``pid`` exits: its pidfd becomes readable then (no polling)."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            log.warning("the process this daemon should exit with (--exit-with %d) is gone: stopping", pid)
            self.request_stop()
            return
        self._owner_fd = fd

        def owner_exited() -> None:
            loop.remove_reader(fd)
            log.info("process %d (--exit-with) exited: stopping", pid)
            self.request_stop()

        loop.add_reader(fd, owner_exited)

    def _start_data_endpoints(self) -> None:
        for ep in self.config.endpoints:
            if ep.scheme == "ucx":
                self.ucx = start_ucx(ep, asyncio.get_running_loop())

    def _bind_all(self) -> None:
        try:
            for ep in self.config.control_endpoints:
                self._listeners.append(self._bind(ep))
        except BaseException:
            self._close_listeners()
            raise

    def _close_listeners(self) -> None:
        for lsock, ep in zip(self._listeners, self.config.control_endpoints, strict=False):
            lsock.close()
            if ep.scheme == "unix":
                _remove_stale_socket(ep.path)
        self._listeners.clear()

    def _release_memory(self) -> None:
        if self.ucx is not None:  # first: nothing may still move bytes in or out of the segments
            self.ucx.close()
            self.ucx = None
        if self.gpu is not None:  # waits for staging copies and unpins the host segments before they go
            self.gpu.close()
            self.gpu = None
        if self.disk is not None:  # its queued writes copy from their own staging buffers, not segments
            self.disk.close(self.config.grace)
            self.disk = None
        index_shm = getattr(self, "_index_shm", None)
        if index_shm is not None:
            self.index.stop()  # clients that still map it stop reading it
            index_shm.unlink()
            index_shm.close()
        segments = getattr(self, "segments", None)
        if segments is not None:
            segments.close()

    def _create_memory(self) -> None:
        cfg = self.config
        self.segments = SegmentSet([cfg.capacity])
        slots = shm_index.slots_for_capacity(cfg.capacity)
        self._index_shm = SharedMemory.create(f"{self.segments.stem}-index", shm_index.table_bytes(slots))
        self.index = shm_index.IndexWriter(self._index_shm.buf, slots, generation=self.generation)
        sizes, tiers = [cfg.capacity], [Tier.HOST]
        if cfg.gpu_capacity:
            self.gpu = GpuMemory(cfg.device or 0, [cfg.gpu_capacity], first_id=len(sizes), host=self.segments)
            sizes.append(cfg.gpu_capacity)
            tiers.append(Tier.GPU)
            log.info("GPU segments: %d bytes on GPU %d (%s); %d bytes of host segments page-locked",
                     cfg.gpu_capacity, self.gpu.device, self.gpu.bus_id, self.gpu.pinned_bytes)
        if cfg.disk is not None:
            self.disk = DiskService(cfg.disk, self.segments)
        self.master = Master(sizes, high_watermark=cfg.high_watermark, low_watermark=cfg.low_watermark,
                             policy=LRUPolicy(self.index.atime), listener=_Publisher(self), tiers=tiers,
                             quota=cfg.quota,
                             on_evict=self.disk.tiering.evicting if self.disk is not None else None,
                             mover=self.segments.move if cfg.relocate else None)
        self.quarantine = Quarantine(self.master)
        if self.disk is not None:
            self.disk.attach(self.master)

    def _bind(self, ep: Endpoint) -> socket.socket:
        if ep.scheme == "unix":
            if dirname(ep.path) == runtime_dir():  # the default place: make sure nobody else owns it
                ensure_private_dir(runtime_dir())
            _refuse_if_live(ep.path)
            _remove_stale_socket(ep.path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)  # created 0600: no window where others could connect
            try:
                sock.bind(ep.path)
            finally:
                os.umask(old)
        else:
            family = socket.AF_INET6 if ":" in ep.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((ep.host, ep.port))
        sock.listen(256)
        sock.setblocking(False)
        return sock

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, lsock: socket.socket, ep: Endpoint) -> None:
        """Accept connections until the daemon drains. Out of descriptors (EMFILE/ENFILE) or memory, it logs,
        backs off and retries: it recovers once descriptors free up, and never stops listening."""
        loop = asyncio.get_running_loop()
        backoff = 0.0
        while not self.draining:
            try:
                conn, addr = await loop.sock_accept(lsock)
            except OSError as exc:
                if self.draining:
                    return
                if exc.errno in _ACCEPT_EXHAUSTED:
                    if not backoff:
                        log.warning("accept on %s failed: %s; backing off and retrying (%d sessions open)", ep,
                                    exc, len(self.sessions))
                    backoff = min(1.0, 2 * backoff or 0.05)
                else:
                    log.warning("accept on %s failed: %s; retrying", ep, exc)
                    backoff = 0.05
                await asyncio.sleep(backoff)
                continue
            if backoff:
                log.info("accept on %s works again", ep)
                backoff = 0.0
            try:
                self._admit(conn, addr, ep)
            except Exception:  # a bug must not end the accept loop
                log.exception("could not set up a connection on %s", ep)
                conn.close()

    def _admit(self, conn: socket.socket, addr: Any, ep: Endpoint) -> None:
        conn.setblocking(False)
        tune(conn)
        peer = f"{ep}" if ep.scheme == "unix" else f"tcp://{addr[0]}:{addr[1]}"
        session = self.session_class(self, conn, peer)
        if not self.connections.admit(session.peer_key, peer):
            conn.close()
            return
        self.sessions.add(session)
        self.session_ids[session] = next(self._session_serials)
        self._spawn(session.run())

    async def _housekeeping(self) -> None:
        while not self.draining:
            await asyncio.sleep(0.5)
            self.index.beat()
            self.quarantine.poll()
            self._cut_stalled_transfers()
            self.master.expire()
            silent = set(self.master.silent_clients(self.config.heartbeat_timeout))
            for session in list(self.sessions):
                if session.client in silent and not session.busy:  # a long wait() is not silence
                    log.warning("client %s silent for over %.0f s: dropping it", session.peer,
                                self.config.heartbeat_timeout)
                    session.close()

    def _cut_stalled_transfers(self) -> None:
        now, limit = asyncio.get_running_loop().time(), self.config.transfer_timeout
        for session in list(self.sessions):
            stalled = session.stalled_for(now)
            if stalled > limit:
                log.warning("client %s: payload transfer made no progress for %.0f s (--transfer-timeout %g); "
                            "cutting the connection, its reservation and lease go with it", session.peer, stalled,
                            limit)
                session.close()

    def request_stop(self) -> None:
        self._stopped.set()

    async def serve_forever(self) -> None:
        """Run until ``request_stop`` (SIGTERM/SIGINT), then shut down gracefully."""
        await self._stopped.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop accepting, let in-flight requests finish (up to the grace period), then free everything."""
        log.info("shutting down: %d sessions", len(self.sessions))
        self.draining = True
        for lsock in self._listeners:
            lsock.close()
        deadline = time.monotonic() + self.config.grace
        while any(s.busy for s in self.sessions) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for session in list(self.sessions):
            session.close()
        self.quarantine.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for ep in self.config.endpoints:
            if ep.scheme == "unix":
                _remove_stale_socket(ep.path)
        self._release_memory()
        if self._owner_fd is not None:
            asyncio.get_running_loop().remove_reader(self._owner_fd)
            os.close(self._owner_fd)
            self._owner_fd = None
        log.info("stopped")

    # ---- master hooks -------------------------------------------------------------------------------
    def on_published(self, replica: Replica) -> None:
        """A version became visible: show it in the shared-memory index and wake waiters."""
        meta = replica.meta
        if self.master.tier_of(replica) is Tier.HOST:  # clients read GPU-resident objects through the daemon
            self.index.publish(meta.key, replica.id, replica.segment, replica.offset, meta.size,
                               replica.expires_at, meta.checksum)
        if self.disk is not None:
            self.disk.tiering.published(replica)
        for fut in self.waiters.pop(meta.key, ()):
            if not fut.done():
                fut.set_result(meta.key)

    def on_moving(self, replica: Replica) -> None:
        """The master is about to copy a host object elsewhere (the ranges may overlap): take it out of the
        shared-memory index first, so that a same-host reader copying it now fails its seqlock check and retries
        (finding no slot, it asks the daemon, which answers after the move)."""
        self.index.unpublish(replica.key, replica.id)

    def on_moved(self, replica: Replica) -> None:
        """The relocated object's bytes are at its new offset: show it there again."""
        meta = replica.meta
        self.index.publish(meta.key, replica.id, replica.segment, replica.offset, meta.size, replica.expires_at,
                           meta.checksum)

    def on_unpublished(self, replica: Replica) -> None:
        self.index.unpublish(replica.key, replica.id)
        if self.disk is not None:
            self.disk.tiering.unpublished(replica)

    # ---- services for sessions ----------------------------------------------------------------------
    @property
    def served_transports(self) -> tuple[str, ...]:
        return SERVED_TRANSPORTS + (("ucx",) if self.ucx is not None else ()) + \
            (("cuda_ipc",) if self.gpu is not None else ())

    def choose_transport(self, requested: str, client_host: str, peer: str,
                         offered: list[str] | tuple[str, ...] = ()) -> str:
        """The data path of a new connection. ``offered``: the transports the client can run (a client that
        offers none gets shm or tcp)."""
        same_host = client_host == self.host_id
        served = self.served_transports
        if requested == "auto":
            prefs = (SAME_HOST_PREFERENCE if same_host else REMOTE_PREFERENCE) + ("tcp",)
            return next(t for t in prefs if t in served and (t in offered or t in SERVED_TRANSPORTS))
        if requested not in served:
            raise TransportError(f"transport {requested!r} is not served here; this daemon serves "
                                 f"{list(served)}{_SERVE_HINTS.get(requested, '')}")
        if requested in SAME_HOST_ONLY and not same_host:
            where = client_host or "a host (or in a process) the daemon cannot verify"
            raise TransportError(f"transport {requested!r} needs the client on the daemon's host ({self.host_id}); "
                                 f"client {peer} is on {where}")
        return requested

    def session_closed(self, session: Session) -> None:
        if session in self.sessions:
            self.sessions.discard(session)
            self.session_ids.pop(session, None)
            self.connections.release(session.peer_key)

    def index_info(self) -> list[Any]:
        return [self._index_shm.name, self._index_shm.size]

    def stats(self, after: int = 0, limit: int = CONNECTIONS_PAGE) -> dict[str, Any]:
        """The daemon's stats with one page of its connections: at most ``limit`` (and CONNECTIONS_PAGE) of
        those that came after the one with id ``after`` (0: from the first), and whether more follow."""
        out = self.master.stats()
        out["clients_by_transport"] = {}
        for s in self.sessions:
            out["clients_by_transport"][s.transport] = out["clients_by_transport"].get(s.transport, 0) + 1
        later = sorted((sid, s) for s, sid in self.session_ids.items() if sid > after)
        page = later[:max(1, min(limit, CONNECTIONS_PAGE, self.config.max_frame >> 12))]
        # bounded whatever the clients call themselves: a page of names cut to 128 characters fits a frame
        out["connections"] = [{"id": sid, "client": _cut(s.name), "peer": _cut(s.peer), "transport": s.transport,
                               "path": _cut(s.data_path)} for sid, s in page]
        out["connections_more"] = len(later) > len(page)
        out["connections_total"] = len(self.sessions)
        out["transports"] = list(self.served_transports)
        if self.gpu is not None:
            out["gpu"] = self.gpu.info()
        if self.disk is not None:
            out.update(self.disk.stats())
        out["listen"] = [str(ep) for ep in self.config.endpoints]
        out["pid"] = self.pid
        return out

    async def wait_for(self, keys: list[str], timeout: float) -> str | None:
        for key in keys:
            if self.master.exists(key) or (self.disk is not None and self.disk.contains(key)):
                return key
        fut = self.add_waiter(keys)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self.forget_waiter(keys, fut)

    def add_waiter(self, keys: list[str]) -> asyncio.Future[str]:
        """A future resolved (by ``on_published``) with the first of ``keys`` to be committed."""
        fut = asyncio.get_running_loop().create_future()
        for key in keys:
            self.waiters.setdefault(key, []).append(fut)
        return fut

    def forget_waiter(self, keys: list[str], fut: asyncio.Future[str]) -> None:
        for key in keys:
            futs = self.waiters.get(key)
            if futs and fut in futs:
                futs.remove(fut)
                if not futs:
                    del self.waiters[key]


def _cut(text: str, most: int = 128) -> str:
    return text if len(text) <= most else text[:most] + f"...(+{len(text) - most})"


def _remove_stale_socket(path: str) -> None:
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


def _refuse_if_live(path: str) -> None:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # nothing listening: a leftover socket file at most
    finally:
        probe.close()
    raise InvalidArgumentError(f"another daemon is already listening on unix://{path}")


def run(config: ServerConfig, server_class: type[Server] = Server, **server_kwargs: Any) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit status."""
    async def main() -> None:
        server = server_class(config, **server_kwargs)
        await server.start()
        await server.serve_forever()

    try:
        import uvloop
    except ImportError:  # optional (the fast extra): asyncio's own loop then
        asyncio.run(main())
    else:
        uvloop.run(main())
    return 0
