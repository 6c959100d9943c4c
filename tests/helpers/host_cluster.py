"""Cluster mode across two namespace hosts (tests/integration/hosts): Redis on host a's end of the link and one
``kvstore serve --cluster`` per host, each advertising its own end of the link, so node-to-node traffic and
host b's Redis traffic cross the link (and stop when it is taken down).

    with cluster_fleet() as fleet:           # skips the test where namespaces cannot be made
        fleet.client(fleet.b, fleet.unix_url, "get", "k", 1000, 7)
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from host_fleet import Fleet, child_env, token_hosts

from kvstore.testing import hosts as H

REDIS_PORT = 6379
NODE_TTL = 3.0
PEER_TIMEOUT = 2.0
REDIS_TIMEOUT = 1.0


class ClusterFleet(Fleet):
    """Redis on a's end of the link; one ``kvstore serve --cluster`` per host (node ``n<host>``)."""

    daemons: dict[str, subprocess.Popen]
    redis: subprocess.Popen
    node_ttl: float = NODE_TTL
    peer_timeout: float = PEER_TIMEOUT
    ucx: bool = False  # each node also listens on ucx://<its link address>:7071 and reads peers over UCX

    def redis_url(self) -> str:
        return f"redis://{self.link.address(self.a)}:{REDIS_PORT}/0"

    def start_redis(self) -> None:
        self.redis = self.a.popen(["redis-server", "--port", str(REDIS_PORT), "--bind", self.link.address(self.a),
                                   "--save", "", "--appendonly", "no", "--dir", "/tmp", "--protected-mode", "no"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        assert self.a.wait_listening(REDIS_PORT, 30, self.redis), "redis-server did not start on host a"

    def start_node(self, host: H.Host) -> None:
        addr = f"tcp://{self.link.address(host)}:7070"
        cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", self.unix_url, "--listen", addr,
               "--token-file", "/tmp/token", "--capacity", "128MiB", "--log-level", "warning",
               "--cluster", self.redis_url(), "--node-id", f"n{host.name}", "--advertise", addr,
               "--node-ttl", str(self.node_ttl), "--peer-timeout", str(self.peer_timeout), "--redis-timeout",
               str(REDIS_TIMEOUT), "--transfer-timeout", "2"]
        if self.ucx:
            cmd += ["--listen", f"ucx://{self.link.address(host)}:7071", "--peer-transport", "ucx"]
        with open(host.path("/tmp/daemon.log"), "ab") as log:
            self.daemons[host.name] = host.popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # registered in Redis: the cluster can find it
            if self.record(host.name).get("pid") == str(self.daemons[host.name].pid):
                return
            assert self.daemons[host.name].poll() is None, self.log(host)
            time.sleep(0.2)
        raise AssertionError(f"node n{host.name} did not register:\n{self.log(host)}")

    def record(self, name: str) -> dict[str, str]:
        """Node ``n<name>``'s record as Redis holds it now ({} once it lapsed), asked from host a."""
        out = self.a.run(["redis-cli", "-h", self.link.address(self.a), "-p", str(REDIS_PORT), "hgetall",
                          f"kvstore:node:n{name}"], check=False).stdout.splitlines()  # raw: one field a line
        return dict(zip(out[0::2], out[1::2], strict=False))

    def log(self, host: H.Host) -> str:
        with open(host.path("/tmp/daemon.log"), errors="replace") as f:
            return f.read()

    def node_stats(self, host: H.Host) -> dict:
        return self.client(host, self.unix_url, "stats")[0]

    def stop_nodes(self) -> None:
        for name, proc in self.daemons.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) == 0, self.log(self.hosts[name])


@contextlib.contextmanager
def cluster_fleet(node_ttl: float = NODE_TTL, peer_timeout: float = PEER_TIMEOUT,
                  ucx: bool = False) -> Iterator[ClusterFleet]:
    """Hosts a and b (1 Gbit/s link), one token on both, Redis and node ``na`` on a, node ``nb`` on b; all removed
    at exit. Skips (pytest) where namespaces cannot be made."""
    with token_hosts() as hosts:
        fleet = ClusterFleet(hosts, hosts.link("a", "b"))
        fleet.daemons, fleet.node_ttl, fleet.peer_timeout, fleet.ucx = {}, node_ttl, peer_timeout, ucx
        fleet.start_redis()
        fleet.start_node(fleet.a)
        fleet.start_node(fleet.b)
        yield fleet
        fleet.stop_nodes()
