"""GPU data-path benchmark: put / get_into of CUDA tensors through a same-host daemon, with the physical
baseline of each path measured in the same run.

    python -m benchmarks.bench_cuda_ipc [--sizes 4KiB,64KiB,1MiB,16MiB,256MiB] [--json PATH]

Paths and their baselines (one copy on the current stream plus a wait for its event, as the store does):

* ``cuda_ipc`` (the daemon's GPU segments): put and get_into against a raw device-to-device copy between two
  tensors of this process.
* ``shm`` with CUDA tensors (device <-> host through the daemon's shared memory): put against a raw
  device-to-host copy into pinned memory, get_into against a raw host-to-device copy out of it.

The store's figure includes its control round trips (allocate, commit or release); the target is >= 0.8 x
the baseline at >= 1 MiB. Needs a CUDA GPU and kvstore._C_cuda. ``benchmarks.bench_transports`` takes its
cuda_ipc rows from :func:`transport_rows`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass

try:
    import torch
except ImportError:  # bench_transports imports this module to ask whether it can run
    torch = None

import kvstore
from benchmarks.common.daemon import Daemon
from benchmarks.common.table import Column
from benchmarks.common.table import format_table as format_table_of
from benchmarks.common.timing import Timing, measure
from kvstore.gpu import runtime as gpu
from kvstore.units import format_size, parse_size

DEFAULT_SIZES = "4KiB,64KiB,1MiB,16MiB,256MiB"
TARGET = 0.8


@dataclass(frozen=True)
class Row:
    path: str
    op: str
    size: int
    p50_us: float
    p99_us: float
    gbps: float
    baseline: str
    baseline_gbps: float
    baseline_p50_us: float

    @property
    def ratio(self) -> float:
        return self.gbps / self.baseline_gbps if self.baseline_gbps else float("nan")


@contextlib.contextmanager
def daemon(capacity: str, gpu_capacity: str, device: int):
    """``kvstore serve`` with GPU segments on ``device``, on a temporary Unix socket; yields its URL."""
    args = ("--gpu-capacity", gpu_capacity, "--device", str(device))
    with Daemon(capacity=capacity, tcp=False, args=args, log_level="warning").start(timeout=60) as d:
        yield d.url


def raw_copy(dst: torch.Tensor, src: torch.Tensor):
    """The baseline: one cudaMemcpyAsync on the current stream and a wait for its event."""
    native, n = gpu.native(), src.numel() * src.element_size()
    device = (dst if dst.is_cuda else src).device
    stream = torch.cuda.current_stream(device).cuda_stream
    return lambda: native.copy_and_wait(dst.data_ptr(), src.data_ptr(), n, device.index, stream)


def bench_size(ipc: kvstore.KVStore, shm: kvstore.KVStore, size: int, device: torch.device) -> list[Row]:
    gen = torch.Generator(device=device).manual_seed(size)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device, generator=gen)
    out = torch.empty_like(src)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    rows = []
    key = f"bench/{size}"
    for path, store in (("cuda_ipc", ipc), ("shm", shm)):
        store.put(key, src)
        put = measure(lambda store=store: store.put(key, src), size)
        out.zero_()
        get = measure(lambda store=store: store.get_into(key, out), size)
        if not torch.equal(out, src):
            raise RuntimeError(f"{path}: get_into returned wrong bytes at size {size}")
        store.remove(key)
        if path == "cuda_ipc":
            d2d = measure(raw_copy(out, src), size)
            rows += [row(path, "put", put, "d2d copy", d2d), row(path, "get_into", get, "d2d copy", d2d)]
        else:
            rows += [row(path, "put", put, "d2h pinned", measure(raw_copy(pinned, src), size)),
                     row(path, "get_into", get, "h2d pinned", measure(raw_copy(out, pinned), size))]
    return rows


def row(path: str, op: str, t: Timing, baseline: str, b: Timing) -> Row:
    return Row(path, op, t.size, t.p50_s * 1e6, t.p99_s * 1e6, t.gbps, baseline, b.gbps, b.p50_s * 1e6)


COLUMNS = [Column("path", "<9", "path"), Column("op", "<9", "op"), Column("size", ">10", lambda r: format_size(r.size)),
           Column("p50 us", ">9.1f", "p50_us"), Column("p99 us", ">9.1f", "p99_us"), Column("GB/s", ">8.2f", "gbps"),
           Column("baseline", "<11", "baseline", gap=3), Column("GB/s", ">8.2f", "baseline_gbps"),
           Column("p50 us", ">9.1f", "baseline_p50_us"), Column("ratio", ">6.2f", "ratio")]


def format_table(rows: list[Row]) -> str:
    return format_table_of(COLUMNS, rows, rule=True)


def summary(rows: list[Row]) -> str:
    """One line: the worst ratio at >= 1 MiB per path and op, and the smallest size's p50 against its baseline."""
    parts = []
    for path, op in dict.fromkeys((r.path, r.op) for r in rows):
        mine = [r for r in rows if (r.path, r.op) == (path, op)]
        big = [r.ratio for r in mine if r.size >= 1 << 20]
        small = min(mine, key=lambda r: r.size)
        worst = f"{min(big):.2f}x" if big else "n/a"
        parts.append(f"{path} {op} >=1MiB {worst}, {format_size(small.size)} {small.p50_us:.0f}/"
                     f"{small.baseline_p50_us:.0f} us")
    return "; ".join(parts)


