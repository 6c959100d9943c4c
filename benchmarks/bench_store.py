"""Store benchmark: put / get_into / get through the embedded store, the daemon over shared memory and the
daemon over TCP, with this machine's baselines measured in the same run.

    python -m benchmarks.bench_store [--sizes 4KiB,64KiB,1MiB,16MiB,64MiB] [--json PATH]
    python -m benchmarks.bench_store --workload mixed [--runs 5] [--capacity 256MiB] [--json PATH]

Ratios: shm and embedded paths against single-thread memcpy into a pre-faulted buffer; the tcp path
against a raw loopback socket between two processes (put: sendall + 1-byte ack; get: recv_into).
When Mooncake Store is installed (``pip install mooncake-transfer-engine-non-cuda``, plus Debian's
``libibverbs1``), it is measured in the same run over TCP on its fastest Python paths (``--no-mooncake``
skips it), and kvstore's rows are compared with it.

``--workload mixed`` measures space instead of speed: the fill a daemon reaches before its first eviction or
refusal under 4 clients' mixed-size traffic, with relocation and without (``benchmarks/store_mixed.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import numpy as np

import kvstore
from benchmarks import store_mixed
from benchmarks.baseline import RawSocket, memcpy, prefaulted
from benchmarks.common.daemon import Daemon
from benchmarks.common.machine import describe, machine
from benchmarks.common.table import Column, format_table
from benchmarks.common.timing import Timing, measure
from kvstore.units import format_size, parse_size

DEFAULT_SIZES = "4KiB,64KiB,1MiB,16MiB,64MiB"


@contextlib.contextmanager
def daemon(capacity: str, extra_listen: tuple[str, ...] = ()):
    """A real ``kvstore serve`` on a temporary Unix socket and a free loopback port (plus ``extra_listen``
    addresses); yields (unix_url, tcp_url) and stops it with SIGTERM."""
    args = [arg for url in extra_listen for arg in ("--listen", url)]
    with Daemon(capacity=capacity, args=args, log_level="warning") as d:
        yield d.unix_url, d.tcp_url


def bench_path(store: kvstore.KVStore, size: int) -> dict[str, Timing]:
    value = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    out = prefaulted(size)
    key = f"bench/{size}"
    store.put(key, value)
    results = {"put": measure(lambda: store.put(key, value), size),
               "get_into": measure(lambda: store.get_into(key, out), size),
               "get": measure(lambda: store.get(key), size, n=None if size < (16 << 20) else 20)}
    if not np.array_equal(out, value):
        raise RuntimeError(f"get_into returned wrong bytes at size {size}")
    store.remove(key)
    return results


def compare_mooncake(rows: list[dict], sizes: list[int]) -> dict:
    """Mooncake Store in the same run, and kvstore's speed-up over it per (op, size)."""
    from benchmarks import mooncake_baseline

    result = mooncake_baseline.measure(sizes)
    if not result["available"]:
        return {"available": False, "reason": result["reason"]}
    ours = {(r["path"], r["op"], r["size"]): r for r in rows}
    speedups = []
    for mc in result["rows"]:
        op = {"put_from": "put", "get_into": "get_into"}.get(mc["op"])
        if op is None:
            continue
        for path in ("daemon+shm", "daemon+tcp"):
            r = ours.get((path, op, mc["size"]))
            if r is not None:
                speedups.append({"op": op, "size": mc["size"], "path": path, "kvstore_p50_us": r["p50_us"],
                                 "mooncake_p50_us": mc["p50_us"], "speedup": mc["p50_us"] / r["p50_us"]})
    return {"available": True, "rows": result["rows"], "speedups": speedups,
            "loadavg": [result.get("loadavg_before"), result.get("loadavg_after")]}


