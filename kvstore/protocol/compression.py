"""Compressed payloads on the stream path: a payload as a run of self-delimiting frames, each lz4 or stored.

A transfer asks for compression with ``compress: "lz4"`` (or ``"lz4-shuffle"``) in its ``put`` request or its
``get`` request; the sender then splits the payload into chunks of at most ``CHUNK`` bytes and sends, for each,
a 24-byte header and a body:

    offset  size  field
         0     2  magic b"KZ"
         2     1  format version (1)
         3     1  codec: 0 stored (body = the chunk), 1 lz4 block (python-lz4, no size prefix)
         4     1  flags: bit 0 = the chunk was byte-shuffled before lz4 (elements of ``elem`` bytes)
         5     1  elem: 0, or the element size of the shuffle (2 for bf16 / fp16)
         6     2  reserved, 0
         8     4  raw length (u32 LE): the chunk's bytes, 1 .. CHUNK
        12     4  wire length (u32 LE): the body's bytes
        16     8  xxh3-64 (u64 LE) of the chunk as stored: uncompressed, unshuffled

The frames of a payload follow each other until their raw lengths add up to the object's size, which both
sides know from the request or the reply (no total length up front, so a sender compresses and sends chunk by
chunk). A chunk that lz4 does not shrink by 1/16 goes stored, and after ``GIVE_UP`` such chunks in a row the
sender stops trying for the rest of the payload: data that does not compress costs one probe, not a transfer's
worth of compressor time.

The receiver checks each header before it reads the body (a header that is not one of these, or that claims
more than the payload's remaining bytes or more wire bytes than lz4 can produce, is a ``ProtocolError``: the
connection cannot be trusted past it), and each chunk against its xxh3 after decoding it: a corrupted frame,
whether lz4 refuses it or decodes it to other bytes, is a ``ChecksumError``. Checksums are of the uncompressed
bytes, so the object's own checksum (recorded at commit) is unaffected by how it travelled.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import lz4.block
import numpy as np
import xxhash

from kvstore.errors import ChecksumError, InvalidArgumentError, ProtocolError

MAGIC = b"KZ"
FORMAT = 1
HEADER = struct.Struct("<2sBBBBHIIQ")
STORED, LZ4 = 0, 1
FLAG_SHUFFLE = 1
CHUNK = 1 << 20  # raw bytes a frame: big enough that lz4 reaches its speed, small enough to stay in cache
GIVE_UP = 4  # stored chunks in a row after which a sender stops compressing this payload
#: wire codecs a transfer may ask for: name -> shuffle element size (0: none)
CODECS = {"lz4": 0, "lz4-shuffle": 2}
#: payloads smaller than this are never compressed: they ride inline, one round trip, where lz4 saves nothing
MIN_SIZE = 64 << 10


def check_codec(value: object, name: str = "compress") -> str | None:
    """The wire field's validator: None, or one of :data:`CODECS`."""
    if value is None or (isinstance(value, str) and value in CODECS):
        return value
    raise InvalidArgumentError(f"{name} must be one of {sorted(CODECS)} or absent, got {value!r:.80}")


def lz4_bound(n: int) -> int:
    """The most bytes lz4 can turn ``n`` bytes into (LZ4_COMPRESSBOUND)."""
    return n + n // 255 + 16


@dataclass(frozen=True, slots=True)
class Frame:
    codec: int
    elem: int  # shuffle element size, 0 without shuffle
    raw_len: int
    wire_len: int
    checksum: int


def parse_header(header: bytes | memoryview, remaining: int) -> Frame:
    """Validate one frame header against the ``remaining`` raw bytes of its payload; ProtocolError if it is
    not a header this side would send."""
    magic, version, codec, flags, elem, reserved, raw_len, wire_len, checksum = HEADER.unpack(header)
    if magic != MAGIC or version != FORMAT:
        raise ProtocolError(f"compressed frame: bad magic/version {bytes(magic)!r}/{version} (expected {MAGIC!r}/"
                            f"{FORMAT})")
    if codec not in (STORED, LZ4) or flags & ~FLAG_SHUFFLE or reserved:
        raise ProtocolError(f"compressed frame: unknown codec {codec}, flags {flags:#x} or reserved {reserved}")
    shuffled = bool(flags & FLAG_SHUFFLE)
    if shuffled != (elem != 0) or elem not in (0, 2, 4, 8) or (shuffled and codec != LZ4):
        raise ProtocolError(f"compressed frame: shuffle flag {shuffled} with element size {elem}")
    if not 0 < raw_len <= min(CHUNK, remaining) or (elem and raw_len % elem):
        raise ProtocolError(f"compressed frame: raw length {raw_len} with {remaining} bytes left (chunks of at most "
                            f"{CHUNK}, whole elements of {elem or 1})")
    if (codec == STORED and wire_len != raw_len) or (codec == LZ4 and not 0 < wire_len <= lz4_bound(raw_len)):
        raise ProtocolError(f"compressed frame: wire length {wire_len} for {raw_len} raw bytes with codec {codec}")
    return Frame(codec, elem, raw_len, wire_len, checksum)


