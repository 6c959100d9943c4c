"""kvstore.cluster: many daemons, one store. Membership and the object directory live in Redis; payload bytes go
node to node over the transports, never through Redis. See docs/cluster.md.

``kvstore serve --cluster redis://HOST:PORT/DB --node-id NAME`` runs a member; ``kvstore.connect(
"kvcluster://HOST:PORT/DB")`` is a client of the whole cluster. Importing this package loads nothing else.
"""

from __future__ import annotations

_LAZY = {
    "ClusterStore": "kvstore.cluster.store",
    "ClusterServer": "kvstore.cluster.daemon.node",
    "ClusterConfig": "kvstore.cluster.config",
}


def __getattr__(name: str):
    try:
        module_name = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'kvstore.cluster' has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


__all__ = list(_LAZY)
