"""Paged-KV packing: gather one request's blocks from every layer's cache into one contiguous buffer, and
scatter them back.

The packed format is block-major: ``packed[i, l]`` holds block ``block_ids[i]`` of layer ``l`` in the layout's
block order (``layout.block_shape``), so any run of blocks ``packed[a:b]`` is itself a valid packed buffer and
can be stored as one object or per chunk without another copy. ``docs/kv_layout.md`` has the shapes and a
worked example.

Both ops are ``torch.library.custom_op``s (``kvstore::gather_pages``, ``kvstore::scatter_pages``) with fake
implementations, so they work under ``torch.compile``. Every input is validated before a kernel runs; errors
are ``TypeError`` (wrong kind of thing) or ``ValueError`` (wrong value), naming expected and actual values.
On CUDA the block-id range check reads the ids back, which waits for the caller's current stream.

Fused checksums (CPU only, eager only: outside the registered ops): ``gather_pages(..., checksum=True)`` also
returns the xxh3-64 of the packed bytes, computed by the extension as it writes them (each ~256 KiB piece is
hashed right after it is copied, while in cache, in packed order: the value equals
``xxhash.xxh3_64_intdigest`` of the whole buffer); ``scatter_pages(..., expect_checksum=c)`` hashes the packed
source as it reads it and raises :class:`~kvstore.errors.ChecksumError` when it differs from ``c`` — after the
bytes were written, so the caller must treat those blocks as failed (never as loaded). The extension loads
``libxxhash.so.0`` at first use; where it is missing, or with ``KVSTORE_NO_FUSED_HASH=1`` in the environment,
both fall back to a separate pass in Python with the same results (the fallback scatter verifies *before*
writing). :func:`fused_checksums` says which path runs.
"""

from __future__ import annotations

import collections
import functools
import importlib
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import xxhash

from kvstore.errors import ChecksumError
from kvstore.layout import KVLayout, KVLayoutKind, dtype_name

__all__ = ["packed_shape", "packed_nbytes", "packed_view", "gather_pages", "scatter_pages", "prepare_gather_pages",
           "prepare_scatter_pages", "fused_checksums"]

_ID_DTYPES = (torch.int32, torch.int64)


