"""DiskTier on a real filesystem: format, recovery from headers, torn writes, corruption, LRU and capacity,
the directory lock, bad paths and a full disk (a small tmpfs mount)."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from kvstore.errors import DiskPathError, DiskReadError, KeyNotFoundError
from kvstore.memory.disk import DiskConfig, DiskTier
from kvstore.memory.disk_dir import LOCK_NAME
from kvstore.memory.disk_file import file_bytes

pytestmark = pytest.mark.timeout(60)
KiB = 1024


def payload(i: int, size: int = 64 * KiB) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def open_tier(path, capacity=4 << 20, **kw) -> DiskTier:
    return DiskTier(DiskConfig(str(path), capacity, **kw))


def read(tier: DiskTier, key: str) -> bytes:
    obj = tier.get(key)
    if obj is None:
        raise KeyNotFoundError(key)
    buf = bytearray(obj.size)
    tier.read_into(obj, memoryview(buf))
    return bytes(buf)


def store(tier: DiskTier, key: str, data: bytes, version: int = 1) -> bool:
    return tier.store(key, b"meta:" + key.encode(), memoryview(data), version)


def files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n != LOCK_NAME)


def test_store_read_back_and_recover_from_headers(tmp_path):
    tier = open_tier(tmp_path)
    data = {f"k{i}": payload(i, 1000 + 4096 * i) for i in range(8)}
    for key, value in data.items():
        assert store(tier, key, value)
    assert all(read(tier, k) == v for k, v in data.items())  # staged or written: the same bytes
    assert tier.flush(30)
    assert tier.stats()["disk_writes"] == 8 and len(files(tmp_path)) == 8
    tier.close()
    again = open_tier(tmp_path)
    try:
        assert again.recovery["objects"] == 8 and again.recovery["dropped"] == 0
        assert sorted(again.keys()) == sorted(data)
        assert all(read(again, k) == v for k, v in data.items())
        assert again.get("k3").meta == b"meta:k3"
    finally:
        again.close()


def test_torn_and_partial_files_are_dropped_at_recovery(tmp_path):
    tier = open_tier(tmp_path)
    for i in range(3):
        store(tier, f"k{i}", payload(i))
    tier.flush(30)
    tier.close()
    names = files(tmp_path)
    with open(tmp_path / names[0], "r+b") as f:  # lost its tail (commit record): a torn write
        f.truncate(os.path.getsize(tmp_path / names[0]) - 100)
    with open(tmp_path / names[1], "r+b") as f:  # a header that no longer matches its commit record
        f.seek(40)
        f.write(b"\xff")
    (tmp_path / f".{'ab' * 16}-{1:016x}.kv.tmp").write_bytes(b"half a write")  # killed before the rename
    again = open_tier(tmp_path)
    try:
        assert again.recovery == {**again.recovery, "objects": 1, "dropped": 3}
        assert files(tmp_path) == [names[2]]
    finally:
        again.close()


def test_corrupted_payload_is_a_typed_error_and_the_object_is_dropped(tmp_path):
    tier = open_tier(tmp_path)
    store(tier, "bad", payload(7))
    store(tier, "good", payload(8))
    tier.flush(30)
    name = tier.get("bad").name
    with open(tmp_path / name, "r+b") as f:  # the payload lost after the rename (power cut): zeros
        f.seek(4096 + 100)
        f.write(bytes(4096))
    with pytest.raises(DiskReadError, match="bad"):
        read(tier, "bad")
    assert not tier.contains("bad") and name not in files(tmp_path)
    assert tier.stats()["disk_errors"] == 1
    with pytest.raises(KeyNotFoundError):
        read(tier, "bad")
    assert read(tier, "good") == payload(8)
    tier.close()


def test_lru_eviction_order_and_capacity_never_exceeded(tmp_path):
    one = file_bytes("k00", b"meta:k00", 64 * KiB)
    tier = open_tier(tmp_path, capacity=10 * one, high_watermark=1.0, low_watermark=1.0)
    try:
        for i in range(10):
            store(tier, f"k{i:02d}", payload(i))
        tier.flush(30)
        read(tier, "k00")  # now the most recently used
        for i in range(10, 13):
            store(tier, f"k{i:02d}", payload(i))
            assert tier.stats()["disk_used_bytes"] <= tier.capacity
        tier.flush(30)
        assert sorted(tier.keys()) == ["k00"] + [f"k{i:02d}" for i in range(4, 13)]
        on_disk = sum(os.path.getsize(tmp_path / n) for n in files(tmp_path))
        assert on_disk <= tier.capacity and on_disk == tier.stats()["disk_used_bytes"]
        assert tier.stats()["disk_evictions"] == 3
        assert not store(tier, "huge", bytes(11 * one))  # larger than the tier: dropped, nothing evicted
        assert len(tier.keys()) == 10
    finally:
        tier.close()


def test_watermarks_evict_down_to_the_low_mark(tmp_path):
    one = file_bytes("k00", b"meta:k00", 64 * KiB)
    tier = open_tier(tmp_path, capacity=10 * one, high_watermark=0.9, low_watermark=0.5)
    try:
        for i in range(10):
            store(tier, f"k{i:02d}", payload(i))
        tier.flush(30)
        assert tier.stats()["disk_used_bytes"] <= 0.5 * tier.capacity + one
        assert "k09" in tier.keys() and "k00" not in tier.keys()
    finally:
        tier.close()


def test_replacing_a_key_keeps_one_file(tmp_path):
    tier = open_tier(tmp_path)
    store(tier, "k", payload(1), version=1)
    tier.flush(30)
    store(tier, "k", payload(2), version=2)
    tier.flush(30)
    assert read(tier, "k") == payload(2) and len(files(tmp_path)) == 1
    tier.close()
    again = open_tier(tmp_path)
    assert read(again, "k") == payload(2) and again.get("k").version == 2
    again.close()


def test_two_tiers_cannot_share_a_path(tmp_path):
    tier = open_tier(tmp_path)
    try:
        with pytest.raises(DiskPathError, match=f"in use by another kvstore process \\(pid {os.getpid()}\\)"):
            open_tier(tmp_path)
    finally:
        tier.close()
    open_tier(tmp_path).close()  # released on close


def test_missing_path_and_file_path_are_clear_errors(tmp_path):
    with pytest.raises(DiskPathError, match="does not exist"):
        open_tier(tmp_path / "nope")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(DiskPathError, match="is not a directory"):
        open_tier(tmp_path / "file")


@pytest.fixture
def small_mount(tmp_path):
    """A 1 MiB tmpfs (needs root and mount(2); skipped where the sandbox forbids it)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_read_only_path_is_a_clear_error(small_mount):
    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    with pytest.raises(DiskPathError, match="not writable"):
        open_tier(small_mount)


def test_disk_full_drops_the_object_and_counts_it(small_mount):
    tier = open_tier(small_mount, capacity=64 << 20)  # the tier believes in more space than the device has
    try:
        stored = [f"k{i}" for i in range(8) if store(tier, f"k{i}", payload(i, 200 * KiB))]
        tier.flush(30)
        stats = tier.stats()
        assert stats["disk_full"] >= 1 and stats["disk_dropped"] == stats["disk_full"]
        kept = tier.keys()
        assert 0 < len(kept) < len(stored)
        assert all(read(tier, k) == payload(int(k[1:]), 200 * KiB) for k in kept)  # never corrupted
        assert not [n for n in os.listdir(small_mount) if n.endswith(".tmp")]
    finally:
        tier.close()


def test_concurrent_reads_while_writing(tmp_path):
    tier = open_tier(tmp_path, capacity=64 << 20)
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            for _ in range(20):
                for i in range(16):
                    if tier.contains(f"k{i}"):
                        assert read(tier, f"k{i}") == payload(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(16):
        store(tier, f"k{i}", payload(i))
    for t in threads:
        t.join()
    tier.close()
    assert not errors, errors
