"""Master arenas: granted space a client commits objects out of (kvstore.core.arena)."""

import pytest

from kvstore.core.allocator import Allocator
from kvstore.core.arena import ArenaPut
from kvstore.core.master import Master
from kvstore.core.meta import ObjectMeta
from kvstore.core.quota import ClientQuota
from kvstore.errors import ArenaError, KeyExistsError, QuotaExceededError

MiB = 1 << 20


def put(arena, offset, key, size=1000, checksum=7):
    return ArenaPut(arena.id, offset, ObjectMeta(key, size), checksum)


def test_commit_carves_the_range_into_an_ordinary_object():
    m = Master([16 * MiB])
    c = m.register_client("a")
    arena = m.grant_arena(c, 4 * MiB)
    base = next(iter(arena.blocks))
    assert m.used_bytes == 4 * MiB and m.stats()["arena_bytes"] == 4 * MiB
    [r] = m.commit_arena(c, [put(arena, base + 4096, "k")])
    assert (r.offset, r.reserved, r.meta.checksum) == (base + 4096, 1024, 7)
    assert m.lookup("k") is r
    assert arena.blocks == {base: 4096, base + 5120: 4 * MiB - 5120}
    assert m.used_bytes == 4 * MiB  # the object's block is carved out of the arena, nothing more taken
    assert m.remove("k")
    assert m.used_bytes == 4 * MiB - 1024  # the object's space went back to the store, not to the arena
    assert m._clients[c].pending_bytes == 4 * MiB - 1024


@pytest.mark.parametrize("where", ["outside", "committed", "unaligned", "overlap-in-batch", "other-client"])
def test_bad_ranges_are_refused_and_change_nothing(where):
    m = Master([16 * MiB])
    a, b = m.register_client("a"), m.register_client("b")
    arena, other = m.grant_arena(a, MiB), m.grant_arena(b, MiB)
    base = next(iter(arena.blocks))
    m.commit_arena(a, [put(arena, base, "first")])
    entries = {"outside": [put(arena, base + MiB - 512, "k")],
               "committed": [put(arena, base, "k")],
               "unaligned": [put(arena, base + 4096 + 8, "k")],
               "overlap-in-batch": [put(arena, base + 8192, "k"), put(arena, base + 8192 + 512, "k2")],
               "other-client": [put(other, next(iter(other.blocks)), "k")]}[where]
    blocks, used = dict(arena.blocks), m.used_bytes
    with pytest.raises(ArenaError):
        m.commit_arena(a, entries)
    assert arena.blocks == blocks and m.used_bytes == used
    assert not m.exists("k") and not m.exists("k2") and m.exists("first")


def test_if_absent_conflict_refuses_the_whole_commit():
    m = Master([16 * MiB])
    c = m.register_client("a")
    arena = m.grant_arena(c, MiB)
    base = next(iter(arena.blocks))
    m.commit_arena(c, [put(arena, base, "k", checksum=1)])
    pending = m.begin_put(ObjectMeta("p", 10), c)
    with pytest.raises(KeyExistsError):
        m.commit_arena(c, [(pending.id, None), put(arena, base + 4096, "k", checksum=2)], if_absent=True)
    assert m.lookup("k").meta.checksum == 1 and not m.exists("p") and m.pending(pending.id)
    assert base + 4096 in arena.blocks or any(o <= base + 4096 < o + n for o, n in arena.blocks.items())


def test_release_and_drop_free_arenas_and_quarantine_holds_them():
    m = Master([16 * MiB])
    c = m.register_client("a")
    arena = m.grant_arena(c, MiB)
    assert m.release_arenas(c, [arena.id]) == MiB and m.used_bytes == 0
    with pytest.raises(ArenaError):
        m.release_arenas(c, [arena.id])
    m.grant_arena(c, MiB)
    m.drop_client(c)
    assert m.used_bytes == 0 and m.stats()["arenas"] == 0
    d = m.register_client("b")
    m.grant_arena(d, MiB)
    m.drop_client(d, quarantine=True)
    assert m.used_bytes == MiB and m.quarantined_bytes() == MiB and m.is_quarantined(d)
    assert m.release_quarantine(d) == MiB and m.used_bytes == 0


def test_arenas_count_in_the_client_quota_and_are_bounded():
    m = Master([16 * MiB], quota=ClientQuota(max_held_bytes=3 * MiB))
    c = m.register_client("a")
    m.grant_arena(c, 2 * MiB)
    with pytest.raises(QuotaExceededError):
        m.grant_arena(c, 2 * MiB, need=2 * MiB)
    smaller = m.grant_arena(c, 2 * MiB, need=4096)  # a whole one would pass the cap: just the put's
    assert smaller.free_bytes == 4096
    d = m.register_client("b")
    for _ in range(Master.MAX_ARENAS):
        m.grant_arena(d, 64)
    with pytest.raises(QuotaExceededError):
        m.grant_arena(d, 64)


def test_arena_in_a_full_store_is_what_is_free_and_evicts_only_for_the_put():
    m = Master([16 * MiB], high_watermark=0.9, low_watermark=0.8)
    c = m.register_client("a")
    for i in range(15):
        r = m.begin_put(ObjectMeta(f"o{i}", MiB), c)
        m.commit(r.id)
    arena = m.grant_arena(c, 8 * MiB, need=4096)
    assert m.evictions <= 3  # to the low watermark for a 4 KiB put, as a put would
    assert arena.free_bytes == 4096  # the cache is full: the arena is the put's own block
    assert m.used_bytes <= 0.9 * 16 * MiB
    m.remove("o14"), m.remove("o13"), m.remove("o12")
    for key in ("o11", "o10", "o9", "o8", "o7", "o6", "o5"):
        m.remove(key)
    assert m.grant_arena(c, 4 * MiB, need=4096).free_bytes == 4 * MiB  # fits below the low watermark: whole


def test_allocator_split_frees_both_parts_separately():
    a = Allocator(4096, 64)
    off = a.allocate(1024)
    a.split(off, off + 256)
    assert a.size_of(off) == 256 and a.size_of(off + 256) == 768 and a.used_bytes == 1024
    with pytest.raises(ValueError):
        a.split(off, off + 100)
    a.free(off + 256)
    a.free(off)
    assert a.used_bytes == 0 and a.largest_free() == 4096
