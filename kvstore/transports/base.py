"""The transport interface, its registry and its error family.

A transport moves the payload of one ``put`` or ``get_into`` between a caller's buffer and a region of a
daemon segment; the client owns the sequence around it (``kvstore/client/writes.py``: reserve, move, commit or
abort). The control messages (dicts) are opaque to it except for the data-plane fields it adds (``mode`` and its
own region fields); the daemon answers them through a :class:`Channel`. What a path can do beyond host puts
and gets it says itself: ``regions()`` (the daemon's memory mapped here) and ``device_path()``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvstore.memory.device import CudaRuntime, DeviceBuffer


class TransportFailure(Exception):
    """The data path failed; the caller aborts the operation (nothing half-written becomes visible)."""


class TransportUnavailable(TransportFailure):
    """The transport cannot be used here (not installed, not served by the peer, or not on this host)."""


class Channel(Protocol):
    """The control connection a transport speaks through (implemented by the kvstore client)."""

    def call(self, request: dict, payload: memoryview | None = None,
             into: Callable[[dict], memoryview] | None = None) -> dict:
        """Send ``request`` (followed by ``payload`` bytes when given) and return the reply. When ``into`` is
        given and the reply announces streamed bytes, they are received into ``into(reply)``."""
        ...


class PayloadDigest(Protocol):
    """The checksum of a put's payload (xxh3-64), recorded at commit."""

    def __call__(self) -> int | None:
        """The digest (computed now if no copy computed it)."""
        ...

    def copy_into(self, dst: memoryview) -> None:
        """Copy the payload into ``dst`` and compute the digest in the same pass (while the bytes are in cache)."""
        ...

    @property
    def known(self) -> int | None:
        """The digest if already computed, else None (computes nothing)."""
        ...

    def record(self, value: int) -> None:
        """Take the digest the receiver computed as the bytes arrived."""
        ...


class Regions(Protocol):
    """The daemon's segments mapped into this process (the same-host paths)."""

    def region(self, segment: int, offset: int, length: int) -> memoryview:
        """A writable view of ``[offset, +length)`` of ``segment`` (mapped on first use); TransportFailure if
        the daemon named a segment or bounds it did not announce."""
        ...


class DevicePath(Protocol):
    """Moves device buffers to and from a same-host daemon's memory. Copies run on the buffer's stream and have
    completed when a call returns."""

    def describe(self) -> str:
        """How device buffers move (``stats()["device_path"]``)."""
        ...

    def reserve_device(self, channel: Channel, request: dict) -> dict:
        """Ask the daemon for the region of the put ``request`` (with this path's fields); its reply: the pending
        put (``put_id``) and where its bytes go."""
        ...

    def write_device(self, channel: Channel, reply: dict, src: DeviceBuffer) -> None:
        """Copy ``src`` into the region ``reply`` names. On failure the caller aborts the put."""
        ...

    def get_into_device(self, channel: Channel, request: dict, dst: Callable[[dict], DeviceBuffer]) -> dict:
        """Read the object named in ``request`` into ``dst(reply)``; return the reply."""
        ...

    def pin_address(self, runtime: CudaRuntime, address: int, length: int) -> bool:
        """Page-lock the mapped memory holding ``[address, +length)``; True if it is pinned."""
        ...

    def close(self) -> None:
        ...


class Transport(Protocol):
    """Client side of one data path. It moves bytes between a caller's buffer and a region of a daemon segment;
    the put sequence around it (reserve, move, then commit, or leave pending, or abort) is the client's.

    A put is two calls: ``reserve`` sends the put request with this path's fields and returns the daemon's reply
    (the pending put's ``put_id`` and where its bytes go), then ``write`` moves the payload there. On a path
    whose bytes follow the request on the control connection (``on_connection``: the stream path) ``reserve``
    sends them too, and the daemon's reply is the committed put unless the request is deferred."""

    name: str
    #: a put's bytes follow its request on the control connection, and a get's follow the reply: the connection's
    #: payload compression applies to them
    on_connection: bool

    def regions(self) -> Regions | None:
        """The daemon's segments mapped here (puts written in place, reads without a copy); None on a path that
        cannot map them."""
        ...

    def device_path(self) -> DevicePath:
        """What moves device buffers on this path (owned and closed by the transport); TransportUnavailable on a
        path that moves host memory only."""
        ...

    def reserve(self, channel: Channel, request: dict, src: memoryview, checksum: PayloadDigest) -> dict:
        """Send the (already validated) put ``request`` with this path's fields; return the daemon's reply."""
        ...

    def write(self, channel: Channel, reply: dict, src: memoryview, checksum: PayloadDigest) -> None:
        """Move ``src`` into the region ``reply`` names; a path that copies the bytes itself may hash them in the
        same pass (``checksum.copy_into``). On failure the caller aborts the put (nothing becomes visible)."""
        ...

    def get_into(self, channel: Channel, request: dict, dst: Callable[[dict], memoryview]) -> dict:
        """Read the object named in ``request`` into the buffer ``dst(reply)`` returns; return the reply."""
        ...

    def close(self) -> None:
        ...


def host_only(name: str) -> str:
    """Why a path that never maps the daemon's memory cannot move device buffers."""
    return (f"the {name} transport moves host memory only; device buffers need a daemon on this host (transport "
            "'auto', 'cuda_ipc' or 'shm')")


_REGISTRY: dict[str, Callable[..., Transport]] = {}
_UNAVAILABLE: dict[str, str] = {}  # known transports that cannot run here, with the reason


def register(name: str, factory: Callable[..., Transport]) -> None:
    _REGISTRY[name] = factory
    _UNAVAILABLE.pop(name, None)


def unavailable(name: str, reason: str) -> None:
    """Record that the known transport ``name`` cannot be used here (``get`` raises with ``reason``)."""
    if name not in _REGISTRY:
        _UNAVAILABLE[name] = reason


def get(name: str) -> Callable[..., Transport]:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        if name in _UNAVAILABLE:
            raise TransportUnavailable(f"transport {name!r} is unavailable: {_UNAVAILABLE[name]}") from None
        raise TransportUnavailable(f"unknown transport {name!r}; known: {sorted(_REGISTRY)}") from None


def names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


#: The built-in transports, by module path: imported on first use (no side effects at package import, and no
#: module of this package imports another back). A module registers its transport when imported, or records
#: why it is unavailable here (ucx without ucxx, cuda_ipc without torch) without importing that dependency.
_MODULES = ("kvstore.transports.shm", "kvstore.transports.tcp", "kvstore.transports.ucx",
            "kvstore.transports.cuda_ipc")


def _load_builtin() -> None:
    for module in _MODULES:
        importlib.import_module(module)
