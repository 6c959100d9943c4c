"""The disk tier through real daemons (``kvstore serve --disk-path``) and the embedded store: demotion and
byte-exact reads, write-through across SIGKILL, a kill during a large demotion, simulated power loss,
corrupted files, a full disk, two daemons on one path, eviction order and capacity."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import Daemon, child_env, short_tmpdir, wait_until

import kvstore
from kvstore.errors import DiskReadError, KeyNotFoundError

pytestmark = pytest.mark.timeout(120)
KiB, MiB = 1024, 1 << 20


def value(i: int, size: int = 256 * KiB) -> bytes:
    return (i.to_bytes(4, "little") + b"kvdisk" * 3)[:8] * (size // 8)


def disk_args(path, capacity: str = "64MiB", policy: str = "demote", promote_after: int = 2) -> tuple:
    return ("--disk-path", str(path), "--disk-capacity", capacity, "--disk-policy", policy,
            "--disk-promote-after", str(promote_after))


@pytest.fixture
def disk_dir():
    path = short_tmpdir()
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


def record_files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".kv"))


def open_store(kind: str, daemon: Daemon | None, disk_dir: str, **kw) -> kvstore.KVStore:
    if kind == "embedded":
        return kvstore.KVStore.embedded("2MiB", disk_path=disk_dir, disk_capacity="64MiB", **kw)
    return daemon.connect("shm" if kind == "daemon-shm" else "tcp")


@pytest.mark.parametrize("kind", ["embedded", "daemon-shm", "daemon-tcp"])
def test_demoted_objects_read_back_byte_exact(kind, daemon_factory, disk_dir):
    d = None if kind == "embedded" else daemon_factory(capacity="2MiB", args=disk_args(disk_dir))
    store = open_store(kind, d, disk_dir)
    try:
        data = {f"k{i:02d}": value(i) for i in range(24)}  # 6 MiB through 2 MiB of memory
        for key, v in data.items():
            store.put(key, v)
        stats = store.stats()
        assert stats["demotions"] >= 16 and stats["disk_objects"] >= 16
        assert stats["used_bytes"] <= stats["capacity_bytes"]
        assert all(store.exists(k) for k in data) and store.batch_exists(["k00", "nope"]) == [True, False]
        assert store.keys() == sorted(data)
        assert store.inspect("k00")["tier"] == "disk"
        buf = bytearray(256 * KiB)
        for key, v in data.items():  # first read of a disk object: straight into the caller's buffer
            assert store.get_into(key, buf, verify=True) == len(v) and buf == v
        outs = [bytearray(256 * KiB) for _ in range(4)]
        assert store.batch_get_into(["k00", "k01", "k02", "k03"], outs) == [256 * KiB] * 4
        assert [bytes(o) for o in outs] == [data[k] for k in ("k00", "k01", "k02", "k03")]
        for key, v in data.items():
            assert bytes(store.get(key, verify=True)) == v
        assert store.stats()["promotions"] >= 1 and store.stats()["disk_reads"] >= 16
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["embedded", "daemon-tcp"])
def test_promotion_on_the_second_read(kind, daemon_factory, disk_dir):
    d = None if kind == "embedded" else daemon_factory(capacity="2MiB", args=disk_args(disk_dir))
    store = open_store(kind, d, disk_dir)
    try:
        store.put("cold", value(1))
        assert store.evict("cold")
        buf = bytearray(256 * KiB)
        store.get_into("cold", buf)
        assert store.inspect("cold")["tier"] == "disk" and store.stats()["promotions"] == 0
        store.get_into("cold", buf)
        assert buf == value(1) and store.stats()["promotions"] == 1
        assert store.inspect("cold")["tier"] == "host"
    finally:
        store.close()


def test_a_new_version_supersedes_the_disk_copy_and_remove_clears_both(daemon_factory, disk_dir):
    d = daemon_factory(capacity="2MiB", args=disk_args(disk_dir))
    with d.connect("shm") as store:
        store.put("k", value(1))
        assert store.evict("k") and store.inspect("k")["tier"] == "disk"
        store.put("k", value(2))
        assert store.evict("k")
        wait_until(lambda: store.stats()["disk_pending_writes"] == 0, 30)
        assert bytes(store.get("k")) == value(2)
        assert store.remove("k") and not store.exists("k")
        with pytest.raises(KeyNotFoundError):
            store.get("k")
        assert record_files(disk_dir) == []


def test_write_through_survives_sigkill_and_restart(daemon_factory, disk_dir):
    d = daemon_factory(capacity="8MiB", args=disk_args(disk_dir, policy="write-through"))
    data = {f"w{i:02d}": value(100 + i, 64 * KiB + 8 * i) for i in range(40)}
    with d.connect("shm") as store:
        for key, v in data.items():
            store.put(key, v)
        assert wait_until(lambda: store.stats()["disk_writes"] == len(data), 60), store.stats()
        checksums = {k: store.inspect(k)["checksum"] for k in data}
    d.kill()
    again = daemon_factory(capacity="8MiB", args=disk_args(disk_dir, policy="write-through"))
    with again.connect("tcp") as store:
        assert "recovered 40 objects" in again.log()
        assert store.keys() == sorted(data)
        for key, v in data.items():
            obj = store.get(key, verify=True)
            assert bytes(obj) == v and f"{obj.meta.checksum:016x}" == checksums[key]


def test_a_write_killed_mid_object_is_never_served(daemon_factory, disk_dir):
    big = os.urandom(96 * MiB)
    d = daemon_factory(capacity="128MiB", args=disk_args(disk_dir, capacity="1GiB"))
    with d.connect("shm") as store:
        store.put("small", value(5))
        assert store.evict("small")
        assert wait_until(lambda: store.stats()["disk_pending_writes"] == 0, 30)
        store.put("big", big)
        assert store.evict("big")
        writing = wait_until(lambda: any(n.endswith(".tmp") for n in os.listdir(disk_dir)), 10, interval=0.001)
        d.kill()  # SIGKILL while the 96 MiB record is being written
    assert writing, "the demotion's write was never seen in flight"
    again = daemon_factory(capacity="128MiB", args=disk_args(disk_dir, capacity="1GiB"))
    with again.connect("tcp") as store:  # answered once start-up (and recovery) is over
        assert not [n for n in os.listdir(disk_dir) if n.endswith(".tmp")]
        assert "dropped 1 torn or partial files" in again.log() or store.exists("big")
        assert bytes(store.get("small")) == value(5)
        if store.exists("big"):  # the write completed between the check and the kill: then it is whole
            assert bytes(store.get("big", verify=True)) == big
        else:
            with pytest.raises(KeyNotFoundError):
                store.get("big")


def test_power_loss_of_a_payload_is_a_typed_error_not_served(daemon_factory, disk_dir):
    """Simulated power loss: the record's header and commit record reached the disk but its payload pages
    did not (zeros where the data was). The restart indexes it (it reads headers only); the read finds the
    checksum wrong, raises DiskReadError for that key, and drops it."""
    d = daemon_factory(capacity="2MiB", args=disk_args(disk_dir))
    with d.connect("shm") as store:
        for key in ("lost", "kept"):
            store.put(key, value(9))
            assert store.evict(key)
        assert wait_until(lambda: store.stats()["disk_pending_writes"] == 0, 30)
    d.kill()
    lost = [n for n in record_files(disk_dir) if _record_key(os.path.join(disk_dir, n)) == "lost"][0]
    with open(os.path.join(disk_dir, lost), "r+b") as f:
        f.seek(4096)
        f.write(bytes(64 * KiB))
    again = daemon_factory(capacity="2MiB", args=disk_args(disk_dir))
    for transport in ("shm", "tcp"):
        with again.connect(transport) as store:
            assert bytes(store.get("kept")) == value(9)
            if transport == "shm":
                with pytest.raises(DiskReadError, match="lost"):
                    store.get_into("lost", bytearray(256 * KiB))
            else:
                with pytest.raises(KeyNotFoundError):
                    store.get("lost")
            assert store.stats()["disk_errors"] == 1


def _record_key(path: str) -> str:
    from kvstore.memory.disk_file import read_record

    return read_record(path).key


def test_second_daemon_on_the_same_path_refuses_to_start(daemon_factory, disk_dir):
    daemon_factory(capacity="2MiB", args=disk_args(disk_dir))
    workdir = short_tmpdir()
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--listen",
                           f"unix://{workdir}/second.sock", "--capacity", "2MiB", *disk_args(disk_dir)],
                          capture_output=True, text=True, env=child_env(), timeout=60)
    assert proc.returncode == 2
    assert "DiskPathError" in proc.stderr and "in use by another kvstore process" in proc.stderr
    assert not os.path.exists(f"{workdir}/second.sock")


def test_missing_disk_path_is_a_clear_error(disk_dir):
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--listen", f"unix://{disk_dir}/s.sock",
                           "--capacity", "2MiB", *disk_args(os.path.join(disk_dir, "absent"))],
                          capture_output=True, text=True, env=child_env(), timeout=60)
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr


def test_disk_eviction_order_and_capacity(daemon_factory, disk_dir):
    # each 256 KiB object takes 256 KiB + a 4 KiB header + a 4 KiB block ending with the commit record on
    # disk: 8 of them stay under the high watermark (95 %) of 2240 KiB
    d = daemon_factory(capacity="1MiB", args=disk_args(disk_dir, capacity="2240KiB"))
    with d.connect("shm") as store:
        for i in range(8):
            store.put(f"e{i}", value(i))
            assert store.evict(f"e{i}")
        assert wait_until(lambda: store.stats()["disk_pending_writes"] == 0, 30)
        assert store.stats()["disk_objects"] == 8 and store.stats()["disk_evictions"] == 0
        store.get_into("e0", bytearray(256 * KiB))  # e0 becomes the most recently used on disk
        for i in range(8, 11):
            store.put(f"e{i}", value(i))
            assert store.evict(f"e{i}")
            stats = store.stats()
            assert stats["disk_used_bytes"] <= stats["disk_capacity_bytes"]
        assert wait_until(lambda: store.stats()["disk_pending_writes"] == 0, 30)
        on_disk = {int(_record_key(os.path.join(disk_dir, n))[1:]) for n in record_files(disk_dir)}
        assert store.stats()["disk_evictions"] >= 3
        oldest_kept = min(on_disk - {0})  # least recently used went first: e1, e2, ... and never e0
        assert on_disk == {0} | set(range(oldest_kept, 11)) and oldest_kept > 1
        assert sum(os.path.getsize(os.path.join(disk_dir, n)) for n in record_files(disk_dir)) <= 2240 * KiB


def test_disk_full_drops_objects_and_memory_keeps_working(daemon_factory, disk_dir):
    mnt = os.path.join(disk_dir, "mnt")
    os.mkdir(mnt)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        d = daemon_factory(capacity="2MiB", args=disk_args(mnt, capacity="64MiB"))
        with d.connect("shm") as store:
            for i in range(10):
                store.put(f"f{i}", value(i))
                assert store.evict(f"f{i}")
            assert wait_until(lambda: store.stats()["disk_pending_writes"] == 0, 30)
            stats = store.stats()
            assert stats["disk_full"] >= 1 and stats["disk_dropped"] >= 1
            for i in range(10):  # each either gone or intact
                if store.exists(f"f{i}"):
                    assert bytes(store.get(f"f{i}", verify=True)) == value(i)
            store.put("after", value(42))  # memory unaffected
            assert bytes(store.get("after")) == value(42)
        d.stop(signal.SIGTERM)
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)


@pytest.mark.parametrize("kind", ["embedded", "daemon-shm"])
def test_a_demoted_object_keeps_its_ttl(kind, daemon_factory, disk_dir):
    d = None if kind == "embedded" else daemon_factory(capacity="2MiB", args=disk_args(disk_dir))
    store = open_store(kind, d, disk_dir)
    try:
        store.put("short", value(1), ttl=0.5)
        store.put("long", value(2), ttl=600)
        assert store.evict("short") and store.evict("long")
        assert store.inspect("short")["tier"] == "disk"
        assert wait_until(lambda: not store.exists("short"), 10)  # expired on disk too
        with pytest.raises(KeyNotFoundError):
            store.get("short")
        assert bytes(store.get("long")) == value(2) and store.inspect("long")["ttl_s"] > 500
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["embedded", "daemon-shm", "daemon-tcp"])
def test_handoff_finds_chunks_that_left_memory_on_disk(kind, daemon_factory, disk_dir):
    torch = pytest.importorskip("torch")
    import handoff_child as child

    from kvstore.handoff import KVHandoff

    d = None if kind == "embedded" else daemon_factory(capacity="2MiB", args=disk_args(disk_dir))
    store = open_store(kind, d, disk_dir)
    try:
        layout = child.layout()
        src = child.caches(12, seed=3)
        h = KVHandoff(store, layout, chunk_blocks=2)
        tokens = list(range(4 * layout.block_size))
        h.publish("r", src, [7, 2, 9, 0], num_tokens=len(tokens), token_ids=tokens).wait()
        for key in store.keys():
            store.evict(key)  # every chunk (and the request's records) leaves memory
        assert store.stats()["objects"] == 0 and store.stats()["disk_objects"] > 0
        dst = [torch.zeros(layout.cache_shape(12), dtype=layout.dtype) for _ in range(layout.num_layers)]
        h.fetch("r", dst, [1, 3, 5, 8], num_tokens=len(tokens))
        for c_src, c_dst in zip(src, dst, strict=True):
            assert torch.equal(c_dst[:, [1, 3, 5, 8]], c_src[:, [7, 2, 9, 0]])
        assert h.lookup(tokens) == len(tokens)  # the prefix chunks are still found
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["embedded", "daemon-shm", "daemon-tcp"])
def test_a_prefix_chunk_on_disk_is_referenced_not_replaced_by_a_later_producer(kind, daemon_factory, disk_dir):
    """Prefix chunks that left memory for the disk are still the stored version: a second producer of the same
    tokens (other bytes) references them (touch finds them on disk) instead of storing its own, so the first
    request, published before, still fetches, and both get the first producer's bytes."""
    torch = pytest.importorskip("torch")
    import handoff_child as child

    from kvstore.handoff import KVHandoff

    d = None if kind == "embedded" else daemon_factory(capacity="2MiB", args=disk_args(disk_dir))
    store = open_store(kind, d, disk_dir)
    try:
        layout = child.layout()
        first, second = child.caches(8, seed=3), child.caches(8, seed=4)
        h = KVHandoff(store, layout, chunk_blocks=2)
        tokens = list(range(4 * layout.block_size))
        one = h.publish("one", first, [0, 1, 2, 3], num_tokens=len(tokens), token_ids=tokens).wait()
        for key in one.chunk_keys:
            store.evict(key)  # the chunks leave memory for the disk
        assert not any(store.inspect(key)["tier"] != "disk" for key in one.chunk_keys)
        assert store.touch(list(one.chunk_keys), 60) == list(one.checksums)
        two = h.publish("two", second, [0, 1, 2, 3], num_tokens=len(tokens), token_ids=tokens).wait()
        assert two.checksums == one.checksums
        for rid in ("one", "two"):
            dst = [torch.zeros(layout.cache_shape(8), dtype=layout.dtype) for _ in range(layout.num_layers)]
            h.fetch(rid, dst, [4, 5, 6, 7], num_tokens=len(tokens))
            for c_src, c_dst in zip(first, dst, strict=True):
                assert torch.equal(c_dst[:, [4, 5, 6, 7]], c_src[:, [0, 1, 2, 3]]), rid
    finally:
        store.close()


