"""GPU access for the store: the CUDA runtime (``kvstore._C_cuda``, loaded on first use) and device buffers
made from torch CUDA tensors.

Nothing here imports torch or initialises CUDA at import time; a value is recognised as device memory only
when torch is already imported (a process holding CUDA tensors has imported it) or when it is a
:class:`kvstore.transports.cuda_ipc.DeviceBuffer` (a raw device address, for callers without torch).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

from kvstore.core.value import Payload
from kvstore.errors import InvalidArgumentError, TransportError
from kvstore.memory.device import DeviceBuffer, address_of

_native: ModuleType | None = None


def native() -> ModuleType:
    """The CUDA runtime helpers of ``kvstore._C_cuda``; TransportError if the extension is not built."""
    global _native
    if _native is None:
        try:
            _native = importlib.import_module("kvstore._C_cuda")
        except ImportError as exc:
            raise TransportError(f"device memory needs kvstore's CUDA extension (kvstore._C_cuda), which is not "
                                 f"built here ({exc}); rebuild with nvcc on PATH: pip install -e .") from None
    return _native


def is_device_value(value: Any) -> bool:
    """True for a torch CUDA tensor or a DeviceBuffer (what the GPU data paths move)."""
    if isinstance(value, DeviceBuffer):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor) and value.device.type == "cuda"


def device_payload(value: Any) -> Payload:
    """A put's source: the tensor's bytes on the caller's current stream of its device (a non-contiguous
    tensor is made contiguous first, on that stream)."""
    if isinstance(value, DeviceBuffer):
        return Payload(value, "bytes", None, None)  # type: ignore[arg-type]  (a device view, not a memoryview)
    t = value.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    return Payload(_buffer_of(t), "torch", dtype, tuple(t.shape))  # type: ignore[arg-type]


def device_destination(out: Any) -> DeviceBuffer:
    """A get_into's destination: the bytes of a contiguous CUDA tensor, or a DeviceBuffer as given."""
    if isinstance(out, DeviceBuffer):
        return out
    if not out.is_contiguous():
        raise InvalidArgumentError(f"get_into needs a contiguous tensor; got shape {tuple(out.shape)} with strides "
                                   f"{tuple(out.stride())}")
    return _buffer_of(out.detach())


def to_host(buf: DeviceBuffer, size: int) -> memoryview:
    """The first ``size`` bytes of ``buf`` copied to host memory (for ``verify=True``), in stream order."""
    host = bytearray(size)
    if size:
        buf.runtime.copy_and_wait(address_of(memoryview(host)), buf.ptr, size, buf.device, buf.stream)
    return memoryview(host)


def _buffer_of(t: Any) -> DeviceBuffer:
    torch = sys.modules["torch"]
    stream = torch.cuda.current_stream(t.device).cuda_stream
    return DeviceBuffer(t.data_ptr(), t.numel() * t.element_size(), t.device.index, stream, native(), owner=t)
