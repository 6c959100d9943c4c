"""GpuMemory: the daemon's GPU side (``kvstore serve --gpu-capacity 8GiB --device 0``).

* GPU segments: plain ``cudaMalloc`` allocations on one device, added to the master's segment list as the GPU
  tier and exported to same-host clients by their CUDA IPC handles (the ``cuda_ipc`` transport).
* The daemon's host segments, page-locked with ``cudaHostRegister`` so that its device-to-host copies into
  shared memory run as DMA.
* Staging: a reader whose data path cannot map GPU memory (``shm`` or ``tcp`` clients, host buffers on
  ``cuda_ipc``) gets a GPU-resident object copied device-to-host by the daemon, on a small thread pool so the
  event loop keeps serving. The pool is drained before any memory is freed.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType

from kvstore.errors import InvalidArgumentError, TransportError
from kvstore.gpu import runtime as gpu
from kvstore.memory.device import address_of
from kvstore.memory.segment import SegmentSet

log = logging.getLogger("kvstore.daemon.server")
STAGING_THREADS = 2


@dataclass(slots=True, eq=False)
class GpuSegment:
    id: int  # the master's segment id
    device: int
    ptr: int
    size: int
    handle: bytes  # CUDA IPC memory handle (64 bytes)


def open_device(device: int) -> ModuleType:
    """The CUDA runtime, checked to see ``device``; InvalidArgumentError saying why not otherwise."""
    try:
        native = gpu.native()
    except TransportError as exc:
        raise InvalidArgumentError(f"--gpu-capacity: {exc}") from None
    try:
        count = native.device_count()
    except RuntimeError as exc:
        raise InvalidArgumentError(f"--gpu-capacity needs a CUDA GPU, but CUDA finds none usable here "
                                   f"({exc})") from None
    if not 0 <= device < count:
        raise InvalidArgumentError(f"--device {device} does not exist: CUDA sees {count} device(s), numbered from 0 "
                                   "(after CUDA_VISIBLE_DEVICES)")
    return native


class GpuMemory:
    """GPU segments with ids ``first_id, first_id + 1, ...`` on ``device``, and ``host``'s segments pinned."""

    def __init__(self, device: int, sizes: list[int], first_id: int, host: SegmentSet):
        self.native = open_device(device)
        self.device = device
        self.bus_id: str = self.native.pci_bus_id(device)
        self.segments: list[GpuSegment] = []
        self._by_id: dict[int, GpuSegment] = {}
        self._pinned: list[int] = []
        self.pinned_bytes = 0
        self._pool: ThreadPoolExecutor | None = None
        try:
            self._check_free(sum(sizes))
            for i, size in enumerate(sizes):
                self._allocate(first_id + i, size)
            self._pin(host)
        except BaseException:
            self.close()
            raise

    def _check_free(self, need: int) -> None:
        free, total = self.native.mem_get_info(self.device)
        if need > free:
            raise InvalidArgumentError(f"--gpu-capacity of {need} bytes exceeds the {free} bytes free on GPU "
                                       f"{self.device} ({self.bus_id}, {total} bytes in all)")

    def _allocate(self, segment_id: int, size: int) -> None:
        try:
            ptr = self.native.device_malloc(self.device, size)
        except RuntimeError as exc:
            raise InvalidArgumentError(f"cannot allocate a GPU segment of {size} bytes on GPU {self.device}: "
                                       f"{exc}") from None
        seg = GpuSegment(segment_id, self.device, ptr, size, b"")
        self.segments.append(seg)  # first: close() frees it if taking the handle fails
        self._by_id[segment_id] = seg
        try:
            seg.handle = bytes(self.native.ipc_get_handle(self.device, ptr))
        except RuntimeError as exc:
            raise InvalidArgumentError(f"GPU {self.device} cannot export memory by CUDA IPC here: {exc}") from None

    def _pin(self, host: SegmentSet) -> None:
        for seg in host.segments:
            base = address_of(seg.shm.buf)
            try:
                self.native.host_register(base, seg.size)
            except RuntimeError as exc:  # copies stay correct, only slower (staged by the driver)
                log.warning("cannot page-lock host segment %s for GPU copies: %s", seg.name, exc)
                continue
            self._pinned.append(base)
            self.pinned_bytes += seg.size

    # ---- services -----------------------------------------------------------------------------------
    def describe(self) -> list[list]:
        """[[segment id, size, IPC handle, PCI bus id], ...] for cuda_ipc clients."""
        return [[s.id, s.size, s.handle, self.bus_id] for s in self.segments]

    def info(self) -> dict:
        return {"device": self.device, "pci_bus_id": self.bus_id, "segments": [s.id for s in self.segments],
                "capacity_bytes": sum(s.size for s in self.segments), "pinned_host_bytes": self.pinned_bytes}

    async def copy_to_host(self, segment_id: int, offset: int, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes at ``offset`` of a GPU segment into ``dst`` (kept alive by the caller)."""
        seg = self._by_id[segment_id]
        n = len(dst)
        if offset < 0 or offset + n > seg.size:
            raise TransportError(f"region [{offset}, +{n}) outside GPU segment {segment_id} of {seg.size} bytes")
        if n == 0:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(STAGING_THREADS, thread_name_prefix="kvstore-gpu-staging")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pool, self._copy_sync, dst, seg.ptr + offset, seg.device)
        except RuntimeError as exc:
            raise TransportError(f"device-to-host copy of a GPU-resident object failed: {exc}") from None

    def _copy_sync(self, dst: memoryview, src: int, device: int) -> None:
        # Takes the view itself, not its address: the pool's work item keeps the destination alive even if the
        # awaiting request is cancelled (shutdown) while the copy runs.
        self.native.memcpy_sync(address_of(dst), src, len(dst), device)

    def close(self) -> None:
        """Wait for staging copies, unpin the host segments (before they are unmapped), free the GPU segments."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for base in self._pinned:
            self._quietly("cudaHostUnregister", self.native.host_unregister, base)
        self._pinned = []
        for seg in self.segments:
            self._quietly("cudaFree", self.native.device_free, seg.device, seg.ptr)
        self.segments, self._by_id = [], {}

    @staticmethod
    def _quietly(what: str, fn, *args) -> None:
        try:
            fn(*args)
        except RuntimeError as exc:
            log.warning("%s failed while releasing GPU memory: %s", what, exc)
