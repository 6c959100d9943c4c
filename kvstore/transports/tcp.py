"""Stream data path (TCP, or the Unix socket itself): the payload follows the control frame on the same
connection, and the daemon moves it straight between the socket and segment memory (``recv_into`` /
``sendmsg`` on memoryviews, no intermediate bytes objects).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from kvstore.transports.base import (
    Channel,
    DevicePath,
    PayloadDigest,
    TransportFailure,
    TransportUnavailable,
    host_only,
    register,
)
from kvstore.transports.sockets import tune as tune  # re-exported for the daemon and tools


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; raise TransportFailure if the peer closes first."""
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise TransportFailure(f"peer closed after {got} of {total} bytes")
        got += n


class StreamTransport:
    """Client side of the stream path: one round trip per put or get, payload inline on the connection."""

    name = "tcp"
    on_connection = True

    def __init__(self, segments: dict | None = None):
        del segments  # the stream path never maps daemon memory

    def regions(self) -> None:
        return None

    def device_path(self) -> DevicePath:
        raise TransportUnavailable(host_only(self.name))

    def reserve(self, channel: Channel, request: dict, src: memoryview, checksum: PayloadDigest) -> dict:
        # The bytes follow the request: the daemon writes them and, unless the put is deferred, commits it in this
        # round trip. No hashing pass here: the daemon hashes the payload as it lands (each piece while in its
        # cache) and replies with the digest. A digest the caller already has goes along and the daemon checks it.
        reply = channel.call({**request, "mode": "stream", "checksum": checksum.known}, payload=src)
        if reply.get("checksum") is not None:
            checksum.record(reply["checksum"])
        return reply

    def write(self, channel: Channel, reply: dict, src: memoryview, checksum: PayloadDigest) -> None:
        pass  # the bytes went with the request

    def get_into(self, channel: Channel, request: dict, dst: Callable[[dict], memoryview]) -> dict:
        return channel.call({**request, "mode": "stream"}, into=dst)

    def close(self) -> None:
        pass


register("tcp", StreamTransport)
