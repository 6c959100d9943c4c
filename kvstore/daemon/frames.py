"""FrameOps: compressed payloads on the stream path, over a session's
:class:`~kvstore.daemon.connection.Connection` (the session owns one).

A ``get`` or ``put`` that carries ``compress`` moves its payload as the frames of
:mod:`kvstore.protocol.compression`. Sending, the next frame is compressed on a worker thread while the event
loop sends the current one (lz4 releases the GIL), so the compressor and the link overlap and other sessions
keep being served. Receiving, each frame is decoded into segment memory and checked against its xxh3 as it
lands; the object's checksum is hashed from the decoded bytes, as for an uncompressed put.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import xxhash

from kvstore.errors import ChecksumError
from kvstore.protocol import compression as cz
from kvstore.protocol.wire import ok_reply

if TYPE_CHECKING:
    from kvstore.daemon.connection import Connection


class FrameOps:
    def __init__(self, conn: Connection):
        self.conn = conn

    async def send_object(self, rid: int, meta: dict[str, Any], region: memoryview, compress: str | None) -> None:
        """The reply to a stream get and its payload: as frames when the client asked for ``compress`` and the
        object is large enough to gain from it, raw otherwise."""
        if compress is None or len(region) < cz.MIN_SIZE:
            await self.conn.send(ok_reply(rid, meta=meta, stream=len(region)), region)
            return
        await self.conn.send(ok_reply(rid, meta=meta, frames=len(region), codec=compress))
        await self.send_frames(region, compress)

    async def send_frames(self, payload: memoryview, codec: str) -> int:
        """Send ``payload`` as frames of ``codec``; returns the bytes that went on the wire. The payload must
        stay valid until this returns (a lease holds it); a frame being compressed when the session is cut
        only reads memory that is still mapped, and is never sent."""
        encoder = cz.Encoder(payload, codec)
        loop, sock, clock = self.conn.loop, self.conn.sock, self.conn.clock
        clock.begins()
        try:
            pending = loop.run_in_executor(None, encoder.frame, 0)
            for i in range(encoder.count):
                header, body = await pending
                if i + 1 < encoder.count:
                    pending = loop.run_in_executor(None, encoder.frame, i + 1)
                await loop.sock_sendall(sock, header)
                await loop.sock_sendall(sock, body)
                clock.moved()
        finally:
            clock.ends()
        self.conn.bytes_out(len(payload))
        return encoder.wire_bytes

    async def read_frames_into(self, region: memoryview, hasher: xxhash.xxh3_64) -> None:
        """Receive the frames of a payload of ``len(region)`` bytes, decode them into ``region`` and hash the
        decoded bytes into ``hasher``. A corrupted frame is a ChecksumError once every frame has been read
        (the connection stays in step); a bad header is a ProtocolError (the session ends: nothing after it
        can be trusted)."""
        header = memoryview(bytearray(cz.HEADER.size))
        scratch: memoryview | None = None
        error: ChecksumError | None = None
        pos = 0
        while pos < len(region):
            await self.conn.read_into(header)
            frame = cz.parse_header(header, len(region) - pos)
            dst = region[pos:pos + frame.raw_len]
            if frame.codec == cz.STORED:
                body = dst
            else:
                if scratch is None:
                    scratch = memoryview(bytearray(cz.lz4_bound(cz.CHUNK)))
                body = scratch[:frame.wire_len]
            await self.conn.read_into(body)
            if error is None:
                try:
                    cz.decode(frame, body, dst)
                    hasher.update(dst)
                except ChecksumError as exc:
                    error = exc
            pos += frame.raw_len
        if error is not None:
            raise error

    async def skip_frames(self, size: int) -> None:
        """Read and drop the frames of a refused put of ``size`` raw bytes (a bad header ends the session)."""
        header = memoryview(bytearray(cz.HEADER.size))
        pos = 0
        while pos < size:
            await self.conn.read_into(header)
            frame = cz.parse_header(header, size - pos)
            await self.conn.skip(frame.wire_len)
            pos += frame.raw_len
