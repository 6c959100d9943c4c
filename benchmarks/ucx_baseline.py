"""RawUcx: the physical baseline of the ucx transport, raw ucxx tag send/recv between two processes with the
same UCX configuration as the store's path (``UCX_TLS`` from the environment for both; the peer's context
uses the daemon's options, ``kvstore.transports.ucx_server.context_config()``; endpoints by worker address without
error handling, or through a listener with it, like ``KVSTORE_UCX_CONNECT=address|listener``).

``peer_memory="shm"`` puts the peer's buffer in POSIX shared memory like a daemon segment (4 KiB pages: a
same-host CMA copy pins every page, which costs several times more than on anonymous huge-page memory), so
the store's gap can be split into what the memory type costs and what the store adds.

Each round trip mirrors :class:`benchmarks.baseline.RawSocket`: ``send(size)`` sends a 9-byte command and
``size`` bytes, then waits for a 1-byte ack; ``recv(size)`` sends the command and receives ``size`` bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import os

from benchmarks.baseline import prefaulted

CMD, DATA, ACK = 1, 2, 3
TIMEOUT_MS = 100


def _wait(worker, requests) -> None:
    while not all(r.completed for r in requests):
        worker.progress_worker_event(TIMEOUT_MS)
    for r in requests:
        r.check_error()


def _setup(config: dict):
    from kvstore.transports.ucx import load

    lib, array = load()
    context = lib.UCXContext(config, feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
    worker = lib.UCXWorker(context)
    worker.init_blocking_progress_mode()
    return lib, array, context, worker


def _peer_buffer(max_size: int, memory: str) -> memoryview:
    if memory == "anon":
        return memoryview(prefaulted(max_size))
    from kvstore.memory.shm import SharedMemory

    return SharedMemory.create(f"kvbench-{os.getpid()}", max_size, unlink_now=True).buf


def _peer(conn, max_size: int, via: str, memory: str) -> None:
    from kvstore.transports.ucx_server import context_config

    lib, array, context, worker = _setup(context_config())
    accepted: list = []
    if via == "listener":
        listener = lib.UCXListener.create(worker, 0, lambda req: accepted.append(req))
        conn.send(("listener", listener.port))
        while not accepted:
            worker.progress_worker_event(TIMEOUT_MS)
        endpoint = listener.create_endpoint_from_conn_request(accepted[0], True)
    else:
        conn.send(("address", worker.address.tobytes()))
        endpoint = worker.create_endpoint_from_worker_address(lib.UCXAddress.create_from_buffer(conn.recv()), False)
    buf = _peer_buffer(max_size, memory)
    cmd, ack = memoryview(bytearray(9)), memoryview(bytearray(1))
    while True:
        _wait(worker, [endpoint.tag_recv(array(cmd), lib.UCXXTag(CMD))])
        kind, size = cmd[0], int.from_bytes(cmd[1:], "little")
        if kind == ord("p"):
            _wait(worker, [endpoint.tag_recv(array(buf[:size]), lib.UCXXTag(DATA))])
            _wait(worker, [endpoint.tag_send(array(ack), lib.UCXXTag(ACK))])
        elif kind == ord("g"):
            _wait(worker, [endpoint.tag_send(array(buf[:size]), lib.UCXXTag(DATA))])
        else:
            break
    conn.send("bye")


class RawUcx:
    """A raw ucxx peer in another process; ``via`` is "address" (shared memory) or "listener" (TCP here);
    ``peer_memory`` is "anon" (ordinary process memory) or "shm" (like a daemon segment)."""

    def __init__(self, max_size: int, via: str = "address", peer_memory: str = "anon"):
        if via not in ("address", "listener"):
            raise ValueError(f"via must be 'address' or 'listener', got {via!r}")
        if peer_memory not in ("anon", "shm"):
            raise ValueError(f"peer_memory must be 'anon' or 'shm', got {peer_memory!r}")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        self.proc = ctx.Process(target=_peer, args=(child, max_size, via, peer_memory), daemon=True)
        self.proc.start()
        self.lib, self.array, self._context, self.worker = _setup({})
        kind, where = self._conn.recv()
        if kind == "listener":
            self.endpoint = self.worker.create_endpoint_from_hostname("127.0.0.1", where, True)
        else:
            address = self.lib.UCXAddress.create_from_buffer(where)
            self.endpoint = self.worker.create_endpoint_from_worker_address(address, False)
            self._conn.send(self.worker.address.tobytes())
        self.buf = memoryview(prefaulted(max_size))
        self._cmd = memoryview(bytearray(9))
        self._ack = memoryview(bytearray(1))

    def _command(self, kind: bytes, size: int):
        self._cmd[:] = kind + size.to_bytes(8, "little")
        return self.endpoint.tag_send(self.array(self._cmd), self.lib.UCXXTag(CMD))

    def send(self, size: int) -> None:
        tag = self.lib.UCXXTag
        _wait(self.worker, [self._command(b"p", size), self.endpoint.tag_send(self.array(self.buf[:size]), tag(DATA)),
                            self.endpoint.tag_recv(self.array(self._ack), tag(ACK))])

    def recv(self, size: int) -> None:
        _wait(self.worker, [self._command(b"g", size),
                            self.endpoint.tag_recv(self.array(self.buf[:size]), self.lib.UCXXTag(DATA))])

    def close(self) -> None:
        _wait(self.worker, [self._command(b"q", 0)])
        self._conn.recv()
        self.proc.join(timeout=10)
        self.endpoint.close()
        self.worker.progress()
