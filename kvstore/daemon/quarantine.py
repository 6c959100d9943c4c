"""Quarantine: segment space of revoked clients that may still touch it, held until their processes are gone.

A same-host client maps the segments and copies into and out of them itself. When the daemon revokes such a
client (its heartbeat expired, or it closed its connection) while its process lives on, nothing can stop a
memcpy it is still running, or a zero-copy view it still holds: handing that space out again would let it
corrupt other clients' objects, or change under the view. So the master keeps the space taken
(``Master.drop_client(quarantine=True)``) and this module watches the process: the peer's pid comes from
``SO_PEERCRED`` on the Unix socket, a pidfd (``os.pidfd_open``) on the event loop becomes readable when the
process exits, and then ``Master.release_quarantine`` frees the space. Where no pidfd can be had (no
``pidfd_open``, descriptors exhausted) the pid is polled from the daemon's housekeeping instead. A client with
no known pid (a same-host client on TCP) keeps its quarantine until the daemon stops; how much one client can
hold at all is bounded by ``--max-held-bytes``.

TCP clients need none of this: the daemon's own stream copy is what writes, and it is cancelled first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from dataclasses import dataclass

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
