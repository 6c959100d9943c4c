"""Disk tier benchmark, with the raw device measured in the same run on the same filesystem.

    python -m benchmarks.bench_disk [--dir DIR] [--sizes 1MiB,16MiB,64MiB] [--total 512MiB] [--json PATH]

Each size runs the raw device and the tier ``--repeat`` times, interleaved (a shared virtual disk's speed
drifts between runs), and reports the medians.

1. Raw device: each object size written as one file per object with ``O_DIRECT`` + ``fdatasync`` and read
   back with ``O_DIRECT`` (the baseline), and the same with buffered I/O (``fdatasync``; reads after
   ``POSIX_FADV_DONTNEED``), which is how the tier's I/O method was chosen.
2. The tier: demotion (evict -> on disk, synced) and disk ``get_into`` straight into the caller's buffer
   (embedded store), demotion and promotion (a shm ``get_into`` of a disk object) through a daemon; each
   as sustained GB/s and as a ratio to the raw device.
3. A Zipf working set of 4x the memory capacity through a daemon (shm): hit rate and mean read latency
   without and with the disk tier (a miss is "recomputed" by a put).
4. Recovery: a tier of ``--recovery`` bytes reopened; seconds, GiB/s of stored objects indexed, objects/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import sys
import tempfile
import time

import numpy as np

import kvstore
from benchmarks.common.daemon import Daemon
from benchmarks.common.machine import describe, machine
from kvstore.memory.disk import DiskConfig, DiskTier
from kvstore.units import format_size, parse_size


def filesystem(path: str) -> str:
    best = ("", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if path.startswith(mnt) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
    return f"{best[2]} on {best[0]} (mounted at {best[1]})"


# ---- 1. the raw device ------------------------------------------------------------------------------
def raw_device(directory: str, size: int, total: int, direct: bool) -> dict:
    n = max(1, total // size)
    buf = mmap.mmap(-1, size)
    buf.write(np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8).tobytes())
    view = memoryview(buf)
    flag = os.O_DIRECT if direct else 0
    paths = [os.path.join(directory, f"raw-{size}-{i}") for i in range(n)]
    t0 = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
        _io(lambda v, done, fd=fd: os.write(fd, v), view)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY | flag)
        _io(lambda v, done, fd=fd: os.preadv(fd, [v], done), view)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    read_s = time.perf_counter() - t0
    for path in paths:
        os.unlink(path)
    view.release()
    buf.close()
    return {"write_gbps": n * size / write_s / 1e9, "read_gbps": n * size / read_s / 1e9}


def _io(op, view: memoryview) -> None:
    """Move all of ``view``: ``op(rest, offset)`` returns how many bytes it moved."""
    done = 0
    while done < len(view):
        got = op(view[done:], done)
        if got <= 0:
            raise OSError(f"short I/O after {done} bytes")
        done += got


# ---- 2. the tier ------------------------------------------------------------------------------------
def wait_written(store: kvstore.KVStore, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while store.stats()["disk_pending_writes"] and time.monotonic() < deadline:
        time.sleep(0.02)  # a stats call costs the daemon loop time: do not poll hard


def tier_embedded(directory: str, size: int, total: int) -> dict:
    n = max(1, total // size)
    value = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    out = np.empty(size, dtype=np.uint8)
    out[:] = 1
    disk = _fresh(directory, "embedded")
    with kvstore.KVStore.embedded(n * size + (64 << 20), disk_path=disk, disk_capacity=2 * n * size + (64 << 20),
                                  disk_promote_after=1 << 30) as store:
        for _ in range(2):  # the first round warms up (a fresh staging buffer faults in every page)
            for i in range(n):
                store.remove(f"e{i}")
                store.put(f"e{i}", value)
            t0 = time.perf_counter()
            for i in range(n):
                store.evict(f"e{i}")
            wait_written(store)
            demote_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(n):
                store.get_into(f"e{i}", out)
            read_s = time.perf_counter() - t0
            assert np.array_equal(out, value), "disk read returned different bytes"
    shutil.rmtree(disk)
    return {"demote_gbps": n * size / demote_s / 1e9, "disk_get_into_gbps": n * size / read_s / 1e9}


@contextlib.contextmanager
def daemon(capacity: int, *args: str):
    """A real ``kvstore serve`` on a Unix socket (the one launcher, ``kvstore.testing.daemon``)."""
    with Daemon(capacity=str(capacity), tcp=False, args=args, log_level="warning") as d:
        kvstore.connect(d.unix_url, timeout=60).close()  # answered once start-up (and recovery) is over
        yield d.unix_url


def tier_daemon(directory: str, size: int, total: int) -> dict:
    n = max(1, total // size)
    value = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    out = np.empty(size, dtype=np.uint8)
    out[:] = 1
    disk = _fresh(directory, "daemon")
    with daemon(n * size + (64 << 20), "--disk-path", disk, "--disk-capacity", str(2 * n * size + (64 << 20))) as url, \
            kvstore.connect(url, transport="shm") as store:
        for _ in range(2):  # the first round warms up
            for i in range(n):
                store.remove(f"d{i}")  # memory and disk: the next eviction writes again
                store.put(f"d{i}", value)
            t0 = time.perf_counter()
            for i in range(n):
                store.evict(f"d{i}")
            wait_written(store)
            demote_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(n):  # shm: the read lands in segment memory, i.e. it promotes
                store.get_into(f"d{i}", out)
            promote_s = time.perf_counter() - t0
            assert np.array_equal(out, value) and store.stats()["promotions"] >= n
    shutil.rmtree(disk)
    return {"daemon_demote_gbps": n * size / demote_s / 1e9, "promote_gbps": n * size / promote_s / 1e9}


# ---- 3. Zipf working set ----------------------------------------------------------------------------
def zipf(directory: str, memory: int, size: int, requests: int, s: float, with_disk: bool) -> dict:
    keys = 4 * memory // size
    rng = np.random.default_rng(7)
    weights = 1.0 / np.arange(1, keys + 1) ** s
    trace = rng.choice(keys, size=requests, p=weights / weights.sum())
    value = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
    out = np.empty(size, dtype=np.uint8)
    disk = _fresh(directory, "zipf")
    args = ("--disk-path", disk, "--disk-capacity", str(8 * memory)) if with_disk else ()
    hits, latencies = 0, []
    with daemon(memory, *args) as url, kvstore.connect(url, transport="shm") as store:
        for phase, part in (("warm", trace[: requests // 3]), ("measure", trace[requests // 3:])):
            for k in part:
                t0 = time.perf_counter()
                try:
                    store.get_into(f"z{k}", out)
                    hit = True
                except kvstore.KeyNotFoundError:
                    hit = False
                if phase == "measure":
                    latencies.append(time.perf_counter() - t0)
                    hits += hit
                if not hit:
                    store.put(f"z{k}", value)  # the "recompute"
        stats = store.stats()
    shutil.rmtree(disk)
    return {"hit_rate": hits / len(latencies), "mean_read_us": 1e6 * float(np.mean(latencies)),
            "p99_read_us": 1e6 * float(np.percentile(latencies, 99)), "keys": keys,
            "disk_reads": stats.get("disk_reads", 0), "promotions": stats.get("promotions", 0)}


# ---- 4. recovery ------------------------------------------------------------------------------------
def recovery(directory: str, total: int, size: int) -> dict:
    disk = _fresh(directory, "recovery")
    payload = memoryview(np.random.default_rng(3).integers(0, 255, size, dtype=np.uint8))
    tier = DiskTier(DiskConfig(disk, total + (64 << 20)))
    for i in range(max(1, total // size)):
        tier.store(f"r{i}", b"", payload, i)
    tier.flush(600)
    tier.close()
    tier = DiskTier(DiskConfig(disk, total + (64 << 20)))
    rec = tier.recovery
    tier.close()
    shutil.rmtree(disk)
    return {"objects": rec["objects"], "bytes": rec["bytes"], "seconds": rec["seconds"],
            "gib_per_s": rec["bytes"] / (1 << 30) / max(rec["seconds"], 1e-9),
            "objects_per_s": rec["objects"] / max(rec["seconds"], 1e-9)}


def _median(runs: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}


def _fresh(directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="directory on the filesystem to measure (default: a temp dir)")
    p.add_argument("--sizes", default="1MiB,16MiB,64MiB", help="object sizes")
    p.add_argument("--total", default="256MiB", help="bytes moved per size and measurement")
    p.add_argument("--repeat", type=int, default=3,
                   help="interleaved repeats of raw device and tier runs (medians are reported)")
    p.add_argument("--memory", default="64MiB", help="memory capacity of the Zipf runs")
    p.add_argument("--zipf-size", default="1MiB", help="object size of the Zipf runs")
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent")
    p.add_argument("--requests", type=int, default=3000, help="Zipf requests (the first third warms up)")
    p.add_argument("--recovery", default="1GiB", help="bytes of objects in the recovery run")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="kvbench-disk-", dir=args.dir)
    try:
        results = run(base, args)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def run(base: str, args: argparse.Namespace) -> dict:
    total = parse_size(args.total)
    results: dict = {"machine": describe(), "machine_info": machine(),
                     "filesystem": filesystem(os.path.realpath(base)), "sizes": {}}
    print(f"machine: {results['machine']}\nfilesystem: {results['filesystem']}\n")
    print(f"{'size':>8} | {'raw O_DIRECT w/r GB/s':>22} | {'buffered w/r GB/s':>18} | {'demote GB/s (x raw)':>20} | "
          f"{'disk get_into GB/s (x raw)':>27} | {'daemon demote':>14} | {'promote (x raw)':>16}")
    for size in (parse_size(s) for s in args.sizes.split(",")):
        reps = [(raw_device(base, size, total, True), raw_device(base, size, total, False),
                 tier_embedded(base, size, total), tier_daemon(base, size, total)) for _ in range(args.repeat)]
        direct, buffered, emb, dmn = (_median([r[i] for r in reps]) for i in range(4))  # interleaved runs
        row = {"raw_direct": direct, "raw_buffered": buffered, **emb, **dmn,
               "demote_x_raw": emb["demote_gbps"] / direct["write_gbps"],
               "disk_get_into_x_raw": emb["disk_get_into_gbps"] / direct["read_gbps"],
               "daemon_demote_x_raw": dmn["daemon_demote_gbps"] / direct["write_gbps"],
               "promote_x_raw": dmn["promote_gbps"] / direct["read_gbps"], "repeats": reps}
        results["sizes"][format_size(size)] = row
        print(f"{format_size(size):>8} | {direct['write_gbps']:10.2f} / {direct['read_gbps']:<9.2f} | "
              f"{buffered['write_gbps']:7.2f} / {buffered['read_gbps']:<8.2f} | "
              f"{emb['demote_gbps']:8.2f} ({row['demote_x_raw']:.2f}x)    | "
              f"{emb['disk_get_into_gbps']:13.2f} ({row['disk_get_into_x_raw']:.2f}x)     | "
              f"{dmn['daemon_demote_gbps']:6.2f} ({row['daemon_demote_x_raw']:.2f}x) | "
              f"{dmn['promote_gbps']:6.2f} ({row['promote_x_raw']:.2f}x)")
    memory, zsize = parse_size(args.memory), parse_size(args.zipf_size)
    print(f"\nZipf (s={args.zipf_s}) over {4 * memory // zsize} keys of {format_size(zsize)} = 4x memory of "
          f"{format_size(memory)}, {args.requests} requests (first third warm-up), daemon over shm:")
    for label, with_disk in (("memory only", False), ("memory + disk tier", True)):
        z = zipf(base, memory, zsize, args.requests, args.zipf_s, with_disk)
        results[f"zipf_{'disk' if with_disk else 'memory'}"] = z
        print(f"  {label:<20} hit rate {100 * z['hit_rate']:5.1f} %   mean read {z['mean_read_us']:8.1f} us   "
              f"p99 {z['p99_read_us']:8.1f} us   disk reads {z['disk_reads']}, promotions {z['promotions']}")
    rec = recovery(base, parse_size(args.recovery), 1 << 20)
    results["recovery"] = rec
    print(f"\nrecovery: {rec['objects']} objects ({format_size(rec['bytes'])}) indexed in {rec['seconds']:.3f} s = "
          f"{rec['gib_per_s']:.1f} GiB/s, {rec['objects_per_s']:.0f} objects/s (headers only)")
    return results


if __name__ == "__main__":
    sys.exit(main())