# ---- issue 24, defect 2: a promotion racing a remove -------------------------------------------------------
def _race_promotion_against_remove(reader: kvstore.KVStore, writer: kvstore.KVStore, delay: float) -> None:
    """get(copy=False) of a disk-only key promotes it; meanwhile a newer version is put and the key removed."""
    got: list = []

    def read() -> None:
        try:
            view = reader.get("k", copy=False)
            got.append(len(view))
            view.release()
        except KeyNotFoundError:
            got.append(None)

    thread = threading.Thread(target=read)
    thread.start()
    time.sleep(delay)
    writer.put("k", b"newer")
    assert writer.remove("k")
    thread.join(60)
    assert not thread.is_alive() and got


@pytest.mark.parametrize("kind", ["embedded", "daemon-shm"])
def test_a_removed_key_never_comes_back_from_a_promotion(kind, daemon_factory, disk_dir):
    big = value(7, 48 * MiB)
    if kind == "embedded":
        writer = reader = kvstore.KVStore.embedded("64MiB", disk_path=disk_dir, disk_capacity="256MiB")
    else:
        d = daemon_factory(capacity="64MiB", args=disk_args(disk_dir, "256MiB"))
        writer, reader = d.connect("shm"), d.connect("shm")
    try:
        for trial in range(8):
            writer.put("k", big)
            assert writer.evict("k")
            assert wait_until(lambda: writer.stats()["disk_pending_writes"] == 0, 30)  # read back from the file
            _race_promotion_against_remove(reader, writer, delay=0.001 * (trial % 4) * 2)
            assert not writer.exists("k"), f"trial {trial}: the removed key is back ({writer.inspect('k')})"
            with pytest.raises(KeyNotFoundError):
                reader.get("k")
    finally:
        writer.close()
        if reader is not writer:
            reader.close()


