"""UcxOps: the daemon-session side of the ``ucx`` data path (a handler object that a
:class:`~kvstore.daemon.session.Session` owns).

``ucx_connect`` / ``ucx_claim`` bind a UCX endpoint to the session; ``put``/``get`` with ``mode="ucx"`` post a
tagged receive into / send from the object's region through it (see :mod:`kvstore.transports.ucx` for the protocol).
A put is committed only after its receive completed without error; a get's lease is released when its send
completes. Closing the session closes the endpoint first, which cancels whatever is still posted, before
the master frees the space of the session's pending puts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvstore.errors import KVStoreError, TransportError
from kvstore.protocol.url import Endpoint
from kvstore.protocol.wire import ok_reply
from kvstore.transports.base import TransportFailure

if TYPE_CHECKING:
    from kvstore.core.master import Lease, Replica
    from kvstore.daemon.context import SessionContext
    from kvstore.daemon.session import Handler
    from kvstore.transports.ucx_server import UcxDataServer, UcxPeer

log = logging.getLogger("kvstore.daemon.server")
#: a commit waits at most this long for the bytes its client says it has sent
LANDING_TIMEOUT = 10.0
T = TypeVar("T")


def start_ucx(endpoint: Endpoint, loop: asyncio.AbstractEventLoop) -> UcxDataServer:
    """Start the daemon's UCX endpoint for ``--listen ucx://host:port``; TransportError if it cannot run."""
    try:
        from kvstore.transports.ucx_server import UcxDataServer

        server = UcxDataServer(endpoint.host, endpoint.port)
        server.start(loop)
    except TransportFailure as exc:
        raise TransportError(f"cannot serve {endpoint}: {exc}") from None
    log.info("UCX data endpoint on port %d", server.port)
    return server


