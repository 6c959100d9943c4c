"""BlockIO: moves whole blocks (every layer) between vLLM's paged KV cache and the store.

One stored object is one block: its pages of every layer, back to back, as opaque bytes (the attention
kernel's in-page packing is named by the layout fingerprint, never interpreted here). This module is the only
one that touches payload bytes, so the data path can move to the zero-copy page API (``reserve`` /
``put_pages`` / ``get_pages``) without the connector noticing.

The paths, on a same-host daemon:
- save (:meth:`save`): one reservation gathers the blocks (all layers) straight into the store's memory and
  commits them all or nothing: one copy, one commit round trip a chunk (the saver thread calls it while vLLM
  keeps the blocks, so nothing is copied first).
- load, blocks of at least ``LEASED_LOAD_MIN`` bytes: ``get_many`` leases all of a request's blocks in one
  round trip, and each block is scattered from its leased view of the store's memory (checksum verified
  first): one copy a block, one round trip a request.
- load, smaller blocks: ``get_into`` through the daemon's shared-memory index (no round trip) into a staging
  buffer (verified), then ``scatter_pages``: two copies, where a round trip would cost more than the copy.
Pages are packed as the layout's kind (``VLLM_HNC``, ``VLLM_NHC`` or ``MLA``, see :mod:`.cache_layouts`), in
the order the cache's memory holds them (a memcpy per page on block-compact layouts). Every path stores the same
bytes: one block, every layer, block-major. Device (CUDA) caches go through :mod:`.device_io`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvstore import ops
from kvstore.client import pages
from kvstore.client.reservation import Reservation
from kvstore.client.store import KVStore, PutFlags
from kvstore.errors import ChecksumError, KeyNotFoundError, KVStoreError, StoreConnectionError, UnsupportedKVCacheError
from kvstore.integrations.vllm.cache_layouts import PageGeometry, geometry_of
from kvstore.integrations.vllm.device_io import CudaDevice, Device, DeviceBlocks
from kvstore.integrations.vllm.keys import CacheLayout
from kvstore.integrations.vllm.store_link import log
from kvstore.layout import KVLayoutKind

STAGING_BYTES = 64 << 20  # blocks are moved in chunks of at most this many bytes (at least one block)
# At ~5 GB/s a round trip of 50-400 us costs as much as copying 0.25-2 MB: above this, a lease beats a copy.
LEASED_LOAD_MIN = 1 << 20
#: blocks leased in one round trip (the daemon takes at most 4096 keys a request)
MAX_LEASES = 128


@dataclass(slots=True)
class LoadResult:
    loaded: int = 0
    failed_blocks: tuple[int, ...] = ()
    nbytes: int = 0
    seconds: float = 0.0
    checksum_errors: int = 0
    missing: int = 0
    connection_lost: bool = False
    #: keys whose bytes failed their checksum: dropped from the store after the load (see ``drop_corrupt``)
    corrupt_keys: list[str] = field(default_factory=list)
    corrupt_removed: int = 0
    #: keys that were not in the store (KV events report them removed)
    missing_keys: list[str] = field(default_factory=list)


class BlockIO:
    """Saves and loads blocks of ``caches`` (one tensor per layer, in the layout's layer order)."""

    def __init__(self, caches: Sequence[torch.Tensor], layout: CacheLayout, *, verify: bool = True,
                 leased_loads: bool | None = None, device: Device | None = None):
        self.layout = layout
        self.verify = verify
        self.leased_loads = layout.block_nbytes >= LEASED_LOAD_MIN if leased_loads is None else leased_loads
        self._geometry = geometry_of(layout)
        self._pages = [self._page_view(t, layout, self._geometry) for t in caches]
        if len(self._pages) != layout.num_layers:
            raise ValueError(f"expected {layout.num_layers} layer caches, got {len(self._pages)}")
        self.num_blocks = caches[0].shape[0]
        self._kernel_layout = self._geometry.kernel_layout(layout.num_layers, layout.model)
        self._chunk = max(1, STAGING_BYTES // layout.block_nbytes)
        self._staging: torch.Tensor | None = None
        # Device caches (or a stand-in device in tests) take the device path: gather on the device, one copy
        # per block into the store's memory (kvstore.integrations.vllm.device_io).
        if device is None and caches[0].device.type == "cuda":
            device = CudaDevice(caches[0].device)
        self.device = None if device is None else DeviceBlocks(self._pages, self._kernel_layout, self._chunk, device)

    @staticmethod
    def _page_view(cache: torch.Tensor, layout: CacheLayout, geometry: PageGeometry) -> torch.Tensor:
        """vLLM's per-layer ``[B, H, N, C]`` view as the page kernels' cache tensor of ``geometry.kind``
        (any strides: interleaved layers and head-outer layouts copy in shorter runs)."""
        if cache.device.type not in ("cpu", "cuda"):
            raise UnsupportedKVCacheError(f"kvstore's vLLM connector moves CPU and CUDA caches, got {cache.device}")
        if str(cache.dtype).removeprefix("torch.") != layout.dtype:
            raise UnsupportedKVCacheError(f"KV cache dtype {cache.dtype} differs from the expected {layout.dtype} "
                                          f"of {layout.backend}")
        shape = tuple(cache.shape[1:])
        if shape != geometry.view_shape:
            raise UnsupportedKVCacheError(f"KV cache of shape {tuple(cache.shape)}: expected [num_blocks, "
                                          f"{', '.join(map(str, geometry.view_shape))}] (blocks, heads, tokens, "
                                          f"content) for {layout.backend} {geometry.kind.value}")
        if geometry.kind is KVLayoutKind.MLA:
            cache = cache.squeeze(1)
        return cache.view(torch.float8_e4m3fn) if cache.dtype == torch.uint8 else cache

    def _buffer(self, n: int) -> torch.Tensor:
        shape = ops.packed_shape(self._kernel_layout, n)
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = torch.empty(ops.packed_shape(self._kernel_layout, self._chunk),
                                        dtype=self._kernel_layout.dtype)
        return self._staging[:n].view(shape)

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ValueError(f"block ids out of range 0..{self.num_blocks - 1}: {list(block_ids)}")
        return ids

    # ---- saves ----------------------------------------------------------------------------------------
    def save(self, store: KVStore, items: Sequence[tuple[str, int]], ttl: float | None = None, *,
             pin: bool = False) -> int:
        """Store block ``block_id`` under ``key`` for every item; returns the bytes written. ``pin``: the
        objects are never evicted (they still expire after ``ttl``): a hand-off the decode side will read.

        Each chunk is one reservation, gathered straight from the cache into the store's memory and committed
        all or nothing (one round trip on a same-host daemon). Raises the store's errors (the caller decides
        what a failure means); a chunk already written stays written."""
        if self.device is not None:
            return self.device.save(store, items, ttl, pin)
        written = 0
        for start in range(0, len(items), self._chunk):
            chunk = items[start:start + self._chunk]
            self._ids([b for _, b in chunk])  # range check
            with Reservation(store, PutFlags(pin=pin), ttl) as batch:
                for key, block_id in chunk:
                    pages.add_pages(batch, key, self._pages, [block_id], self._kernel_layout)
            written += len(chunk) * self.layout.block_nbytes
        return written

    # ---- loads ----------------------------------------------------------------------------------------
    def load(self, store: KVStore, items: Sequence[tuple[str, int]]) -> LoadResult:
        """Load every item's key into its block. A block whose object is missing, corrupt (checksum) or
        unreadable is reported in ``failed_blocks`` (its cache bytes are then undefined: vLLM recomputes
        it). A lost connection (``connection_lost``) fails the remaining blocks too."""
        result = LoadResult()
        start_time = time.perf_counter()
        if self.device is not None:
            failed = self.device.load(store, items, self.verify, result)
        else:
            load = self._load_leased if self.leased_loads else self._load_staged
            failed = load(store, items, result)
        if result.corrupt_keys and not result.connection_lost:
            result.corrupt_removed = drop_corrupt(store, result.corrupt_keys)
        result.failed_blocks = tuple(failed)
        result.nbytes = result.loaded * self.layout.block_nbytes
        result.seconds = time.perf_counter() - start_time
        return result

    def _load_leased(self, store: KVStore, items: Sequence[tuple[str, int]], result: LoadResult) -> list[int]:
        """Lease every block of a chunk in one round trip (``get_many``), scatter each from its view of the
        store's memory, release each lease once its scatter ends (sent at the end, without a round trip)."""
        self._ids([b for _, b in items])  # range check, before anything is leased
        failed: list[int] = []
        for start in range(0, len(items), MAX_LEASES):
            chunk = items[start:start + MAX_LEASES]
            try:
                objs = store.get_many([key for key, _ in chunk])
            except StoreConnectionError:
                result.connection_lost = True
                failed.extend(b for _, b in items[start:])
                break
            for (key, block_id), obj in zip(chunk, objs, strict=True):
                if isinstance(obj, KVStoreError):
                    self._count_failure(obj, result, key)
                    failed.append(block_id)
                    continue
                try:
                    with obj:
                        # checksum hashed inside the copy: a corrupt block is reported failed, and vLLM recomputes it
                        pages.scatter_object(obj, [block_id], self._pages, self._kernel_layout, self.verify,
                                             hash_in_copy=True)
                    result.loaded += 1
                except KVStoreError as exc:
                    self._count_failure(exc, result, key)
                    failed.append(block_id)
        store.send_releases()  # the blocks are evictable again now, not at the loader's next request
        return failed

    @staticmethod
    def _count_failure(exc: KVStoreError, result: LoadResult, key: str) -> None:
        if isinstance(exc, ChecksumError):
            result.checksum_errors += 1
            result.corrupt_keys.append(key)
        elif isinstance(exc, KeyNotFoundError):
            result.missing += 1
            result.missing_keys.append(key)

    def _load_staged(self, store: KVStore, items: Sequence[tuple[str, int]], result: LoadResult) -> list[int]:
        failed: list[int] = []
        for start in range(0, len(items), self._chunk):
            chunk = items[start:start + self._chunk]
            packed = self._buffer(len(chunk))
            flat = packed.view(len(chunk), -1)
            good: list[int] = []
            for i, (key, block_id) in enumerate(chunk):
                try:
                    store.get_into(key, flat[i], verify=self.verify)
                    good.append(i)
                except StoreConnectionError:
                    result.connection_lost = True
                    failed.extend(b for _, b in items[start + i:])
                    break
                except KVStoreError as exc:
                    self._count_failure(exc, result, key)
                    failed.append(block_id)
            self._scatter(packed, chunk, good)
            result.loaded += len(good)
            if result.connection_lost:
                break
        return failed

    def _scatter(self, packed: torch.Tensor, chunk: Sequence[tuple[str, int]], good: list[int]) -> None:
        if not good:
            return
        src = packed if len(good) == len(chunk) else packed[torch.tensor(good, dtype=torch.int64)].contiguous()
        ids = self._ids([chunk[i][1] for i in good])
        ops.scatter_pages(src, ids, self._pages, layout=self._kernel_layout)


def drop_corrupt(store: KVStore, keys: Sequence[str]) -> int:
    """Remove objects whose bytes failed their checksum, so that the next lookup misses and the blocks are
    recomputed (and saved again) instead of being found, loaded and failed on every retry. Best effort: a key
    replaced, leased by another reader or unreachable meanwhile stays (the scheduler also stops loading a
    request after ``MAX_LOAD_ATTEMPTS``); returns how many were removed."""
    removed = 0
    for key in keys:
        try:
            removed += bool(store.remove(key))
        except KVStoreError as exc:
            log.info("kvstore: corrupt block %s stays in the store (%s: %s)", key, type(exc).__name__, exc)
    if removed:
        log.warning("kvstore: removed %d corrupt block(s) from the store; they are recomputed", removed)
    return removed
