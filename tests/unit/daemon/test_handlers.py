"""The daemon's op tables against the one wire schema: every declared op has a handler in some daemon, every
handler's op is declared, and building a cluster daemon changes nothing global."""

from __future__ import annotations

import copy

from kvstore.cluster.config import ClusterConfig
from kvstore.cluster.daemon.node import ClusterServer
from kvstore.cluster.daemon.session import ClusterSession
from kvstore.daemon.config import ServerConfig
from kvstore.daemon.session import Session
from kvstore.protocol import wire


def _ops(cls: type[Session]) -> set[str]:
    return set(cls.handlers(cls.__new__(cls)))  # the table needs no connection


def test_every_declared_op_is_served_and_every_served_op_declared():
    single, cluster = _ops(Session), _ops(ClusterSession)
    assert single <= cluster
    assert cluster == set(wire.SCHEMA)
    assert cluster - single == {"peer_get", "peer_evict"}


def test_handlers_are_the_subclass_overrides():
    session = ClusterSession.__new__(ClusterSession)
    table = session.handlers()
    assert table["get"].__func__ is ClusterSession.op_get
    assert table["hello"].__func__ is ClusterSession.op_hello  # adds the index lease
    assert table["put"].__func__ is ClusterSession.op_put
    assert table["ping"].__func__ is Session.op_ping


def test_building_a_cluster_daemon_leaves_the_schema_alone():
    before = copy.copy(wire.SCHEMA)
    cfg = ClusterConfig(redis_url="redis://127.0.0.1:1/0", node_id="n1", advertise="tcp://127.0.0.1:1")
    ClusterServer(ServerConfig(listen=("tcp://127.0.0.1:1",), token="t"), cfg)
    assert wire.SCHEMA == before
