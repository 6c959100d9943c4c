"""Connection: the client's blocking control channel to the daemon (implements ``transports.Channel``).

Every call is bounded by the connection's timeout; on a timeout or a broken socket the connection is closed
(its framing can no longer be trusted) and a ConnectionError-family error is raised. A connection given a
``reauth`` (``reconnects_with``) opens a fresh socket on its next call and authenticates it first, so one timed
out call does not leave the client unusable; one closed by ``close()`` stays closed. Lease releases can be
queued from any thread (e.g. a garbage-collected zero-copy object) and go out, without waiting for a reply,
ahead of the next request.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import select
import socket
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from kvstore.errors import (
    ChecksumError,
    InvalidArgumentError,
    KVStoreError,
    ProtocolError,
    StoreConnectionError,
    StoreTimeoutError,
    error_from_wire,
)
from kvstore.protocol import compression, wire
from kvstore.protocol.credentials import check_peer
from kvstore.protocol.url import Endpoint
from kvstore.transports.sockets import tune

_BUFFER = 64 << 10

Message = dict[str, Any]  # a request to the daemon, or its reply
#: where the bytes a reply announces (``stream`` or ``frames``) land: ``into(reply)`` gives the view to fill
Into = Callable[[Message], memoryview]


class Caller(Protocol):
    """What a call needs of a connection: a :class:`Connection`, or the stand-in re-authentication gets while
    the connection's lock is held (``reconnects_with``)."""

    @property
    def endpoint(self) -> Endpoint: ...

    def call(self, request: Message, payload: memoryview | None = None, into: Into | None = None,
             timeout: float | None = None) -> Message: ...


#: re-authentication of a fresh socket (``Connection.reconnects_with``): a bound method of the connection's owner
Reauth = Callable[[Caller], None]

MAX_TIMEOUT = 86400.0 * 365  # seconds; past what the platform's time_t takes, settimeout overflows

