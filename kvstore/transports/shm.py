"""Same-host data path: POSIX shared memory the daemon owns and its clients map.

The mapping itself is :class:`kvstore.memory.shm.SharedMemory`. ``ShmTransport`` is the client side: a put asks
the daemon for a region, copies the caller's bytes into it once and commits; a get_into leases the object,
copies it out once and releases the lease without waiting for the reply.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.memory.shm import SharedMemory, SharedMemoryError, SharedMemoryUnavailable
from kvstore.transports.base import Channel, PayloadDigest, TransportFailure, TransportUnavailable, register


def copy(dst: memoryview, src: memoryview) -> None:
    """One memcpy between two byte views of equal length."""
    dst[:] = src


class ShmTransport:
    """Client side of the same-host path. ``segments`` maps segment id -> (name, size) from the daemon."""

    name = "shm"

    def __init__(self, segments: dict[int, tuple[str, int]]):
        self._segments = dict(segments)
        self._maps: dict[int, SharedMemory] = {}

    def segment_size(self, segment: int) -> int:
        """Size of a segment the daemon announced at hello."""
        try:
            return self._segments[segment][1]
        except KeyError:
            raise TransportFailure(f"daemon named unknown segment {segment}") from None

    def region(self, segment: int, offset: int, length: int) -> memoryview:
        seg = self._maps.get(segment)
        if seg is None:
            try:
                name, size = self._segments[segment]
            except KeyError:
                raise TransportFailure(f"daemon named unknown segment {segment}") from None
            try:
                seg = self._maps[segment] = SharedMemory.attach(name, size)
            except SharedMemoryUnavailable as exc:
                raise TransportUnavailable(str(exc)) from exc
            except SharedMemoryError as exc:
                raise TransportFailure(str(exc)) from exc
        if offset < 0 or length < 0 or offset + length > seg.size:
            raise TransportFailure(f"region [{offset}, +{length}) outside segment {segment} of {seg.size} bytes")
        return seg.buf[offset:offset + length]

    def put(self, channel: Channel, request: dict, src: memoryview, checksum: PayloadDigest) -> dict:
        reply = channel.call({**request, "mode": "region"})
        try:
            dst = self.region(reply["segment"], reply["offset"], len(src))
            checksum.copy_into(dst)  # one pass: each piece hashed while in cache
            dst.release()
        except BaseException:
            channel.call({"op": "abort", "put_id": reply["put_id"]})
            raise
        if request.get("defer"):  # the caller commits a whole batch at once
            return {"put_id": reply["put_id"], "checksum": checksum()}
        return channel.call({"op": "commit", "put_id": reply["put_id"], "checksum": checksum()})

    def get_into(self, channel: Channel, request: dict, dst: Callable[[dict], memoryview]) -> dict:
        reply = channel.call({**request, "mode": "region"})
        try:
            out = dst(reply)
            src = self.region(reply["segment"], reply["offset"], reply["size"])
            copy(out[:reply["size"]], src)
            src.release()
        finally:
            channel.call({"op": "release", "lease": reply["lease"], "noreply": True})
        return reply

    def close(self) -> None:
        for seg in self._maps.values():
            seg.close()
        self._maps.clear()


register("shm", ShmTransport)
