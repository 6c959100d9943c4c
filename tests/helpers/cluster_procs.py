"""A cluster of real processes for the tests: a throwaway redis-server (optionally watched by a Sentinel) and
``kvstore serve --cluster`` daemons registered in it. tests/integration/cluster/test_cluster.py and the
backend contract suite (the ``cluster`` store kind of tests/conftest.py) use it."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import zlib

import numpy as np
import redis
from conftest import Daemon, free_port, wait_until

import kvstore

TTL = 2.0           # node TTL of the test daemons
PEER_TIMEOUT = 1.0  # bound on one node-to-node call, and on one client call in these tests
NS = "kvstore"


def payload(key: str, size: int) -> bytes:
    """Deterministic bytes for a key (the same on every reader)."""
    return np.random.default_rng(zlib.crc32(key.encode())).integers(0, 256, size, dtype=np.uint8).tobytes()


class RedisServer:
    """A throwaway redis-server on a loopback port (no persistence: a restart loses everything)."""

    def __init__(self, workdir: str, password: str | None = None):
        self.workdir, self.password = workdir, password
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", self.workdir]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        assert wait_until(self._pong, 10), "redis-server did not start"
        return self

    def _pong(self) -> bool:
        try:
            return self.client().ping()
        except redis.RedisError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Sentinel:
    """A redis-server in Sentinel mode watching ``redis`` as service ``kvs``."""

    def __init__(self, workdir: str, server: RedisServer):
        self.port = free_port()
        self.conf = os.path.join(workdir, f"sentinel-{self.port}.conf")
        with open(self.conf, "w") as f:
            f.write(f"port {self.port}\nbind 127.0.0.1\ndir {workdir}\n"
                    f"sentinel monitor kvs 127.0.0.1 {server.port} 1\n")
        self.proc = subprocess.Popen(["redis-server", self.conf, "--sentinel"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_timeout=2)
        assert wait_until(lambda: _quiet(lambda: client.sentinel_get_master_addr_by_name("kvs")), 10)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _quiet(fn):
    try:
        return fn()
    except redis.RedisError:
        return None


class ClusterDaemon(Daemon):
    """``kvstore serve --cluster`` (advertising its own TCP port) that counts as started once registered."""

    def __init__(self, workdir: str, server: RedisServer, redis_url: str, node_id: str, **kw):
        super().__init__(workdir, **kw)
        self.server, self.redis_url, self.node_id = server, redis_url, node_id

    def command(self) -> list[str]:
        return super().command() + ["--cluster", self.redis_url, "--node-id", self.node_id, "--advertise",
                                    self.tcp_url, "--node-ttl", str(TTL), "--peer-timeout", str(PEER_TIMEOUT),
                                    "--redis-timeout", "1"]

    def record(self, rds: redis.Redis) -> dict:
        return {k.decode(): v.decode() for k, v in rds.hgetall(f"{NS}:node:{self.node_id}").items()}

    def start(self, timeout: float = 30.0) -> ClusterDaemon:
        super().start(timeout)
        rds = self.server.client()
        ok = wait_until(lambda: self.record(rds).get("pid") == str(self.pid), timeout)
        assert ok, f"node {self.node_id} did not register:\n{self.log()}"
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a test may have left it stopped
        super().stop(sig, timeout)


class Cluster:
    """A redis-server and one ``kvstore serve --cluster`` daemon per name in ``names`` (each of ``capacity``,
    with ``args`` as more serve flags)."""

    def __init__(self, workdir: str, password: str | None = None, sentinel: bool = False, names: str = "ABC",
                 capacity: str = "64MiB", args: tuple[str, ...] = ()):
        self.workdir = workdir
        self.stores: list[kvstore.KVStore] = []
        self.sentinel: Sentinel | None = None
        self.nodes: dict[str, ClusterDaemon] = {}
        self.redis = RedisServer(workdir, password).start()
        try:
            self.sentinel = Sentinel(workdir, self.redis) if sentinel else None
            url = f"redis+sentinel://127.0.0.1:{self.sentinel.port}/kvs/0" if sentinel else self.redis.url
            for name in names:
                self.nodes[name] = ClusterDaemon(workdir, self.redis, url, name, capacity=capacity, args=args)
                self.nodes[name].start()
        except BaseException:
            for d in self.nodes.values():
                d.kill()
            self.close()  # stops what did start; a failed start leaves no process behind
            raise

    @property
    def url(self) -> str:
        if self.sentinel is not None:
            return f"kvcluster+sentinel://127.0.0.1:{self.sentinel.port}/kvs/0"
        auth = f":{self.redis.password}@" if self.redis.password else ""
        return f"kvcluster://{auth}127.0.0.1:{self.redis.port}/0"

    def client(self, node: str | None = None, **options) -> kvstore.KVStore:
        """A cluster client whose home daemon is ``node``."""
        query = "&".join(f"{k}={v}" for k, v in {"node": node, **options}.items() if v is not None)
        store = kvstore.connect(self.url + ("?" + query if query else ""), timeout=PEER_TIMEOUT * 5)
        self.stores.append(store)
        return store

    def daemon_client(self, node: str, transport: str = "shm") -> kvstore.KVStore:
        """A plain client of one daemon, which resolves other nodes' keys itself."""
        store = self.nodes[node].connect(transport, timeout=PEER_TIMEOUT * 5)
        self.stores.append(store)
        return store

    def logs(self) -> str:
        return "\n".join(f"---- node {name}:\n{d.log()}" for name, d in self.nodes.items())

    def entries(self, key: str) -> dict[str, bytes]:
        return {k.decode(): v for k, v in self.redis.client().hgetall(f"{NS}:obj:{key}").items()}

    def close(self) -> None:
        for store in self.stores:
            try:
                store.close()
            except Exception:
                pass
        failures = []
        for d in self.nodes.values():
            if d.stopped and d.proc is not None:
                for path in glob.glob(f"/dev/shm/kvstore-{d.pid}-*"):
                    os.unlink(path)  # a SIGKILLed daemon cannot clean up
            try:
                d.stop()
            except AssertionError as exc:
                failures.append(str(exc))
        self.redis.kill()
        if self.sentinel is not None:
            self.sentinel.kill()
        assert not failures, "\n".join(failures)