def unavailable() -> str | None:
    """None when the cuda_ipc path can be measured here, else why not."""
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    try:
        gpu.native()
    except kvstore.KVStoreError as exc:
        return str(exc)
    return None


def transport_rows(sizes: list[int], device: int = 0) -> list[dict]:
    """cuda_ipc put / get_into against the raw device-to-device copy, as rows of bench_transports (its own
    daemon, with GPU segments)."""
    capacity = f"{max(256 << 20, 3 * max(sizes)) >> 20}MiB"
    torch.cuda.set_device(device)
    out = []
    with daemon(capacity, capacity, device) as url, kvstore.connect(url, transport="cuda_ipc") as ipc, \
            kvstore.connect(url, transport="shm") as shm:
        for size in sizes:
            for r in bench_size(ipc, shm, size, torch.device("cuda", device)):
                if r.path == "cuda_ipc":
                    out.append({"transport": "cuda_ipc", "op": r.op, "size": r.size, "p50_us": r.p50_us,
                                "p99_us": r.p99_us, "gbps": r.gbps, "baseline": r.baseline,
                                "baseline_p50_us": r.baseline_p50_us, "baseline_gbps": r.baseline_gbps,
                                "ratio": r.ratio, "target": TARGET if r.size >= (1 << 20) else 0.5})
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cuda_ipc", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated sizes (default %(default)s)")
    p.add_argument("--device", type=int, default=0, help="CUDA device of the daemon and the tensors")
    p.add_argument("--gpu-capacity", default="2GiB", help="the daemon's GPU segments (default %(default)s)")
    p.add_argument("--capacity", default="2GiB", help="the daemon's host segments (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--summary", metavar="PATH", help="write a one-line summary to PATH")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"bench_cuda_ipc cannot run: {reason}", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    rows: list[Row] = []
    with daemon(args.capacity, args.gpu_capacity, args.device) as url:
        with kvstore.connect(url) as ipc, kvstore.connect(url, transport="shm") as shm:
            if ipc.transport != "cuda_ipc":
                raise RuntimeError(f"transport='auto' chose {ipc.transport}, not cuda_ipc")
            for size in sizes:
                rows += bench_size(ipc, shm, size, device)
            paths = {"cuda_ipc": ipc.stats()["device_path"], "shm": shm.stats()["device_path"]}
    print(f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}; {paths}")
    print(format_table(rows))
    line = summary(rows)
    print(line)
    if args.summary:
        with open(args.summary, "w") as f:
            f.write(line + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "paths": paths, "target": TARGET,
                       "rows": [{**asdict(r), "ratio": r.ratio} for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
