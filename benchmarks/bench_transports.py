"""Transport benchmark: the store's put / get_into through each data path, and that path's raw baseline
measured in the same run.

    python -m benchmarks.bench_transports [--sizes 4KiB,64KiB,1MiB,16MiB,256MiB] [--transports shm,tcp,ucx]
                                          [--plot PATH] [--json PATH]

| transport    | store client                                  | baseline (same run)                          |
|--------------|-----------------------------------------------|----------------------------------------------|
| shm          | unix:// control, transport="shm"              | single-thread memcpy into a pre-faulted buffer |
| tcp          | tcp:// loopback, transport="tcp"              | raw socket sendall/recv_into between 2 processes |
| ucx          | unix:// control, transport="ucx" (by address) | raw ucxx tag send/recv, 2 processes, same UCX_TLS |
| ucx-listener | as ucx, KVSTORE_UCX_CONNECT=listener          | raw ucxx through a listener (TCP lanes here)  |
| cuda_ipc     | CUDA tensors, its own --gpu-capacity daemon   | device-to-device copy (bench_cuda_ipc)       |

Targets: ratio (store GB/s over baseline GB/s, i.e. baseline p50 over store p50) >= 0.8 for sizes >= 1 MiB,
>= 0.5 (p50 at most twice the baseline's) below. The store and its baselines are timed in alternating blocks,
so a load that drifts during the run weighs on both alike. Iterations shrink with size so a default run stays
within a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np

import kvstore
from benchmarks.baseline import RawSocket, prefaulted
from benchmarks.bench_store import daemon as store_daemon
from benchmarks.common.machine import describe, machine
from benchmarks.common.timing import Timing, timing_of
from kvstore.units import format_size, parse_size

DEFAULT_SIZES = "4KiB,64KiB,1MiB,16MiB,256MiB"
DEFAULT_TRANSPORTS = "shm,tcp,ucx,cuda_ipc"
KNOWN = ("shm", "tcp", "ucx", "ucx-listener", "cuda_ipc")
BUDGET = 1 << 30  # bytes moved per measurement (bounded by the iteration limits below)


def iterations(size: int) -> int:
    return max(8, min(2000, BUDGET // max(size, 1)))


def interleaved(fns: list[Callable[[], object]], size: int, rounds: int = 8) -> list[Timing]:
    """Time each of ``fns`` ``iterations(size)`` times, alternating between them in ``rounds`` blocks, so a
    load that drifts during the run (a shared machine) weighs on the store and its baseline alike."""
    n = iterations(size)
    per = max(1, n // rounds)
    times: list[list[float]] = [[] for _ in fns]
    clock = time.perf_counter
    for fn in fns:
        for _ in range(1 if size >= (64 << 20) else 3):
            fn()  # warm-up
    while len(times[0]) < n:
        for fn, acc in zip(fns, times, strict=True):
            for _ in range(min(per, n - len(acc))):
                t0 = clock()
                fn()
                acc.append(clock() - t0)
    return [timing_of(size, acc) for acc in times]


@contextlib.contextmanager
def daemon(capacity: str, ucx: bool) -> Iterator[tuple[str, str]]:
    with store_daemon(capacity, ("ucx://127.0.0.1:0",) if ucx else ()) as urls:
        yield urls


def ucx_available() -> str | None:
    """None when the ucx transport can run here, else why not."""
    try:
        from kvstore.transports.ucx import load

        load()
    except Exception as exc:  # TransportUnavailable, or a broken install
        return str(exc)
    return None


# ---- baselines ----------------------------------------------------------------------------------------
class Baseline:
    """One transport's physical bound: ``ops(size)`` gives the put-like and get-like call of one size."""

    def __init__(self, name: str, ops: Callable[[int], dict[str, Callable[[], object]]],
                 close: Callable[[], None] = lambda: None):
        self.name, self.ops, self.close = name, ops, close


