"""Block I/O for caches in device memory (CUDA): the data path :class:`~.block_io.BlockIO` hands device caches to.

Save, per chunk of blocks: reserve one object per block in the store (on a same-host daemon or the embedded
store, views of the store's own memory; the client page-locks each shared-memory segment once with
``cudaHostRegister``), one gather kernel packs the blocks (every layer, block-major) into a device staging buffer
on the connector's own CUDA stream, after that stream has waited for the forward pass that wrote them; then one
device-to-host copy per block straight into its reserved view, all enqueued on that stream with one wait at the
end, and one commit (which records each object's xxh3, so loads can verify). Load is the reverse: lease the
objects (views of the store's memory, checked against their checksums on the host when asked), one
host-to-device copy each into staging and one wait, release, one scatter kernel, and the engine's stream waits
for ours before the forward pass reads the blocks. Over ``tcp`` the views are staging buffers the store sends.

The device is a small :class:`Device` object, so that tests drive this path on machines without a GPU
(``tests/helpers/fake_cuda.py``: host memory posing as device memory). A device fault or an out-of-memory error
during a save raises DeviceCopyError (the worker drops the save, counted, nothing committed; it is no store
fault); during a load it fails the chunk's blocks (vLLM recomputes them). Neither stops the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from kvstore import ops
from kvstore.client.reservation import Reservation
from kvstore.client.store import KVStore, PutFlags
from kvstore.core.digest import checksum_of
from kvstore.errors import ChecksumError, DeviceCopyError, KeyNotFoundError, KVStoreError, StoreConnectionError
from kvstore.layout import KVLayout, dtype_name

DEVICE_ERRORS = (RuntimeError, torch.OutOfMemoryError)  # CUDA errors surface as RuntimeError in torch


class Device(Protocol):
    """Where the caches live: staging memory, the connector's stream and the CUDA runtime that copies on it."""

    runtime: Any  # kvstore._C_cuda (or tests' fake_cuda): memcpy_async, event_* and host_register
    index: int  # the device ordinal
    stream_handle: int  # the connector's stream as a cudaStream_t

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def ids(self, block_ids: Sequence[int]) -> torch.Tensor: ...
    def on_stream(self, *, after_engine: bool, before_engine: bool) -> contextlib.AbstractContextManager: ...


class CudaDevice:
    """A CUDA device with one stream of the connector's own (never the default stream)."""

    def __init__(self, device: torch.device):
        from kvstore.gpu import runtime as gpu

        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.stream = torch.cuda.Stream(device)
        self.stream_handle = self.stream.cuda_stream
        self.runtime = gpu.native()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with torch.cuda.stream(self.stream):  # allocated for our stream: reused only after our work on it
            return torch.empty(shape, dtype=dtype, device=self.device)

    def ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.int64).to(self.device, non_blocking=True)

    @contextlib.contextmanager
    def on_stream(self, *, after_engine: bool, before_engine: bool) -> Iterator[None]:
        """Run on the connector's stream; ``after_engine``: first wait for the engine's queued work (the blocks
        a save reads); ``before_engine``: the engine's stream waits for ours after (the blocks a load wrote)."""
        engine = torch.cuda.current_stream(self.device)
        if after_engine:
            self.stream.wait_stream(engine)
        with torch.cuda.stream(self.stream):
            yield
        if before_engine:
            engine.wait_stream(self.stream)