def shuffle(chunk: memoryview, elem: int) -> np.ndarray:
    """Byte ``i`` of every element together, for ``i`` in 0..elem-1 (a bf16's exponent bytes become a run)."""
    return np.ascontiguousarray(np.frombuffer(chunk, np.uint8).reshape(-1, elem).T)


def decode(frame: Frame, body: bytes | memoryview, dst: memoryview) -> None:
    """Decode ``body`` into ``dst`` (``frame.raw_len`` bytes) and check it; ChecksumError if lz4 refuses the
    body or the bytes do not hash to the header's xxh3 (``dst`` then holds undefined bytes)."""
    if frame.codec == LZ4:
        try:
            raw = lz4.block.decompress(body, uncompressed_size=frame.raw_len)
        except lz4.block.LZ4BlockError as exc:
            raise ChecksumError(f"compressed frame of {frame.raw_len} bytes does not decode: {exc}") from None
        if len(raw) != frame.raw_len:
            raise ChecksumError(f"compressed frame decoded to {len(raw)} bytes, its header says {frame.raw_len}")
        if frame.elem:
            out = np.frombuffer(dst, np.uint8).reshape(-1, frame.elem)
            out[:] = np.frombuffer(raw, np.uint8).reshape(frame.elem, -1).T
        else:
            dst[:] = raw
    elif body is not dst:
        dst[:] = body
    got = xxhash.xxh3_64_intdigest(dst)
    if got != frame.checksum:
        raise ChecksumError(f"compressed frame of {frame.raw_len} bytes hashes to {got:#x} after decoding, its "
                            f"sender's xxh3 is {frame.checksum:#x}; the payload was corrupted on the way")


class Encoder:
    """The frames of one payload, made one at a time (``frame(i)`` in order: whether chunk ``i`` is tried
    depends on how the earlier ones compressed). ``wire_bytes`` / ``compressed`` count what was sent."""

    def __init__(self, payload: memoryview, codec: str, chunk: int = CHUNK):
        self.payload = payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
        self.elem = CODECS[codec]
        self.chunk = chunk - chunk % max(self.elem, 1)
        self.count = -(-len(self.payload) // self.chunk)
        self.wire_bytes = self.compressed = 0
        self._misses = 0

    def __iter__(self) -> Iterator[tuple[bytes, bytes | memoryview]]:
        return (self.frame(i) for i in range(self.count))

    def frame(self, i: int) -> tuple[bytes, bytes | memoryview]:
        """(header, body) of chunk ``i``: lz4 when it shrinks the chunk by 1/16, else the chunk itself."""
        chunk = self.payload[i * self.chunk:(i + 1) * self.chunk]
        checksum = xxhash.xxh3_64_intdigest(chunk)
        elem = self.elem if len(chunk) % max(self.elem, 1) == 0 else 0
        if self._misses < GIVE_UP:
            src = shuffle(chunk, elem) if elem else chunk
            body = lz4.block.compress(src, store_size=False)
            if len(body) <= len(chunk) - len(chunk) // 16:
                self._misses = 0
                self.compressed += 1
                self.wire_bytes += HEADER.size + len(body)
                flags = FLAG_SHUFFLE if elem else 0
                return HEADER.pack(MAGIC, FORMAT, LZ4, flags, elem, 0, len(chunk), len(body), checksum), body
            self._misses += 1
        self.wire_bytes += HEADER.size + len(chunk)
        return HEADER.pack(MAGIC, FORMAT, STORED, 0, 0, 0, len(chunk), len(chunk), checksum), chunk


__all__ = ["CHUNK", "CODECS", "HEADER", "MIN_SIZE", "Encoder", "Frame", "check_codec", "decode", "lz4_bound",
           "parse_header", "shuffle"]
