"""Relocation over a real Allocator and a bytearray standing in for the segment: after opening an extent the
blocks still tile the segment, free blocks are coalesced, every object's bytes moved with it, and objects that
may not move never did."""

from dataclasses import dataclass
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.core.allocator import Allocator
from kvstore.core.relocation import open_extent, plan, plan_pack

ALIGN = 64


@dataclass
class Obj:
    offset: int
    reserved: int
    tag: int


class Memory:
    """A segment's bytes: each object is filled with its tag, so a lost or torn move shows."""

    def __init__(self, allocator: Allocator):
        self.a = allocator
        self.buf = memoryview(bytearray(allocator.capacity))
        self.objects: dict[int, Obj] = {}
        self.moves = 0

    def put(self, nbytes: int, tag: int) -> Obj | None:
        off = self.a.allocate(nbytes)
        if off is None:
            return None
        obj = Obj(off, self.a.size_of(off), tag)
        self.buf[off:off + obj.reserved] = bytes([tag]) * obj.reserved
        self.objects[off] = obj
        return obj

    def drop(self, obj: Obj) -> None:
        del self.objects[obj.offset]
        self.a.free(obj.offset)

    def move(self, obj: Obj, dst: int) -> None:
        self.buf[dst:dst + obj.reserved] = self.buf[obj.offset:obj.offset + obj.reserved]  # may overlap
        del self.objects[obj.offset]
        obj.offset = dst
        self.objects[dst] = obj
        self.moves += 1

    def check(self) -> None:
        blocks = self.a.blocks()
        assert blocks[0][0] == 0 and sum(s for _, s, _ in blocks) == self.a.capacity
        for (o1, s1, u1), (o2, _, u2) in pairwise(blocks):
            assert o1 + s1 == o2  # no gap, no overlap
            assert u1 or u2  # two free neighbours would have been coalesced
        assert {o for o, _, used in blocks if used} == set(self.objects)
        assert self.a.used_bytes == sum(o.reserved for o in self.objects.values())
        for obj in self.objects.values():
            assert self.buf[obj.offset:obj.offset + obj.reserved] == bytes([obj.tag]) * obj.reserved


def fragmented(seed_sizes: list[int], capacity: int = 1 << 20) -> Memory:
    """Fill with the given sizes, then free every other object: the free space is in pieces."""
    mem = Memory(Allocator(capacity, ALIGN))
    placed = [mem.put(n, i % 250 + 1) for i, n in enumerate(seed_sizes)]
    for obj in [o for o in placed if o is not None][::2]:
        mem.drop(obj)
    return mem


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(1, 40_000), min_size=4, max_size=80),
       pinned=st.sets(st.integers(0, 79), max_size=20), need=st.integers(1, 300_000),
       max_pack=st.one_of(st.none(), st.integers(0, 400_000)))
def test_open_extent_keeps_every_invariant(sizes, pinned, need, max_pack):
    mem = fragmented(sizes, capacity=256 << 10)
    fixed = {o.offset for i, o in enumerate(sorted(mem.objects.values(), key=lambda o: o.offset)) if i in pinned}
    before = {id(o): o.offset for o in mem.objects.values()}
    movable = {off: o for off, o in mem.objects.items() if off not in fixed}
    opened = open_extent(mem.a, need, movable, mem.move, max_pack)
    mem.check()
    assert all(o.offset in fixed or o.offset in mem.objects for o in mem.objects.values())
    assert all(before[id(mem.objects[off])] == off for off in fixed)  # never moved
    if opened:
        assert mem.a.largest_free() >= mem.a.aligned(need)
        assert mem.put(need, 255) is not None
        mem.check()
    else:
        assert mem.moves == 0 and {id(o): o.offset for o in mem.objects.values()} == before
        if not fixed and max_pack is None:  # everything may move: only a lack of bytes can refuse
            assert mem.a.free_bytes < mem.a.aligned(need)


def test_window_moves_the_fewest_bytes():
    mem = Memory(Allocator(64 * 1024, ALIGN))
    # [4K obj][4K free][1K obj][3K free][48K obj][4K free]: the cheapest 8 KiB window moves only the 1 KiB object
    a = mem.put(4096, 1)
    hole1 = mem.put(4096, 2)
    small = mem.put(1024, 3)
    hole2 = mem.put(3072, 4)
    mem.put(48 * 1024, 5)
    mem.drop(hole1)
    mem.drop(hole2)
    assert mem.a.largest_free() == 4096 and mem.a.free_bytes == 11 * 1024
    windows = plan(mem.a, 8192, lambda off: True)
    assert windows[0].moves == (small.offset,) and windows[0].moved_bytes == 1024
    assert open_extent(mem.a, 8192, dict(mem.objects), mem.move)
    mem.check()
    assert mem.a.largest_free() >= 8192 and mem.moves == 1 and a.offset == 0  # only the small one moved


def test_pack_when_no_window_fits():
    """Objects larger than every hole cannot be moved out of a window; packing slides them down instead."""
    mem = Memory(Allocator(8 * 8192, ALIGN))
    objs = [mem.put(6144 if i % 2 == 0 else 2048, i + 1) for i in range(16)]
    for o in objs[1::2]:
        mem.drop(o)  # 8 holes of 2 KiB between 8 objects of 6 KiB: no hole takes an object
    assert mem.a.largest_free() == 2048 and mem.a.free_bytes == 16 * 1024
    assert plan(mem.a, 6144, lambda off: True)  # windows pass the byte budget; their objects fit no hole
    stretch = plan_pack(mem.a, 6144, lambda off: True)
    assert stretch is not None and sum(s for _, s, used in stretch if not used) >= 6144
    assert not open_extent(mem.a, 6144, dict(mem.objects), mem.move, max_pack=4096)  # would move more
    assert mem.moves == 0
    assert open_extent(mem.a, 6144, dict(mem.objects), mem.move)
    mem.check()
    assert mem.a.largest_free() >= 6144 and mem.moves >= 2


def test_unmovable_objects_split_the_space_for_good():
    mem = Memory(Allocator(16 * 4096, ALIGN))
    objs = [mem.put(4096, i + 1) for i in range(16)]
    for o in objs[1::2]:
        mem.drop(o)
    assert not open_extent(mem.a, 8192, {}, mem.move)
    assert mem.moves == 0
    mem.check()


@pytest.mark.parametrize("bad", [(0, 64), (128, 64), (64, 100), (64, 1 << 30)])
def test_claim_needs_a_free_block_start(bad):
    a = Allocator(1 << 20, ALIGN)
    a.allocate(64)
    with pytest.raises(ValueError):
        a.claim(*bad)  # 0 is used, 128 starts no block, 100 is unaligned, 1 GiB is larger than the block
