"""A stand-in for the CUDA runtime functions of ``kvstore._C_cuda`` on machines without a GPU.

"Device memory" is POSIX shared memory named ``kvfakegpu-<pid>-<n>``, so that another process can "open its IPC
handle" (the handle is the name); copies are ``memmove``; streams, events and devices are not modelled. It lets
the cuda_ipc protocol, the GPU tier and the daemon's staging run end to end on CPU. It mimics two CUDA rules
the code must respect: a process cannot open its own IPC handle, and a host range cannot be registered twice.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os

from kvstore.memory.device import address_of
from kvstore.memory.shm import SHM_DIR, SharedMemory

PREFIX = "kvfakegpu-"
BUS_ID = "0000:00:00.0"
calls: collections.Counter = collections.Counter()
registered: dict[int, int] = {}  # host address -> bytes
_allocs: dict[int, SharedMemory] = {}  # this process's "device" allocations, by address
_opened: dict[int, SharedMemory] = {}  # mappings opened by handle, by address
_ids = itertools.count()


class CudaError(RuntimeError):
    pass


def _device(device: int) -> None:
    if device != 0:
        raise CudaError(f"fake CUDA: cudaErrorInvalidDevice: no device {device}")


def device_count() -> int:
    return 1


def pci_bus_id(device: int) -> str:
    _device(device)
    return BUS_ID


def device_by_pci_bus_id(bus_id: str) -> int:
    if bus_id != BUS_ID:
        raise CudaError(f"fake CUDA: cudaErrorInvalidDevice: no device at {bus_id}")
    return 0


def mem_get_info(device: int) -> tuple[int, int]:
    _device(device)
    return 64 << 30, 80 << 30


def device_malloc(device: int, nbytes: int) -> int:
    _device(device)
    shm = SharedMemory.create(f"{PREFIX}{os.getpid()}-{next(_ids)}", nbytes, prefault=False)
    address = address_of(shm.buf)
    _allocs[address] = shm
    return address


def device_free(device: int, ptr: int) -> None:
    shm = _allocs.pop(ptr)
    shm.unlink()
    shm.close()


def ipc_get_handle(device: int, ptr: int) -> bytes:
    return _allocs[ptr].name.encode().ljust(64, b"\0")


def ipc_open(device: int, handle: bytes) -> int:
    _device(device)
    if len(handle) != 64:
        raise ValueError(f"a CUDA IPC memory handle is 64 bytes, got {len(handle)}")
    name = handle.rstrip(b"\0").decode()
    if any(shm.name == name for shm in _allocs.values()):
        raise CudaError("fake CUDA: cudaErrorInvalidContext: a process cannot open its own IPC handle")
    shm = SharedMemory.attach(name, os.stat(os.path.join(SHM_DIR, name)).st_size)
    address = address_of(shm.buf)
    _opened[address] = shm
    calls["ipc_open"] += 1
    return address


def ipc_close(device: int, ptr: int) -> None:
    _opened.pop(ptr).close()
    calls["ipc_close"] += 1


def host_register(ptr: int, nbytes: int) -> None:
    if ptr in registered:
        raise CudaError("fake CUDA: cudaErrorHostMemoryAlreadyRegistered")
    registered[ptr] = nbytes
    calls["host_register"] += 1


def host_unregister(ptr: int) -> None:
    if registered.pop(ptr, None) is None:
        raise CudaError("fake CUDA: cudaErrorHostMemoryNotRegistered")
    calls["host_unregister"] += 1


def memcpy_sync(dst: int, src: int, nbytes: int, device: int) -> None:
    calls["memcpy_sync"] += 1
    ctypes.memmove(dst, src, nbytes)


def copy_and_wait(dst: int, src: int, nbytes: int, device: int, stream: int) -> None:
    _device(device)
    calls["copy_and_wait"] += 1
    ctypes.memmove(dst, src, nbytes)


def memcpy_async(dst: int, src: int, nbytes: int, device: int, stream: int) -> None:
    _device(device)
    calls["memcpy_async"] += 1
    ctypes.memmove(dst, src, nbytes)  # the fake has no streams: done at once, in enqueue order


def event_create(device: int) -> int:
    _device(device)
    calls["event_create"] += 1
    return next(_ids) + 1


def event_record(event: int, device: int, stream: int) -> None:
    calls["event_record"] += 1


def event_synchronize(event: int) -> None:
    calls["event_synchronize"] += 1


def event_destroy(event: int) -> None:
    calls["event_destroy"] += 1
