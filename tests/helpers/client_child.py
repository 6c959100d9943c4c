"""A kvstore client run as a separate process by the fault tests; it reports progress on stdout.

Usage: client_child.py MODE URL TRANSPORT KEY [SIZE]

  put-region  begin a region-mode put of SIZE bytes over shm, copy half of it, print READY, then hang
              (the test SIGKILLs it between begin and commit)
  put-stream  send a stream-mode put of SIZE bytes over a raw socket, send half of the payload, print
              READY, then hang (the daemon is left waiting for the rest)
  lease       hold ``store.lease(KEY)``, print READY, hang
  view        hold a zero-copy ``store.get(KEY, copy=False)`` (a lease), print READY, hang
  put         put SIZE bytes of the key-derived pattern under KEY, print DONE, exit
  ephemeral   put SIZE bytes under KEY with ephemeral=True, print READY, hang
  arena       put SIZE bytes under KEY over shm (which takes an arena), print READY and the arena's bytes, hang
  view-dropped  hold a zero-copy view of KEY, then lose the control connection (as a timed-out call does) and
              stay alive: print READY; on each SIGUSR1 print VIEW same|changed
  paused-put  hold a zero-copy view of KEY, then begin a region put of SIZE bytes under KEY + "/big"; in the
              middle of the copy print READY and SIGSTOP itself; once continued, finish the copy (into space
              the daemon may have revoked meanwhile), try to commit, print RESULT committed|refused
              same|changed (the view), then hang
"""

from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np

import kvstore
from kvstore.core.meta import ObjectMeta
from kvstore.protocol import credentials, wire
from kvstore.protocol.credentials import env_token
from kvstore.protocol.url import Endpoint, host_id


def pattern(key: str, size: int) -> bytes:
    """Deterministic bytes derived from the key (the parent regenerates them to compare)."""
    seed = int.from_bytes(key.encode()[:8].ljust(8, b"\0"), "little") ^ size
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def hang() -> None:
    while True:
        time.sleep(60)


def put_region(url: str, key: str, size: int) -> None:
    from kvstore.core.digest import Digest

    def half_copy(self: Digest, dst: memoryview) -> None:
        half = len(dst) // 2
        dst[:half] = self._view[:half]
        print("READY", flush=True)
        hang()

    Digest.copy_into = half_copy  # the real client path (shm: copy while hashing), stopped mid-copy
    store = kvstore.connect(url, transport="shm")
    store.put(key, pattern(key, size))


def paused_put(url: str, key: str, size: int) -> None:
    import signal

    from kvstore.core.digest import Digest

    store = kvstore.connect(url, transport="shm")
    view = store.get(key, copy=False)
    expected = bytes(view)

    def paused_copy(self: Digest, dst: memoryview) -> None:
        half = len(dst) // 2
        dst[:half] = self._view[:half]
        print("READY", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # a debugger, a cgroup freeze, a long stall
        dst[:] = self._view  # the whole copy lands after the thaw: what a live process's memcpy does

    Digest.copy_into = paused_copy  # the real client path (shm: copy while hashing), paused mid-copy
    try:
        store.put(key + "/big", pattern(key + "/big", size))
        commit = "committed"
    except kvstore.KVStoreError:
        commit = "refused"
    # one line: the parent's reader waits for lines one select() at a time
    print("RESULT", commit, "same" if bytes(view) == expected else "changed", flush=True)
    hang()


def view_dropped(url: str, key: str) -> None:
    store = kvstore.connect(url, transport="shm")
    view = store.get(key, copy=False)
    expected = bytes(view)
    import signal

    store._conn.close()  # the daemon sees a disconnect; this process and its mapping of the segment live on
    signal.signal(signal.SIGUSR1, lambda *_: print("VIEW", "same" if bytes(view) == expected else "changed",
                                                   flush=True))
    print("READY", flush=True)
    hang()


def put_stream(url: str, key: str, size: int) -> None:
    ep = Endpoint.parse(url)
    family = socket.AF_UNIX if ep.scheme == "unix" else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.connect(ep.path if ep.scheme == "unix" else (ep.host, ep.port))
    token, auth = env_token(), {}
    if token is not None:  # prove the token without sending it (a hand-made hello's challenge)
        nonce = credentials.new_nonce()
        sock.sendall(wire.encode({"v": wire.VERSION, "id": 0, "op": "challenge", "nonce": nonce}))
        reply = _read_reply(sock)
        auth = {"proof": credentials.proof(token, "client", nonce, reply["nonce"], reply["node"])}
    sock.sendall(wire.encode({"v": wire.VERSION, "id": 1, "op": "hello", "client": "stalled-writer",
                              "transport": "tcp", "host": host_id(), "pid": os.getpid(), **auth}))
    _read_reply(sock)
    meta = ObjectMeta(key=key, size=size)
    sock.sendall(wire.encode({"v": wire.VERSION, "id": 2, "op": "put", "key": key, "size": size,
                              "meta": meta.to_wire(), "mode": "stream"}))
    sock.sendall(pattern(key, size)[:size // 2])
    print("READY", flush=True)
    hang()


def _read_reply(sock: socket.socket) -> dict:
    header = _recv_exact(sock, 4)
    return wire.decode(_recv_exact(sock, wire.frame_length(header)))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("daemon closed")
        buf += chunk
    return buf


def main() -> None:
    mode, url, transport, key = sys.argv[1:5]
    size = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    if mode == "put-region":
        put_region(url, key, size)
    elif mode == "view-dropped":
        view_dropped(url, key)
    elif mode == "paused-put":
        paused_put(url, key, size)
    elif mode == "put-stream":
        put_stream(url, key, size)
    elif mode in ("lease", "view"):
        store = kvstore.connect(url, transport=transport)
        if mode == "lease":
            with store.lease(key):
                print("READY", flush=True)
                hang()
        obj = store.get(key, copy=False)
        print("READY", len(obj), flush=True)
        hang()
    elif mode == "arena":
        store = kvstore.connect(url, transport="shm")
        store.put(key, pattern(key, size))
        print("READY", store.stats()["arena_bytes"], flush=True)
        hang()
    elif mode == "ephemeral":
        store = kvstore.connect(url, transport=transport)
        store.put(key, pattern(key, size), ephemeral=True)
        print("READY", flush=True)
        hang()
    elif mode == "put":
        with kvstore.connect(url, transport=transport) as store:
            store.put(key, pattern(key, size))
        print("DONE", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
