"""The daemon's op tables against the one wire schema: every declared op has a handler in some daemon, every
handler's op is declared, and building a cluster daemon changes nothing global."""

from __future__ import annotations

import asyncio
import copy
import socket

from kvstore.cluster.config import ClusterConfig
from kvstore.cluster.daemon.node import ClusterServer
from kvstore.cluster.daemon.session import ClusterSession
from kvstore.daemon.arena_ops import ArenaOps
from kvstore.daemon.config import ServerConfig
from kvstore.daemon.gpu_ops import GpuOps
from kvstore.daemon.server import Server
from kvstore.daemon.session import Handler, Session
from kvstore.daemon.ucx_ops import UcxOps
from kvstore.protocol import wire

_CONFIG = ServerConfig(listen=("tcp://127.0.0.1:1",), token="t")


def _cluster_server() -> ClusterServer:
    cfg = ClusterConfig(redis_url="redis://127.0.0.1:1/0", node_id="n1", advertise="tcp://127.0.0.1:1")
    return ClusterServer(_CONFIG, cfg)


def _session(cls: type[Session], server: Server) -> tuple[Session, dict[str, Handler]]:
    """A session of ``server`` (not started: the table needs no daemon memory) over a real socket pair."""
    async def build() -> tuple[Session, dict[str, Handler]]:
        a, b = socket.socketpair()
        with a, b:
            session = cls(server, a, "test")
            return session, session.handlers()
    return asyncio.run(build())


def test_every_declared_op_is_served_and_every_served_op_declared():
    _, single = _session(Session, Server(_CONFIG))
    _, cluster = _session(ClusterSession, _cluster_server())
    assert set(single) <= set(cluster)
    assert set(cluster) == set(wire.SCHEMA)
    assert set(cluster) - set(single) == {"peer_get", "peer_evict"}


def test_handlers_are_the_subclass_overrides_and_the_op_groups():
    session, table = _session(ClusterSession, _cluster_server())
    assert table["get"].__func__ is ClusterSession.op_get
    assert table["hello"].__func__ is ClusterSession.op_hello  # adds the index lease
    assert table["put"].__func__ is ClusterSession.op_put
    assert table["arena_commit"].__func__ is ClusterSession.op_arena_commit
    assert table["ping"].__func__ is Session.op_ping
    # the op groups are handler objects the session owns
    assert table["arena"].__self__ is session.arena and isinstance(session.arena, ArenaOps)
    assert table["cuda_put"].__self__ is session.gpu and isinstance(session.gpu, GpuOps)
    assert table["ucx_claim"].__self__ is session.ucx and isinstance(session.ucx, UcxOps)


def test_building_a_cluster_daemon_leaves_the_schema_alone():
    before = copy.copy(wire.SCHEMA)
    _cluster_server()
    assert wire.SCHEMA == before
