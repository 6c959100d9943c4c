"""SessionGuards: what keeps one connection from holding the daemon's resources for nothing (mixed into
:class:`~kvstore.daemon.session.Session`).

- an authentication deadline: a connection that has not said ``hello`` within ``--auth-timeout`` is closed;
- a progress deadline on every payload transfer: a stream put whose bytes stop arriving, or a stream reply
  whose reader stops reading, for ``--transfer-timeout`` is cut by the server's housekeeping (the put's
  reservation and the get's lease go with the session);
- a watch on the connection while a ``wait`` blocks: a client that goes away ends its session at once instead
  of keeping its descriptor, session and buffers until the wait's timeout.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable
from typing import TypeVar

log = logging.getLogger("kvstore.daemon.server")
T = TypeVar("T")
_SEND_CHUNK = 1 << 20  # progress is noted between chunks of a payload being sent


class PeerGone(Exception):
    """The peer closed its connection while the session was not reading from it."""


class SessionGuards:
    # provided by Session (which also provides close())
    loop: asyncio.AbstractEventLoop
    sock: socket.socket
    peer: str
    client: int | None
    _buf: bytearray
    _start: int
    _end: int

    transfer_at: float | None = None  # loop time a byte last moved in the payload transfer now running
    _auth_timer: asyncio.TimerHandle | None = None

    # ---- authentication deadline ----------------------------------------------------------------------
    def start_auth_deadline(self, seconds: float) -> None:
        self._auth_timer = self.loop.call_later(seconds, self._auth_expired, seconds)

    def _auth_expired(self, seconds: float) -> None:
        self._auth_timer = None
        if self.client is None:
            log.warning("client %s did not authenticate within %.1f s (--auth-timeout); closing connection",
                        self.peer, seconds)
            self.close()

    def cancel_auth_deadline(self) -> None:
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None

    # ---- transfer progress ----------------------------------------------------------------------------
    def transfer_begins(self) -> None:
        self.transfer_at = self.loop.time()

    def transfer_moved(self) -> None:
        self.transfer_at = self.loop.time()

    def transfer_ends(self) -> None:
        self.transfer_at = None

    def stalled_for(self, now: float) -> float:
        """Seconds the running payload transfer has gone without a byte moving (0 when none runs)."""
        return 0.0 if self.transfer_at is None else now - self.transfer_at

    async def send_payload(self, payload: memoryview) -> None:
        self.transfer_begins()
        try:
            for start in range(0, len(payload), _SEND_CHUNK):
                await self.loop.sock_sendall(self.sock, payload[start:start + _SEND_CHUNK])
                self.transfer_moved()
        finally:
            self.transfer_ends()

    # ---- a wait that watches its connection -----------------------------------------------------------
    async def watching_peer(self, work: Awaitable[T]) -> T:
        """Await ``work`` while reading the connection: raises PeerGone if the peer closes meanwhile (bytes it
        sends meanwhile are kept for the next frame)."""
        job = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(self._until_peer_closes())
        try:
            done, _ = await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
            if job not in done:
                watch.result()  # PeerGone, or the buffer filled up: then wait for the work alone
                return await job
            return job.result()
        finally:
            for task in (job, watch):
                if not task.done():
                    task.cancel()

    async def _until_peer_closes(self) -> None:
        if self._start:  # make room at the end of the buffer
            keep = self._buf[self._start:self._end]
            self._buf[:len(keep)] = keep
            self._start, self._end = 0, len(keep)
        view = memoryview(self._buf)
        while self._end < len(self._buf):
            got = await self.loop.sock_recv_into(self.sock, view[self._end:])
            if got == 0:
                raise PeerGone(f"client {self.peer} closed its connection during a wait")
            self._end += got