def run(sizes: list[int], mooncake: bool = True) -> dict:
    biggest = max(sizes)
    capacity = f"{max(256 << 20, 4 * biggest) >> 20}MiB"
    rows: list[dict] = []
    base = {s: memcpy(s) for s in sizes}
    raw = RawSocket(biggest)
    raw_put = {s: measure(lambda s=s: raw.send(s), s) for s in sizes}
    raw_get = {s: measure(lambda s=s: raw.recv(s), s) for s in sizes}
    raw.close()
    with daemon(capacity) as (unix_url, tcp_url):
        paths = [("embedded", lambda: kvstore.KVStore.embedded(capacity=capacity)),
                 ("daemon+shm", lambda: kvstore.connect(unix_url, transport="shm")),
                 ("daemon+tcp", lambda: kvstore.connect(tcp_url, transport="tcp"))]
        for name, factory in paths:
            with factory() as store:
                for size in sizes:
                    for op, t in bench_path(store, size).items():
                        if name == "daemon+tcp" and op != "get":
                            ref, ref_name = (raw_put if op == "put" else raw_get)[size], "raw socket"
                        else:
                            ref, ref_name = base[size], "memcpy"
                        rows.append({"path": name, "op": op, **t.as_dict(), "baseline": ref_name,
                                     "baseline_gbps": ref.gbps, "ratio": t.gbps / ref.gbps})
    return {"machine": describe(machine()), "rows": rows,
            "mooncake": compare_mooncake(rows, sizes) if mooncake else {"available": False, "reason": "skipped"},
            "baselines": {"memcpy": {s: base[s].as_dict() for s in sizes},
                          "raw_socket_put": {s: raw_put[s].as_dict() for s in sizes},
                          "raw_socket_get": {s: raw_get[s].as_dict() for s in sizes}}}


COLUMNS = [Column("path", "<11", "path"), Column("op", "<8", "op"),
           Column("size", ">9", lambda r: format_size(r["size"])), Column("p50 us", ">10.1f", "p50_us"),
           Column("p99 us", ">10.1f", "p99_us"), Column("GB/s", ">7.2f", "gbps"), Column("baseline", ">10", "baseline"),
           Column("base GB/s", ">9.2f", "baseline_gbps"), Column("ratio", ">6.2f", "ratio")]


def print_table(result: dict) -> None:
    print(f"# kvstore store benchmark — {result['machine']}")
    print(format_table(COLUMNS, result["rows"]))
    mc = result["mooncake"]
    if not mc["available"]:
        print(f"# Mooncake Store: not measured ({mc['reason']})")
        return
    print("# Mooncake Store over TCP, same run (put_from / get_into into a registered buffer):")
    for r in mc["rows"]:
        print(f"{'mooncake':<11} {r['op']:<8} {format_size(r['size']):>9} {r['p50_us']:>10.1f} {r['p99_us']:>10.1f} "
              f"{r['gbps']:>7.2f}")
    print("# kvstore speed-up over Mooncake (Mooncake p50 / kvstore p50):")
    for s in mc["speedups"]:
        print(f"{s['path']:<11} {s['op']:<8} {format_size(s['size']):>9} {s['kvstore_p50_us']:>10.1f} "
              f"{s['mooncake_p50_us']:>10.1f} {s['speedup']:>7.1f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated sizes (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--no-mooncake", action="store_true", help="do not measure Mooncake Store")
    parser.add_argument("--workload", choices=["speed", "mixed"], default="speed",
                        help="speed: put/get per size (default); mixed: fill before the first eviction")
    parser.add_argument("--runs", type=int, default=5, help="mixed: runs (seeds) per daemon kind (default 5)")
    parser.add_argument("--capacity", default="256MiB", help="mixed: the daemon's capacity (default %(default)s)")
    parser.add_argument("--largest", default="8MiB", help="mixed: the largest value (default %(default)s)")
    parser.add_argument("--steady", type=float, default=3.0, help="mixed: seconds sampled after the first eviction")
    args = parser.parse_args(argv)
    if args.workload == "mixed":
        if args.runs < 1:
            parser.error(f"--runs must be at least 1, got {args.runs}")
        result = store_mixed.run(args.runs, args.capacity, parse_size(args.largest), args.steady)
        result["machine"] = describe(machine())
        store_mixed.print_table(result, result["machine"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return 0
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    result = run(sizes, mooncake=not args.no_mooncake)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
