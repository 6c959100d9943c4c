"""Same-host GPU data paths: CUDA IPC into the daemon's GPU segments, and device <-> host copies through its
shared memory.

A device buffer (:class:`DeviceBuffer`: a device address, its length, its device, the caller's stream and the
CUDA runtime to use) moves to and from a same-host daemon in one of two ways:

* ``cuda_ipc`` (:class:`CudaIpcTransport`; the daemon holds GPU segments, ``kvstore serve --gpu-capacity``). A
  put asks for a region of a GPU segment (op ``cuda_put``) and copies device-to-device into it through the
  segment's CUDA IPC mapping; the client commits it. A get (op ``cuda_get``) leases the object and copies it out
  the same way; an object the daemon holds in host memory is copied host-to-device from the mapped shared memory
  instead. Host buffers on this transport take the ``shm`` path unchanged (a GPU-resident object read into a host buffer
  is staged into shared memory by the daemon).
* ``shm`` with device buffers (:class:`ShmDevicePath`; any same-host daemon, no GPU needed on its side):
  device-to-host into the mapped shared-memory region, and host-to-device back.

Ordering. Each copy is enqueued on the caller's stream, so it runs after the work that produced a put's bytes
and before work queued after a get; an event recorded after it is waited for before the client commits a put
(the object becomes visible only with all its bytes in place) or releases a get's lease (the daemon may reuse
the space only once the copy has read it). Work queued on the stream after the copy is not waited for.

Mappings. A GPU segment's IPC handle is opened once per process (reference-counted across the clients of the
process: CUDA maps one handle once per process) and closed when the last transport using it closes. A
shared-memory segment is page-locked with ``cudaHostRegister`` the first time a device copy touches it (so its
copies run as DMA; a segment that cannot be registered is copied unpinned, more slowly) and unregistered
before it is unmapped.

This module never initialises CUDA itself: the runtime arrives with the device buffers
(``DeviceBuffer.runtime``, see :class:`CudaRuntime`), so importing it needs neither torch nor a GPU.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable

from kvstore.memory.device import CudaRuntime, DeviceBuffer, address_of  # noqa: F401  (re-exported)
from kvstore.transports.base import Channel, TransportFailure, register, unavailable
from kvstore.transports.shm import ShmDevicePath, ShmTransport
from kvstore.transports.shm import cuda_call as _cuda


class _IpcMappings:
    """This process's open CUDA IPC mappings, by handle, reference-counted across transports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[bytes, list] = {}  # handle -> [address, device, references, runtime]

    def acquire(self, runtime: CudaRuntime, handle: bytes, device: int) -> int:
        with self._lock:
            entry = self._open.get(handle)
            if entry is None:
                ptr = _cuda("opening a GPU segment's CUDA IPC handle", runtime.ipc_open, device, handle)
                entry = self._open[handle] = [ptr, device, 0, runtime]
            entry[2] += 1
            return entry[0]

    def release(self, handle: bytes) -> None:
        with self._lock:
            entry = self._open.get(handle)
            if entry is None:
                return
            entry[2] -= 1
            if entry[2] > 0:
                return
            del self._open[handle]
        ptr, device, _, runtime = entry
        _cuda("closing a CUDA IPC mapping", runtime.ipc_close, device, ptr)

    def count(self) -> int:
        with self._lock:
            return len(self._open)


IPC_MAPPINGS = _IpcMappings()