# ---- issue 24, defect 4: a disk that stops answering never stalls memory service ----------------------------
def _stuck_write(path: str, key: str) -> str:
    """A FIFO where the tier's writer will create the first file it writes (``key``'s, generation 1): opening it
    blocks until a reader comes, as a write to a disk that stopped answering would."""
    name = f"{hashlib.blake2b(key.encode(), digest_size=16).hexdigest()}-{1:016x}.kv"
    fifo = os.path.join(path, f".{name}.tmp")
    os.mkfifo(fifo)
    return fifo


def _drain(fifo: str) -> threading.Thread:
    def read() -> None:
        with open(fifo, "rb") as f:
            while f.read(1 << 20):
                pass

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_a_stuck_disk_drops_demotions_instead_of_stalling_the_daemon(daemon_factory, disk_dir):
    d = daemon_factory(capacity="16MiB", args=disk_args(disk_dir, "1GiB"))
    fifo = _stuck_write(disk_dir, "first")
    size = 4 * MiB
    with d.connect("shm") as s, d.connect("tcp") as other:
        s.put("first", value(0, size))
        for i in range(1, 65):  # about the 256 MiB staging area: the writer is stuck on the first object
            s.put(f"fill/{i}", value(i, size))
        behind = s.stats().get("disk_behind", 0)
        started = time.monotonic()
        for i in range(65, 125):  # each evicts one more object; none may wait for the stuck writer
            s.put(f"fill/{i}", value(i, size))
            other.ping()
        # a deadline bound only (did not hang): each of these waited 1 s for staging room before the fix
        assert time.monotonic() - started < 30
        stats = s.stats()
        assert stats["disk_behind"] - behind >= 50 and stats["disk_dropped"] >= stats["disk_behind"], stats
        assert bytes(other.get("fill/124")) == value(124, size)
    _drain(fifo)


