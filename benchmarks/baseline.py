"""Physical baselines measured in the same run as the thing they bound: single-thread memcpy into a
pre-faulted buffer, and a raw loopback socket between two processes (``sendall`` / ``recv_into``).
Also the timing statistics every benchmark here reports (median, p99, GB/s)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Timing:
    size: int
    p50_s: float
    p99_s: float
    n: int

    @property
    def gbps(self) -> float:
        return self.size / self.p50_s / 1e9 if self.p50_s > 0 else float("inf")

    def as_dict(self) -> dict:
        return {"size": self.size, "p50_us": self.p50_s * 1e6, "p99_us": self.p99_s * 1e6,
                "gbps": self.gbps, "n": self.n}


def iterations(size: int, budget_bytes: int = 512 << 20, lo: int = 20, hi: int = 3000) -> int:
    return max(lo, min(hi, budget_bytes // max(size, 1)))


def measure(fn: Callable[[], object], size: int, n: int | None = None, warmup: int = 3) -> Timing:
    n = n or iterations(size)
    for _ in range(warmup):
        fn()
    times = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    times.sort()
    return Timing(size, statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))], n)


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
