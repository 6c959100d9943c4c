"""GpuClient: ``put`` / ``batch_put`` / ``get_into`` of device memory for :class:`kvstore.client.remote.RemoteStore`
(a mixin placed before :class:`kvstore.client.store.KVStore`).

Device values are torch CUDA tensors (or :class:`kvstore.transports.cuda_ipc.DeviceBuffer` objects); host values go
to the base class unchanged. On a ``cuda_ipc`` connection they move device-to-device through the daemon's GPU
segments; on ``shm`` device-to-host through its shared memory; other paths refuse them with
InvalidArgumentError before anything is sent. Copies run on the caller's current CUDA stream and have completed
when the call returns.

Checksums: an object put from device memory records none (hashing device memory would cost a device-to-host
copy), so ``verify=True`` cannot check it; an object put from host memory and read into device memory is
verified by copying the bytes back to the host.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvstore.client.store import PutFlags
from kvstore.core.digest import Digest
from kvstore.core.meta import ObjectMeta, validate_key
from kvstore.core.value import Payload
from kvstore.errors import BufferTooSmallError, InvalidArgumentError, TransportError
from kvstore.gpu import runtime as gpu
from kvstore.transports.base import TransportFailure, TransportUnavailable
from kvstore.transports.cuda_ipc import CudaIpcTransport, DeviceBuffer, ShmDevicePath, device_path


def _no_digest() -> None:
    return None


class GpuClient:
    """Mixin. Expects ``_data`` (the connection's transport), ``_conn``, ``transport``, ``_prepare``,
    ``_put``, ``_put_many`` and ``_verify_raw``."""

    _device: CudaIpcTransport | ShmDevicePath | None = None

    def put(self, key: str, value: Any, meta: dict | None = None, ttl: float | None = None, *,
            if_absent: bool = False, pin: bool = False, ephemeral: bool = False) -> ObjectMeta:
        if not gpu.is_device_value(value):
            return super().put(key, value, meta, ttl, if_absent=if_absent, pin=pin, ephemeral=ephemeral)
        self._device_path()  # refuse before anything is sent
        object_meta, payload = self._prepare_device(key, value, meta, ttl)
        return self._put(object_meta, payload, _no_digest,
                         flags=PutFlags(if_absent=if_absent, pin=pin, ephemeral=ephemeral))

    def batch_put(self, items: Iterable[tuple[str, Any]], ttl: float | None = None, *,
                  ephemeral: bool = False) -> list[ObjectMeta]:
        items = list(items)
        if not any(gpu.is_device_value(value) for _, value in items):
            return super().batch_put(items, ttl, ephemeral=ephemeral)
        self._device_path()
        prepared = [self._prepare_device(key, value, None, ttl) if gpu.is_device_value(value)
                    else self._prepare(key, value, None, ttl) for key, value in items]
        digests = [_no_digest if isinstance(p.view, DeviceBuffer) else Digest(p.view) for _, p in prepared]
        return self._put_many(prepared, digests, flags=PutFlags(ephemeral=ephemeral))

    def get_into(self, key: str, out: Any, *, verify: bool = False) -> int:
        if not gpu.is_device_value(out):
            return super().get_into(key, out, verify=verify)
        path = self._device_path()
        dst = gpu.device_destination(out)
        key = validate_key(key)

        def fit(reply: dict) -> DeviceBuffer:
            size = reply["size"]
            if size > len(dst):
                raise BufferTooSmallError(f"object {key!r} is {size} bytes but the buffer holds {len(dst)}",
                                          needed=size, got=len(dst))
            return dst

        try:
            reply = path.get_into_device(self._conn, {"op": "get", "key": key}, fit)
        except TransportFailure as exc:
            raise TransportError(f"get of {key!r} failed on the {self.transport} path: {exc}") from None
        size, checksum = reply["size"], reply["meta"]["checksum"]
        if verify and checksum is not None:
            self._verify_raw(key, checksum, gpu.to_host(dst, size))
        return size

    def device_path_name(self) -> str:
        """How device buffers move on this connection (``stats()["device_path"]``)."""
        try:
            return self._device_path().describe()
        except InvalidArgumentError:
            return "none: this path moves host memory only"

    # ---- internals ----------------------------------------------------------------------------------
    def _prepare_device(self, key: str, value: Any, meta: dict | None, ttl: float | None
                        ) -> tuple[ObjectMeta, Payload]:
        base, _ = self._prepare(key, b"", meta, ttl)  # validates key, ttl and user meta
        payload = gpu.device_payload(value)
        return ObjectMeta(key=base.key, size=len(payload.view), kind=payload.kind, dtype=payload.dtype,
                          shape=payload.shape, producer=base.producer, ttl=base.ttl, user=base.user), payload

    def _device_path(self) -> CudaIpcTransport | ShmDevicePath:
        if self._device is None:
            try:
                self._device = device_path(self._data)
            except TransportUnavailable as exc:
                raise InvalidArgumentError(f"{exc}; this connection uses {self.transport}") from None
        return self._device

    def _close_device_path(self) -> None:
        """Unpin what the device path pinned; call before the transport unmaps the shared memory."""
        device, self._device = self._device, None
        if device is not None and device is not self._data:
            device.close()
