"""The master relocates objects to join free space before it evicts or refuses; StoreFullError tells the truth.

The segment is a bytearray the mover copies inside, and every object is filled with its own tag, so a move
that lost or tore bytes shows."""

import random
import re

import pytest

from kvstore.core.master import Master
from kvstore.core.meta import ObjectMeta
from kvstore.errors import StoreFullError

KiB, MiB = 1 << 10, 1 << 20


class Segment:
    def __init__(self, capacity: int):
        self.buf = memoryview(bytearray(capacity))
        self.moves = 0

    def move(self, segment: int, src: int, dst: int, nbytes: int) -> None:
        assert segment == 0
        self.buf[dst:dst + nbytes] = self.buf[src:src + nbytes]
        self.moves += 1


class Tagged:
    """A master over a Segment; puts fill their bytes with a tag, ``check`` reads every object back."""

    def __init__(self, capacity: int, *, move: bool = True, **kw):
        self.seg = Segment(capacity)
        self.m = Master([capacity], mover=self.seg.move if move else None, **kw)
        self.client = self.m.register_client("t")
        self.tags: dict[str, int] = {}

    def put(self, key: str, size: int, **kw):
        r = self.m.begin_put(ObjectMeta(key=key, size=size, checksum=1), self.client, **kw)
        tag = len(self.tags) % 251 + 1
        self.seg.buf[r.offset:r.offset + size] = bytes([tag]) * size
        self.tags[key] = tag
        return self.m.commit(r.id)

    def check(self) -> None:
        for key in self.m.keys():
            r = self.m.lookup(key)
            assert self.seg.buf[r.offset:r.offset + r.size] == bytes([self.tags[key]]) * r.size, key


def mixed_fill(seed: int, *, move: bool, capacity: int = 64 * MiB) -> tuple[float, Tagged]:
    """KV-like mixed traffic from 4 clients (half fixed chunk sizes, half 1 KiB-2 MiB log-uniform; nearly as
    many removes as puts, so the free space ends up in pieces) until the first eviction or refusal; returns
    the fill just before it."""
    rng = random.Random(seed)
    t = Tagged(capacity, move=move, high_watermark=1.0, low_watermark=1.0)
    mine: list[list[str]] = [[] for _ in range(4)]
    for n in range(200_000):
        keys = mine[rng.randrange(4)]
        if keys and rng.random() < 0.49:
            t.m.remove(keys.pop(rng.randrange(len(keys))))
            continue
        size = rng.choice((32 * KiB, 128 * KiB, 512 * KiB)) if rng.random() < 0.5 else int(2 ** rng.uniform(10, 21))
        fill = t.m.used_bytes / t.m.capacity
        try:
            t.put(f"k{n}", size)
        except StoreFullError:
            return fill, t
        if t.m.evictions:
            return fill, t
        keys.append(f"k{n}")
    raise AssertionError("the store never filled up")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_mixed_workload_fills_past_90_percent_before_the_first_eviction(seed):
    fill, t = mixed_fill(seed, move=True)
    assert fill >= 0.9, f"first eviction at {fill:.3f} of capacity"
    assert t.m.relocations > 0 and t.m.stats()["fill_at_first_eviction"] is not None
    t.check()


def test_without_relocation_the_same_traffic_evicts_earlier():
    """The bound above is the relocation's doing: the same traffic without a mover evicts sooner."""
    fills = [mixed_fill(seed, move=False)[0] for seed in (1, 2, 3)]
    moved = [mixed_fill(seed, move=True)[0] for seed in (1, 2, 3)]
    assert min(fills) < 0.9 <= min(moved)


def pinned_comb(move: bool) -> Tagged:
    """Issue 11: 16 pinned 2.5 MiB objects, 1.5 MiB apart once the unpinned ones between them are gone:
    62.5 % used, 24 MiB free, no free extent over 1.5 MiB."""
    t = Tagged(64 * MiB, move=move, high_watermark=1.0, low_watermark=1.0)
    for i in range(16):
        t.put(f"pin{i}", 5 * MiB // 2, pin=True)
        t.put(f"tmp{i}", 3 * MiB // 2)
    for i in range(16):
        t.m.remove(f"tmp{i}")
    return t


def test_an_8mib_put_beside_pinned_data_moves_them_instead_of_failing():
    t = pinned_comb(move=True)
    assert t.m.used_bytes == 40 * MiB and t.m.stats()["largest_free_bytes"] == 3 * MiB // 2
    t.put("big", 8 * MiB)
    assert t.m.relocations >= 2 and t.m.evictions == 0
    assert all(t.m.exists(f"pin{i}") for i in range(16))
    t.check()


def test_pinned_fragmentation_without_a_mover_reports_the_truth():
    t = pinned_comb(move=False)
    with pytest.raises(StoreFullError) as info:
        t.put("big", 8 * MiB)
    msg = str(info.value)
    assert f"{40 * MiB} of {64 * MiB} bytes used, {24 * MiB} free, largest free extent {3 * MiB // 2}" in msg
    assert "fragmentation 0.94" in msg and "in pieces" in msg and f"{40 * MiB} bytes pinned" in msg
    assert "leased" not in msg and "pending" not in msg and "quarantined" not in msg  # none of those hold space
    assert t.m.stats()["refusals"] == 1


def test_leased_and_pending_objects_never_move_and_are_named():
    t = Tagged(16 * MiB, high_watermark=1.0, low_watermark=1.0)
    for i in range(8):
        t.put(f"a{i}", MiB)
        t.put(f"gap{i}", MiB)
    leases = [t.m.lease(f"a{i}", t.client) for i in range(8)]
    offsets = {f"a{i}": t.m.lookup(f"a{i}").offset for i in range(8)}
    for i in range(8):
        t.m.remove(f"gap{i}")
    pending = t.m.begin_put(ObjectMeta(key="p", size=MiB), t.client)  # takes one 1 MiB hole
    t.seg.buf[pending.offset:pending.offset + MiB] = b"\xfe" * MiB
    t.tags["p"] = 0xFE
    with pytest.raises(StoreFullError) as info:
        t.put("big", 2 * MiB)  # 7 MiB free in 1 MiB holes between leased objects
    msg = str(info.value)
    assert f"{9 * MiB} of {16 * MiB} bytes used, {7 * MiB} free, largest free extent {MiB}" in msg
    assert f"{8 * MiB} bytes leased" in msg and f"{MiB} bytes in pending puts" in msg and "pinned" not in msg
    assert {k: t.m.lookup(k).offset for k in offsets} == offsets and t.seg.moves == 0
    for lease in leases:
        t.m.release(lease.id)
    t.m.commit(pending.id)
    t.put("big", 2 * MiB)  # now they may move (or go)
    t.check()


def test_a_full_store_names_what_holds_it():
    t = Tagged(4 * MiB)
    t.put("a", 2 * MiB, pin=True)
    t.put("b", MiB)
    lease = t.m.lease("b", t.client)
    with pytest.raises(StoreFullError) as info:
        t.put("c", 2 * MiB)
    msg = str(info.value)
    assert re.search(rf"{3 * MiB} of {4 * MiB} bytes used, {MiB} free, largest free extent {MiB} "
                     r"\(fragmentation 0\.00\); the free space is smaller than the request", msg), msg
    assert f"{MiB} bytes leased" in msg and f"{2 * MiB} bytes pinned" in msg and "pending" not in msg
    t.m.release(lease.id)
    t.put("c", 2 * MiB)  # b is evictable again
    assert not t.m.exists("b")
