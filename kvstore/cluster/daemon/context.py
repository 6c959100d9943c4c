"""ClusterContext: what a cluster member's sessions and its remote reader may use of the node.

The daemon's :class:`~kvstore.daemon.context.DaemonContext` plus the cluster's state: which objects are this
node's own (``local``, ``doomed``), the directory, the publisher, the remote reader and the cluster options.
:class:`~kvstore.cluster.daemon.node.ClusterServer` implements it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvstore.daemon.context import DaemonContext

if TYPE_CHECKING:
    from kvstore.cluster.config import ClusterConfig
    from kvstore.cluster.daemon.publisher import Publisher
    from kvstore.cluster.daemon.reader import RemoteReader
    from kvstore.cluster.directory import AsyncDirectory


class ClusterContext(DaemonContext, Protocol):
    cluster: ClusterConfig
    node_id: str
    doomed: dict[str, int]  # dropped while leased: key -> replica id
    directory: AsyncDirectory
    publisher: Publisher
    remote: RemoteReader

    def local(self, key: str) -> bool:
        """This node serves its own copy of ``key``."""
        ...

    async def ensure_fresh(self) -> None: ...

    async def remove_everywhere(self, keys: list[str]) -> list[int]: ...