def baselines_for(transport: str, biggest: int) -> list[Baseline]:
    """The transport's physical baseline, then (ucx) the same with the peer's memory like a segment's."""
    if transport == "shm":
        return [Baseline("memcpy", memcpy_ops)]
    if transport == "tcp":
        return [_raw("raw socket", RawSocket(biggest))]
    from benchmarks.ucx_baseline import RawUcx

    via = "listener" if transport == "ucx-listener" else "address"
    return [_raw("raw ucxx", RawUcx(biggest, via=via)),
            _raw("raw ucxx, shm peer", RawUcx(biggest, via=via, peer_memory="shm"))]


def _raw(name: str, raw) -> Baseline:
    return Baseline(name, lambda s: {"put": lambda: raw.send(s), "get_into": lambda: raw.recv(s)}, raw.close)


def memcpy_ops(size: int) -> dict[str, Callable[[], object]]:
    """Single-thread memcpy into a pre-faulted buffer, both ways (what baseline.memcpy times)."""
    src = memoryview(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8))
    dst = memoryview(prefaulted(size))

    def copy() -> None:
        dst[:] = src

    return {"put": copy, "get_into": copy}


# ---- the store ----------------------------------------------------------------------------------------
def open_store(transport: str, unix_url: str, tcp_url: str) -> kvstore.KVStore:
    if transport == "tcp":
        return kvstore.connect(tcp_url, transport="tcp", timeout=60)
    if transport.startswith("ucx"):
        os.environ["KVSTORE_UCX_CONNECT"] = "listener" if transport == "ucx-listener" else "address"
        return kvstore.connect(unix_url, transport="ucx", timeout=60)
    return kvstore.connect(unix_url, transport="shm", timeout=60)


def store_ops(store: kvstore.KVStore, size: int) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    """The store's put and get_into of one ``size`` object, and a check to run afterwards."""
    value = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    out = prefaulted(size)
    key = f"bench/{size}"
    store.put(key, value)

    def check() -> None:
        if not np.array_equal(out, value):
            raise RuntimeError(f"get_into returned wrong bytes at size {size}")
        store.remove(key)

    return {"put": lambda: store.put(key, value), "get_into": lambda: store.get_into(key, out)}, check


def run_transport(transport: str, sizes: list[int], urls: tuple[str, str]) -> list[dict]:
    rows = []
    bases = baselines_for(transport, max(sizes))
    try:
        with open_store(transport, *urls) as store:
            for size in sizes:
                ops, check = store_ops(store, size)
                base_ops = [b.ops(size) for b in bases]
                for op in ("put", "get_into"):
                    t, *refs = interleaved([ops[op]] + [b[op] for b in base_ops], size)
                    rows.append(row(transport, op, t, bases, refs))
                check()
    finally:
        for b in bases:
            b.close()
        os.environ.pop("KVSTORE_UCX_CONNECT", None)
    return rows


def row(transport: str, op: str, t: Timing, bases: list[Baseline], refs: list[Timing]) -> dict:
    out = {"transport": transport, "op": op, **t.as_dict(), "baseline": bases[0].name,
           "baseline_p50_us": refs[0].p50_s * 1e6, "baseline_gbps": refs[0].gbps, "ratio": t.gbps / refs[0].gbps,
           "target": 0.8 if t.size >= (1 << 20) else 0.5}
    if len(refs) > 1:
        out.update(alt_baseline=bases[1].name, alt_baseline_p50_us=refs[1].p50_s * 1e6,
                   alt_baseline_gbps=refs[1].gbps, alt_ratio=t.gbps / refs[1].gbps)
    return out


def run(sizes: list[int], wanted: list[str]) -> dict:
    biggest = max(sizes)
    capacity = f"{max(256 << 20, 3 * biggest) >> 20}MiB"
    skipped: dict[str, str] = {}
    ucx_reason = ucx_available()
    for name in wanted:
        if name.startswith("ucx") and ucx_reason:
            skipped[name] = f"not measured: {ucx_reason}"
        elif name == "cuda_ipc":
            from benchmarks import bench_cuda_ipc

            if bench_cuda_ipc.unavailable():
                skipped[name] = f"not measured: {bench_cuda_ipc.unavailable()}"
    measured = [t for t in wanted if t not in skipped]
    started, load_before = time.monotonic(), os.getloadavg()
    rows: list[dict] = []
    with daemon(capacity, ucx=ucx_reason is None) as urls:
        for transport in measured:
            if transport != "cuda_ipc":  # measured below, against a daemon with GPU segments
                rows += run_transport(transport, sizes, urls)
    if "cuda_ipc" in measured:
        from benchmarks import bench_cuda_ipc

        rows += bench_cuda_ipc.transport_rows(sizes)
    return {"machine": describe(machine()), "load_before": load_before, "load_after": os.getloadavg(),
            "seconds": time.monotonic() - started, "ucx": ucx_info(ucx_reason), "rows": rows,
            "not_measured": skipped}


