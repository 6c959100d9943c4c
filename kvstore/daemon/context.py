"""DaemonContext: what a session and its op handlers may use of the daemon.

Sessions depend on this narrow protocol, not on :class:`~kvstore.daemon.server.Server`: the master (index,
leases, eviction), the host segments, the metrics, the optional GPU and UCX services, and a handful of calls.
The server implements it; a cluster node extends it (``kvstore.cluster.daemon.context``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvstore.core.master import Master
    from kvstore.daemon.config import ServerConfig
    from kvstore.daemon.disk_io import DiskService
    from kvstore.daemon.metrics import Metrics
    from kvstore.daemon.quarantine import Quarantine
    from kvstore.gpu.memory import GpuMemory
    from kvstore.memory.segment import SegmentSet


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
    ucx: Any  # kvstore.transports.ucx_server.UcxDataServer while a --listen ucx:// endpoint runs
    draining: bool

    @property
    def served_transports(self) -> tuple[str, ...]: ...

    def choose_transport(self, requested: str, client_host: str, peer: str, offered: list[str] | tuple = ()
                         ) -> str: ...

    def index_info(self) -> list: ...

    def stats(self, after: int = 0, limit: int = 256) -> dict:
        """The daemon's stats with a page of its connections (those with an id above ``after``)."""
        ...

    async def wait_for(self, keys: list[str], timeout: float) -> str | None: ...

    def session_closed(self, session: Any) -> None:
        """Forget a session that ended."""
        ...
