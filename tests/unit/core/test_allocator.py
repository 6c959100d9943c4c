import random
from itertools import pairwise

import pytest

from kvstore.core.allocator import Allocator


def test_alignment_and_reuse():
    a = Allocator(1 << 20, alignment=64)
    offs = [a.allocate(n) for n in (1, 63, 64, 65, 1000)]
    assert all(o % 64 == 0 for o in offs)
    assert len(set(offs)) == len(offs)
    assert a.size_of(offs[3]) == 128
    for o in offs:
        a.free(o)
    assert a.used_bytes == 0
    assert a.stats().free_blocks == 1  # everything coalesced back into one block
    assert a.largest_free() == a.capacity


def test_full_returns_none_and_nothing_changes():
    a = Allocator(4096, alignment=64)
    assert a.allocate(4096) == 0
    assert a.allocate(1) is None
    assert a.used_bytes == 4096


def test_double_free_and_unknown_offset_raise():
    a = Allocator(4096)
    o = a.allocate(100)
    a.free(o)
    with pytest.raises(ValueError):
        a.free(o)
    with pytest.raises(ValueError):
        a.free(12345)


@pytest.mark.parametrize("bad", [0, 3, 48])
def test_bad_alignment(bad):
    with pytest.raises(ValueError):
        Allocator(4096, alignment=bad)


def test_random_workload_never_overlaps_and_coalesces():
    rng = random.Random(7)
    a = Allocator(8 << 20, alignment=64)
    live: dict[int, int] = {}
    for _ in range(20000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            n = rng.choice([64, 4096, 65536, rng.randrange(1, 300000)])
            off = a.allocate(n)
            if off is None:
                assert a.largest_free() < a.aligned(n) or a.stats().fragmentation > 0
                continue
            live[off] = a.size_of(off)
    spans = sorted(live.items())
    for (o1, s1), (o2, _) in pairwise(spans):
        assert o1 + s1 <= o2
    assert a.used_bytes == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.stats().free_blocks == 1 and a.used_bytes == 0


def test_fragmentation_reported():
    a = Allocator(1 << 16, alignment=64)
    offs = [a.allocate(4096) for _ in range(16)]
    for o in offs[::2]:
        a.free(o)
    st = a.stats()
    assert st.free == 8 * 4096
    assert st.largest_free == 4096
    assert st.fragmentation == pytest.approx(1 - 1 / 8)
