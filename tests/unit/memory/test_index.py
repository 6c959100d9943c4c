import time

import pytest

from kvstore.memory import index


class Mem:
    """A fake 'segment' for the reader: a bytearray addressed by (segment, offset, size)."""

    def __init__(self, size=1 << 16):
        self.data = bytearray(size)

    def region(self, segment, offset, size):
        return memoryview(self.data)[offset:offset + size]


def make(slots=64):
    buf = memoryview(bytearray(index.table_bytes(slots)))
    mem = Mem()
    return index.IndexWriter(buf, slots), index.IndexReader(buf, mem.region), mem


def read(reader, key, size=4096):
    out = bytearray(size)
    hit = reader.read_into(key, lambda n: memoryview(out))
    return None if hit is None else (bytes(out[:hit[0]]), hit[1], hit[2])


def test_read_of_one_version_copies_nothing_when_another_is_shown():
    w, r, mem = make()
    mem.data[100:103] = b"new"
    w.publish("a", version=8, segment=0, offset=100, size=3, expires=None, checksum=5)
    out = bytearray(b"untouched")
    calls = []

    def fit(n):
        calls.append(n)
        return memoryview(out)

    assert r.read_into("a", fit, only=7) is None  # the caller listed version 7: 8 is not it
    assert calls == [] and out == b"untouched"
    assert r.read_into("a", fit, only=8) == (3, 8, 5) and out[:3] == b"new"


def test_publish_read_unpublish():
    w, r, mem = make()
    mem.data[100:105] = b"hello"
    assert w.publish("a", version=7, segment=0, offset=100, size=5, expires=None, checksum=99)
    assert read(r, "a") == (b"hello", 7, 99)
    w.unpublish("a", version=6)  # stale version: ignored
    assert read(r, "a") is not None
    w.unpublish("a", version=7)
    assert read(r, "a") is None
    assert read(r, "never") is None


def test_replace_in_place():
    w, r, mem = make()
    mem.data[0:3] = b"old"
    mem.data[10:13] = b"new"
    w.publish("k", 1, 0, 0, 3, None, 0)
    w.publish("k", 2, 0, 10, 3, None, 0)
    assert read(r, "k")[:2] == (b"new", 2)


def test_expired_entry_falls_back():
    w, r, _ = make()
    w.publish("k", 1, 0, 0, 3, time.monotonic() - 1, 0)
    assert read(r, "k") is None


def test_many_keys_with_tombstones_and_rebuild():
    w, r, mem = make(slots=64)
    for round_ in range(20):
        for i in range(30):
            key = f"k{round_}-{i}"
            assert w.publish(key, round_ * 100 + i, 0, i, 1, None, 0)
        for i in range(30):
            w.unpublish(f"k{round_}-{i}", round_ * 100 + i)
    for i in range(30):
        mem.data[i] = i
        w.publish(f"final{i}", 5000 + i, 0, i, 1, None, 0)
    for i in range(30):
        assert read(r, f"final{i}")[:2] == (bytes([i]), 5000 + i)


def test_table_full_refuses_instead_of_overflowing():
    w, r, _ = make(slots=64)
    results = [w.publish(f"k{i}", i + 1, 0, 0, 1, None, 0) for i in range(64)]
    assert results.count(True) == int(index.MAX_LOAD * 64)
    assert not results[-1]


def test_concurrent_change_during_copy_is_detected():
    w, r, mem = make()
    mem.data[0:4] = b"AAAA"
    w.publish("k", 1, 0, 0, 4, None, 0)
    calls = []

    def out(n):
        calls.append(n)
        if len(calls) == 1:  # the daemon replaces the key while this reader copies
            mem.data[8:12] = b"BBBB"
            w.publish("k", 2, 0, 8, 4, None, 0)
        return memoryview(buf)

    buf = bytearray(4)
    hit = r.read_into("k", out)
    assert hit[1] == 2 and bytes(buf) == b"BBBB" and len(calls) == 2


def test_atime_written_by_reader():
    w, r, _ = make()
    w.publish("k", 1, 0, 0, 1, None, 0)
    assert w.atime("k") == 0
    read(r, "k")
    assert w.atime("k") > 0


def test_bad_magic():
    with pytest.raises(ValueError):
        index.IndexReader(memoryview(bytearray(index.table_bytes(16))), None)


def gated(reader, key, gate=lambda: True, during=None):
    out = bytearray(64)

    def fit(n):
        if during is not None:
            during()  # what happens to the daemon while the copy runs
        return memoryview(out)

    hit = reader.read_into(key, fit, gate=gate)
    return None if hit is None else bytes(out[:hit[0]])


def test_gated_read_only_while_no_stop_is_left_unchecked():
    w, r, mem = make()
    mem.data[0:3] = b"old"
    w.publish("k", version=1, segment=0, offset=0, size=3, expires=None, checksum=0)
    assert r.marks() == (0, 0) and gated(r, "k") == b"old"
    began = w.stops()
    assert w.stopped() == began + 1  # SIGCONT: stopped since the last re-check
    assert gated(r, "k") is None
    assert read(r, "k")[0] == b"old"  # an ungated read (a single daemon's index) does not look at the marks
    w.checked(began)  # a re-check that began before that stop does not cover it
    assert gated(r, "k") is None
    w.checked(began + 1)
    assert gated(r, "k") == b"old"
    w.checked(began)  # a late, older re-check never moves it back
    assert r.marks() == (began + 1, began + 1) and gated(r, "k") == b"old"


def test_gated_read_is_discarded_when_a_stop_or_a_closed_gate_comes_during_the_copy():
    w, r, mem = make()
    mem.data[0:3] = b"old"
    w.publish("k", version=1, segment=0, offset=0, size=3, expires=None, checksum=0)
    assert gated(r, "k", during=w.stopped) is None  # stopped and resumed while copying
    w.checked(w.stops())
    assert gated(r, "k", gate=lambda: False) is None  # the process is stopped now
    calls = []
    assert gated(r, "k", gate=lambda: calls.append(1) or True) == b"old" and calls == [1]  # checked after the copy
