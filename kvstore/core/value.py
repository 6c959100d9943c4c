"""Values in and out of the store: bytes-like, numpy arrays and torch CPU tensors as flat byte views, and
``KVObject``, what ``get`` returns.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.core.meta import ObjectMeta, check_plain_dtype
from kvstore.errors import InvalidArgumentError
from kvstore.memory.device import DeviceBuffer


@dataclass(frozen=True, slots=True)
class Payload:
    """A value seen as flat bytes, plus what it takes to rebuild it."""

    view: memoryview  # format "B", 1-D, C-contiguous (a kvstore.transports.cuda_ipc.DeviceBuffer for device memory)
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _not_host(value: Any, what: str) -> InvalidArgumentError:
    """The error for device memory given to a path that moves host memory only."""
    kind = f"{value.device.type} tensor" if _is_tensor(value) else type(value).__name__
    hint = ("connect to a kvstore daemon on this host (transport 'auto', 'cuda_ipc' or 'shm'), which moves CUDA "
            "tensors; this store takes host memory only" if kind in ("cuda tensor", "DeviceBuffer")
            else "pass a CPU tensor")
    return InvalidArgumentError(f"{what} of a {kind}: {hint}")


def as_payload(value: Any) -> Payload:
    """Flat byte view of ``value`` (host memory) without copying it where it is already contiguous."""
    if _is_tensor(value):
        if value.device.type != "cpu":
            raise _not_host(value, "put")
        t = value.detach().contiguous()
        flat = t.reshape(-1).view(_torch().uint8) if t.numel() else _torch().empty(0, dtype=_torch().uint8)
        return Payload(memoryview(flat.numpy()).cast("B"), "torch", str(t.dtype).removeprefix("torch."),
                       tuple(t.shape))
    if isinstance(value, DeviceBuffer):  # device memory: only the GPU paths take it (kvstore.client.device)
        raise _not_host(value, "put")
    if isinstance(value, np.ndarray):
        check_plain_dtype(value.dtype)
        arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)  # which makes 0-d arrays 1-d
        return Payload(arr.reshape(-1).view(np.uint8).data, "numpy", arr.dtype.str, value.shape)
    try:
        view = memoryview(value)
    except TypeError:
        raise InvalidArgumentError(f"value must be bytes-like, a numpy array or a torch CPU tensor, "
                                   f"got {type(value).__name__}") from None
    if not view.c_contiguous:
        raise InvalidArgumentError("a bytes-like value must be C-contiguous")
    return Payload(view.cast("B") if view.format != "B" or view.ndim != 1 else view, "bytes", None, None)


def writable_view(out: Any) -> memoryview:
    """Flat writable byte view of a ``get_into`` destination (numpy, torch CPU tensor, bytearray, ...)."""
    if isinstance(out, DeviceBuffer):
        raise _not_host(out, "get_into")
    if _is_tensor(out):
        if out.device.type != "cpu":
            raise _not_host(out, "get_into")
        if not out.is_contiguous():
            raise InvalidArgumentError("get_into needs a contiguous tensor")
        flat = out.detach().reshape(-1)
        out = flat.view(_torch().uint8).numpy() if flat.numel() else np.empty(0, np.uint8)
    if isinstance(out, np.ndarray):
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise InvalidArgumentError("get_into needs a C-contiguous, writeable numpy array")
        return out.reshape(-1).view(np.uint8).data
    try:
        view = memoryview(out)
    except TypeError:
        raise InvalidArgumentError(f"get_into needs a writable buffer, got {type(out).__name__}") from None
    if view.readonly:
        raise InvalidArgumentError(f"get_into needs a writable buffer; {type(out).__name__} is read-only")
    if not view.c_contiguous:
        raise InvalidArgumentError("get_into needs a C-contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _torch() -> ModuleType:
    import torch

    return torch


class KVObject(np.ndarray):
    """A stored object: a read-only flat ``uint8`` array (so it supports the buffer protocol: ``bytes(obj)``,
    ``memoryview(obj)``), with ``.meta`` and ``.numpy()`` / ``.tensor()`` to get the value back with the
    dtype and shape it was put with.

    A zero-copy object (``get(key, copy=False)`` on a transport that maps the store's memory; see
    ``KVStore.get``) views that memory and holds a lease until ``release()``, the end of a ``with`` block, or
    garbage collection."""

    meta: ObjectMeta
    _finalizer: weakref.finalize[[], KVObject] | None

    if TYPE_CHECKING:  # an ndarray exports its buffer on every Python; numpy's stubs declare it from 3.12 on
        def __buffer__(self, flags: int, /) -> memoryview: ...

    @classmethod
    def wrap(cls, data: Any, meta: ObjectMeta, on_release: Callable[[], None] | None = None) -> KVObject:
        obj = np.frombuffer(data, dtype=np.uint8).view(cls)
        obj.flags.writeable = False
        obj.meta = meta
        obj._finalizer = weakref.finalize(obj, on_release) if on_release is not None else None
        return obj

    def __array_finalize__(self, obj: Any) -> None:
        meta = getattr(obj, "meta", None)
        if meta is not None:  # a view of a KVObject; a new one (wrap) gets its meta right after
            self.meta = meta
        self._finalizer = None  # views keep the base (and its lease) alive; only the base releases

    def release(self) -> None:
        finalizer = getattr(self, "_finalizer", None)  # unset on an object numpy made without a base
        if finalizer is not None:
            finalizer()

    def __enter__(self) -> KVObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def numpy(self) -> np.ndarray:
        """The value as put: numpy dtype and shape restored (bytes values come back as flat uint8)."""
        base = self.view(np.ndarray)
        meta = self.meta
        if meta.kind == "numpy" and meta.dtype:
            return base.view(np.dtype(meta.dtype)).reshape(meta.shape)
        as_numpy = _numpy_dtype(meta.dtype) if meta.kind == "torch" and meta.dtype else None
        if as_numpy is not None:
            return base.view(as_numpy).reshape(meta.shape)
        return base

    def tensor(self) -> Any:
        """The value as a torch CPU tensor with the put's dtype and shape (read-only memory: clone to write)."""
        torch = _torch()
        if len(self):
            with warnings.catch_warnings():  # the memory is read-only on purpose; documented above
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(self.view(np.ndarray), dtype=torch.uint8)
        else:
            raw = torch.empty(0, dtype=torch.uint8)
        meta = self.meta
        if meta.kind == "torch" and meta.dtype:
            dtype = getattr(torch, meta.dtype)
            return raw.view(dtype).reshape(meta.shape)
        if meta.kind == "numpy" and meta.dtype:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(self.numpy())
        return raw

    def __repr__(self) -> str:
        return f"KVObject(key={self.meta.key!r}, size={len(self)}, kind={self.meta.kind}, dtype={self.meta.dtype})"

    __str__ = __repr__


def _numpy_dtype(torch_dtype_name: str) -> np.dtype | None:
    try:
        return np.dtype(torch_dtype_name)
    except TypeError:
        return None  # bfloat16, float8: no numpy equivalent; use .tensor()
