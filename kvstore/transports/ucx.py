"""UCX data path (on ``ucxx``): the client side, :class:`UcxTransport`, registered as ``"ucx"``.

A ucx client is an ordinary kvstore client: hello, put, commit, get and the rest go over its unix/tcp control
connection. Payloads above the inline limit move over UCX as tagged messages, straight between the caller's
buffer and the daemon's segment memory (the daemon side is :mod:`kvstore.transports.ucx_server`):

* **put**: ``put(mode="ucx")``: the daemon allocates the region and replies with the put id and a random
  62-bit tag; the client sends its buffer with that tag, waits until the send completes, then commits. The
  daemon receives a message into the region only once it has probed it and seen exactly the object's length,
  and commits only once that receive completed without error: a put whose bytes do not all arrive (or whose
  message has another length) is aborted and never visible.
* **get_into**: ``get(mode="ucx")``: the daemon leases the object, posts a tagged send from the segment and
  replies with the size and tag (objects up to 64 KiB come back inline on the control reply instead); the
  client receives into the caller's buffer. The daemon releases the lease when its send completes.
  One round trip.

Connecting (on the first transfer, op ``ucx_connect``):

* **same host**: the two sides exchange UCX worker addresses over the control connection and create their
  endpoints without peer-failure handling, which lets UCX use shared memory (sysv fifo for eager messages,
  CMA single-copy rendezvous for large ones). Through a listener UCX would pick TCP here, because the
  shared-memory transports cannot detect a dead peer.
* **other host**: the client connects to the daemon's UCX listener (``--listen ucx://host:port``) with
  peer-failure handling on, so UCX picks the best lanes it has (RDMA verbs when built with them, TCP
  otherwise). The daemon sends a one-time random id over the new endpoint and the client claims it on its
  control connection (op ``ucx_claim``), which binds the endpoint to the authenticated session.
* ``KVSTORE_UCX_CONNECT=address|listener`` overrides the choice (e.g. to use the listener on one host).

Who touches whose memory (same host, CMA). The daemon's UCX context uses ``RNDV_SCHEME=put_zcopy``: a client
writes its puts into the daemon's segment and reads its gets from it, so the daemon never makes a system call
on a client's pages and a client that dies mid-transfer cannot take the daemon down (its receive is simply
cancelled when the session closes). The converse is UCX's rule for endpoints without error handling: if the
*daemon* dies in the middle of a same-host transfer, UCX aborts the client process. ``transport="shm"`` (the
same-host default of ``"auto"``) has no such coupling; ``UCX_TLS=^cma`` keeps UCX but copies through the
shared-memory fifo instead (slower, no cross-process system calls).

RDMA deployments. The PyPI ``libucx`` wheel is built without verbs. On hosts with RDMA NICs, build or install
a UCX with verbs/rdmacm (e.g. the distribution's ``ucx``/``rdma-core`` packages or MLNX_OFED) and make ucxx
load it: ``LD_LIBRARY_PATH=/opt/ucx/lib`` (ucxx then uses the system ``libucp`` when ``libucx`` is not
installed from PyPI), check with ``ucx_info -d`` that ``rc_mlx5``/``dc_mlx5`` appear, and choose transports
with ``UCX_TLS=rc,sm,self`` (or ``UCX_TLS=^tcp`` to keep every other transport) and ``UCX_NET_DEVICES=mlx5_0:1``
on both the daemon and its clients. ``docs/transports.md`` has the full recipe.

Everything UCX is imported on first use: this module only asks whether ``ucxx`` is installed.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore.transports.base import (
    Channel,
    DevicePath,
    PayloadDigest,
    TransportFailure,
    TransportUnavailable,
    host_only,
    register,
    unavailable,
)

#: transfer tags are random and below this bound; the bit above marks the daemon's wire-up message
TAG_LIMIT = 1 << 62
WIREUP_TAG = 1 << 62
#: ``ucx_connect`` ``via`` values a client may ask for
CONNECT_MODES = ("auto", "address", "listener")
DEFAULT_TIMEOUT = 30.0
INSTALL_HINT = "install it with: pip install 'kvstore[ucx]'  (ucxx-cu12, which brings libucx)"


def new_tag() -> int:
    """A fresh random transfer tag (unguessable, so another peer cannot aim a message at a posted receive)."""
    return secrets.randbelow(TAG_LIMIT - 1) + 1


def load() -> tuple[Any, Any]:
    """Import ucxx on first use; returns ``(libucxx, Array)``. Raises TransportUnavailable with the reason."""
    # ucxx sets UCX_MEMTYPE_CACHE at import, which UCX >= 1.19 no longer knows and warns about on every
    # context; keep stderr quiet unless the user asked for those warnings.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        from ucxx._lib import libucxx
        from ucxx._lib.arr import Array
    except ImportError as exc:
        raise TransportUnavailable(f"the ucx transport needs the ucxx package ({exc}); {INSTALL_HINT}") from None
    except Exception as exc:  # a broken libucx: surface it as unavailable, not as a crash of the caller
        raise TransportUnavailable(f"ucxx failed to load: {type(exc).__name__}: {exc}") from None
    return libucxx, Array


def failure(what: str, exc: BaseException) -> TransportFailure:
    """A ucxx error (a status-code exception) as this package's TransportFailure."""
    return TransportFailure(f"{what} failed: {type(exc).__name__}: {exc}")


