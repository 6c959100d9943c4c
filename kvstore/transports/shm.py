"""Same-host data path: POSIX shared memory the daemon owns and its clients map.

The mapping itself is :class:`kvstore.memory.shm.SharedMemory`. ``ShmTransport`` is the client side: a put asks
the daemon for a region, copies the caller's bytes into it once and commits; a get_into leases the object,
copies it out once and releases the lease without waiting for the reply. ``ShmDevicePath`` moves device buffers
through the same mapped memory (device-to-host into a put's region, host-to-device out of a get's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvstore.memory.device import CudaRuntime, DeviceBuffer, address_of
from kvstore.memory.shm import SharedMemory, SharedMemoryError, SharedMemoryUnavailable
from kvstore.transports.base import (
    Channel,
    DevicePath,
    PayloadDigest,
    TransportFailure,
    TransportUnavailable,
    register,
)


def copy(dst: memoryview, src: memoryview) -> None:
    """One memcpy between two byte views of equal length."""
    dst[:] = src


def cuda_call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call the runtime, turning its errors into TransportFailure."""
    try:
        return fn(*args)
    except (RuntimeError, ValueError, OSError) as exc:
        raise TransportFailure(f"{what} failed: {exc}") from None


class ShmTransport:
    """Client side of the same-host path. ``segments`` maps segment id -> (name, size) from the daemon."""

    name = "shm"
    on_connection = False

    def __init__(self, segments: dict[int, tuple[str, int]]):
        self._segments = dict(segments)
        self._maps: dict[int, SharedMemory] = {}
        self._device: ShmDevicePath | None = None

    def regions(self) -> ShmTransport:
        return self

    def device_path(self) -> DevicePath:
        """Device buffers through this mapped memory (pinned on first use, unpinned at close)."""
        if self._device is None:
            self._device = ShmDevicePath(self)
        return self._device

    def segment_size(self, segment: int) -> int:
        """Size of a segment the daemon announced at hello."""
        try:
            return self._segments[segment][1]
        except KeyError:
            raise TransportFailure(f"daemon named unknown segment {segment}") from None

    def region(self, segment: int, offset: int, length: int) -> memoryview:
        seg = self._maps.get(segment)
        if seg is None:
            try:
                name, size = self._segments[segment]
            except KeyError:
                raise TransportFailure(f"daemon named unknown segment {segment}") from None
            try:
                seg = self._maps[segment] = SharedMemory.attach(name, size)
            except SharedMemoryUnavailable as exc:
                raise TransportUnavailable(str(exc)) from exc
            except SharedMemoryError as exc:
                raise TransportFailure(str(exc)) from exc
        if offset < 0 or length < 0 or offset + length > seg.size:
            raise TransportFailure(f"region [{offset}, +{length}) outside segment {segment} of {seg.size} bytes")
        return seg.buf[offset:offset + length]

    def reserve(self, channel: Channel, request: dict, src: memoryview, checksum: PayloadDigest) -> dict:
        return channel.call({**request, "mode": "region"})

    def write(self, channel: Channel, reply: dict, src: memoryview, checksum: PayloadDigest) -> None:
        dst = self.region(reply["segment"], reply["offset"], len(src))
        try:
            checksum.copy_into(dst)  # one pass: each piece hashed while in cache
        finally:
            dst.release()

    def get_into(self, channel: Channel, request: dict, dst: Callable[[dict], memoryview]) -> dict:
        reply = channel.call({**request, "mode": "region"})
        try:
            out = dst(reply)
            src = self.region(reply["segment"], reply["offset"], reply["size"])
            copy(out[:reply["size"]], src)
            src.release()
        finally:
            channel.call({"op": "release", "lease": reply["lease"], "noreply": True})
        return reply

    def close(self) -> None:
        if self._device is not None:  # unpins the segments: before they are unmapped
            self._device.close()
            self._device = None
        for seg in self._maps.values():
            seg.close()
        self._maps.clear()