class CudaIpcTransport(ShmTransport):
    """Client side of ``cuda_ipc``: the shm path for host buffers, plus device buffers to and from the daemon's
    GPU segments by CUDA IPC (and to and from its host segments by :class:`ShmDevicePath`)."""

    name = "cuda_ipc"

    def __init__(self, segments: dict[int, tuple[str, int]]):
        super().__init__(segments)
        self._host = ShmDevicePath(self)
        self._lock = threading.Lock()
        self._gpu_segments: dict[int, tuple[int, bytes, str]] | None = None  # id -> (size, handle, bus id)
        self._mapped: dict[int, tuple[bytes, int, int]] = {}  # id -> (handle, address here, size)

    def describe(self) -> str:
        return f"cuda_ipc: {len(self._mapped)} GPU segment(s) mapped by CUDA IPC; {self._host.describe()}"

    def pin_address(self, runtime: CudaRuntime, address: int, length: int) -> bool:
        return self._host.pin_address(runtime, address, length)

    # ---- device buffers -----------------------------------------------------------------------------
    def device_path(self) -> CudaIpcTransport:
        return self

    def reserve_device(self, channel: Channel, request: dict) -> dict:
        fields = {k: v for k, v in request.items() if k not in ("op", "mode")}
        return channel.call({**fields, "op": "cuda_put"})

    def write_device(self, channel: Channel, reply: dict, src: DeviceBuffer) -> None:
        if reply["tier"] != "gpu":
            self._host.copy_to_region(src, reply["segment"], reply["offset"])
            return
        dst = self._gpu_address(channel, src.runtime, reply["segment"], reply["offset"], len(src))
        if len(src):
            _cuda("device-to-device copy into the daemon's GPU segment", src.runtime.copy_and_wait, dst, src.ptr,
                  len(src), src.device, src.stream)

    def get_into_device(self, channel: Channel, request: dict, dst: Callable[[dict], DeviceBuffer]) -> dict:
        reply = channel.call({"op": "cuda_get", "key": request["key"]})
        try:
            out, size = dst(reply), reply["size"]
            if reply["tier"] != "gpu":
                self._host.copy_from_region(out, reply["segment"], reply["offset"], size)
            elif size:
                if size > len(out):
                    raise TransportFailure(f"object of {size} bytes does not fit the device buffer of {len(out)}")
                src = self._gpu_address(channel, out.runtime, reply["segment"], reply["offset"], size)
                _cuda("device-to-device copy out of the daemon's GPU segment", out.runtime.copy_and_wait, out.ptr,
                      src, size, out.device, out.stream)
        finally:
            channel.call({"op": "release", "lease": reply["lease"], "noreply": True})
        return reply

    # ---- GPU segments -------------------------------------------------------------------------------
    def _gpu_address(self, channel: Channel, runtime: CudaRuntime, segment: int, offset: int, length: int) -> int:
        with self._lock:
            mapped = self._mapped.get(segment)
            if mapped is None:
                size, handle, bus_id = self._gpu_segment(channel, segment)
                device = _cuda(f"finding the daemon's GPU {bus_id} in this process (is it hidden by "
                               "CUDA_VISIBLE_DEVICES?)", runtime.device_by_pci_bus_id, bus_id)
                mapped = self._mapped[segment] = (handle, IPC_MAPPINGS.acquire(runtime, handle, device), size)
        _, base, size = mapped
        if offset < 0 or length < 0 or offset + length > size:
            raise TransportFailure(f"region [{offset}, +{length}) outside GPU segment {segment} of {size} bytes")
        return base + offset

    def _gpu_segment(self, channel: Channel, segment: int) -> tuple[int, bytes, str]:
        if self._gpu_segments is None or segment not in self._gpu_segments:
            reply = channel.call({"op": "cuda_segments"})
            self._gpu_segments = {sid: (size, bytes(handle), bus_id) for sid, size, handle, bus_id in reply["segments"]}
        try:
            return self._gpu_segments[segment]
        except KeyError:
            raise TransportFailure(f"daemon named unknown GPU segment {segment}") from None

    def close(self) -> None:
        with self._lock:
            mapped, self._mapped = self._mapped, {}
        for handle, _, _ in mapped.values():
            try:
                IPC_MAPPINGS.release(handle)
            except TransportFailure:
                pass  # closing anyway; the mapping goes with the process at worst
        self._host.close()  # before super() unmaps the shared memory
        super().close()


# Device buffers come from torch CUDA tensors: a process without torch has none to offer this transport for.
if importlib.util.find_spec("torch") is None:
    unavailable("cuda_ipc", "it moves torch CUDA tensors, and torch is not installed")
else:
    register("cuda_ipc", CudaIpcTransport)
