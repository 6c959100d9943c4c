"""Endpoint: a parsed ``unix:///path``, ``tcp://host:port`` or ``ucx://host:port`` (the daemon's UCX data
endpoint) address, and this host's identity."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvstore.errors import InvalidArgumentError


def runtime_dir() -> str:
    """This user's directory for the default socket: ``$XDG_RUNTIME_DIR`` (0700 by its spec), else
    ``/tmp/kvstore-<uid>`` (the daemon creates it 0700; see kvstore.protocol.credentials.ensure_private_dir)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return xdg if xdg and os.path.isabs(xdg) else f"/tmp/kvstore-{os.getuid()}"


def default_socket_url() -> str:
    """Where ``kvstore serve`` listens by default: ``unix://<runtime_dir()>/kvstore.sock``."""
    return f"unix://{os.path.join(runtime_dir(), 'kvstore.sock')}"


def default_url() -> str:
    """Where clients connect by default: ``$KVSTORE_URL``, else ``default_socket_url()``."""
    return os.environ.get("KVSTORE_URL") or default_socket_url()


def host_id() -> str:
    """The same value for every process on this host (hostname + boot id): decides same-host paths."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True, slots=True)
class Endpoint:
    scheme: str  # "unix", "tcp" or "ucx"
    path: str = ""
    host: str = ""
    port: int = 0

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        if not isinstance(url, str):
            raise InvalidArgumentError(f"address must be a str like unix:///run/kv.sock, got {url!r}")
        parts = urlsplit(url)
        if parts.scheme == "unix":
            path = parts.path or parts.netloc
            if not path:
                raise InvalidArgumentError(f"unix address {url!r} has no path (use unix:///run/kv.sock)")
            return cls("unix", path=path)
        if parts.scheme in ("tcp", "ucx"):
            try:
                port = parts.port
            except ValueError:
                port = None
            if not parts.hostname or port is None:
                raise InvalidArgumentError(f"{parts.scheme} address {url!r} needs a host and a port "
                                           f"({parts.scheme}://127.0.0.1:7070)")
            return cls(parts.scheme, host=parts.hostname, port=port)
        raise InvalidArgumentError(f"unsupported address {url!r}; use unix:///path, tcp://host:port or "
                                   "ucx://host:port")

    def is_loopback(self) -> bool:
        if self.scheme == "unix":
            return True
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise InvalidArgumentError(f"cannot resolve {self.host!r}: {exc}") from None
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)

    def __str__(self) -> str:
        return f"unix://{self.path}" if self.scheme == "unix" else f"{self.scheme}://{self.host}:{self.port}"
