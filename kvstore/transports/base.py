"""The transport interface, its registry and its error family.

A transport moves the payload of one ``put`` or ``get_into`` between a caller's buffer and a region of a
daemon segment. The control messages (dicts) are opaque to it except for the data-plane fields it adds
(``mode`` and its own region fields); the daemon answers them through a :class:`Channel`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol


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


class Transport(Protocol):
    """Client side of one data path."""

    name: str

    def put(self, channel: Channel, request: dict, src: memoryview, checksum: PayloadDigest) -> dict:
        """Store ``src`` under the (already validated) ``request``; return the commit reply. ``checksum()``
        is the payload's digest, recorded at commit; a path that copies the bytes itself may use
        ``checksum.copy_into`` to hash them in the same pass.
        With ``request["defer"]`` the put is left pending: return ``{"put_id", "checksum"}`` and the caller
        commits it with others (``commit_many``)."""
        ...

    def get_into(self, channel: Channel, request: dict, dst: Callable[[dict], memoryview]) -> dict:
        """Read the object named in ``request`` into the buffer ``dst(reply)`` returns; return the reply."""
        ...

    def close(self) -> None:
        ...


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