class UcxOps:
    """``ucx_connect``, ``ucx_claim``, and the UCX side of the session's ``put`` / ``get`` / ``commit`` /
    ``abort`` in ``mode="ucx"``."""

    def __init__(self, session: SessionContext):
        self.s = session
        self.data_peer: UcxPeer | None = None
        self._landing: dict[int, tuple[int, asyncio.Future[Any]]] = {}  # put id -> (tag, payload landed)

    def handlers(self) -> dict[str, Handler]:
        return {"ucx_connect": self.op_ucx_connect, "ucx_claim": self.op_ucx_claim}

    @property
    def data_path(self) -> str:
        """How this client's payloads move, for stats and ``kvstore stats``."""
        if self.s.transport != "ucx":
            return self.s.transport
        return self.data_peer.describe() if self.data_peer is not None else "ucx (not connected yet)"

    # ---- ops ----------------------------------------------------------------------------------------
    async def op_ucx_connect(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        ucx = self._ucx_server()
        self.close_data()
        same_host = self.s.client_host == self.s.ctx.host_id
        via = f["via"] if f["via"] != "auto" else ("address" if same_host else "listener")
        if via == "address":
            self.data_peer = _ucx(lambda: ucx.connect(f["address"], error_handling=not same_host))
            return ok_reply(rid, via="address", address=ucx.address, error_handling=not same_host)
        return ok_reply(rid, via="listener", host=self._listener_host(ucx.host), port=ucx.port)

    async def op_ucx_claim(self, rid: int, f: dict[str, Any]) -> dict[str, Any]:
        ucx = self._ucx_server()
        self.close_data()
        self.data_peer = _ucx(lambda: ucx.claim(f["conn"]))
        return ok_reply(rid)

    # ---- put / get / commit hooks (called from the session's ops) -------------------------------------
    def put_reply(self, rid: int, replica: Replica) -> dict[str, Any]:
        """The region is allocated: post the receive into it and tell the client which tag to send with."""
        try:
            peer = self._peer()
            region = self.s.segments[replica.segment].view(replica.offset, replica.size)
            tag, landed = _ucx(lambda: peer.receive(region))
        except BaseException:
            self.s.master.abort(replica.id)
            raise
        self._landing[replica.id] = (tag, landed)
        return ok_reply(rid, put_id=replica.id, tag=tag)

    def get_reply(self, rid: int, lease: Lease) -> dict[str, Any]:
        """The object is leased: post the send from its region; the lease goes when the send completes."""
        replica = lease.replica
        try:
            peer = self._peer()
            region = self.s.segments[replica.segment].view(replica.offset, replica.size)
            tag, sent = _ucx(lambda: peer.send(region))
        except BaseException:
            self._release_quietly(lease.id)
            raise
        sent.add_done_callback(lambda _: self._release_quietly(lease.id))
        return ok_reply(rid, meta=replica.meta.to_wire(), size=replica.size, tag=tag)

    async def landed(self, put_ids: list[int]) -> None:
        """Wait until the UCX payloads of ``put_ids`` (if any went by UCX) arrived whole; a put whose bytes
        did not arrive is aborted (never visible) and the commit fails with TransportError."""
        for put_id in put_ids:
            tag, landed = self._landing.pop(put_id, (0, None))
            if landed is None:
                continue
            try:
                await asyncio.wait_for(asyncio.shield(landed), LANDING_TIMEOUT)
            except (TransportFailure, asyncio.TimeoutError) as exc:
                self._stop_receiving(tag, landed)
                try:
                    self.s.master.abort(put_id)
                except KVStoreError:
                    pass  # revoked meanwhile
                reason = str(exc) or f"nothing arrived within {LANDING_TIMEOUT:g} s"
                raise TransportError(f"put {put_id} aborted: its payload did not arrive ({reason})") from None

    def cancel_landing(self, put_id: int) -> None:
        """The client aborts a put: a receive still posted into its region must not outlive the region."""
        tag, landed = self._landing.pop(put_id, (0, None))
        if landed is not None:
            self._stop_receiving(tag, landed)

    def _stop_receiving(self, tag: int, landed: asyncio.Future[Any]) -> None:
        """Nothing may write into a put's region once it is aborted: drop the expectation, or, if the
        receive is posted already, close the endpoint (ucxx has no per-request cancel; the client
        reconnects on its next transfer)."""
        peer = self.data_peer
        if not landed.done() and peer is not None and not peer.abandon(tag):
            self.close_data()

    def close_data(self) -> None:
        """Close the endpoint (cancelling what is posted on it) and abort every UCX put whose payload had
        not landed whole: its receive is gone, so it can never be committed."""
        peer, self.data_peer = self.data_peer, None
        if peer is not None:
            peer.close()
        for put_id, (_, landed) in list(self._landing.items()):
            if landed.done() and not landed.cancelled() and landed.exception() is None:
                continue
            del self._landing[put_id]
            try:
                self.s.master.abort(put_id)
            except KVStoreError:
                pass  # already aborted or revoked

    # ---- helpers ------------------------------------------------------------------------------------
    def _ucx_server(self) -> UcxDataServer:
        if self.s.transport != "ucx":
            raise TransportError(f"ucx ops need the ucx transport; this connection uses {self.s.transport}")
        ucx: UcxDataServer | None = self.s.ctx.ucx
        if ucx is None:
            raise TransportError("this daemon serves no UCX endpoint (start it with --listen ucx://host:port)")
        return ucx

    def _peer(self) -> UcxPeer:
        self._ucx_server()
        if self.data_peer is None or self.data_peer.closed:
            raise TransportError("no UCX endpoint on this connection: send ucx_connect first")
        return self.data_peer

    def _release_quietly(self, lease_id: int) -> None:
        if self.s.client is None:
            return  # the session closed: the master already released this client's leases
        try:
            self.s.master.release(lease_id)
        except KVStoreError:
            pass

    def _listener_host(self, host: str) -> str:
        """The listener's host as this client can reach it: for a wildcard bind, the address the client's
        control connection arrived on."""
        try:
            wildcard = ipaddress.ip_address(host).is_unspecified
        except ValueError:
            return host  # a name
        if not wildcard:
            return host
        try:
            return str(self.s.sock.getsockname()[0])
        except (OSError, TypeError, IndexError):
            return "127.0.0.1"


def _ucx(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except TransportFailure as exc:
        raise TransportError(str(exc)) from None
