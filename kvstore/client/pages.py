"""Paged KV straight into a store and back: ``KVStore.put_pages`` / ``get_pages`` (and their batch forms).

A put reserves the packed object's space and gathers the request's blocks from every layer's cache directly
into it (one copy on CPU caches; on CUDA caches one gather on the device and one device-to-host copy into
the reserved memory). A get leases the stored object (a zero-copy view on the embedded store and over shm),
checks its size and dtype against the layout before any byte is written into the caches, then scatters
straight from the view and releases the lease. The object's shape is ``ops.packed_shape(layout, n)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstore.core.digest import checksum_of
from kvstore.errors import ChecksumError, LayoutMismatchError
from kvstore.layout import KVLayout, dtype_name

if TYPE_CHECKING:
    import torch

    from kvstore.client.reservation import Reservation
    from kvstore.client.store import KVStore
    from kvstore.core.meta import ObjectMeta
    from kvstore.core.value import KVObject


def block_tensor(block_ids: Any, device: Any) -> torch.Tensor:
    """Block ids as a 1-D integer tensor on ``device``. Floats and bools are refused (TypeError naming the
    dtype): a truncated id would put pages in the wrong blocks."""
    import torch

    ids = block_ids if isinstance(block_ids, torch.Tensor) else torch.as_tensor(list(block_ids))
    if ids.dtype not in (torch.int32, torch.int64) and not (ids.numel() == 0 and ids.dtype == torch.float32):
        raise TypeError(f"block_ids must be integers (int32 or int64), got dtype {ids.dtype}")
    if ids.numel() == 0:
        ids = ids.to(torch.int64)
    return ids.reshape(-1).to(device)


def add_pages(batch: Reservation, key: str, kv_caches: Sequence[torch.Tensor], block_ids: Any,
              layout: KVLayout, meta: dict[str, Any] | None = None) -> ObjectMeta | None:
    """Reserve ``key`` in ``batch`` and gather the blocks into it; returns nothing (commit publishes)."""
    from kvstore import ops

    ids = block_tensor(block_ids, kv_caches[0].device if len(kv_caches) else "cpu")
    shape = ops.packed_shape(layout, len(ids))
    view = batch.add(key, ops.packed_nbytes(layout, len(ids)), meta=meta, kind="torch",
                     dtype=dtype_name(layout.dtype), shape=shape)
    if len(kv_caches) and kv_caches[0].device.type != "cpu":  # gather on the device, one copy to the host
        import torch

        staged = torch.empty(shape, dtype=layout.dtype, device=kv_caches[0].device)
        ops.gather_pages(kv_caches, ids, staged, layout=layout)
        ops.packed_view(view, layout, len(ids)).copy_(staged)
    else:
        ops.gather_pages(kv_caches, ids, view, layout=layout)
    return None


def put_pages(store: KVStore, items: Sequence[tuple[str, Any]], kv_caches: Sequence[torch.Tensor],
              layout: KVLayout, ttl: float | None, ephemeral: bool, meta: dict[str, Any] | None) -> list[ObjectMeta]:
    with store.reservation(ttl=ttl, ephemeral=ephemeral) as batch:
        for key, block_ids in items:
            add_pages(batch, key, kv_caches, block_ids, layout, meta)
    return batch.committed


def check_object(meta: ObjectMeta, layout: KVLayout, num_blocks: int) -> None:
    """LayoutMismatchError unless the stored object is ``num_blocks`` packed blocks of ``layout``."""
    from kvstore import ops

    expected = ops.packed_nbytes(layout, num_blocks)
    if meta.size != expected:
        raise LayoutMismatchError(f"object {meta.key!r} holds {meta.size} bytes; {num_blocks} blocks of this "
                                  f"layout are {expected}")
    if meta.kind == "torch" and meta.dtype not in (None, dtype_name(layout.dtype)):
        raise LayoutMismatchError(f"object {meta.key!r} holds {meta.dtype} pages; this layout is "
                                  f"{dtype_name(layout.dtype)}")


def get_pages(store: KVStore, items: Sequence[tuple[str, Any]], kv_caches: Sequence[torch.Tensor],
              layout: KVLayout, verify: bool) -> int:
    """Scatter every stored object into its blocks; returns the bytes moved. Each object is checked (and, with
    ``verify``, its checksum) before any of its bytes reach the caches."""

    total = 0
    for key, block_ids in items:
        with store.get(key, copy=False) as obj:
            total += scatter_object(obj, block_ids, kv_caches, layout, verify)
    return total


def scatter_object(obj: KVObject, block_ids: Any, kv_caches: Sequence[torch.Tensor], layout: KVLayout,
                   verify: bool, *, hash_in_copy: bool = False) -> int:
    """Scatter one stored object (held by the caller) into blocks ``block_ids``; returns its bytes. Checked
    (and, with ``verify``, its checksum) before any byte reaches the caches -- unless ``hash_in_copy`` (CPU
    caches): then the checksum is computed inside the copy, one pass over the bytes instead of two, and a
    ChecksumError means the blocks were written with unverified bytes, for a caller that then treats them as
    failed (the vLLM connector: vLLM recomputes them)."""
    from kvstore import ops

    device = kv_caches[0].device if len(kv_caches) else "cpu"
    ids = block_tensor(block_ids, device)
    check_object(obj.meta, layout, len(ids))
    view = memoryview(obj)
    if verify and obj.meta.checksum is not None and hash_in_copy and str(device) == "cpu":
        try:
            ops.scatter_pages(ops.packed_view(view, layout, len(ids)), ids, kv_caches, layout=layout,
                              expect_checksum=obj.meta.checksum)
        except ChecksumError:
            raise ChecksumError(f"object {obj.meta.key!r}: bytes differ from the checksum recorded at commit; "
                                f"blocks {list(map(int, ids))} hold unverified bytes") from None
        return len(view)
    if verify and obj.meta.checksum is not None and checksum_of(view) != obj.meta.checksum:
        raise ChecksumError(f"object {obj.meta.key!r}: bytes differ from the checksum recorded at commit")
    src = ops.packed_view(view, layout, len(ids))
    if device != "cpu" and getattr(device, "type", "cpu") != "cpu":
        src = src.to(device)
    ops.scatter_pages(src, ids, kv_caches, layout=layout)
    nbytes = len(view)
    del src, view
    return nbytes
