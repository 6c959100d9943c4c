"""Relocation: open one free extent by moving a few committed objects (pure logic, no I/O).

Why moving and not size classes: the store holds few, large objects (a 256 MiB store of 1 KiB–8 MiB values
holds a few hundred), and the TLSF allocator already places them about as well as best fit. Simulated on the
mixed workload, address-ordered first fit, best fit and two-ended placement all stop at 0.81–0.95 fill before
the first failed allocation, and slabs do worse (a slab per size class is mostly empty when a class has a few
objects, and a slab needs a large extent of its own). Whatever the placement, freeing objects at random leaves
the free space in pieces; only moving joins them. Moving is bounded: to place ``need`` bytes it moves at most the
objects of one window of about ``need`` bytes (fewest bytes to move first), never the whole segment.

When moving is safe, which the caller decides per object: only a committed, visible object that nobody holds
(no lease, no quarantine hold; pending puts are never moved), since every view a client may keep of an object's
bytes (zero-copy gets, reads over TCP/UCX/CUDA IPC, the disk tier's copy) is taken under a lease. Same-host
lock-free readers of the shared-memory index copy, then re-check the slot's sequence number; the owner copies
the bytes first, republishes the slot at the new offset (a new sequence number), and only then is the old space
freed — so a reader that copied from the old place retries, exactly as after an eviction.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvstore.core.allocator import Allocator


class _Placed(Protocol):  # what a moved object has (the master's Replica)
    offset: int
    reserved: int


T = TypeVar("T", bound=_Placed)


@dataclass(frozen=True, slots=True)
class Window:
    """``length`` contiguous bytes at ``offset`` made of free pieces (``claims``: (offset, size) each, the last
    one possibly a head of a larger free block) and the objects at ``moves`` (``moved_bytes`` in all)."""

    offset: int
    length: int
    moves: tuple[int, ...]
    moved_bytes: int
    claims: tuple[tuple[int, int], ...]


#: windows tried, cheapest first, before giving up (a window fails when its objects do not fit elsewhere)
TRIES = 4


def plan(allocator: Allocator, need: int, movable: Callable[[int], bool], count: int = TRIES) -> list[Window]:
    """Up to ``count`` windows of ``need`` bytes (aligned) whose objects fit in the free bytes outside them,
    fewest bytes to move first. ``movable(offset)``: whether the object there may move. O(n log n) in blocks."""
    best: list[tuple[int, int, int, int]] = []  # (-moved, run, i, j): the ``count`` cheapest, as a max-heap
    budget = allocator.free_bytes
    runs = _runs(allocator.blocks(), movable)
    for r, run in enumerate(runs):
        j = length = moved = 0
        for i in range(len(run)):
            while j < len(run) and length < need:
                length += run[j][1]
                moved += run[j][1] if run[j][2] else 0
                j += 1
            if length < need:
                break
            leftover = 0 if run[j - 1][2] else length - need  # the tail of the last free block stays outside
            if moved and budget - (length - moved - leftover) >= moved:
                entry = (-moved, r, i, j)
                if len(best) < count:
                    heapq.heappush(best, entry)
                elif entry > best[0]:
                    heapq.heapreplace(best, entry)
            length -= run[i][1]
            moved -= run[i][1] if run[i][2] else 0
    return [_window(runs[r][i:j], need, -neg) for neg, r, i, j in sorted(best, reverse=True)]


def plan_pack(allocator: Allocator, need: int, movable: Callable[[int], bool]) -> list[tuple[int, int, bool]] | None:
    """The stretch of blocks, free or movable, holding at least ``need`` free bytes with the fewest object bytes
    in it (packing its objects to its start leaves those free bytes in one extent), or None."""
    best: tuple[int, list[tuple[int, int, bool]]] | None = None
    for run in _runs(allocator.blocks(), movable):
        j = free = moved = 0
        for i in range(len(run)):
            while j < len(run) and free < need:
                free += 0 if run[j][2] else run[j][1]
                moved += run[j][1] if run[j][2] else 0
                j += 1
            if free < need:
                break
            if best is None or moved < best[0]:
                best = (moved, run[i:j])
            free -= 0 if run[i][2] else run[i][1]
            moved -= run[i][1] if run[i][2] else 0
    return None if best is None else best[1]


def open_extent(allocator: Allocator, need: int, objects: Mapping[int, T], move: Callable[[T, int], None],
                max_pack: int | None = None) -> bool:
    """Make ``need`` contiguous bytes free by moving some of ``objects`` (offset -> object; the ones allowed
    to move). ``move(obj, dst)`` copies the object's bytes to ``dst`` (the ranges may overlap: a memmove) and
    records its new offset. First the cheap way: empty one window of ``need`` bytes into free space elsewhere;
    else pack the objects of the stretch that holds ``need`` free bytes with the fewest object bytes, if those are
    at most ``max_pack`` (None: any). False, with nothing moved, when neither works (objects that may not move
    split the free space, or packing would move more than ``max_pack``)."""
    size = allocator.aligned(need)
    if any(_clear(allocator, w, objects, move) for w in plan(allocator, size, objects.__contains__)):
        return True
    stretch = plan_pack(allocator, size, objects.__contains__)
    if stretch is None or (max_pack is not None and sum(s for _, s, used in stretch if used) > max_pack):
        return False
    _pack(allocator, stretch, objects, move)
    return True


def _pack(allocator: Allocator, stretch: list[tuple[int, int, bool]], objects: Mapping[int, T],
          move: Callable[[T, int], None]) -> None:
    """Slide the stretch's objects down to its start, in address order: each one's old block is freed (it joins
    the free gap below it, which starts at the cursor) and its new place claimed from that gap's start."""
    cursor = stretch[0][0]
    for offset, size, used in stretch:
        if not used:
            continue
        if offset != cursor:
            allocator.free(offset)
            allocator.claim(cursor, size)
            move(objects[offset], cursor)
        cursor += size


def _clear(allocator: Allocator, window: Window, objects: Mapping[int, T], move: Callable[[T, int], None]) -> bool:
    for offset, size in window.claims:  # hold the window's free pieces so no destination lands inside it
        allocator.claim(offset, size)
    destinations: list[tuple[int, int]] = []
    try:
        for src in sorted(window.moves, key=allocator.size_of, reverse=True):  # largest first: best fit
            dst = allocator.allocate(allocator.size_of(src))
            if dst is None:
                for _, taken in destinations:
                    allocator.free(taken)
                return False
            destinations.append((src, dst))
        for src, dst in destinations:
            move(objects[src], dst)
            allocator.free(src)
    finally:
        for offset, _ in window.claims:
            allocator.free(offset)
    return True


def _runs(blocks: list[tuple[int, int, bool]], movable: Callable[[int], bool]) -> list[list[tuple[int, int, bool]]]:
    """Maximal stretches of free blocks and movable objects, split at every object that may not move."""
    runs: list[list[tuple[int, int, bool]]] = [[]]
    for block in blocks:
        if block[2] and not movable(block[0]):
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append(block)
    return [r for r in runs if r]


def _window(blocks: list[tuple[int, int, bool]], need: int, moved: int) -> Window:
    claims: list[tuple[int, int]] = []
    covered = 0
    for offset, size, used in blocks:
        if not used:
            claims.append((offset, min(size, need - covered) if covered + size > need else size))
        covered += size
    start = blocks[0][0]
    return Window(start, min(covered, need) if not blocks[-1][2] else covered,
                  tuple(o for o, _, used in blocks if used), moved, tuple(claims))
