"""``kvstore serve --cluster redis://HOST:PORT/DB --node-id NAME --advertise tcp://ADDR:PORT``: the serve options
of a cluster member, and running one. Importing this module imports neither Redis nor the daemon."""

from __future__ import annotations

import argparse
import socket

from kvstore.errors import InvalidArgumentError


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster", "join a cluster whose membership and object directory live in Redis")
    g.add_argument("--cluster", metavar="REDIS_URL",
                   help="redis://[:PASSWORD@]HOST:PORT/DB (rediss:// for TLS, or "
                        "redis+sentinel://S1:26379,S2:26379/SERVICE/DB): join this cluster")
    g.add_argument("--node-id", help="this daemon's unique name in the cluster (default: the hostname)")
    g.add_argument("--advertise", metavar="URL",
                   help="tcp://ADDR:PORT other nodes reach this daemon at (default: the first --listen tcp:// address)")
    g.add_argument("--node-ttl", type=float, default=10.0,
                   help="seconds without a heartbeat before this node counts as dead (default %(default)s)")
    g.add_argument("--peer-timeout", type=float, default=5.0,
                   help="bound in seconds on one call to another node (default %(default)s)")
    g.add_argument("--redis-timeout", type=float, default=2.0,
                   help="bound in seconds on one Redis command (default %(default)s)")
    g.add_argument("--peer-transport", default="auto", choices=["auto", "tcp", "shm", "ucx"],
                   help="data path to other nodes: auto = shared memory on this host, else UCX where both ends "
                        "run it, else tcp")
    g.add_argument("--peer-compression", default="off", choices=["off", "lz4", "lz4-shuffle", "auto"],
                   help="lz4 on the tcp path of reads from other nodes: auto = only while this node measures "
                        "that it pays (link slower than lz4 on this data, and the data compresses) "
                        "(default %(default)s)")
    g.add_argument("--cluster-namespace", default="kvstore", help="prefix of every Redis key (default %(default)s)")
    g.add_argument("--no-directory-sync", action="store_true",
                   help="acknowledge puts before their directory entry is written (faster; a reader on another "
                        "node may miss a key for a millisecond or so after its put returned)")


def cluster_config(args: argparse.Namespace, listen: tuple):
    from kvstore.cluster.config import ClusterConfig
    from kvstore.protocol.url import Endpoint

    advertise = args.advertise
    if advertise is None:
        tcp = [ep for ep in map(Endpoint.parse, listen) if ep.scheme == "tcp"]
        if not tcp:
            raise InvalidArgumentError("a cluster member needs a tcp:// --listen address (or --advertise)")
        advertise = str(tcp[0])
    return ClusterConfig(redis_url=args.cluster, node_id=args.node_id or socket.gethostname().split(".")[0],
                         advertise=advertise, node_ttl=args.node_ttl, peer_timeout=args.peer_timeout,
                         redis_timeout=args.redis_timeout, namespace=args.cluster_namespace,
                         peer_transport=args.peer_transport, directory_sync=not args.no_directory_sync,
                         peer_compression=args.peer_compression)


def serve(args: argparse.Namespace, config) -> int:
    """Run a cluster member with the single-node ``config`` (a ServerConfig) until SIGTERM/SIGINT."""
    from kvstore.cluster.config import require_redis

    require_redis()  # before anything is bound or allocated
    from kvstore.cluster.daemon.node import ClusterServer
    from kvstore.daemon.server import run

    return run(config, ClusterServer, cluster=cluster_config(args, config.listen))