class Connection:
    def __init__(self, endpoint: Endpoint, timeout: float):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT:
            raise InvalidArgumentError(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {timeout!r}")
        self.endpoint, self.timeout = endpoint, timeout
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._buf = bytearray(_BUFFER)
        self._start = self._end = 0
        self._releases: collections.deque[int] = collections.deque()
        self._reauth: weakref.WeakMethod[Reauth] | None = None
        self._closed_by_user = False
        self.reconnects = 0
        self._lz4_scratch: memoryview | None = None
        self.last_wire_bytes = 0  # bytes the last compressed payload took on the wire
        self.max_frame = wire.MAX_FRAME  # the daemon's (its hello says): larger requests are refused unsent
        self._sock: socket.socket | None = self._open()

    def reconnects_with(self, reauth: Reauth) -> None:
        """After a failure closed this connection, the next call opens a new socket and runs ``reauth(channel)``
        on it first (``channel.call`` and ``channel.endpoint``, as on a Connection). ``reauth`` is a bound method,
        held weakly (the client that owns this connection)."""
        self._reauth = weakref.WeakMethod(reauth)

    def _reopen_locked(self) -> socket.socket:
        reauth = self._reauth() if self._reauth is not None else None
        if reauth is None or self._closed_by_user:
            raise StoreConnectionError(f"connection to {self.endpoint} is closed")
        self._sock = self._open()
        self._start = self._end = 0
        self._releases.clear()  # their leases went with the old connection
        try:
            reauth(_Unlocked(self))
        except BaseException:
            self._close_locked()
            raise
        self.reconnects += 1
        return self._sock

    def _open(self) -> socket.socket:
        ep = self.endpoint
        family = socket.AF_UNIX if ep.scheme == "unix" else (socket.AF_INET6 if ":" in ep.host else socket.AF_INET)
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(ep.path if ep.scheme == "unix" else (ep.host, ep.port))
        except TimeoutError:
            sock.close()
            raise StoreTimeoutError(f"connecting to {ep} timed out after {self.timeout} s") from None
        except OSError as exc:
            sock.close()
            raise StoreConnectionError(f"cannot connect to {ep}: {exc}") from None
        if ep.scheme == "unix":
            try:
                check_peer(sock, str(ep))  # before a token or a byte of data goes out
            except BaseException:
                sock.close()
                raise
        tune(sock)
        return sock

    @contextlib.contextmanager
    def bounded(self, seconds: float | None) -> Iterator[None]:
        """Calls made in the block (by this thread: a connection serves one caller at a time) are bounded by
        ``seconds`` when that is shorter than the connection's timeout."""
        if seconds is None or seconds >= self.timeout:
            yield
            return
        with self._lock:
            saved, self.timeout = self.timeout, seconds
            if self._sock is not None:
                self._sock.settimeout(seconds)
        try:
            yield
        finally:
            with self._lock:
                self.timeout = saved
                if self._sock is not None:
                    self._sock.settimeout(saved)

    @property
    def closed(self) -> bool:
        return self._sock is None

    def check_alive(self) -> None:
        """Raise StoreConnectionError if the connection is closed or the daemon's end has gone (EOF or reset),
        without a round trip: for the paths that read the daemon's shared memory without asking it."""
        sock = self._sock
        if sock is None:
            with self._lock:
                sock = self._sock or self._reopen_locked()
        poller = select.poll()  # a socket with a timeout would wait in recv(): ask readiness without waiting
        poller.register(sock, select.POLLIN)
        if not poller.poll(0):
            return  # nothing to read: the daemon's end is open
        try:
            if sock.recv(1, socket.MSG_PEEK):
                return  # a reply another thread is about to read
            gone: object = "the daemon closed the connection"
        except OSError as exc:
            gone = exc
        with self._lock:
            self._close_locked()
        raise StoreConnectionError(f"lost connection to {self.endpoint}: {gone}")

    # ---- Channel ------------------------------------------------------------------------------------
    def call(self, request: Message, payload: memoryview | None = None, into: Into | None = None,
             timeout: float | None = None) -> Message:
        with self._lock:
            return self._call_locked(request, payload, into, timeout)

    def try_call(self, request: Message) -> bool:
        """Send ``request`` only if nobody else is using the connection now (heartbeats)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._sock is not None:
                self._call_locked(request, None, None, None)
            return True
        finally:
            self._lock.release()

    def queue_release(self, lease: int) -> None:
        self._releases.append(lease)

    def _call_locked(self, request: Message, payload: memoryview | None, into: Into | None,
                     timeout: float | None) -> Message:
        sock = self._sock
        if sock is None:
            sock = self._reopen_locked()
        try:
            if timeout is not None:
                sock.settimeout(timeout)
            self._flush_releases(sock)
            rid = next(self._ids)
            frame = wire.encode({"v": wire.VERSION, "id": rid, **request}, self.max_frame)
            if payload is not None and request.get("compress") and len(payload) >= compression.MIN_SIZE:
                sock.sendall(frame)
                self._send_frames(sock, payload, request["compress"])
            elif payload is not None and len(payload) <= _BUFFER:
                sock.sendall(frame + payload)
            else:
                sock.sendall(frame)
                if payload is not None:
                    sock.sendall(payload)
            if request.get("noreply"):
                return {}
            reply = self._read_frame(sock)
            if reply.get("id") != rid:
                raise ProtocolError(f"reply id {reply.get('id')!r} does not match request {rid}")
            if not reply.get("ok"):
                if reply.get("error") == "Protocol":  # the daemon closes after a framing error
                    self._close_locked()
                raise error_from_wire(str(reply.get("error")), str(reply.get("message")), reply.get("extra"))
            if reply.get("stream"):
                self._receive_stream(sock, reply, into)
            elif reply.get("frames"):
                self._receive_frames(sock, reply, into)
            return reply
        except KVStoreError:
            raise  # the daemon's typed answer (some are OSError subclasses): not a broken connection
        except TimeoutError:
            self._close_locked()
            raise StoreTimeoutError(f"daemon at {self.endpoint} did not answer {request.get('op')!r} "
                                    f"within {timeout or self.timeout} s") from None
        except (ConnectionError, OSError) as exc:
            self._close_locked()
            raise StoreConnectionError(f"lost connection to {self.endpoint}: {exc}") from None
        finally:
            if timeout is not None and self._sock is not None:
                self._sock.settimeout(self.timeout)

    def send_releases(self) -> None:
        """Send the queued releases now (no reply awaited) instead of with the next request."""
        with self._lock:
            if self._sock is not None and self._releases:
                try:
                    self._flush_releases(self._sock)
                except OSError:
                    pass  # the next request reports the broken connection (and the daemon drops its leases)

    def _flush_releases(self, sock: socket.socket) -> None:
        while self._releases:
            lease = self._releases.popleft()
            sock.sendall(wire.encode({"v": wire.VERSION, "id": next(self._ids), "op": "release",
                                      "lease": lease, "noreply": True}))

    def _receive_stream(self, sock: socket.socket, reply: Message, into: Into | None) -> None:
        size = reply["stream"]
        try:
            dst = into(reply) if into is not None else None
        except BaseException:
            self._skip(sock, size)  # keep the framing intact, then report the caller's error
            raise
        if dst is None:
            self._skip(sock, size)
            raise ProtocolError("daemon streamed bytes nobody asked for")
        self._read_into(sock, dst[:size])

    # ---- compressed payloads (kvstore.protocol.compression) ------------------------------------------
    def _send_frames(self, sock: socket.socket, payload: memoryview, codec: str) -> None:
        # compressing frame i+1 overlaps with the kernel sending frame i out of the socket buffer
        encoder = compression.Encoder(payload, codec)
        for header, body in encoder:
            sock.sendall(header)
            sock.sendall(body)
        self.last_wire_bytes = encoder.wire_bytes

    def _receive_frames(self, sock: socket.socket, reply: Message, into: Into | None) -> None:
        """Decode the frames of a ``frames: size`` reply into ``into(reply)``, checking each. A corrupted frame
        raises ChecksumError after the rest are read (the connection stays in step; the buffer holds undefined
        bytes); a bad header raises ProtocolError and closes the connection."""
        size = reply["frames"]
        try:
            dst = into(reply) if into is not None else None
        except BaseException as exc:
            error: BaseException | None = exc
            dst = None
        else:
            error = None if dst is not None else ProtocolError("daemon streamed bytes nobody asked for")
        header = memoryview(bytearray(compression.HEADER.size))
        pos = wire_bytes = 0
        while pos < size:
            self._read_into(sock, header)
            try:
                frame = compression.parse_header(header, size - pos)
            except ProtocolError:
                self._close_locked()
                raise
            wire_bytes += len(header) + frame.wire_len
            if error is not None or dst is None:  # (no dst: error says why)
                self._skip(sock, frame.wire_len)
            else:
                target = dst[pos:pos + frame.raw_len]
                body = target if frame.codec == compression.STORED else self._scratch(frame.wire_len)
                self._read_into(sock, body)
                try:
                    compression.decode(frame, body, target)
                except ChecksumError as exc:
                    error = exc
            pos += frame.raw_len
        self.last_wire_bytes = wire_bytes
        if error is not None:
            raise error

    def _scratch(self, n: int) -> memoryview:
        if self._lz4_scratch is None:
            self._lz4_scratch = memoryview(bytearray(compression.lz4_bound(compression.CHUNK)))
        return self._lz4_scratch[:n]

    # ---- framing ------------------------------------------------------------------------------------
    def _fill(self, sock: socket.socket, n: int) -> None:
        if self._end - self._start >= n:
            return
        self._buf, self._start, self._end = wire.make_room(self._buf, self._start, self._end, n)
        view = memoryview(self._buf)
        while self._end - self._start < n:
            got = sock.recv_into(view[self._end:])
            if got == 0:
                raise ConnectionResetError("daemon closed the connection")
            self._end += got

    def _read_frame(self, sock: socket.socket) -> Message:
        self._fill(sock, 4)
        n = wire.frame_length(self._buf[self._start:self._start + 4])
        self._fill(sock, 4 + n)
        body = bytes(self._buf[self._start + 4:self._start + 4 + n])
        self._start += 4 + n
        return wire.decode(body, wire.REPLY_LIMITS)

    def _read_into(self, sock: socket.socket, view: memoryview) -> None:
        take = min(len(view), self._end - self._start)
        view[:take] = self._buf[self._start:self._start + take]
        self._start += take
        got = take
        while got < len(view):
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionResetError(f"daemon closed after {got} of {len(view)} bytes")
            got += n

    def _skip(self, sock: socket.socket, n: int) -> None:
        scratch = memoryview(bytearray(min(max(n, 1), 1 << 20)))
        while n > 0:
            chunk = scratch[:min(n, len(scratch))]
            self._read_into(sock, chunk)
            n -= len(chunk)

    # ---- closing ------------------------------------------------------------------------------------
    def _close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self._closed_by_user = True
            if self._sock is not None:
                try:
                    self._flush_releases(self._sock)
                except OSError:
                    pass
            self._close_locked()


class _Unlocked:
    """A Connection's ``call`` for code that runs while the connection's lock is held (re-authentication)."""

    def __init__(self, conn: Connection):
        self._conn, self.endpoint = conn, conn.endpoint

    def call(self, request: Message, payload: memoryview | None = None, into: Into | None = None,
             timeout: float | None = None) -> Message:
        return self._conn._call_locked(request, payload, into, timeout)