def ucx_info(reason: str | None) -> dict:
    if reason:
        return {"available": False, "reason": reason}
    from ucxx._lib import libucxx

    return {"available": True, "ucx_version": ".".join(map(str, libucxx.get_ucx_version())),
            "UCX_TLS": os.environ.get("UCX_TLS", "(default)")}


# ---- output -------------------------------------------------------------------------------------------
def print_table(result: dict) -> None:
    print(f"# kvstore transport benchmark — {result['machine']}")
    print(f"# load average {result['load_before'][0]:.1f} before, {result['load_after'][0]:.1f} after "
          f"(a shared machine: figures are noisy); {result['seconds']:.0f} s; ucx: {result['ucx']}")
    print(f"{'transport':<13} {'op':<8} {'size':>9} {'p50 us':>10} {'p99 us':>10} {'GB/s':>7} {'baseline':>10} "
          f"{'base p50':>10} {'base GB/s':>9} {'ratio':>6} {'target':>7}  second baseline")
    for r in result["rows"]:
        verdict = "ok" if r["ratio"] >= r["target"] else "MISS"
        print(f"{r['transport']:<13} {r['op']:<8} {format_size(r['size']):>9} {r['p50_us']:>10.1f} "
              f"{r['p99_us']:>10.1f} {r['gbps']:>7.2f} {r['baseline']:>10} {r['baseline_p50_us']:>10.1f} "
              f"{r['baseline_gbps']:>9.2f} {r['ratio']:>6.2f} {'>=' + format(r['target'], '.1f'):>5} {verdict:<4}"
              + (f"  {r['alt_baseline']}: {r['alt_baseline_gbps']:.2f} GB/s, ratio {r['alt_ratio']:.2f}"
                 if "alt_baseline" in r else ""))
    for name, why in result["not_measured"].items():
        print(f"{name:<13} {why}")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    transports = sorted({r["transport"] for r in result["rows"]}, key=KNOWN.index)
    colors = dict(zip(KNOWN, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for ax, op in zip(axes, ("put", "get_into"), strict=True):
        for t in transports:
            rows = sorted((r for r in result["rows"] if r["transport"] == t and r["op"] == op),
                          key=lambda r: r["size"])
            sizes = [r["size"] for r in rows]
            ax.plot(sizes, [r["gbps"] for r in rows], "o-", color=colors[t], label=f"{t} (store)")
            ax.plot(sizes, [r["baseline_gbps"] for r in rows], "x--", color=colors[t], alpha=0.6,
                    label=f"{t} baseline: {rows[0]['baseline'] if rows else ''}")
            if rows and "alt_baseline" in rows[0]:
                ax.plot(sizes, [r["alt_baseline_gbps"] for r in rows], "+:", color=colors[t], alpha=0.6,
                        label=f"{t} baseline: {rows[0]['alt_baseline']}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("object size (bytes)")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s (p50)")
    axes[1].legend(fontsize=7, loc="lower right")
    missing = "; ".join(f"{k}: {v}" for k, v in result["not_measured"].items())
    fig.suptitle(f"kvstore transports vs raw baselines — {result['machine'][:80]}" +
                 (f"\n{missing}" if missing else ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated sizes (default %(default)s)")
    parser.add_argument("--transports", default=DEFAULT_TRANSPORTS,
                        help=f"comma-separated, of {', '.join(KNOWN)} (default %(default)s)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of bandwidth against size per transport")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    wanted = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in KNOWN]
    if unknown or not sizes or min(sizes) <= 0:
        parser.error(f"unknown transports {unknown} (known: {KNOWN})" if unknown else "sizes must be positive")
    result = run(sizes, wanted)
    print_table(result)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