# -- public API ---------------------------------------------------------------------------------------------
def packed_shape(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
    """Shape of the packed buffer for ``num_blocks`` blocks: ``(num_blocks, num_layers, *layout.block_shape)``."""
    _check_layout_type(layout)
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
    return (num_blocks, layout.num_layers, *layout.block_shape)


def packed_nbytes(layout: KVLayout, num_blocks: int) -> int:
    """Bytes of the packed buffer for ``num_blocks`` blocks (``num_blocks * layout.block_nbytes``)."""
    packed_shape(layout, num_blocks)  # validates
    return num_blocks * layout.block_nbytes


def packed_view(buffer, layout: KVLayout, num_blocks: int | None = None) -> torch.Tensor:
    """A packed tensor over ``buffer``'s bytes, without copying: any C-contiguous object of the buffer protocol
    (a store's reserved or leased memory, a bytearray, a numpy array) reinterpreted as the layout's dtype and
    ``packed_shape(layout, num_blocks)``. ``num_blocks`` defaults to what the buffer holds; the buffer must be
    exactly ``packed_nbytes(layout, num_blocks)`` long. A read-only buffer gives a tensor that must not be
    written (scatter reads it; gather refuses it)."""
    _check_layout_type(layout)
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(f"expected a torch.Tensor or a buffer, got {type(buffer).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("expected a C-contiguous buffer")
    nbytes = view.nbytes
    if num_blocks is None:
        if layout.block_nbytes == 0 or nbytes % layout.block_nbytes:
            raise ValueError(f"buffer of {nbytes} bytes is not a whole number of {layout.block_nbytes}-byte blocks")
        num_blocks = nbytes // layout.block_nbytes
    expected = packed_nbytes(layout, num_blocks)
    if nbytes != expected:
        raise ValueError(f"buffer: expected {expected} bytes for {num_blocks} blocks, got {nbytes}")
    if nbytes == 0:
        return torch.empty(packed_shape(layout, 0), dtype=layout.dtype)
    flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")  # leased, read-only views
        raw = torch.frombuffer(flat, dtype=torch.uint8)
    return raw.view(layout.dtype).view(packed_shape(layout, num_blocks))


def _as_packed(packed, layout: KVLayout, block_ids, writable: bool) -> torch.Tensor:
    """``packed`` as given when it is a tensor; a buffer becomes a packed view over its bytes."""
    if isinstance(packed, torch.Tensor) or isinstance(packed, (tuple, list)) or packed is None:
        return packed  # tensors go as they are; the rest fails in _check_call with the usual message
    if writable and memoryview(packed).readonly:
        raise ValueError("out: expected a writable buffer, got a read-only one")
    count = len(block_ids) if isinstance(block_ids, torch.Tensor) and block_ids.dim() == 1 else None
    return packed_view(packed, layout, count)


def gather_pages(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor | memoryview, *,
                 layout: KVLayout, checksum: bool = False):
    """Copy blocks ``block_ids`` of every layer into ``out`` and return ``out``.

    ``kv_caches``: one tensor per layer, each of shape ``layout.cache_shape(num_cache_blocks)`` (any strides);
    ``block_ids``: 1-D int32/int64 on the caches' device, each in ``[0, num_cache_blocks)`` (repeats allowed);
    ``out``: contiguous, ``packed_shape(layout, len(block_ids))``, the caches' dtype and device, not
    overlapping any cache — or a writable buffer of exactly that many bytes (e.g. memory reserved in a store,
    see :func:`packed_view`; CPU caches only). Raises TypeError/ValueError before anything is copied.

    ``checksum=True`` (CPU caches; not traced by ``torch.compile``) returns ``(out, xxh3)`` instead: the
    xxh3-64 of the packed bytes, hashed inside the copy (see the module docstring and :func:`fused_checksums`).
    """
    out = _as_packed(out, layout, block_ids, writable=True)
    kv_caches = _check_call(layout, kv_caches, block_ids, out, "out")
    if checksum:
        return out, _hashed_copy(layout.kind.value, kv_caches, block_ids, out, gather=True)
    torch.ops.kvstore.gather_pages(kv_caches, block_ids, out, layout.kind.value)
    return out


def scatter_pages(src: torch.Tensor | memoryview, block_ids: torch.Tensor, kv_caches: Sequence[torch.Tensor], *,
                  layout: KVLayout, expect_checksum: int | None = None) -> None:
    """Copy the packed ``src`` into blocks ``block_ids`` of every layer's cache (in place).

    Shapes as for :func:`gather_pages`, with ``src`` in the place of ``out``. ``block_ids`` must not repeat
    (two writes to one block would race), and the caches must be distinct, non-self-overlapping tensors that
    do not overlap ``src``. ``src`` may also be a buffer (e.g. a store's leased zero-copy view; CPU caches
    only). Raises TypeError/ValueError before anything is copied.

    ``expect_checksum`` (CPU caches; not traced): the xxh3-64 ``src`` must have. It is hashed while it is
    copied, and a mismatch raises :class:`~kvstore.errors.ChecksumError` (``.expected``, ``.actual``) *after*
    the blocks were written with the bad bytes: treat them as failed. (The Python fallback checks first and
    writes nothing; either way the error means "these blocks are not loaded".)
    """
    src = _as_packed(src, layout, block_ids, writable=False)
    kv_caches = _check_call(layout, kv_caches, block_ids, src, "src")
    if expect_checksum is not None:
        if isinstance(expect_checksum, bool) or not isinstance(expect_checksum, int) or \
                not 0 <= expect_checksum < 1 << 64:
            raise TypeError(f"expect_checksum must be an unsigned 64-bit int or None, got {expect_checksum!r}")
        actual = _hashed_copy(layout.kind.value, kv_caches, block_ids, src, gather=False, expect=expect_checksum)
        if actual != expect_checksum:
            error = ChecksumError(f"packed source has xxh3 {actual:#018x}, expected {expect_checksum:#018x}; blocks "
                                  f"{_ids_text(block_ids)} hold unverified bytes: treat them as failed")
            error.expected, error.actual = expect_checksum, actual
            raise error
        return
    torch.ops.kvstore.scatter_pages(src, block_ids, kv_caches, layout.kind.value)


def fused_checksums() -> str | None:
    """None when ``checksum=`` / ``expect_checksum=`` hash inside the copy; else why they fall back to a
    separate Python pass (``KVSTORE_NO_FUSED_HASH=1`` set, the extension not built, or ``libxxhash.so.0``
    not loadable — ``KVSTORE_XXHASH_LIB`` names another file to load)."""
    if os.environ.get("KVSTORE_NO_FUSED_HASH", "").strip() not in ("", "0"):
        return "fused checksums disabled by KVSTORE_NO_FUSED_HASH"
    try:
        native = _native("_C")
    except RuntimeError as exc:
        return str(exc)
    status = native.xxh3_status() if hasattr(native, "xxh3_status") else "the extension predates fused checksums"
    return f"fused checksums unavailable: {status}" if status else None


def prepare_gather_pages(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor, *,
                         layout: KVLayout) -> Callable[[], None]:
    """Validate a :func:`gather_pages` call once and return a function that runs its copy again and again.

    For callers that repeat one copy many times (benchmarks timing the kernel alone, an engine re-using a
    fixed staging buffer). Arguments and errors as for :func:`gather_pages`, raised here, before any copy;
    except that on CPU the block-id range (and, for scatter, repeats) is checked by the extension on every
    call, so a bad id raises ValueError from the returned function, still before a byte is copied.
    ``block_ids`` is copied now, so later changes to it do not reach the prepared call; the tensors must
    stay allocated with the same shapes (the call keeps them alive). The returned function takes no
    arguments, runs (CPU) or enqueues on the current stream (CUDA) one kernel, and returns None.
    """
    kv_caches = _check_call(layout, kv_caches, block_ids, out, "out")
    return _prepare(layout.kind.value, kv_caches, block_ids, out, gather=True)


def prepare_scatter_pages(src: torch.Tensor, block_ids: torch.Tensor, kv_caches: Sequence[torch.Tensor], *,
                          layout: KVLayout) -> Callable[[], None]:
    """Validate a :func:`scatter_pages` call once and return a function that runs its copy again and again.

    As :func:`prepare_gather_pages`, with the checks and errors of :func:`scatter_pages`."""
    kv_caches = _check_call(layout, kv_caches, block_ids, src, "src")
    return _prepare(layout.kind.value, kv_caches, block_ids, src, gather=False)


def _prepare(layout_kind: str, kv_caches: list[torch.Tensor], block_ids: torch.Tensor, packed: torch.Tensor,
             gather: bool) -> Callable[[], None]:
    """Every check the registered op makes, once; then a launch of the checked arguments."""
    name = "out" if gather else "src"
    pages = _inspect(layout_kind, kv_caches, block_ids, packed, name)
    ids = _checked_ids(block_ids, pages.num_cache_blocks, unique=not gather).clone()
    ptrs = [t.data_ptr() for t in kv_caches]
    if not gather:
        _check_writable_caches(kv_caches, ptrs)
    _check_disjoint(packed, name, kv_caches, ptrs, ids, gather=gather)
    return _PreparedCopy(tuple(kv_caches), pages, ptrs, ids, packed, gather)


@dataclass(frozen=True, slots=True)
class _PreparedCopy:
    """A validated copy; holding the caches keeps ``ptrs`` valid for as long as the copy can be run."""

    kv_caches: tuple[torch.Tensor, ...]
    pages: _Pages
    ptrs: list[int]
    ids: torch.Tensor
    packed: torch.Tensor
    gather: bool

    def __call__(self) -> None:
        _launch(self.pages, self.ptrs, self.ids, self.packed, self.gather)


def _hashed_copy(layout_kind: str, kv_caches: list[torch.Tensor], block_ids: torch.Tensor, packed: torch.Tensor,
                 gather: bool, expect: int | None = None) -> int:
    """Every check of the registered op, then the copy with the xxh3-64 of the packed bytes (fused, or a Python
    pass after a gather / before a scatter, which then copies only when the digest is ``expect``)."""
    name = "out" if gather else "src"
    pages = _inspect(layout_kind, kv_caches, block_ids, packed, name)
    if packed.device.type != "cpu":
        raise ValueError(f"{name}: fused checksums need CPU caches and a CPU packed buffer, got device "
                         f"{packed.device}")
    ids = _checked_ids(block_ids, pages.num_cache_blocks, unique=not gather)
    ptrs = [t.data_ptr() for t in kv_caches]
    if not gather:
        _check_writable_caches(kv_caches, ptrs)
    _check_disjoint(packed, name, kv_caches, ptrs, ids, gather=gather)
    if fused_checksums() is None and ids.numel():
        return _launch(pages, ptrs, ids, packed, gather, hashed=True)
    if gather:
        _launch(pages, ptrs, ids, packed, gather)
        return xxhash.xxh3_64_intdigest(_bytes_of(packed))
    _checked_ids(block_ids, pages.num_cache_blocks, unique=True, here=True)  # bad ids first, not a checksum error
    actual = xxhash.xxh3_64_intdigest(_bytes_of(packed))
    if actual == expect:
        _launch(pages, ptrs, ids, packed, gather)
    return actual


def _bytes_of(packed: torch.Tensor) -> memoryview:
    return memoryview(packed.reshape(-1).view(torch.uint8).numpy())


def _ids_text(block_ids: torch.Tensor) -> str:
    ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else list(block_ids)
    return str(ids) if len(ids) <= 16 else f"{ids[:16]} (+{len(ids) - 16} more)"


# -- the registered ops --------------------------------------------------------------------------------------
@torch.library.custom_op("kvstore::gather_pages", mutates_args=("out",))
def _gather_pages_op(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor,
                     layout_kind: str) -> None:
    pages = _inspect(layout_kind, kv_caches, block_ids, out, "out")
    ids = _checked_ids(block_ids, pages.num_cache_blocks, unique=False)
    ptrs = [t.data_ptr() for t in kv_caches]
    _check_disjoint(out, "out", kv_caches, ptrs, ids, gather=True)
    _launch(pages, ptrs, ids, out, gather=True)


@_gather_pages_op.register_fake
def _(kv_caches, block_ids, out, layout_kind):
    _inspect(layout_kind, kv_caches, block_ids, out, "out")


@torch.library.custom_op("kvstore::scatter_pages", mutates_args=("kv_caches",))
def _scatter_pages_op(src: torch.Tensor, block_ids: torch.Tensor, kv_caches: list[torch.Tensor],
                      layout_kind: str) -> None:
    pages = _inspect(layout_kind, kv_caches, block_ids, src, "src")
    ids = _checked_ids(block_ids, pages.num_cache_blocks, unique=True)
    ptrs = [t.data_ptr() for t in kv_caches]
    _check_writable_caches(kv_caches, ptrs)
    _check_disjoint(src, "src", kv_caches, ptrs, ids, gather=False)
    _launch(pages, ptrs, ids, src, gather=False)


@_scatter_pages_op.register_fake
def _(src, block_ids, kv_caches, layout_kind):
    _inspect(layout_kind, kv_caches, block_ids, src, "src")


# -- validation ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Pages:
    """What the kernels need, read off validated tensors. Strides are in elements."""

    num_layers: int
    num_cache_blocks: int
    block_stride: int
    dim_sizes: list[int]
    dim_strides: list[int]
    itemsize: int


def _check_layout_type(layout: object) -> None:
    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout must be a kvstore.KVLayout, got {type(layout).__name__}")


def _check_call(layout: KVLayout, kv_caches, block_ids, packed, name: str) -> list[torch.Tensor]:
    """Checks argument types and the first cache against the layout; the op checks every other layer
    against the first (so per-layer work is done once)."""
    _check_layout_type(layout)
    if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence):
        raise TypeError(f"kv_caches must be a list of tensors (one per layer), got {type(kv_caches).__name__}")
    if not isinstance(block_ids, torch.Tensor):
        raise TypeError(f"block_ids must be a torch.Tensor of int32/int64, got {type(block_ids).__name__}")
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    kv_caches = list(kv_caches)
    if len(kv_caches) != layout.num_layers:
        raise ValueError(f"kv_caches: expected {layout.num_layers} layers (layout.num_layers), got {len(kv_caches)}")
    if not all(isinstance(cache, torch.Tensor) for cache in kv_caches):
        i, bad = next((i, c) for i, c in enumerate(kv_caches) if not isinstance(c, torch.Tensor))
        raise TypeError(f"kv_caches[{i}] must be a torch.Tensor, got {type(bad).__name__}")
    first = kv_caches[0]
    if first.dtype != layout.dtype:
        raise TypeError(f"kv_caches[0]: expected dtype {layout.dtype} (layout.dtype), got {first.dtype}")
    block_dim = layout.kind.cache_dims.index("block")
    expected = layout.cache_shape(first.shape[block_dim] if first.dim() > block_dim else 0)
    if tuple(first.shape) != expected:
        shown = tuple("num_blocks" if d == block_dim else s for d, s in enumerate(expected))
        raise ValueError(f"kv_caches[0]: expected shape {shown} for {layout.kind.name} "
                         f"{layout.kind.cache_dims}, got {tuple(first.shape)}")
    return kv_caches


@functools.cache
def _kind_dims(layout_kind: str) -> tuple[KVLayoutKind, int, int | None, tuple[int, ...]]:
    """(kind, block dim, kv dim or None, cache dims of one block in packed order) of a layout kind."""
    kind = KVLayoutKind.parse(layout_kind)
    dims = kind.cache_dims
    kv_dim = dims.index("kv") if "kv" in dims else None
    return kind, dims.index("block"), kv_dim, tuple(dims.index(d) for d in kind.block_dims)


def _inspect(layout_kind: str, kv_caches: list[torch.Tensor], block_ids, packed, name: str) -> _Pages:
    """Checks the op's arguments for consistency with each other; runs on real and on fake tensors."""
    kind, block_dim, kv_dim, block_dims = _kind_dims(layout_kind)
    if len(kv_caches) == 0:
        raise ValueError("kv_caches: expected at least one layer, got an empty list")
    first = kv_caches[0]
    dims = kind.cache_dims
    if first.dim() != len(dims):
        raise ValueError(f"kv_caches[0]: expected {len(dims)} dims {dims} for {kind.name}, got shape "
                         f"{tuple(first.shape)}")
    if kv_dim is not None and first.shape[kv_dim] != 2:
        raise ValueError(f"kv_caches[0]: expected size 2 (K and V) at dim {kv_dim} for {kind.name}, "
                         f"got shape {tuple(first.shape)}")
    if first.device.type not in ("cpu", "cuda"):
        raise ValueError(f"kv_caches[0]: expected a cpu or cuda tensor, got device {first.device}")
    try:
        dtype_name(first.dtype)
    except ValueError as exc:
        raise TypeError(f"kv_caches[0]: {exc}") from None
    _check_same_as_first(kv_caches)
    _check_ids_tensor(block_ids, first.device)
    shape, stride = first.shape, first.stride()
    dim_sizes = [shape[d] for d in block_dims]
    _check_packed(packed, name, (block_ids.shape[0], len(kv_caches), *dim_sizes), first)
    return _Pages(num_layers=len(kv_caches), num_cache_blocks=shape[block_dim], block_stride=stride[block_dim],
                  dim_sizes=dim_sizes, dim_strides=[stride[d] for d in block_dims], itemsize=first.element_size())


def _check_same_as_first(kv_caches: list[torch.Tensor]) -> None:
    first = kv_caches[0]
    shape, stride, dtype, device = first.shape, first.stride(), first.dtype, first.device
    for i, cache in enumerate(kv_caches):  # one fast pass; the slow, precise message only on failure
        if cache.shape != shape or cache.stride() != stride or cache.dtype != dtype or cache.device != device:
            for what, want, got in (("shape", shape, cache.shape), ("stride", stride, cache.stride()),
                                    ("dtype", dtype, cache.dtype), ("device", device, cache.device)):
                if want != got:
                    error = TypeError if what == "dtype" else ValueError
                    raise error(f"kv_caches[{i}]: expected the {what} of kv_caches[0], {want}, got {got}")


def _check_ids_tensor(block_ids, device: torch.device) -> None:
    if not isinstance(block_ids, torch.Tensor):
        raise TypeError(f"block_ids must be a torch.Tensor of int32/int64, got {type(block_ids).__name__}")
    if block_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"block_ids: expected dtype torch.int32 or torch.int64, got {block_ids.dtype}")
    if block_ids.dim() != 1:
        raise ValueError(f"block_ids: expected a 1-D tensor, got shape {tuple(block_ids.shape)}")
    if block_ids.device != device:
        raise ValueError(f"block_ids: expected device {device} (the caches' device), got {block_ids.device}")