class ShmDevicePath:
    """Device buffers through the shared memory a :class:`ShmTransport` maps: one device-to-host copy into the
    region of a put, one host-to-device copy out of the region of a get."""

    name = "shm"

    def __init__(self, shm: ShmTransport):
        self._shm = shm
        self._lock = threading.Lock()
        self._pinned: dict[int, tuple[int, CudaRuntime]] = {}  # segment -> (base address, runtime)
        self._unpinned: dict[int, str] = {}  # segment -> why it could not be registered

    def describe(self) -> str:
        state = "pinned" if self._pinned and not self._unpinned else "unpinned" if self._unpinned else "not used yet"
        return f"{self.name}: device<->host copies through shared memory ({state})"

    def reserve_device(self, channel: Channel, request: dict) -> dict:
        return channel.call({**request, "mode": "region"})

    def write_device(self, channel: Channel, reply: dict, src: DeviceBuffer) -> None:
        self.copy_to_region(src, reply["segment"], reply["offset"])

    def get_into_device(self, channel: Channel, request: dict, dst: Callable[[dict], DeviceBuffer]) -> dict:
        reply = channel.call({**request, "mode": "region"})
        try:
            out = dst(reply)
            self.copy_from_region(out, reply["segment"], reply["offset"], reply["size"])
        finally:
            channel.call({"op": "release", "lease": reply["lease"], "noreply": True})
        return reply

    def copy_to_region(self, src: DeviceBuffer, segment: int, offset: int) -> None:
        if len(src):
            dst = self._region_address(src.runtime, segment, offset, len(src))
            cuda_call("device-to-host copy", src.runtime.copy_and_wait, dst, src.ptr, len(src), src.device, src.stream)

    def copy_from_region(self, dst: DeviceBuffer, segment: int, offset: int, size: int) -> None:
        if size > len(dst):
            raise TransportFailure(f"object of {size} bytes does not fit the device buffer of {len(dst)}")
        if size:
            src = self._region_address(dst.runtime, segment, offset, size)
            cuda_call("host-to-device copy", dst.runtime.copy_and_wait, dst.ptr, src, size, dst.device, dst.stream)

    def _region_address(self, runtime: CudaRuntime, segment: int, offset: int, length: int) -> int:
        view = self._shm.region(segment, offset, length)  # maps the segment and checks the bounds
        try:
            if segment not in self._pinned and segment not in self._unpinned:
                self._pin(runtime, segment)
            return address_of(view)
        finally:
            view.release()

    def pin_address(self, runtime: CudaRuntime, address: int, length: int) -> bool:
        """Page-lock the mapped segment holding ``[address, +length)`` (once per segment, as device copies do);
        True if it is pinned. For callers that copy into reserved or leased views themselves."""
        for segment, seg in list(self._shm._maps.items()):
            base = address_of(seg.buf)
            if base <= address and address + length <= base + seg.size:
                if segment not in self._pinned and segment not in self._unpinned:
                    self._pin(runtime, segment)
                return segment in self._pinned
        return False

    def _pin(self, runtime: CudaRuntime, segment: int) -> None:
        with self._lock:
            if segment in self._pinned or segment in self._unpinned:
                return
            size = self._shm.segment_size(segment)
            whole = self._shm.region(segment, 0, size)
            try:
                base = address_of(whole)
                runtime.host_register(base, size)
            except (RuntimeError, ValueError, OSError) as exc:
                self._unpinned[segment] = str(exc)  # still correct, just staged by the driver
            else:
                self._pinned[segment] = (base, runtime)
            finally:
                whole.release()

    def close(self) -> None:
        """Unregister the pinned segments; call before the shared memory is unmapped."""
        with self._lock:
            pinned, self._pinned = self._pinned, {}
        for base, runtime in pinned.values():
            try:
                runtime.host_unregister(base)
            except (RuntimeError, ValueError, OSError):
                pass  # the mapping goes away next either way


register("shm", ShmTransport)
