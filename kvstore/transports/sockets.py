"""Socket tuning shared by every connection that carries payloads: the client's control connection, the stream
data path and the daemon's listeners."""

from __future__ import annotations

import socket

#: socket buffer size asked for on data connections; large payloads move in fewer system calls
SOCKET_BUFFER = 4 << 20


def tune(sock: socket.socket) -> None:
    """Low latency for control frames, large kernel buffers for payloads."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass
