"""UcxDataServer: the daemon's UCX data endpoint (``--listen ucx://host:port``), and UcxPeer, one client's
endpoint on it. The protocol and the client side are described in :mod:`kvstore.transports.ucx`.

One UCX context and worker serve every client. The worker is progressed by the daemon's asyncio loop: its
event fd is registered with ``loop.add_reader``, so there is no progress thread and no lock; every request is
posted, progressed and completed on the loop thread, and its completion resolves an asyncio future.

The context uses ``RNDV_SCHEME=put_zcopy``: in a same-host (CMA) rendezvous the client writes its puts into
the segment and reads its gets out of it, so the daemon never makes a system call on a client's memory, and
a client that dies mid-transfer cannot make UCX abort the daemon. Every request is posted through the
client's endpoint, so closing a UcxPeer (the session ended) cancels whatever it still had posted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from kvstore.transports.base import TransportFailure
from kvstore.transports.ucx import WIREUP_TAG, check, failure, load, new_tag
from kvstore.transports.ucx_bind import bind_addresses, local_address

log = logging.getLogger("kvstore.daemon.server")
#: an endpoint that connected to the listener but was not claimed by a session within this time is closed
UNCLAIMED_TTL = 30.0
#: safety net: progress the worker this often even if its event fd stays quiet
TICK_S = 0.2
CONTEXT_CONFIG = {"RNDV_SCHEME": "put_zcopy"}


def context_config() -> dict[str, str]:
    """The daemon's UCX context options: CONTEXT_CONFIG, less what the environment sets itself. Setting
    ``UCX_RNDV_SCHEME=get_zcopy`` makes the daemon do the same-host copies (about 1.7x faster into 4 KiB-page
    shared memory here) at the price this module's docstring names: a client killed mid-transfer then
    makes UCX abort the daemon."""
    return {k: v for k, v in CONTEXT_CONFIG.items() if f"UCX_{k}" not in os.environ}


@dataclass(slots=True, eq=False)
class _Pending:
    request: Any
    future: asyncio.Future
    keep: tuple  # buffers UCX reads or writes until the request completes
    what: str


@dataclass(slots=True, eq=False)
class _Expected:
    """A put's payload not yet arrived: received (into ``region``) once a message with ``tag`` is probed."""
    peer: UcxPeer
    region: memoryview
    future: asyncio.Future


class UcxPeer:
    """One client's endpoint on the daemon's worker. ``receive``/``send`` post a tagged transfer between a
    segment region and the client and return ``(tag, future)``; ``close`` cancels everything still posted."""

    def __init__(self, server: UcxDataServer, endpoint: Any, via: str, error_handling: bool):
        self.server, self._endpoint = server, endpoint
        self.via, self.error_handling = via, error_handling

    @property
    def closed(self) -> bool:
        return self._endpoint is None

    def describe(self) -> str:
        links = "peer-failure handling (tcp or verbs)" if self.error_handling else "shared memory (sysv/cma)"
        return f"ucx by {self.via}, {links}"

    def receive(self, region: memoryview) -> tuple[int, asyncio.Future]:
        """Expect a message of exactly ``len(region)`` bytes for ``region``; its future fails if the message
        has another length. Nothing is posted into the region until the message is there (tag probe), and
        the receive then goes through this endpoint, so ``close`` cancels it."""
        if self._endpoint is None:
            raise TransportFailure("the client's UCX endpoint is closed; it must reconnect (ucx_connect)")
        return self.server.expect(self, region)

    def abandon(self, tag: int) -> bool:
        """Stop expecting the message ``tag``; False if it is not expected (any more): its receive may be
        posted, and only ``close`` can cancel that (ucxx has no per-request cancel)."""
        return self.server.unexpect(self, tag)

    def receive_probed(self, region: memoryview, probe: Any) -> asyncio.Future:
        what = f"receive of {len(region)} bytes"
        if self._endpoint is None:
            raise TransportFailure(f"{what}: the client's UCX endpoint closed")
        buf = self.server.array(region)
        try:
            request = self._endpoint.tag_recv_with_handle(buf, probe)
        except Exception as exc:
            raise failure(what, exc) from None
        return self.server.watch(request, (buf, region), what)

    def send(self, region: memoryview) -> tuple[int, asyncio.Future]:
        """Post a send of ``region``; it completes when the client has taken the bytes."""
        return self._post("tag_send", region, f"send of {len(region)} bytes")

    def _post(self, method: str, region: memoryview, what: str) -> tuple[int, asyncio.Future]:
        if self._endpoint is None:
            raise TransportFailure("the client's UCX endpoint is closed; it must reconnect (ucx_connect)")
        lib, array = self.server.lib, self.server.array
        tag = new_tag()
        buf = array(region)
        try:
            request = getattr(self._endpoint, method)(buf, lib.UCXXTag(tag))
        except Exception as exc:
            raise failure(what, exc) from None
        return tag, self.server.watch(request, (buf, region), what)

    def close(self) -> None:
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            self.server.forget(self)
            self.server.close_endpoint(endpoint)


class UcxDataServer:
    """The daemon side of the UCX path: a listener on ``port`` (all interfaces: ucxx binds no address) for
    clients on other hosts, and the worker address for clients on this host."""

    def __init__(self, host: str, port: int, config: dict[str, str] | None = None):
        self.host, self.port = host, port
        self._bind = bind_addresses(host)
        self.lib, self.array = load()
        self._config = {**context_config(), **(config or {})}
        self._pending: list[_Pending] = []
        self._expected: dict[int, _Expected] = {}
        self._unclaimed: dict[int, tuple[Any, float]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context = self._worker = self._listener = None
        self._tick: asyncio.TimerHandle | None = None
        self._progressing = self._posted = False

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        lib = self.lib
        try:
            self._context = lib.UCXContext(self._config, feature_flags=(lib.Feature.TAG, lib.Feature.WAKEUP))
            self._worker = lib.UCXWorker(self._context)
            self._worker.init_blocking_progress_mode()
            self._listener = lib.UCXListener.create(self._worker, self.port, self._on_connect)
        except Exception as exc:
            self._context = self._worker = self._listener = None
            raise failure(f"starting the UCX endpoint on port {self.port}", exc) from None
        self.port = self._listener.port
        self._loop = loop
        loop.add_reader(self._worker.epoll_file_descriptor, self.progress)
        self._tick = loop.call_later(TICK_S, self._on_tick)
        self.progress()

    @property
    def address(self) -> bytes:
        """The worker address a same-host client connects to."""
        return self._worker.address.tobytes()

    def close(self) -> None:
        """Cancel everything in flight and release the worker (the daemon is stopping)."""
        if self._worker is None:
            return
        for endpoint, _ in self._unclaimed.values():
            self.close_endpoint(endpoint)
        self._unclaimed.clear()
        if self._tick is not None:
            self._tick.cancel()
        self._loop.remove_reader(self._worker.epoll_file_descriptor)
        self._worker.progress()
        self._reap()
        closing = TransportFailure("the daemon's UCX endpoint closed")
        for p in self._pending:
            if not p.future.done():
                p.future.set_exception(closing)
        for e in self._expected.values():
            if not e.future.done():
                e.future.set_exception(closing)
        self._pending.clear()
        self._expected.clear()
        self._listener = self._worker = self._context = None

    # ---- peers --------------------------------------------------------------------------------------
    def connect(self, address: bytes, error_handling: bool) -> UcxPeer:
        """An endpoint to a client's worker ``address`` (same host: without peer-failure handling)."""
        try:
            remote = self.lib.UCXAddress.create_from_buffer(address)
            endpoint = self._worker.create_endpoint_from_worker_address(remote, error_handling)
        except Exception as exc:
            raise failure("connecting to the client's worker address", exc) from None
        self.progress()
        return UcxPeer(self, endpoint, "address", error_handling)

    def claim(self, conn: int) -> UcxPeer:
        """The listener endpoint that received the one-time id ``conn``."""
        try:
            endpoint, _ = self._unclaimed.pop(conn)
        except KeyError:
            raise TransportFailure(f"no pending UCX connection with id {conn:#x} (expired or already claimed)") \
                from None
        return UcxPeer(self, endpoint, "listener", True)

    def expect(self, peer: UcxPeer, region: memoryview) -> tuple[int, asyncio.Future]:
        tag = new_tag()
        future = self._loop.create_future()
        future.add_done_callback(_quiet)
        self._expected[tag] = _Expected(peer, region, future)
        self._kick()
        return tag, future

    def unexpect(self, peer: UcxPeer, tag: int) -> bool:
        expected = self._expected.get(tag)
        if expected is None or expected.peer is not peer:
            return False
        del self._expected[tag]
        if not expected.future.done():
            expected.future.set_exception(TransportFailure("abandoned"))
        return True

    def forget(self, peer: UcxPeer) -> None:
        """Drop what ``peer`` was still expected to send (its session is closing)."""
        for tag, e in list(self._expected.items()):
            if e.peer is peer:
                del self._expected[tag]
                if not e.future.done():
                    e.future.set_exception(TransportFailure("the client's UCX endpoint closed"))

    def close_endpoint(self, endpoint: Any) -> None:
        try:
            # ucxx cancels every request still posted through the endpoint. One that failed (peer gone, with
            # error handling on) is closed and its requests cancelled already; closing it again would crash.
            if endpoint.alive:
                endpoint.close()
        except Exception as exc:
            log.debug("closing a UCX endpoint: %s", exc)
        self._kick()

    def _addressed_to_us(self, endpoint: Any) -> bool:
        """ucxx listens on every interface (it takes no bind address): serve only connections that arrived
        on the address asked for (``--listen ucx://127.0.0.1:P`` must not answer on a public interface)."""
        if self._bind is None:
            return True
        local = local_address(endpoint)
        if local is not None and ipaddress.ip_address(local) in self._bind:
            return True
        log.warning("refused a UCX connection to %s: this endpoint serves %s only", local or "an unknown address",
                    self.host)
        self.close_endpoint(endpoint)
        return False

    def _on_connect(self, conn_request: Any) -> None:
        # Runs inside worker progress: accept on the next loop turn instead of re-entering UCX here.
        self._loop.call_soon(self._accept, conn_request)

    def _accept(self, conn_request: Any) -> None:
        if self._worker is None:
            return
        try:
            endpoint = self._listener.create_endpoint_from_conn_request(conn_request, True)
        except Exception as exc:
            log.warning("refused a UCX connection: %s", exc)
            return
        if not self._addressed_to_us(endpoint):
            return
        conn = new_tag()
        self._unclaimed[conn] = (endpoint, time.monotonic() + UNCLAIMED_TTL)
        hello = memoryview(bytearray(conn.to_bytes(8, "little")))
        buf = self.array(hello)
        try:
            request = endpoint.tag_send(buf, self.lib.UCXXTag(WIREUP_TAG))
        except Exception as exc:
            self._unclaimed.pop(conn, None)
            self.close_endpoint(endpoint)
            log.warning("UCX wire-up send failed: %s", exc)
            return
        self.watch(request, (buf, hello), "wire-up").add_done_callback(_quiet)

    # ---- progress -----------------------------------------------------------------------------------
    def watch(self, request: Any, keep: tuple, what: str) -> asyncio.Future:
        """A future resolved (on the loop) when ``request`` completes; it fails with TransportFailure."""
        future = self._loop.create_future()
        future.add_done_callback(_quiet)
        self._pending.append(_Pending(request, future, keep, what))
        self._kick()
        return future

    def progress(self) -> None:
        """Progress the worker until it has nothing left to do, resolve completed requests, and re-arm the
        event fd (arming fails while events are pending, hence the loop)."""
        worker = self._worker
        if worker is None or self._progressing:
            return
        self._progressing = True
        try:
            while True:
                self._posted = False
                worker.progress()
                if self._expected:
                    self._match()
                self._reap()
                if not self._posted and worker.arm():
                    return
        finally:
            self._progressing = False

    def _kick(self) -> None:
        """Something was posted: progress now, or once more if we are inside progress already."""
        self._posted = True
        self.progress()

    def _match(self) -> None:
        """Start receiving every expected payload whose message has arrived (a length other than the
        region's fails the put; the message is drained by a one-byte receive so its sender completes)."""
        lib = self.lib
        for tag, e in list(self._expected.items()):
            probe = self._worker.tag_probe(lib.UCXXTag(tag), remove=True)
            if not probe.matched:
                continue
            del self._expected[tag]
            if probe.length != len(e.region):
                self._drain(e.peer, probe)
                e.future.set_exception(TransportFailure(f"the client sent {probe.length} bytes for a "
                                                        f"{len(e.region)}-byte object"))
                continue
            try:
                received = e.peer.receive_probed(e.region, probe)
            except TransportFailure as exc:
                e.future.set_exception(exc)
                continue
            received.add_done_callback(lambda f, out=e.future: _chain(f, out))

    def _drain(self, peer: UcxPeer, probe: Any) -> None:
        sink = memoryview(bytearray(1))
        try:
            peer.receive_probed(sink, probe)
        except TransportFailure:
            pass  # the endpoint is gone; the message goes with it

    def _reap(self) -> None:
        if not self._pending:
            return
        still = []
        for p in self._pending:
            if not p.request.completed:
                still.append(p)
                continue
            if p.future.done():
                continue
            try:
                check(p.request, p.what)
            except TransportFailure as exc:
                p.future.set_exception(exc)
            else:
                p.future.set_result(None)
        self._pending = still

    def _on_tick(self) -> None:
        self.progress()
        now = time.monotonic()
        for conn, (endpoint, deadline) in list(self._unclaimed.items()):
            if deadline < now:
                del self._unclaimed[conn]
                self.close_endpoint(endpoint)
        if self._worker is not None:
            self._tick = self._loop.call_later(TICK_S, self._on_tick)


def _chain(source: asyncio.Future, target: asyncio.Future) -> None:
    if target.done():
        return
    if source.cancelled():
        target.set_exception(TransportFailure("receive cancelled"))
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(None)


def _quiet(future: asyncio.Future) -> None:
    """Mark a failure as seen: a transfer nobody awaits any more (its session closed) is not an error."""
    if not future.cancelled():
        future.exception()

