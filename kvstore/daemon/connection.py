"""Connection: the framed socket of one daemon session — its receive buffer, frames in and out, and payload
bytes moved straight between the socket and segment memory (``sock_recv_into`` / ``sock_sendall`` on
memoryviews of the segment), with the progress of each payload transfer noted for the stall deadline
(:class:`~kvstore.daemon.guards.TransferClock`)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import xxhash

from kvstore.daemon.guards import PeerGone, TransferClock, watching
from kvstore.protocol import wire

T = TypeVar("T")
#: the receive buffer once the peer is authenticated (before: one pre-authentication frame)
BUFFER = 64 << 10
INLINE_REPLY = 64 << 10  # stream replies up to this size go out in one send with their header
#: a streamed put is received (and hashed) in pieces this big: each is hashed right after it lands, while in cache
_HASH_PIECE = 256 << 10
_SEND_CHUNK = 1 << 20  # progress is noted between chunks of a payload being sent


class Closed(Exception):
    """The peer went away (or framing broke): end the session."""


class Connection:
    """``bytes_out(n)`` counts the payload bytes sent (the daemon's metrics)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, peer: str,
                 bytes_out: Callable[[int], None], max_frame: int = wire.MAX_FRAME):
        self.loop, self.sock, self.peer, self.bytes_out = loop, sock, peer, bytes_out
        self.max_frame = max_frame  # the daemon's --max-frame: no frame it sends is larger
        self.clock = TransferClock(loop)
        self._buf = bytearray(4 + wire.MAX_PREAUTH_FRAME)  # grows once authenticated
        self._start = self._end = 0

    def authenticated(self) -> None:
        """The peer said hello: the full-size buffer (what is buffered is kept)."""
        if len(self._buf) < BUFFER:
            self._buf = self._buf[self._start:self._end] + bytearray(BUFFER - (self._end - self._start))
            self._start, self._end = 0, self._end - self._start

    # ---- frames in ----------------------------------------------------------------------------------
    async def _fill(self, n: int) -> None:
        """Make at least ``n`` unread bytes available in the buffer."""
        if self._end - self._start >= n:
            return
        self._buf, self._start, self._end = wire.make_room(self._buf, self._start, self._end, n)
        view = memoryview(self._buf)
        while self._end - self._start < n:
            got = await self.loop.sock_recv_into(self.sock, view[self._end:])
            if got == 0:
                raise Closed("truncated frame" if self._end > self._start else "")
            self._end += got

    async def read_frame(self, limit: int) -> dict[str, Any] | None:
        """The next frame's message (at most ``limit`` bytes), or None at a clean end of stream between frames."""
        try:
            await self._fill(4)
        except Closed as exc:
            if str(exc):
                raise
            return None  # clean end of stream between frames
        n = wire.frame_length(self._buf[self._start:self._start + 4], limit)
        await self._fill(4 + n)
        body = memoryview(self._buf)[self._start + 4:self._start + 4 + n]
        self._start += 4 + n
        try:
            return wire.decode(body)
        finally:
            body.release()

    # ---- payload bytes ------------------------------------------------------------------------------
    async def read_into(self, view: memoryview, hasher: xxhash.xxh3_64 | None = None) -> None:
        """Receive exactly len(view) payload bytes: buffered ones first, then straight from the socket. With
        ``hasher``, each piece is hashed right after it lands, while it is still in cache (no second pass)."""
        take = min(len(view), self._end - self._start)
        view[:take] = self._buf[self._start:self._start + take]
        self._start += take
        got = take
        if hasher is not None and take:
            hasher.update(view[:take])
        clock = self.clock
        clock.begins()
        try:
            while got < len(view):
                piece = view[got:got + _HASH_PIECE] if hasher is not None else view[got:]
                n = await self.loop.sock_recv_into(self.sock, piece)
                if n == 0:
                    raise Closed(f"peer closed after {got} of {len(view)} payload bytes")
                if hasher is not None:
                    hasher.update(view[got:got + n])
                got += n
                clock.moved()
        finally:
            clock.ends()

    async def skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            chunk = scratch[:min(n, len(scratch))]
            await self.read_into(chunk)
            n -= len(chunk)

    async def send(self, message: dict[str, Any], payload: memoryview | None = None) -> None:
        frame = wire.encode(message, self.max_frame)
        if payload is not None:
            self.bytes_out(len(payload))
            if len(payload) <= INLINE_REPLY:
                frame += payload
                payload = None
        await self.loop.sock_sendall(self.sock, frame)
        if payload is not None:
            await self.send_payload(payload)

    async def send_payload(self, payload: memoryview) -> None:
        clock = self.clock
        clock.begins()
        try:
            for start in range(0, len(payload), _SEND_CHUNK):
                await self.loop.sock_sendall(self.sock, payload[start:start + _SEND_CHUNK])
                clock.moved()
        finally:
            clock.ends()

    # ---- a wait that watches its connection -----------------------------------------------------------
    async def watching_peer(self, work: Awaitable[T]) -> T:
        """Await ``work`` while reading the connection: raises PeerGone if the peer closes meanwhile (bytes it
        sends meanwhile are kept for the next frame)."""
        return await watching(work, self._until_peer_closes())

    async def _until_peer_closes(self) -> None:
        # room at the end of the buffer: the unread bytes move to its front (room for a whole buffer of them)
        self._buf, self._start, self._end = wire.make_room(self._buf, self._start, self._end, len(self._buf))
        view = memoryview(self._buf)
        while self._end < len(self._buf):
            got = await self.loop.sock_recv_into(self.sock, view[self._end:])
            if got == 0:
                raise PeerGone(f"client {self.peer} closed its connection during a wait")
            self._end += got
