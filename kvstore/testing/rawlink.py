"""The raw socket across a link: the physical baseline that transfers over the link are measured against.

Run as two processes, one on each host (``kvstore.testing.hosts.measure_link`` starts them)::

    python -m kvstore.testing.rawlink recv --bind 10.213.0.2 --port 7100 --bytes 67108864 --repeats 5
    python -m kvstore.testing.rawlink send --to 10.213.0.2 --port 7100 --bytes 67108864 --repeats 5

The sender times each repeat from its first ``sendall`` to the receiver's one-byte acknowledgement that every
byte landed (one round trip included, as in a store's put or get), and prints the seconds as JSON. Both sockets
are tuned like kvstore's stream path (``kvstore.transports.tcp.tune``), so the two differ only in what kvstore
adds on top.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

from kvstore.transports.tcp import recv_exact, tune

_PIECE = 4 << 20  # bytes per send/recv call: large enough that system calls do not bound the rate


def receive(bind: str, port: int, nbytes: int, repeats: int, timeout: float) -> None:
    with socket.create_server((bind, port)) as server:
        server.settimeout(timeout)
        print("ready", flush=True)  # the parent starts the sender only after this line
        conn, _ = server.accept()
    with conn:
        conn.settimeout(timeout)
        tune(conn)
        buf = memoryview(bytearray(min(nbytes, _PIECE)))
        for _ in range(repeats):
            left = nbytes
            while left:
                take = min(left, len(buf))
                recv_exact(conn, buf[:take])
                left -= take
            conn.sendall(b"\x01")


def send(to: str, port: int, nbytes: int, repeats: int, timeout: float) -> list[float]:
    payload = memoryview(bytearray(min(nbytes, _PIECE)))
    ack = bytearray(1)
    seconds = []
    with socket.create_connection((to, port), timeout=timeout) as conn:
        tune(conn)
        for _ in range(repeats):
            start = time.perf_counter()
            left = nbytes
            while left:
                take = min(left, len(payload))
                conn.sendall(payload[:take])
                left -= take
            recv_exact(conn, memoryview(ack))
            seconds.append(time.perf_counter() - start)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("recv", "send"))
    parser.add_argument("--bind", default="0.0.0.0")
    parser.add_argument("--to", default="")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bytes", type=int, default=64 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.bytes <= 0 or args.repeats <= 0:
        parser.error(f"--bytes and --repeats must be positive, got {args.bytes} and {args.repeats}")
    if args.role == "recv":
        receive(args.bind, args.port, args.bytes, args.repeats, args.timeout)
        return 0
    if not args.to:
        parser.error("send needs --to ADDRESS")
    print(json.dumps({"bytes": args.bytes, "seconds": send(args.to, args.port, args.bytes, args.repeats,
                                                           args.timeout)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
