"""DaemonContext: what a session and its op handlers may use of the daemon; SessionContext: what a session's
op groups may use of the session.

Sessions depend on this narrow protocol, not on :class:`~kvstore.daemon.server.Server`: the master (index,
leases, eviction), the host segments, the metrics, the optional GPU and UCX services, and a handful of calls.
The server implements it; a cluster node extends it (``kvstore.cluster.daemon.context``).

A session (:class:`~kvstore.daemon.session.Session`) owns its op groups (``ArenaOps``, ``GpuOps``, ``UcxOps``,
``DiskOps``: handler objects, each in its own module) and hands each itself as a :class:`SessionContext`: the
daemon's context, the connection and what the handshake settled, all read-only for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvstore.errors import LeaseError

if TYPE_CHECKING:
    import socket

    from kvstore.core.master import Master
    from kvstore.daemon.config import ServerConfig
    from kvstore.daemon.connection import Connection
    from kvstore.daemon.disk_io import DiskService
    from kvstore.daemon.metrics import Metrics
    from kvstore.daemon.quarantine import Quarantine
    from kvstore.gpu.memory import GpuMemory
    from kvstore.memory.segment import SegmentSet
    from kvstore.transports.ucx_server import UcxDataServer


class DaemonContext(Protocol):
    config: ServerConfig
    host_id: str
    pid: int
    node_id: str  # "" unless a cluster member
    generation: int  # random per daemon start; its shared-memory index shows it to lock-free readers
    master: Master
    segments: SegmentSet
    metrics: Metrics
    quarantine: Quarantine  # revokes clients; holds the space of live same-host ones until they exit
    gpu: GpuMemory | None  # with --gpu-capacity
    disk: DiskService | None  # with --disk-path
    ucx: UcxDataServer | None  # while a --listen ucx:// endpoint runs
    draining: bool

    @property
    def served_transports(self) -> tuple[str, ...]: ...

    def choose_transport(self, requested: str, client_host: str, peer: str,
                         offered: list[str] | tuple[str, ...] = ()) -> str: ...

    def index_info(self) -> list[Any]: ...

    def stats(self, after: int = 0, limit: int = 256) -> dict[str, Any]:
        """The daemon's stats with a page of its connections (those with an id above ``after``)."""
        ...

    async def wait_for(self, keys: list[str], timeout: float) -> str | None: ...

    def session_closed(self, session: Any) -> None:
        """Forget a session that ended."""
        ...


class SessionContext(Protocol):
    """What an op group may use of its session (read-only)."""

    @property
    def ctx(self) -> DaemonContext: ...

    @property
    def master(self) -> Master: ...

    @property
    def segments(self) -> SegmentSet: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def conn(self) -> Connection:
        """The framed socket: replies, payload bytes."""
        ...

    @property
    def sock(self) -> socket.socket: ...

    @property
    def client(self) -> int | None:
        """The client's id in the master: None before its hello and once the session closed."""
        ...

    @property
    def transport(self) -> str:
        """The data path the hello settled ("none" before it)."""
        ...

    @property
    def client_host(self) -> str:
        """The client's host as far as the daemon can tell ("" for a remote or unverified one)."""
        ...

    def require_shm(self) -> None:
        """TransportError unless this connection maps the daemon's shared memory."""
        ...


def client_of(session: SessionContext) -> int:
    """The session's client id; LeaseError (the master's own for an unknown client) once there is none: every
    op but the handshake's runs after hello, so only a session closed meanwhile has none."""
    client = session.client
    if client is None:
        raise LeaseError(f"client {client} is not registered (dropped after a disconnect?)")
    return client
