"""Physical baselines measured in the same run as the thing they bound: single-thread memcpy into a
pre-faulted buffer, and a raw loopback socket between two processes (``sendall`` / ``recv_into``).
The timing statistics every benchmark here reports (median, p99, GB/s) are :mod:`benchmarks.common.timing`."""

from __future__ import annotations

import multiprocessing as mp
import socket

import numpy as np

from benchmarks.common.timing import Timing, measure


def prefaulted(size: int) -> np.ndarray:
    buf = np.empty(max(size, 1), dtype=np.uint8)
    buf[:] = 1  # touch every page now, so the measurement sees warm memory
    return buf[:size]


def memcpy(size: int, n: int | None = None) -> Timing:
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = prefaulted(size)
    dv, sv = memoryview(dst), memoryview(src)

    def copy():
        dv[:] = sv

    return measure(copy, size, n)


# ---- raw socket -------------------------------------------------------------------------------------
def _echo_server(port_q, sizes: list[int]) -> None:
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port_q.put(lsock.getsockname()[1])
    conn, _ = lsock.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(prefaulted(max(sizes)))
    ctrl = bytearray(9)
    while True:
        if _recv_exact(conn, memoryview(ctrl)) is False:
            return
        kind, size = ctrl[0], int.from_bytes(ctrl[1:], "little")
        if kind == ord("p"):  # client sends size bytes, we ack with one byte
            _recv_exact(conn, buf[:size])
            conn.sendall(b"k")
        elif kind == ord("g"):  # client asks for size bytes
            conn.sendall(buf[:size])
        else:
            return


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


class RawSocket:
    """A raw loopback TCP peer in another process: ``send(size)`` and ``recv(size)`` round trips."""

    def __init__(self, max_size: int):
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=_echo_server, args=(q, [max_size]), daemon=True)
        self.proc.start()
        port = q.get(timeout=30)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = memoryview(prefaulted(max_size))
        self.ack = memoryview(bytearray(1))

    def send(self, size: int) -> None:
        self.sock.sendall(b"p" + size.to_bytes(8, "little"))
        self.sock.sendall(self.buf[:size])
        _recv_exact(self.sock, self.ack)

    def recv(self, size: int) -> None:
        self.sock.sendall(b"g" + size.to_bytes(8, "little"))
        _recv_exact(self.sock, self.buf[:size])

    def close(self) -> None:
        self.sock.sendall(b"q" + bytes(8))
        self.sock.close()
        self.proc.join(timeout=5)