def _check_packed(packed, name: str, expected: tuple, cache: torch.Tensor) -> None:
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != cache.dtype:
        raise TypeError(f"{name}: expected dtype {cache.dtype} (the caches' dtype), got {packed.dtype}")
    if packed.device != cache.device:
        raise ValueError(f"{name}: expected device {cache.device} (the caches' device), got {packed.device}")
    if tuple(packed.shape) != expected:
        raise ValueError(f"{name}: expected packed shape {expected} (blocks, layers, *block_shape), got "
                         f"{tuple(packed.shape)}")
    if not packed.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {packed.stride()}")


def _checked_ids(block_ids: torch.Tensor, num_cache_blocks: int, unique: bool, here: bool = False) -> torch.Tensor:
    """Contiguous ids, checked for range (and, for scatter, repeats) before any kernel sees them.

    CUDA ids are reduced on the device and read back as three numbers (one wait for the current stream).
    CPU ids are checked by the extension itself, with the same messages, before it copies a byte: reading
    them from Python costs ~100 us once a large copy has evicted the CPU caches (``here=True`` checks CPU ids
    here too: for a caller that may not reach the extension).
    """
    ids = block_ids.contiguous()
    if ids.numel() == 0 or (ids.device.type == "cpu" and not here):
        return ids
    if unique:
        ordered = torch.sort(ids).values
        stats = torch.stack([ordered[0], ordered[-1], (ordered[1:] == ordered[:-1]).any().to(ids.dtype)])
    else:
        stats = torch.stack(torch.aminmax(ids))
    low, high, *repeated = stats.tolist()
    if low < 0 or high >= num_cache_blocks:
        bad = int(((ids < 0) | (ids >= num_cache_blocks)).nonzero()[0, 0])
        raise ValueError(f"block_ids[{bad}] = {int(ids[bad])} is out of range: expected 0 <= id < "
                         f"{num_cache_blocks} (blocks in each cache)")
    if repeated and repeated[0]:
        value = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
        where = (ids == value).nonzero().flatten().tolist()
        raise ValueError(f"block_ids: expected distinct ids for scatter, got {value} at positions {where}")
    return ids


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to one past its last (torch strides are non-negative)."""
    if t.numel() == 0:
        return 0
    return (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def _check_disjoint(packed: torch.Tensor, name: str, kv_caches: list[torch.Tensor], ptrs: list[int],
                    ids: torch.Tensor, gather: bool) -> None:
    """The packed buffer must not overlap any cache, nor the ids the destination being written."""
    start, end = _span(packed)
    extent = _extent_bytes(kv_caches[0])  # every layer has the same shape and strides
    id_start, id_end = _span(ids)
    for i, c_start in enumerate(ptrs):
        if start < c_start + extent and c_start < end:
            raise ValueError(f"{name} overlaps kv_caches[{i}] in memory ({name} bytes [{start:#x}, {end:#x}), "
                             f"cache bytes [{c_start:#x}, {c_start + extent:#x})); expected disjoint source and "
                             f"destination")
        if not gather and id_start < c_start + extent and c_start < id_end:
            raise ValueError(f"block_ids overlaps kv_caches[{i}] in memory; expected ids outside the caches")
    if gather and id_start < end and start < id_end:
        raise ValueError(f"block_ids overlaps {name} in memory; expected ids outside the packed buffer")


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + _extent_bytes(t)


def _check_writable_caches(kv_caches: list[torch.Tensor], ptrs: list[int]) -> None:
    """Scatter destinations: no element reachable twice, and no layer passed twice."""
    first = kv_caches[0]
    dims = sorted((st, sz) for sz, st in zip(first.shape, first.stride(), strict=True) if sz > 1)
    extent = 1
    for stride, size in dims:
        if stride < extent:
            raise ValueError(f"kv_caches: expected non-overlapping strides, got shape {tuple(first.shape)} with "
                             f"strides {first.stride()} (an expanded or aliased view cannot be written)")
        extent = stride * size
    if len(set(ptrs)) != len(ptrs):
        seen: dict[int, int] = {}
        for i, ptr in enumerate(ptrs):
            j = seen.setdefault(ptr, i)
            if j != i:
                raise ValueError(f"kv_caches[{j}] and kv_caches[{i}] are the same memory; expected one tensor per "
                                 f"layer")


# -- kernels -------------------------------------------------------------------------------------------------
def _native(name: str):
    try:
        return importlib.import_module(f"kvstore.{name}")
    except ImportError as exc:
        hint = ("kvstore was built without CUDA kernels: rebuild with nvcc on PATH (KVSTORE_CUDA=1 pip install -e .)"
                if name == "_C_cuda" else "kvstore's native extension is not built: run `pip install -e .`")
        raise RuntimeError(f"{hint} ({exc})") from exc


def _launch_args(pages: _Pages, ids: torch.Tensor, packed: torch.Tensor) -> dict:
    return dict(block_ids=ids.data_ptr(), ids_int64=ids.dtype == torch.int64, num_ids=ids.numel(),
                num_cache_blocks=pages.num_cache_blocks, block_stride=pages.block_stride,
                dim_sizes=pages.dim_sizes, dim_strides=pages.dim_strides, itemsize=pages.itemsize,
                packed=packed.data_ptr())


def _launch(pages: _Pages, ptrs: list[int], ids: torch.Tensor, packed: torch.Tensor, gather: bool,
            hashed: bool = False) -> int | None:
    """Runs (CPU) or enqueues (CUDA) one kernel; ``ptrs`` are the layers' base addresses. ``hashed`` (CPU):
    the fused-checksum kernel, returning the xxh3-64 of the packed bytes."""
    if ids.numel() == 0:
        return None
    common = _launch_args(pages, ids, packed)
    if packed.device.type == "cpu":
        native = _native("_C")
        if hashed:
            fn = native.gather_pages_xxh3 if gather else native.scatter_pages_xxh3
        else:
            fn = native.gather_pages if gather else native.scatter_pages
        return fn(layer_ptrs=ptrs, num_threads=torch.get_num_threads(), **common)
    native = _native("_C_cuda")
    device = packed.device
    stream = torch.cuda.current_stream(device)
    table, bits = _layer_table(ptrs, device)
    table.record_stream(stream)  # the table may be evicted while this launch is still queued
    fn = native.gather_pages if gather else native.scatter_pages
    fn(layer_ptrs=table.data_ptr(), layer_ptr_bits=bits, num_layers=pages.num_layers, device=device.index,
       stream=stream.cuda_stream, **common)
    return None


_TABLE_CAPACITY = 64
_tables: collections.OrderedDict[tuple, tuple[torch.Tensor, int]] = collections.OrderedDict()
_tables_lock = threading.Lock()


def _layer_table(ptrs: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """Device array of the layers' base addresses (and their OR), built once per set of caches.

    Keyed by the addresses themselves, so a hit is always correct, even after the caches were reallocated.
    """
    key = (device.index, tuple(ptrs))
    with _tables_lock:
        hit = _tables.get(key)
        if hit is not None:
            _tables.move_to_end(key)
            return hit
    bits = 0
    for p in ptrs:
        bits |= p
    entry = (torch.tensor(ptrs, dtype=torch.int64).to(device), bits)
    with _tables_lock:
        _tables[key] = entry
        while len(_tables) > _TABLE_CAPACITY:
            _tables.popitem(last=False)
    return entry
