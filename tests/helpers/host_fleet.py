"""Two namespace hosts joined by a shaped link, with a ``kvstore serve`` daemon on host a (one per module): the
``fleet`` fixture of tests/integration/hosts (``two_hosts``; here, not in a conftest.py of that folder, which
would shadow the suite's own ``conftest`` module).

Clients run on either host as ``tests/helpers/host_client.py`` subprocesses; each host has its own copy of one
token in its private /tmp. Host a's daemon listens on its Unix socket (clients on a) and on its end of the link
(clients on b, ``tcp://``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import paths
import pytest

from kvstore.testing import hosts as H

PORT = 7070
CLIENT = str(paths.HELPERS / "host_client.py")


def child_env() -> dict:
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", KVSTORE_TOKEN_FILE="/tmp/token",
               PYTHONPATH=os.pathsep.join(filter(None, [str(paths.ROOT), env.get("PYTHONPATH")])))
    return env


@dataclass
class Fleet:
    hosts: H.Hosts
    link: H.Link
    daemon: subprocess.Popen | None = None
    serve_args: tuple[str, ...] = ()

    @property
    def a(self) -> H.Host:
        return self.hosts["a"]

    @property
    def b(self) -> H.Host:
        return self.hosts["b"]

    @property
    def tcp_url(self) -> str:
        return f"tcp://{self.link.address(self.a)}:{PORT}"

    unix_url = "unix:///tmp/kv.sock"

    def start_daemon(self) -> None:
        cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", self.unix_url, "--listen", self.tcp_url,
               "--token-file", "/tmp/token", "--capacity", "256MiB", "--log-level", "warning", *self.serve_args]
        log = open(self.a.path("/tmp/daemon.log"), "ab")
        self.daemon = self.a.popen(cmd, cwd=str(paths.ROOT), stdout=log, stderr=subprocess.STDOUT, env=child_env())
        log.close()
        if not self.a.wait_listening(PORT, 60, self.daemon):
            raise RuntimeError(f"kvstore serve on host a did not start:\n{self.daemon_log()}")

    def stop_daemon(self) -> int:
        self.daemon.send_signal(signal.SIGTERM)
        return self.daemon.wait(30)

    def daemon_log(self) -> str:
        with open(self.a.path("/tmp/daemon.log"), errors="replace") as f:
            return f.read()

    def client(self, host: H.Host, url: str, *args: str, timeout: float = 10.0, **kw) -> list[dict]:
        """Run one client operation on ``host``; its JSON lines."""
        done = host.run([sys.executable, CLIENT, url, *map(str, args), "--timeout", str(timeout)], env=child_env(),
                        timeout=120, check=False, **kw)
        lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
        if done.returncode != 0 and not lines:
            raise AssertionError(f"client on {host.name} failed ({done.returncode}):\n{done.stderr}")
        return lines

    def start_client(self, host: H.Host, url: str, *args: str, timeout: float = 10.0) -> subprocess.Popen:
        """Start one client operation on ``host`` and return once it says it started moving its payload."""
        proc = host.popen([sys.executable, CLIENT, url, *map(str, args), "--timeout", str(timeout)], env=child_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        if '"started"' not in line:
            raise AssertionError(f"client on {host.name} did not start: {line}{proc.stderr.read()}")
        return proc

    def stats(self) -> dict:
        return self.client(self.a, self.unix_url, "stats")[0]

    def wait_settled(self, timeout: float = 20.0) -> dict:
        """The daemon's stats once no put is pending and no lease held (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if (stats["pending"] == 0 and stats["leases"] == 0) or time.monotonic() > deadline:
                return stats
            time.sleep(0.2)


def finish(proc: subprocess.Popen, timeout: float = 60.0) -> list[dict]:
    out, _ = proc.communicate(timeout=timeout)
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


@contextlib.contextmanager
def token_hosts() -> Iterator[H.Hosts]:
    """Hosts a and b joined by a 1 Gbit/s link, each with the same token in its private /tmp/token; removed at
    exit. Skips (pytest) where namespaces cannot be made."""
    reason = H.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    H.remove_stale()
    with H.Hosts(("a", "b"), rate_gbit=1) as hosts:
        token = secrets.token_hex(16)
        for host in hosts.hosts.values():
            fd = os.open(host.path("/tmp/token"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, token.encode())
            os.close(fd)
        yield hosts


def two_hosts():
    """The generator behind a module's ``fleet`` fixture: hosts a and b at 1 Gbit/s, a daemon on a."""
    with token_hosts() as hosts:
        # short stall and liveness limits: a cut link frees the daemon's side within seconds
        fleet = Fleet(hosts, hosts.link("a", "b"), serve_args=("--transfer-timeout", "2", "--heartbeat-timeout", "4"))
        fleet.start_daemon()
        try:
            yield fleet
        finally:
            if fleet.daemon.poll() is None:
                code = fleet.stop_daemon()
                assert code == 0, fleet.daemon_log()
                mine = f"kvstore-{fleet.daemon.pid}-"  # the pid of nsenter, which execs the daemon
                assert not [n for n in os.listdir(fleet.a.path("/dev/shm")) if n.startswith(mine)]
    assert H.namespaces() == []
