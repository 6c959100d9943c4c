"""Block I/O for caches in device memory (CUDA): the data path :class:`~.block_io.BlockIO` hands device caches to.

Save: one gather kernel packs a chunk of blocks (every layer, block-major) into a device staging buffer on the
connector's own CUDA stream (after the stream has waited for the forward pass that wrote them), then each
block's bytes go to the store as a device value: on a same-host daemon (``shm`` / ``cuda_ipc``) that is one
device-to-host copy straight into the object's reserved region of the daemon's shared memory, which the client
page-locks (``cudaHostRegister``) once per segment, enqueued on the same stream (or a device-to-device copy
into a GPU segment on ``cuda_ipc``). Load is the reverse: host-to-device from the leased region into staging,
one scatter kernel, and the engine's stream waits for ours before the forward pass reads the blocks. A store
that moves host memory only (embedded, ``tcp``) gets a device-to-host copy into a private buffer instead.

The device itself is a small :class:`Device` object, so that tests drive this path on machines without a GPU
(``tests/helpers/fake_cuda.py``: host memory posing as device memory, with the store's real device path).
A device fault or an out-of-memory error during a save raises TransportError (the worker drops the save,
counted); during a load it fails the chunk's blocks (vLLM recomputes them). Neither stops the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from kvstore import ops
from kvstore.client.store import KVStore
from kvstore.errors import ChecksumError, KeyNotFoundError, KVStoreError, StoreConnectionError, TransportError
from kvstore.layout import KVLayout

DEVICE_ERRORS = (RuntimeError, torch.OutOfMemoryError)  # CUDA errors surface as RuntimeError in torch


class Device(Protocol):
    """Where the caches live: staging memory, the connector's stream, and how the store sees device bytes."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def ids(self, block_ids: Sequence[int]) -> torch.Tensor: ...
    def on_stream(self, *, after_engine: bool, before_engine: bool) -> contextlib.AbstractContextManager: ...
    def value(self, t: torch.Tensor) -> Any: ...


class CudaDevice:
    """A CUDA device with one stream of the connector's own (never the default stream)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
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

    def value(self, t: torch.Tensor) -> torch.Tensor:
        return t  # the store enqueues its copy on the current stream: ours, inside on_stream


class DeviceBlocks:
    """Saves and loads whole blocks of device ``pages`` (kernel views, one per layer) through a store."""

    def __init__(self, pages: list[torch.Tensor], kernel_layout: KVLayout, chunk: int, device: Device):
        self.pages, self.layout, self.chunk, self.device = pages, kernel_layout, chunk, device
        self.block_nbytes = kernel_layout.block_nbytes
        self._staging: torch.Tensor | None = None

    def _stage(self, n: int) -> torch.Tensor:
        if self._staging is None:
            self._staging = self.device.empty(ops.packed_shape(self.layout, self.chunk), self.layout.dtype)
        return self._staging[:n]

    # ---- saves ----------------------------------------------------------------------------------------
    def save(self, store: KVStore, items: Sequence[tuple[str, int]], ttl: float | None) -> int:
        """Gather each chunk on the device, then one copy per block into the store (all of a chunk or none)."""
        written = 0
        for start in range(0, len(items), self.chunk):
            chunk = items[start:start + self.chunk]
            try:
                with self.device.on_stream(after_engine=True, before_engine=False):
                    staged = self._stage(len(chunk))
                    ops.gather_pages(self.pages, self.device.ids([b for _, b in chunk]), staged, layout=self.layout)
                    self._put(store, [k for k, _ in chunk], staged, ttl)
            except DEVICE_ERRORS as exc:
                raise TransportError(f"device error while saving {len(chunk)} block(s): {exc}") from None
            written += len(chunk) * self.block_nbytes
        return written

    def pack(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A new device buffer holding the blocks (the asynchronous saver's copy), gathered on our stream."""
        try:
            with self.device.on_stream(after_engine=True, before_engine=False):
                packed = self.device.empty(ops.packed_shape(self.layout, len(block_ids)), self.layout.dtype)
                return ops.gather_pages(self.pages, self.device.ids(block_ids), packed, layout=self.layout)
        except DEVICE_ERRORS as exc:
            raise TransportError(f"device error while packing {len(block_ids)} block(s): {exc}") from None

    def put_packed(self, store: KVStore, keys: Sequence[str], packed: torch.Tensor, ttl: float | None) -> int:
        try:
            with self.device.on_stream(after_engine=False, before_engine=False):
                self._put(store, list(keys), packed, ttl)
        except DEVICE_ERRORS as exc:
            raise TransportError(f"device error while saving {len(keys)} block(s): {exc}") from None
        return len(keys) * self.block_nbytes

    def _put(self, store: KVStore, keys: list[str], packed: torch.Tensor, ttl: float | None) -> None:
        if store.device_memory() is None:  # a host-only store: one device-to-host copy into a private buffer
            host = packed.to("cpu")
            store.batch_put([(key, host[i:i + 1]) for i, key in enumerate(keys)], ttl=ttl)
            return
        store.batch_put([(key, self.device.value(packed[i:i + 1])) for i, key in enumerate(keys)], ttl=ttl)

    # ---- loads ----------------------------------------------------------------------------------------
    def load(self, store: KVStore, items: Sequence[tuple[str, int]], verify: bool, result: Any) -> list[int]:
        """Copy each chunk's objects into staging on our stream, then one scatter; returns the failed blocks."""
        failed: list[int] = []
        for start in range(0, len(items), self.chunk):
            chunk = items[start:start + self.chunk]
            try:
                with self.device.on_stream(after_engine=True, before_engine=True):
                    good = self._load_chunk(store, chunk, verify, result, failed, items[start:])
            except DEVICE_ERRORS:
                good = []
                failed.extend(b for _, b in chunk if b not in failed)
            result.loaded += len(good)
            if result.connection_lost:
                break
        return failed

    def _load_chunk(self, store: KVStore, chunk: Sequence[tuple[str, int]], verify: bool, result: Any,
                    failed: list[int], rest: Sequence[tuple[str, int]]) -> list[int]:
        staged = self._stage(len(chunk))
        flat = staged.view(len(chunk), -1)
        host = store.device_memory() is None
        good: list[int] = []
        for i, (key, block_id) in enumerate(chunk):
            try:
                if host:  # a host-only store: into a private buffer, then one host-to-device copy
                    buf = torch.empty(flat.shape[1], dtype=flat.dtype)
                    store.get_into(key, buf, verify=verify)
                    flat[i].copy_(buf)
                else:
                    store.get_into(key, self.device.value(flat[i]), verify=verify)
                good.append(i)
            except StoreConnectionError:
                result.connection_lost = True
                failed.extend(b for _, b in rest[i:])
                break
            except KVStoreError as exc:
                if isinstance(exc, ChecksumError):
                    result.checksum_errors += 1
                elif isinstance(exc, KeyNotFoundError):
                    result.missing += 1
                failed.append(block_id)
        if good:
            src = staged if len(good) == len(chunk) else staged[self.device.ids(good)].contiguous()
            ops.scatter_pages(src, self.device.ids([chunk[i][1] for i in good]), self.pages, layout=self.layout)
        return good
