"""Allocator: offsets inside one segment, two-level segregated fit (TLSF-style).

Free blocks sit in size-class bins: a first level by power of two and, inside each, ``2**SL_BITS`` linear
sub-classes. A bitmap of non-empty bins finds a fitting bin in O(1) big-int operations; frees coalesce
with both neighbours through start/end maps in O(1). Every block is aligned to ``alignment`` bytes.
Pure logic: no I/O, no memory is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

SL_BITS = 4
_SL_COUNT = 1 << SL_BITS


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    capacity: int
    used: int
    free: int
    largest_free: int
    free_blocks: int
    allocations: int

    @property
    def fragmentation(self) -> float:
        """1 - largest free block / all free bytes: 0 when free space is one block."""
        return 0.0 if self.free == 0 else 1.0 - self.largest_free / self.free


def _bin_index(size: int) -> int:
    fl = size.bit_length() - 1
    if fl < SL_BITS:
        return size  # tiny sizes get one bin each (never happens with alignment >= 16)
    sl = (size >> (fl - SL_BITS)) & (_SL_COUNT - 1)
    return (fl - SL_BITS + 1) * _SL_COUNT + sl


def _round_up_to_bin(size: int) -> int:
    """Smallest size >= ``size`` whose whole bin holds blocks >= ``size`` (TLSF's mapping search)."""
    fl = size.bit_length() - 1
    if fl < SL_BITS:
        return size
    return size + (1 << (fl - SL_BITS)) - 1


class Allocator:
    """Allocates aligned byte ranges in ``[0, capacity)``.

    ``allocate`` returns an offset or ``None`` when no free block fits (the caller decides whether to
    evict and retry); ``free`` takes an offset previously returned.
    """

    def __init__(self, capacity: int, alignment: int = 64):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity < alignment:
            raise ValueError(f"capacity {capacity} is smaller than the alignment {alignment}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self._bins: dict[int, dict[int, None]] = {}
        self._bitmap = 0
        self._free_start: dict[int, int] = {}
        self._free_end: dict[int, int] = {}
        self._used: dict[int, int] = {}
        self._used_bytes = 0
        self._insert_free(0, self.capacity)

    # ---- public -------------------------------------------------------------------------------------
    def aligned(self, nbytes: int) -> int:
        """Bytes actually reserved for a request of ``nbytes`` (zero-byte objects still take one unit)."""
        n = max(nbytes, 1)
        return (n + self.alignment - 1) & ~(self.alignment - 1)

    def allocate(self, nbytes: int) -> int | None:
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes})")
        size = self.aligned(nbytes)
        offset = self._take_fitting(size)
        if offset is None:
            return None
        block = self._free_start[offset]
        self._remove_free(offset, block)
        if block > size:
            self._insert_free(offset + size, block - size)
        self._used[offset] = size
        self._used_bytes += size
        return offset

    def free(self, offset: int) -> int:
        """Free the block at ``offset``; returns its reserved size. Unknown offsets raise ValueError."""
        size = self._used.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset} is not an allocated block")
        self._used_bytes -= size
        start, end = offset, offset + size
        prev_start = self._free_end.get(start)
        if prev_start is not None:
            self._remove_free(prev_start, start - prev_start)
            start = prev_start
        next_size = self._free_start.get(end)
        if next_size is not None:
            self._remove_free(end, next_size)
            end += next_size
        self._insert_free(start, end - start)
        return size

    def split(self, offset: int, at: int) -> None:
        """Cut the allocated block at ``offset`` in two at ``at`` (aligned, strictly inside it): both parts stay
        allocated and are freed on their own (an arena hands a committed range over to the object stored in it)."""
        size = self._used.get(offset)
        if size is None:
            raise ValueError(f"offset {offset} is not an allocated block")
        if not offset < at < offset + size or at % self.alignment:
            raise ValueError(f"cannot split the block [{offset}, +{size}) at {at} (alignment {self.alignment})")
        self._used[offset] = at - offset
        self._used[at] = offset + size - at

    def hole_if_freed(self, offset: int) -> int:
        """Size of the free block that freeing the allocation at ``offset`` would leave (with its neighbours)."""
        size = self._used[offset]
        before = offset - self._free_end[offset] if offset in self._free_end else 0
        after = self._free_start.get(offset + size, 0)
        return before + size + after

    def size_of(self, offset: int) -> int:
        return self._used[offset]

    def claim(self, offset: int, size: int) -> None:
        """Take the first ``size`` bytes of the free block that starts at ``offset`` (``free`` gives them back).
        Relocation holds a window's free pieces this way while it moves the window's objects elsewhere."""
        block = self._free_start.get(offset)
        if block is None or size <= 0 or size % self.alignment or size > block:
            raise ValueError(f"cannot claim {size} bytes at {offset}: no free block of that size starts there")
        self._remove_free(offset, block)
        if block > size:
            self._insert_free(offset + size, block - size)
        self._used[offset] = size
        self._used_bytes += size

    def blocks(self) -> list[tuple[int, int, bool]]:
        """Every block, free or used, in address order: ``(offset, size, used)``. O(n log n): for the rare
        slow path (planning a relocation), never for a plain allocation."""
        spans = [(o, s, True) for o, s in self._used.items()] + [(o, s, False) for o, s in self._free_start.items()]
        spans.sort()
        return spans

    @property
    def block_count(self) -> int:
        """Free and used blocks together."""
        return len(self._used) + len(self._free_start)

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._used_bytes

    def largest_free(self) -> int:
        if not self._bitmap:
            return 0
        top = self._bins[self._bitmap.bit_length() - 1]
        return max(self._free_start[o] for o in top)

    def stats(self) -> AllocatorStats:
        return AllocatorStats(self.capacity, self._used_bytes, self.free_bytes, self.largest_free(),
                              len(self._free_start), len(self._used))

    # ---- bins ---------------------------------------------------------------------------------------
    def _take_fitting(self, size: int) -> int | None:
        idx = _bin_index(_round_up_to_bin(size))
        candidates = self._bitmap >> idx
        if candidates:
            found = idx + (candidates & -candidates).bit_length() - 1
            return next(iter(self._bins[found]))
        # The bin of `size` itself may still hold a block large enough (its members vary in size).
        for offset in self._bins.get(_bin_index(size), ()):
            if self._free_start[offset] >= size:
                return offset
        return None

    def _insert_free(self, offset: int, size: int) -> None:
        self._free_start[offset] = size
        self._free_end[offset + size] = offset
        idx = _bin_index(size)
        self._bins.setdefault(idx, {})[offset] = None
        self._bitmap |= 1 << idx

    def _remove_free(self, offset: int, size: int) -> None:
        del self._free_start[offset]
        del self._free_end[offset + size]
        idx = _bin_index(size)
        members = self._bins[idx]
        del members[offset]
        if not members:
            del self._bins[idx]
            self._bitmap &= ~(1 << idx)