def _address(view: memoryview) -> int:
    """Address of a (possibly read-only) contiguous byte view."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class DeviceBlocks:
    """Saves and loads whole blocks of device ``pages`` (kernel views, one per layer) through a store."""

    def __init__(self, pages: list[torch.Tensor], kernel_layout: KVLayout, chunk: int, device: Device):
        self.pages, self.layout, self.chunk, self.device = pages, kernel_layout, chunk, device
        self.block_nbytes = kernel_layout.block_nbytes
        self._staging: torch.Tensor | None = None
        self.pinned = 0  # views whose store memory was page-locked when copied (stats and tests)

    def _stage(self, n: int) -> torch.Tensor:
        if self._staging is None:
            self._staging = self.device.empty(ops.packed_shape(self.layout, self.chunk), self.layout.dtype)
        return self._staging[:n]

    def _copy(self, store: KVStore, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """Enqueue one copy of a block per (host address, device address) on our stream; wait once for all.
        Each host range is page-locked first where the store can (its shared-memory segment, once)."""
        dev, rt, nbytes = self.device, self.device.runtime, self.block_nbytes
        memory = store.device_memory()
        pin = getattr(memory, "pin_host", None)
        for host, _ in pairs:
            if pin is not None and pin(rt, host, nbytes):
                self.pinned += 1
        for host, device_ptr in pairs:
            dst, src = (host, device_ptr) if to_host else (device_ptr, host)
            rt.memcpy_async(dst, src, nbytes, dev.index, dev.stream_handle)
        event = rt.event_create(dev.index)
        try:
            rt.event_record(event, dev.index, dev.stream_handle)
            rt.event_synchronize(event)  # the gather before and the copies: everything of ours so far
        finally:
            rt.event_destroy(event)

    # ---- saves ----------------------------------------------------------------------------------------
    def save(self, store: KVStore, items: Sequence[tuple[str, int]], ttl: float | None, pin: bool = False) -> int:
        """Per chunk: reserve, gather on the device, one copy per block into its view, one commit. ``pin``: a
        hand-off's blocks, never evicted before they expire."""
        written = 0
        for start in range(0, len(items), self.chunk):
            chunk = items[start:start + self.chunk]
            with self.device.on_stream(after_engine=True, before_engine=False):
                self._save_chunk(store, [k for k, _ in chunk], None, [b for _, b in chunk], ttl, pin)
            written += len(chunk) * self.block_nbytes
        return written

    def _save_chunk(self, store: KVStore, keys: list[str], packed: torch.Tensor | None, block_ids: list[int],
                    ttl: float | None, pin: bool = False) -> None:
        batch = Reservation(store, PutFlags(pin=pin), ttl)
        try:
            shape, dtype = ops.packed_shape(self.layout, 1), dtype_name(self.layout.dtype)
            views = [batch.add(key, self.block_nbytes, kind="torch", dtype=dtype, shape=shape) for key in keys]
            if packed is None:
                packed = self._stage(len(keys))
                ops.gather_pages(self.pages, self.device.ids(block_ids), packed, layout=self.layout)
            base = packed.data_ptr()
            self._copy(store, [(_address(v), base + i * self.block_nbytes) for i, v in enumerate(views)], True)
            del views
        except DEVICE_ERRORS as exc:
            batch.abort()
            raise DeviceCopyError(f"device error while saving {len(keys)} block(s): {exc}") from None
        except BaseException:
            batch.abort()
            raise
        batch.commit()  # hashes each object on the host: loads can verify device-saved blocks too

    def load(self, store: KVStore, items: Sequence[tuple[str, int]], verify: bool, result: Any) -> list[int]:
        """Per chunk: lease the objects, one copy each into staging, one scatter; returns the failed blocks."""
        failed: list[int] = []
        for start in range(0, len(items), self.chunk):
            chunk = items[start:start + self.chunk]
            leased: list[Any] = []
            good: list[tuple[int, memoryview]] = []
            loaded = 0
            try:
                with self.device.on_stream(after_engine=True, before_engine=True):
                    good = self._lease(store, chunk, verify, result, failed, items[start:], leased)
                    self._load_chunk(store, chunk, good)
                loaded = len(good)
            except DEVICE_ERRORS:
                failed.extend(b for _, b in chunk if b not in failed)
            finally:
                for _, view in good:
                    view.release()
                for obj in leased:
                    obj.release()
            result.loaded += loaded
            if result.connection_lost:
                break
        return failed

    def _lease(self, store: KVStore, chunk: Sequence[tuple[str, int]], verify: bool, result: Any,
               failed: list[int], rest: Sequence[tuple[str, int]], leased: list[Any]) -> list[tuple[int, memoryview]]:
        """Lease each object (checked: size, and its checksum on the host with ``verify``); (position, view)
        of the good ones."""
        good: list[tuple[int, memoryview]] = []
        for i, (key, block_id) in enumerate(chunk):
            try:
                obj = store.get(key, copy=False)
                leased.append(obj)
                view = memoryview(obj)
                if len(view) != self.block_nbytes:
                    raise KeyNotFoundError(f"object {key!r} holds {len(view)} bytes, a block is {self.block_nbytes}")
                if verify and obj.meta.checksum is not None and checksum_of(view) != obj.meta.checksum:
                    raise ChecksumError(f"object {key!r}: bytes differ from the checksum recorded at commit")
                good.append((i, view))
            except StoreConnectionError:
                result.connection_lost = True
                failed.extend(b for _, b in rest[i:])
                break
            except KVStoreError as exc:
                if isinstance(exc, ChecksumError):
                    result.checksum_errors += 1
                    result.corrupt_keys.append(key)
                elif isinstance(exc, KeyNotFoundError):
                    result.missing += 1
                    result.missing_keys.append(key)
                failed.append(block_id)
        return good

    def _load_chunk(self, store: KVStore, chunk: Sequence[tuple[str, int]], good: list[tuple[int, memoryview]]
                    ) -> None:
        if not good:
            return
        staged = self._stage(len(good))
        base = staged.data_ptr()
        self._copy(store, [(_address(view), base + n * self.block_nbytes) for n, (_, view) in enumerate(good)],
                   to_host=False)
        ids = self.device.ids([chunk[i][1] for i, _ in good])
        ops.scatter_pages(staged, ids, self.pages, layout=self.layout)
