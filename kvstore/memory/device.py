"""Device memory as the store sees it: a raw device address with its length, device, stream and the CUDA
runtime that moves it (:class:`DeviceBuffer`), and the address of a host buffer (for registering and copying).

Nothing here imports torch or initialises CUDA: the runtime arrives with the buffer.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Protocol


class CudaRuntime(Protocol):
    """The CUDA runtime services these paths use (``kvstore._C_cuda`` provides them). Addresses, streams are
    ints; failures raise RuntimeError (or ValueError for a malformed argument)."""

    def device_by_pci_bus_id(self, bus_id: str) -> int: ...
    def ipc_open(self, device: int, handle: bytes) -> int: ...
    def ipc_close(self, device: int, ptr: int) -> None: ...
    def host_register(self, ptr: int, nbytes: int) -> None: ...
    def host_unregister(self, ptr: int) -> None: ...
    def copy_and_wait(self, dst: int, src: int, nbytes: int, device: int, stream: int) -> None: ...


@dataclass(frozen=True, slots=True)
class DeviceBuffer:
    """``nbytes`` of device memory at ``ptr`` on CUDA device ``device`` (an ordinal of this process), used on
    ``stream`` (a cudaStream_t as an int; 0 is the legacy default stream). ``owner`` keeps the memory alive
    while the buffer is in use (e.g. the tensor it views)."""

    ptr: int
    nbytes: int
    device: int
    stream: int
    runtime: CudaRuntime
    owner: Any = None

    def __post_init__(self) -> None:
        for name in ("ptr", "nbytes", "device", "stream"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DeviceBuffer.{name} must be an int >= 0, got {value!r}")

    def __len__(self) -> int:
        return self.nbytes

    def __getitem__(self, index: slice) -> DeviceBuffer:
        if not isinstance(index, slice):
            raise TypeError(f"a DeviceBuffer can only be sliced, got {type(index).__name__}")
        start, stop, step = index.indices(self.nbytes)
        if step != 1:
            raise ValueError(f"a DeviceBuffer slice must have step 1, got {step}")
        return DeviceBuffer(self.ptr + start, max(0, stop - start), self.device, self.stream, self.runtime, self.owner)


def address_of(view: memoryview) -> int:
    """Address of the first byte of a writable, non-empty buffer (no reference to it is kept)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