def check(request: Any, what: str) -> None:
    """Raise TransportFailure if a completed ucxx request ended in error."""
    try:
        request.check_error()
    except Exception as exc:  # ucxx raises one class per UCS status code
        raise failure(what, exc) from None


class UcxTransport:
    """Client side of the UCX path: one UCX context, worker and endpoint per connection, progressed by the
    calling thread (blocking on the worker's event fd while a transfer is in flight, no progress thread)."""

    name = "ucx"
    on_connection = False

    def __init__(self, segments: dict | None = None, *, connect: str | None = None):
        del segments  # the UCX path never maps daemon memory
        mode = connect or os.environ.get("KVSTORE_UCX_CONNECT", "auto")
        if mode not in CONNECT_MODES:
            raise TransportFailure(f"KVSTORE_UCX_CONNECT must be one of {CONNECT_MODES}, got {mode!r}")
        self._lib, self._array = load()
        self._mode = mode
        self._lock = threading.Lock()
        try:
            self._context = self._lib.UCXContext({}, feature_flags=(self._lib.Feature.TAG, self._lib.Feature.WAKEUP))
            self._worker = self._lib.UCXWorker(self._context)
            self._worker.init_blocking_progress_mode()
        except Exception as exc:
            raise TransportUnavailable(f"cannot start a UCX worker: {type(exc).__name__}: {exc}") from None
        self._endpoint: Any = None
        self._connects = 0  # endpoints opened so far: names the current one
        self.via: str | None = None  # "address" or "listener" once connected
        self.timeout = DEFAULT_TIMEOUT

    # ---- Transport ----------------------------------------------------------------------------------
    def regions(self) -> None:
        return None

    def device_path(self) -> DevicePath:
        raise TransportUnavailable(host_only(self.name))

    def reserve(self, channel: Channel, request: dict, src: memoryview, checksum: PayloadDigest) -> dict:
        with self._lock:
            reply = self._call(channel, {**request, "mode": "ucx"})
            # the endpoint the daemon posted its receive on: the send must go through that one
            return {**reply, "ucx_endpoint": self._connects}

    def write(self, channel: Channel, reply: dict, src: memoryview, checksum: PayloadDigest) -> None:
        with self._lock:
            if self._endpoint is None or reply["ucx_endpoint"] != self._connects:
                raise TransportFailure("the UCX endpoint this put was reserved on is gone")  # another thread's failure
            try:
                what = f"send of {len(src)} bytes"
                self._wait(self._post(self._endpoint.tag_send, what, self._array(src),
                                      self._lib.UCXXTag(reply["tag"])), what)
            except BaseException:
                self._disconnect()  # nothing of ours may stay posted; the daemon cancels its receive on abort
                raise

    def get_into(self, channel: Channel, request: dict, dst: Callable[[dict], memoryview]) -> dict:
        with self._lock:
            reply = self._call(channel, {**request, "mode": "ucx"}, into=dst)
            if "tag" not in reply:
                return reply  # small object: it came inline with the reply
            size, tag = reply["size"], self._lib.UCXXTag(reply["tag"])
            try:
                out = dst(reply)[:size]
            except BaseException:
                self._drain(tag)
                raise
            what = f"receive of {size} bytes"
            try:
                self._wait(self._post(self._endpoint.tag_recv, what, self._array(out), tag), what)
            except TransportFailure:
                self._disconnect()  # cancels the receive: nothing writes into the caller's buffer later
                channel.call({"op": "ping"})  # a dead daemon surfaces as the connection error it is
                raise
        return reply

    def close(self) -> None:
        with self._lock:
            self._disconnect()
            self._worker = self._context = None

    # ---- connection ---------------------------------------------------------------------------------
    def _call(self, channel: Channel, request: dict, into: Callable[[dict], memoryview] | None = None) -> dict:
        """A ucx-mode put/get. The daemon drops a client's endpoint when a transfer failed under it (it
        answers the next one with a Transport error): reconnect once and retry; the refused request left
        nothing allocated or leased."""
        self._ensure_connected(channel)
        try:
            return channel.call(request, into=into)
        except Exception as exc:
            if getattr(exc, "code", None) != "Transport":  # the wire code of the daemon's TransportError
                raise
        self._disconnect()
        self._ensure_connected(channel)
        return channel.call(request, into=into)

    def _ensure_connected(self, channel: Channel) -> None:
        if self._endpoint is not None:
            return
        if self._worker is None:
            raise TransportFailure("the ucx transport is closed")
        self.timeout = float(getattr(channel, "timeout", DEFAULT_TIMEOUT))
        reply = channel.call({"op": "ucx_connect", "address": self._worker.address.tobytes(), "via": self._mode})
        try:
            self._open_endpoint(channel, reply)
        except BaseException:
            self._disconnect()
            raise
        self._connects += 1
        self.via = reply["via"]

    def _open_endpoint(self, channel: Channel, reply: dict) -> None:
        lib = self._lib
        if reply["via"] == "address":
            address = self._post(lib.UCXAddress.create_from_buffer, "reading the daemon's worker address",
                                 reply["address"])
            self._endpoint = self._post(self._worker.create_endpoint_from_worker_address, "connecting by worker "
                                        "address", address, reply["error_handling"])
            return
        where = f"{reply['host']}:{reply['port']}"
        self._endpoint = self._post(self._worker.create_endpoint_from_hostname, f"connecting to {where}",
                                    reply["host"], reply["port"], True)
        conn = bytearray(8)
        self._wait(self._post(self._endpoint.tag_recv, "wire-up", self._array(memoryview(conn)),
                              lib.UCXXTag(WIREUP_TAG)), f"UCX wire-up with {where}")
        channel.call({"op": "ucx_claim", "conn": int.from_bytes(conn, "little")})

    @staticmethod
    def _post(fn: Callable[..., Any], what: str, *args: Any) -> Any:
        """Call into ucxx, turning its status exceptions into TransportFailure."""
        try:
            return fn(*args)
        except Exception as exc:
            raise failure(what, exc) from None

    def _disconnect(self) -> None:
        endpoint, self._endpoint, self.via = self._endpoint, None, None
        if endpoint is None:
            return
        try:
            if endpoint.alive:  # a failed endpoint is closed already (closing it again crashes ucxx)
                endpoint.close()  # cancels every request still posted on it
            self._worker.progress()
        except Exception:
            pass  # the endpoint is being dropped either way

    # ---- progress -----------------------------------------------------------------------------------
    def _wait(self, request: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        worker = self._worker
        while not request.completed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportFailure(f"{what} did not complete within {self.timeout:g} s")
            worker.progress_worker_event(max(1, min(100, int(left * 1000))))
        check(request, what)

    def _drain(self, tag: Any) -> None:
        """Consume a message we will not keep: a one-byte receive truncates it and completes its sender."""
        sink = memoryview(bytearray(1))
        try:
            what = "discarding a refused object"
            self._wait(self._post(self._endpoint.tag_recv, what, self._array(sink), tag), what)
        except TransportFailure:
            pass  # expected: the message is longer than one byte; its sender is completed all the same
        except BaseException:
            self._disconnect()
            raise


if importlib.util.find_spec("ucxx") is None:
    unavailable("ucx", f"the ucxx package is not installed; {INSTALL_HINT}")
else:
    register("ucx", UcxTransport)