# ---- issue 24, defect 3: --disk-path leaves files it did not write alone -----------------------------------
def test_files_the_tier_did_not_write_are_left_alone(daemon_factory, disk_dir):
    mine = {"notes.tmp": b"a user's notes", "data.kv": b"not a kvstore record", ".lock": b"someone else's lock",
            "model.kv.tmp": b"half of a download", f"{'ab' * 16}.kv": b"a hex-named file"}
    for name, content in mine.items():
        with open(os.path.join(disk_dir, name), "wb") as f:
            f.write(content)
    d = daemon_factory(capacity="2MiB", args=disk_args(disk_dir, policy="write-through"))
    with d.connect("shm") as s:
        for i in range(16):  # 4 MiB through 2 MiB of memory: demotions and write-through records
            s.put(f"k{i}", value(i))
        assert wait_until(lambda: s.stats()["disk_pending_writes"] == 0, 30)
    d.stop()
    again = daemon_factory(capacity="2MiB", args=disk_args(disk_dir, policy="write-through"))  # recovery
    with again.connect("tcp") as s:
        assert bytes(s.get("k0")) == value(0)
    for name, content in mine.items():
        with open(os.path.join(disk_dir, name), "rb") as f:
            assert f.read() == content, name
    assert "5 files not written by the tier are left alone" in again.log()
