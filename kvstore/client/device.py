"""Device memory in a store: how ``KVStore.put`` / ``batch_put`` / ``get_into`` move torch CUDA tensors (or
:class:`~kvstore.memory.device.DeviceBuffer` objects).

A backend supplies one :class:`DeviceMemory` through ``KVStore.device_memory()`` (None: it takes host memory
only, and device values are refused with InvalidArgumentError before anything is sent); ``KVHandoff`` asks the
same hook whether it can hand device tensors to the store as they are. Two implementations:

* :class:`StagedDeviceMemory` (the embedded and cluster stores): device-to-host into a host buffer, then the
  store's host path; the reverse on reads. Checksums are recorded as for host values.
* :class:`DirectDeviceMemory` (a client of a same-host daemon on ``cuda_ipc`` or ``shm``): device-to-device
  through the daemon's GPU segments, or device-to-host straight into its shared memory (see
  :mod:`kvstore.transports.cuda_ipc`). An object put from device memory this way records no checksum (hashing
  device memory would cost a device-to-host copy), so ``verify=True`` cannot check it; an object put from
  host memory and read into device memory is verified by copying the bytes back to the host.

Copies run on the caller's current CUDA stream and have completed when the call returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvstore.core.digest import Digest
from kvstore.core.meta import ObjectMeta
from kvstore.core.value import Payload
from kvstore.errors import BufferTooSmallError, TransportError
from kvstore.gpu import runtime as gpu
from kvstore.memory.device import DeviceBuffer, address_of
from kvstore.transports.base import Channel, DevicePath, TransportFailure

PutMany = Callable[..., list[ObjectMeta]]  # a backend's _put_many(items, digests, *, flags)
GetInto = Callable[[str, Callable[[int], memoryview]], tuple[int, int | None]]  # a backend's _get_into


class DeviceMemory(Protocol):
    """What a store does with device values."""

    def describe(self) -> str:
        """How device buffers move (``stats()["device_path"]``)."""
        ...

    def put_many(self, items: list[tuple[ObjectMeta, Payload]], flags: Any) -> list[ObjectMeta]:
        """Store every item (device or host payloads) all or nothing, like ``batch_put``."""
        ...

    def get_into(self, key: str, dst: DeviceBuffer) -> tuple[int, int | None]:
        """Copy object ``key`` into ``dst``; (size, checksum recorded at commit). BufferTooSmallError first."""
        ...

    def close(self) -> None:
        ...


class _NoDigest:
    """The digest of a device payload: none is recorded (hashing device memory would cost a copy to the host)."""

    known = None

    def __call__(self) -> None:
        return None

    def copy_into(self, dst: memoryview) -> None:
        raise TypeError("a device payload is not copied through host memory")

    def record(self, value: int) -> None:
        pass


def _fitter(key: str, capacity: int) -> Callable[[int], None]:
    def fit(size: int) -> None:
        if size > capacity:
            raise BufferTooSmallError(f"object {key!r} is {size} bytes but the buffer holds {capacity}",
                                      needed=size, got=capacity)
    return fit


def _to_device(dst: DeviceBuffer, host: memoryview) -> None:
    if len(host):
        dst.runtime.copy_and_wait(dst.ptr, address_of(host), len(host), dst.device, dst.stream)


class StagedDeviceMemory:
    """Device values through a host buffer and the store's own host path (any backend)."""

    def __init__(self, put_many: PutMany, get_into: GetInto):
        self._put_many, self._get_into = put_many, get_into

    def describe(self) -> str:
        return "staged: device <-> host buffer, then the store's host path"

    def put_many(self, items: list[tuple[ObjectMeta, Payload]], flags: Any) -> list[ObjectMeta]:
        staged = [(meta, self._stage(payload)) for meta, payload in items]
        return self._put_many(staged, [Digest(p.view) for _, p in staged], flags=flags)

    @staticmethod
    def _stage(payload: Payload) -> Payload:
        if not isinstance(payload.view, DeviceBuffer):
            return payload
        return Payload(gpu.to_host(payload.view, len(payload.view)), payload.kind, payload.dtype, payload.shape)

    def get_into(self, key: str, dst: DeviceBuffer) -> tuple[int, int | None]:
        fit = _fitter(key, len(dst))
        holder: list[memoryview] = []

        def host(size: int) -> memoryview:
            fit(size)
            holder.append(memoryview(bytearray(size)))
            return holder[0]

        size, checksum = self._get_into(key, host)
        if holder:
            _to_device(dst, holder[0][:size])
        return size, checksum

    def close(self) -> None:
        pass


class DirectDeviceMemory:
    """Device values straight to and from a same-host daemon's memory (``cuda_ipc`` or ``shm``)."""

    def __init__(self, path: DevicePath, channel: Channel, put_many: PutMany, transport: str):
        self.path, self._channel, self._put_many = path, channel, put_many
        self._transport = transport

    def describe(self) -> str:
        return self.path.describe()

    def put_many(self, items: list[tuple[ObjectMeta, Payload]], flags: Any) -> list[ObjectMeta]:
        digests = [_NoDigest() if isinstance(p.view, DeviceBuffer) else Digest(p.view) for _, p in items]
        return self._put_many(items, digests, flags=flags)

    def get_into(self, key: str, dst: DeviceBuffer) -> tuple[int, int | None]:
        fit = _fitter(key, len(dst))

        def into(reply: dict[str, Any]) -> DeviceBuffer:
            fit(reply["size"])
            return dst

        try:
            reply = self.path.get_into_device(self._channel, {"op": "get", "key": key}, into)
        except TransportFailure as exc:
            raise TransportError(f"get of {key!r} failed on the {self._transport} path: {exc}") from None
        return reply["size"], reply["meta"]["checksum"]

    def pin_host(self, runtime: Any, address: int, length: int) -> bool:
        """Page-lock the store memory at ``address`` (a reserved or leased view of this client) for copies
        the caller enqueues itself; True if it is pinned (once per segment; unpinned at close)."""
        return self.path.pin_address(runtime, address, length)

    def close(self) -> None:
        pass  # the path is the transport's: it unpins what it pinned before it unmaps the shared memory
