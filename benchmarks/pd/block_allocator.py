"""A free-list allocator of KV-cache blocks with per-request block tables."""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """Not enough free blocks for the allocation. Nothing was allocated; retry after requests finish."""


class BlockAllocator:
    """Hands out block ids ``0 .. num_blocks-1`` and remembers which request holds which, in order.

    Freed blocks go to the back of the free list, so a long run reuses blocks in a scrambled order, as a
    real engine does (hand-offs must not assume a producer's block order).
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, request_id: str, count: int) -> list[int]:
        """Append ``count`` blocks to ``request_id``'s table and return the whole table."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > len(self._free):
            raise OutOfBlocksError(f"{request_id}: need {count} blocks, {len(self._free)} free of {self.num_blocks}")
        table = self._tables.setdefault(request_id, [])
        table.extend(self._free.popleft() for _ in range(count))
        self.peak_used = max(self.peak_used, self.num_used)
        return table

    def table(self, request_id: str) -> list[int]:
        """The request's blocks in position order; KeyError if it holds none."""
        try:
            return self._tables[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no blocks") from None

    def free(self, request_id: str) -> int:
        """Return all of the request's blocks to the free list; returns how many (0 if it held none)."""
        table = self._tables.pop(request_id, [])
        self._free.extend(table)
        return len(table)
