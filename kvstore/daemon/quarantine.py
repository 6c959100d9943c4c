"""Quarantine: segment space of revoked clients that may still touch it, held until their processes are gone.

A same-host client maps the segments and copies into and out of them itself. When the daemon revokes such a
client (its heartbeat expired, or it closed its connection) while its process lives on, nothing can stop a
memcpy it is still running, or a zero-copy view it still holds: handing that space out again would let it
corrupt other clients' objects, or change under the view. So the master keeps the space taken
(``Master.drop_client(quarantine=True)``) and this module watches the process: the peer's pid comes from
``SO_PEERCRED`` on the Unix socket, a pidfd (``os.pidfd_open``) on the event loop becomes readable when the
process exits, and then ``Master.release_quarantine`` frees the space. Where no pidfd can be had (no
``pidfd_open``, descriptors exhausted) the pid is polled from the daemon's housekeeping instead. A TCP client
gets a mapping transport only once its process is known (:func:`tcp_peer_cred`: the other end of the
connection is a socket of this host's network namespace, held by a process whose descriptors the daemon may
read); a client whose pid cannot be had never maps memory, so no quarantine waits on an unknown process.

TCP clients need none of this: the daemon's own stream copy is what writes, and it is cancelled first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address

from kvstore.core.master import Master

log = logging.getLogger("kvstore.daemon.quarantine")
_UCRED = struct.Struct("3i")  # pid, uid, gid
MAPS_MEMORY = ("shm", "cuda_ipc")  # transports whose clients copy into and out of the daemon's memory themselves


@dataclass(frozen=True, slots=True)
class PeerCred:
    pid: int | None  # None when the peer's pid is not visible here (another PID namespace)
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred | None:
    """The credentials of a Unix-socket peer, taken by the kernel at connect; None for other sockets."""
    if sock.family != socket.AF_UNIX:
        return None
    try:
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    return PeerCred(pid if pid > 0 else None, uid, gid)


def tcp_peer_cred(sock: socket.socket) -> PeerCred | None:
    """The process at the other end of a TCP connection when it runs on this host (same network namespace)
    and its descriptors are readable here (same user, or a daemon running as root); None otherwise. Scans
    /proc: run it off the event loop."""
    try:
        peer, local = ip_address(sock.getpeername()[0]), sock.getsockname()
        peer_port, local_addr, local_port = sock.getpeername()[1], ip_address(local[0]), local[1]
    except (OSError, ValueError):
        return None
    found = _socket_row(peer, peer_port, local_addr, local_port)
    if found is None:
        return None
    uid, inode = found
    pid = _holder_of(inode, uid)
    return None if pid is None else PeerCred(pid, uid, -1)


def _proc_net_addr(addr: IPv4Address | IPv6Address, port: int) -> str:
    # /proc/net/tcp{,6} print each 32-bit word of the address as the CPU stores it
    packed = addr.packed
    return "".join(f"{w:08X}" for w in struct.unpack(f"={len(packed) // 4}I", packed)) + f":{port:04X}"


def _socket_row(peer: IPv4Address | IPv6Address, peer_port: int, local: IPv4Address | IPv6Address,
                local_port: int) -> tuple[int, int] | None:
    """(uid, inode) of this host's socket whose local end is ``peer`` and remote end is ``local``."""
    tables = []
    for a, b in ((peer, local), (getattr(peer, "ipv4_mapped", None), getattr(local, "ipv4_mapped", None))):
        if a is not None and b is not None:
            name = "tcp6" if a.version == 6 else "tcp"
            tables.append((name, _proc_net_addr(a, peer_port), _proc_net_addr(b, local_port)))
    for name, want_local, want_remote in tables:
        try:
            with open(f"/proc/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[1] == want_local and cols[2] == want_remote:
                return int(cols[7]), int(cols[9])
    return None


def _holder_of(inode: int, uid: int) -> int | None:
    """A process of user ``uid`` holding the socket ``inode`` (the first found, if several share it)."""
    target = f"socket:[{inode}]"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") == target:
                    return int(entry)
            except OSError:
                continue
    return None


class PidWatch:
    """One client process, watched from the moment it authenticates (so a recycled pid is never mistaken
    for it): a pidfd when one can be opened, else the bare pid."""

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self.fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self.fd, self.gone = None, True
            return
        except (AttributeError, OSError):
            self.fd = None
        self.gone = False

    def alive(self) -> bool:
        if self.gone:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            self.gone = True
        except PermissionError:
            pass  # exists, owned by someone else
        return not self.gone

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Quarantine:
    """Decides, at a client's revocation, whether its space is freed at once or held; frees held space when
    the client's process exits."""

    def __init__(self, master: Master):
        self.master = master
        self._held: dict[int, PidWatch | None] = {}  # client id -> its process (None: unknown, kept)

    def revoke(self, client: int, watch: PidWatch | None, maps_memory: bool, peer: str) -> tuple[int, int]:
        """Drop ``client``; ``maps_memory``: its transport lets its process touch segment memory itself.
        Takes ownership of ``watch``. Returns (puts revoked, leases released)."""
        if not maps_memory or (watch is not None and not watch.alive()):
            if watch is not None:
                watch.close()
            return self.master.drop_client(client)
        puts, leases = self.master.drop_client(client, quarantine=True)
        if not self.master.is_quarantined(client):  # it held nothing
            if watch is not None:
                watch.close()
            return puts, leases
        self._held[client] = watch
        log.warning("client %s revoked while its process %s lives: %d bytes of its puts and leases quarantined "
                    "until it exits", peer, "(pid unknown)" if watch is None else watch.pid,
                    self.master.quarantined_bytes())
        if watch is not None and watch.fd is not None:
            asyncio.get_running_loop().add_reader(watch.fd, self._exited, client)
        return puts, leases

    def poll(self) -> None:
        """Housekeeping: release clients watched by pid only whose process has gone."""
        for client, watch in list(self._held.items()):
            if watch is not None and watch.fd is None and not watch.alive():
                self._exited(client)

    def _exited(self, client: int) -> None:
        watch = self._held.pop(client, None)
        if watch is not None and watch.fd is not None:
            asyncio.get_running_loop().remove_reader(watch.fd)
            watch.close()
        freed = self.master.release_quarantine(client)
        log.info("quarantined client process %s exited: %d bytes freed", watch.pid if watch else "?", freed)

    def close(self) -> None:
        for watch in self._held.values():
            if watch is not None and watch.fd is not None:
                asyncio.get_running_loop().remove_reader(watch.fd)
                watch.close()
        self._held.clear()
