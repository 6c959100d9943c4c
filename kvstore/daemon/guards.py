"""Guards: what keeps one connection from holding the daemon's resources for nothing (parts that a
:class:`~kvstore.daemon.session.Session` and its :class:`~kvstore.daemon.connection.Connection` own).

- an authentication deadline (:class:`AuthDeadline`): a connection that has not said ``hello`` within
  ``--auth-timeout`` is closed;
- a progress deadline on every payload transfer (:class:`TransferClock`): a stream put whose bytes stop
  arriving, or a stream reply whose reader stops reading, for ``--transfer-timeout`` is cut by the server's
  housekeeping (the put's reservation and the get's lease go with the session);
- a watch on the connection while a ``wait`` blocks (:func:`watching`): a client that goes away ends its
  session at once instead of keeping its descriptor, session and buffers until the wait's timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class PeerGone(Exception):
    """The peer closed its connection while the session was not reading from it."""


class AuthDeadline:
    """Calls ``expired(seconds)`` unless cancelled within ``seconds`` of ``start``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, expired: Callable[[float], None]):
        self.loop, self._expired = loop, expired
        self._timer: asyncio.TimerHandle | None = None

    def start(self, seconds: float) -> None:
        self._timer = self.loop.call_later(seconds, self._fire, seconds)

    def _fire(self, seconds: float) -> None:
        self._timer = None
        self._expired(seconds)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class TransferClock:
    """When a byte last moved in the payload transfer now running (loop time; None when none runs)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.at: float | None = None

    def begins(self) -> None:
        self.at = self.loop.time()

    def moved(self) -> None:
        self.at = self.loop.time()

    def ends(self) -> None:
        self.at = None

    def stalled_for(self, now: float) -> float:
        """Seconds the running payload transfer has gone without a byte moving (0 when none runs)."""
        return 0.0 if self.at is None else now - self.at


async def watching(work: Awaitable[T], until_peer_closes: Awaitable[None]) -> T:
    """Await ``work`` while ``until_peer_closes`` reads the connection: PeerGone if the peer closes meanwhile; if
    the reader stops otherwise (its buffer filled up), wait for the work alone."""
    job = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_peer_closes)
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
