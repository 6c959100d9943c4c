"""The vLLM connector's block I/O (``BlockIO.save`` / ``load``) on synthetic caches laid out as vLLM 0.32 allocates
them, against the physical copy of the same bytes measured in the same run.

    python -m benchmarks.bench_block_io [--device cuda] [--layout LBNHC] [--blocks 16,64,256] [--json PATH]

The caches are one allocation viewed as one ``[B, H, N, C]`` cache per layer in vLLM's layout (``LBNHC``, vLLM's
default, ``LBHNC``, ``BLHNC``...), built here without vLLM (it is not on the GPU machine). A save of ``n`` blocks
gathers them (every layer) and writes one object per block; a load reads them back into other blocks. On CUDA
caches that is the device path (gather on the connector's stream, one copy per block into the reserved,
page-locked shared memory; the reverse on load); the baseline is one ``cudaMemcpy`` of the same bytes between the
device and pinned host memory (D2H for saves, H2D for loads). On CPU caches the baseline is one memcpy.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import kvstore
from benchmarks.common.daemon import Daemon
from benchmarks.common.machine import describe
from benchmarks.common.table import Column, format_table
from benchmarks.common.timing import measure
from kvstore.integrations.vllm.block_io import BlockIO
from kvstore.integrations.vllm.cache_layouts import LAYOUT_KINDS, layout_name, page_geometry
from kvstore.integrations.vllm.keys import CacheLayout
from kvstore.units import format_size

# vLLM layout -> physical order of (layer, block, head, token, content), as vLLM's KVCacheLayout names it
_ORDER = {name: tuple("LBHNC".index(c) for c in name) for name in LAYOUT_KINDS}


def vllm_caches(args, num_blocks: int, device: str) -> list[torch.Tensor]:
    """One allocation in ``args.layout``'s memory order, viewed as vLLM's per-layer ``[B, H, N, C]`` caches."""
    sizes = (args.layers, num_blocks, args.kv_heads, args.block_size, 2 * args.head_dim)
    order = _ORDER[layout_name(args.layout)]
    raw = torch.empty([sizes[d] for d in order], dtype=getattr(torch, args.dtype), device=device).normal_()
    logical = raw.permute(*[order.index(d) for d in range(5)])  # back to [L, B, H, N, C]
    return [logical[i] for i in range(args.layers)]


def cache_layout(args) -> CacheLayout:
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    geometry = page_geometry(args.layout, mla=False, heads=args.kv_heads, tokens=args.block_size,
                             content_bytes=2 * args.head_dim * itemsize, dtype=args.dtype, itemsize=itemsize)
    return CacheLayout(backend=f"{args.device}/bench", packing="kv-content", cache_layout="", dtype=args.dtype,
                       kv_cache_dtype="auto", block_size=args.block_size, num_layers=args.layers,
                       num_kv_heads=args.kv_heads, head_size=args.head_dim, page_shape=geometry.page_shape,
                       model="bench", revision="", tp_rank=0, tp_size=1, kind=geometry.kind.value)


def baselines(nbytes: int, device: str, iters: int) -> tuple[float, float]:
    """GB/s of one copy of ``nbytes``: (device -> pinned host, pinned host -> device), or memcpy twice on CPU."""
    if device == "cpu":
        a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        t = measure(lambda: b.copy_(a), nbytes, iters).gbps
        return t, t
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(dst, src):
        dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    return (measure(lambda: copy(host, dev), nbytes, iters).gbps, measure(lambda: copy(dev, host), nbytes, iters).gbps)


def run_path(path: str, store, args, blocks: list[int]) -> list[dict]:
    layout = cache_layout(args)
    cache_blocks = 2 * max(blocks)
    src, dst = vllm_caches(args, cache_blocks, args.device), vllm_caches(args, cache_blocks, args.device)
    save_io, load_io = BlockIO(src, layout), BlockIO(dst, layout)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = []
    for n in blocks:
        items = [(f"bench/blockio/{i}", i) for i in range(n)]
        back = [(key, cache_blocks - 1 - i) for key, i in items]
        nbytes = n * layout.block_nbytes
        d2h, h2d = baselines(nbytes, args.device, args.iters)
        save = measure(lambda: (save_io.save(store, items), sync()), nbytes, args.iters)  # noqa: B023
        load = measure(lambda: (load_io.load(store, back), sync()), nbytes, args.iters)  # noqa: B023
        result = load_io.load(store, back)
        if result.loaded != n:
            raise RuntimeError(f"{path}: loaded {result.loaded} of {n} blocks ({result})")
        for op, t, base in (("save", save, d2h), ("load", load, h2d)):
            rows.append({"path": path, "op": op, "blocks": n, "bytes": nbytes, "p50_us": t.p50_s * 1e6,
                         "p99_us": t.p99_s * 1e6, "gbps": t.gbps, "baseline_gbps": base, "x_baseline": t.gbps / base})
        for key, _ in items:
            store.remove(key)
    return rows


COLUMNS = [Column("path", "<11", "path"), Column("op", "<5", "op"), Column("blocks", ">6", "blocks"),
           Column("bytes", ">9", lambda r: format_size(r["bytes"])), Column("p50 us", ">10.0f", "p50_us"),
           Column("p99 us", ">10.0f", "p99_us"), Column("GB/s", ">7.2f", "gbps"),
           Column("copy GB/s", ">9.2f", "baseline_gbps"), Column("x copy", ">7.2f", "x_baseline")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_block_io", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layout", default="LBNHC", help="vLLM KV-cache layout (default %(default)s)")
    p.add_argument("--blocks", default="16,64,256", help="blocks per save/load (default %(default)s)")
    p.add_argument("--paths", default="daemon-shm,embedded", help="daemon-shm, daemon-tcp, embedded")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--capacity", default="4GiB", help="the store's capacity (default %(default)s)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--summary", metavar="PATH", help="write a one-line summary to PATH")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_block_io: --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    blocks = [int(b) for b in args.blocks.split(",")]
    rows: list[dict] = []
    for path in args.paths.split(","):
        if path == "embedded":
            with kvstore.KVStore.embedded(capacity=args.capacity) as store:
                rows += run_path(path, store, args, blocks)
            continue
        with Daemon(capacity=args.capacity) as daemon, kvstore.connect(
                daemon.unix_url if path == "daemon-shm" else daemon.tcp_url,
                transport="shm" if path == "daemon-shm" else "tcp") as store:
            rows += run_path(path, store, args, blocks)
    name = torch.cuda.get_device_name() if args.device == "cuda" else describe()
    print(f"block I/O, {args.layout} caches on {args.device} ({name}), {args.layers} layers x {args.kv_heads} heads x "
          f"{args.head_dim} dim x {args.block_size} tokens {args.dtype}; medians of {args.iters}")
    print(format_table(COLUMNS, rows, rule=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    if args.summary:
        big = [r for r in rows if r["blocks"] == max(blocks)]
        with open(args.summary, "w") as f:
            f.write("; ".join(f"{r['path']} {r['op']} {r['blocks']} blk: {r['gbps']:.1f} GB/s, "
                              f"{r['x_baseline']:.2f}x copy" for r in big) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
