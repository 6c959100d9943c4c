"""BlockIO: moves whole blocks (every layer) between vLLM's paged KV cache and the store.

One stored object is one block: its pages of every layer, back to back, as opaque bytes (the attention
kernel's in-page packing is named by the layout fingerprint, never interpreted here). This module is the only
one that touches payload bytes, so the data path can move to the zero-copy page API (``reserve`` /
``put_pages`` / ``get_pages``) without the connector noticing.

The paths, on a same-host daemon:
- save (:meth:`save`): one reservation gathers the blocks (all layers) straight into the store's memory and
  commits them all or nothing: one copy, one commit round trip a chunk (the saver thread calls it while vLLM
  keeps the blocks, so nothing is copied first).
- load, blocks of at least ``LEASED_LOAD_MIN`` bytes: ``get_pages`` scatters each block from a leased view
  of the store's memory (checksum verified first): one copy and one round trip a block.
- load, smaller blocks: ``get_into`` through the daemon's shared-memory index (no round trip) into a staging
  buffer (verified), then ``scatter_pages``: two copies, where a round trip would cost more than the copy.
A CPU-backend page ``[num_kv_heads, block_size, 2 * head_size]`` is contiguous, so it is packed with the
kernel of a block-major layout whose page has the same element count (a memcpy per page). Every path stores
the same bytes: one block, every layer, block-major.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore import ops
from kvstore.client import pages
from kvstore.client.reservation import Reservation
from kvstore.client.store import KVStore, PutFlags
from kvstore.errors import ChecksumError, KeyNotFoundError, KVStoreError, StoreConnectionError
from kvstore.integrations.vllm.keys import CacheLayout
from kvstore.layout import KVLayout, KVLayoutKind

STAGING_BYTES = 64 << 20  # blocks are moved in chunks of at most this many bytes (at least one block)
# At ~5 GB/s a round trip of 50-400 us costs as much as copying 0.25-2 MB: above this, a lease beats a copy.
LEASED_LOAD_MIN = 1 << 20


@dataclass(slots=True)
class LoadResult:
    loaded: int = 0
    failed_blocks: tuple[int, ...] = ()
    nbytes: int = 0
    seconds: float = 0.0
    checksum_errors: int = 0
    missing: int = 0
    connection_lost: bool = False


class BlockIO:
    """Saves and loads blocks of ``caches`` (one tensor per layer, in the layout's layer order)."""

    def __init__(self, caches: Sequence[torch.Tensor], layout: CacheLayout, *, verify: bool = True,
                 leased_loads: bool | None = None):
        self.layout = layout
        self.verify = verify
        self.leased_loads = layout.block_nbytes >= LEASED_LOAD_MIN if leased_loads is None else leased_loads
        self._pages = [self._page_view(t, layout) for t in caches]
        if len(self._pages) != layout.num_layers:
            raise ValueError(f"expected {layout.num_layers} layer caches, got {len(self._pages)}")
        self.num_blocks = caches[0].shape[0]
        # The page kernels see each page as one contiguous run: a block-major layout with pages of the
        # same element count (see the module docstring).
        heads, block_size, width = layout.page_shape
        self._kernel_layout = KVLayout(KVLayoutKind.FLASHINFER_HND, num_layers=layout.num_layers,
                                       num_kv_heads=heads, head_dim=width // 2, block_size=block_size,
                                       dtype=caches[0].dtype, model_id=layout.model)
        self._chunk = max(1, STAGING_BYTES // layout.block_nbytes)
        self._staging: torch.Tensor | None = None

    @staticmethod
    def _page_view(cache: torch.Tensor, layout: CacheLayout) -> torch.Tensor:
        if cache.device.type != "cpu":
            raise NotImplementedError(f"kvstore's vLLM connector moves CPU caches only, got {cache.device}")
        if tuple(cache.shape[1:]) != layout.page_shape:
            raise ValueError(f"KV cache page shape {tuple(cache.shape[1:])} differs from the expected "
                             f"{layout.page_shape} of {layout.backend}")
        if str(cache.dtype).removeprefix("torch.") != layout.dtype:
            raise ValueError(f"KV cache dtype {cache.dtype} differs from the expected {layout.dtype}")
        if not cache.is_contiguous():
            raise ValueError(f"KV cache of shape {tuple(cache.shape)} with strides {cache.stride()} is not "
                             "block-contiguous")
        heads, block_size, width = layout.page_shape
        return cache.view(cache.shape[0], 2, heads, block_size, width // 2)

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
        load = self._load_leased if self.leased_loads else self._load_staged
        failed = load(store, items, result)
        result.failed_blocks = tuple(failed)
        result.nbytes = result.loaded * self.layout.block_nbytes
        result.seconds = time.perf_counter() - start_time
        return result

    def _load_leased(self, store: KVStore, items: Sequence[tuple[str, int]], result: LoadResult) -> list[int]:
        failed: list[int] = []
        for i, (key, block_id) in enumerate(items):
            self._ids([block_id])
            try:
                store.get_pages(key, self._pages, [block_id], layout=self._kernel_layout, verify=self.verify)
                result.loaded += 1
            except StoreConnectionError:
                result.connection_lost = True
                failed.extend(b for _, b in items[i:])
                break
            except KVStoreError as exc:
                self._count_failure(exc, result)
                failed.append(block_id)
        return failed

    @staticmethod
    def _count_failure(exc: KVStoreError, result: LoadResult) -> None:
        if isinstance(exc, ChecksumError):
            result.checksum_errors += 1
        elif isinstance(exc, KeyNotFoundError):
            result.missing += 1

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
                    self._count_failure(exc, result)
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
