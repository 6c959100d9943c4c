"""Paged-KV packing benchmark: ``kvstore.ops.gather_pages`` / ``scatter_pages`` against, in the same run,
memcpy of the same bytes (the ceiling) and the per-layer torch ``index_select`` / ``index_copy_`` loop (what
engines do today).

    python -m benchmarks.bench_pages                      # CPU, Llama-3-8B geometry
    python -m benchmarks.bench_pages --device cuda --json out.json

Every timed iteration touches cold memory: fresh random block ids from a cache larger than the last-level
cache, and packed / memcpy buffers rotated over at least 4x that cache, so memcpy is the DRAM-to-DRAM (or
HBM-to-HBM) ceiling and not a cache-to-cache one. Variants are interleaved within each iteration, so noise
from other processes lands on all of them alike, and the ratios are medians of per-iteration ratios. Columns:
``op`` is the public call (validation included; on CUDA that includes reading the ids back), ``kernel`` the copy
alone (pre-validated arguments).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from benchmarks.common import table
from benchmarks.common.machine import machine
from benchmarks.common.table import Column
from kvstore import KVLayout, KVLayoutKind, ops
from kvstore.workloads import stats

DEFAULT_BLOCKS = {"cpu": "1,4,16,64,256", "cuda": "1,8,64,512,2048"}
TARGETS = {"cpu": (0.8, 2.0), "cuda": (0.7, 3.0)}  # (x memcpy, x torch loop), for pages >= 16 KiB
MIN_TARGET_PAGE = 16 << 10


# -- timing ------------------------------------------------------------------------------------------------------
class Clock:
    """Times one call: wall clock on CPU, CUDA events (read at the end of a round) on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[str, object, object]] = []
        self.samples: dict[str, list[float]] = {}

    def time(self, name: str, fn: Callable[[], object]) -> None:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self.pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            fn()
            self.samples.setdefault(name, []).append(time.perf_counter() - t0)

    def end_round(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            for name, start, end in self.pending:
                self.samples.setdefault(name, []).append(start.elapsed_time(end) / 1e3)
            self.pending.clear()


# -- the variants --------------------------------------------------------------------------------------------------
def block_permutation(kind: KVLayoutKind) -> tuple[int, list[int]]:
    """(block dim of a cache, permutation of a cache's dims into (block, *block_dims) packed order)."""
    dims = kind.cache_dims
    block_dim = dims.index("block")
    return block_dim, [block_dim] + [dims.index(d) for d in kind.block_dims]


def torch_gather(kind, caches, ids, out) -> None:
    block_dim, perm = block_permutation(kind)
    for layer, cache in enumerate(caches):
        out[:, layer].copy_(cache.index_select(block_dim, ids).permute(perm))


def torch_scatter(kind, src, ids, caches) -> None:
    block_dim, perm = block_permutation(kind)
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    for layer, cache in enumerate(caches):
        cache.index_copy_(block_dim, ids, src[:, layer].permute(inverse))


def memcpy_fn(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], None]:
    if device.type == "cuda":
        return lambda dst, src: dst.copy_(src)
    return lambda dst, src: ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())


def kernel_only(layout: KVLayout, caches, ids, packed, gather: bool) -> Callable[[], None]:
    """The copy without the op's per-call validation (arguments validated once, by ops.prepare_*)."""
    if gather:
        return ops.prepare_gather_pages(caches, ids, packed, layout=layout)
    return ops.prepare_scatter_pages(packed, ids, caches, layout=layout)


# -- one size --------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    op: str
    blocks: int
    page_kib: float
    mib: float
    op_gbps: float
    op_p50_us: float
    op_p99_us: float
    kernel_gbps: float
    memcpy_gbps: float
    torch_gbps: float
    vs_memcpy: float
    vs_torch: float
    meets_target: str


def cold_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).L2_cache_size
    try:
        return 4 * max(os.sysconf("SC_LEVEL3_CACHE_SIZE"), 8 << 20)
    except (ValueError, OSError):
        return 128 << 20


def bench_size(layout: KVLayout, caches, n: int, args, device: torch.device) -> list[Row]:
    nbytes = ops.packed_nbytes(layout, n)
    rotation = max(1, min(64, math.ceil(cold_bytes(device) / nbytes)))
    gen = torch.Generator().manual_seed(args.seed + n)
    num_cache = caches[0].shape[layout.kind.cache_dims.index("block")]
    id_sets = [torch.randperm(num_cache, generator=gen)[:n].to(device) for _ in range(rotation)]
    packed = [torch.empty(ops.packed_shape(layout, n), dtype=layout.dtype, device=device) for _ in range(rotation)]
    scratch = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(rotation)]
    for t in packed + scratch:
        t.view(torch.uint8).fill_(1)  # fault the pages in before timing
    memcpy = memcpy_fn(device)
    rows = []
    for op in args.ops:
        gather = op == "gather"
        kernels = [kernel_only(layout, caches, ids, buf, gather) for ids, buf in zip(id_sets, packed, strict=True)]
        variants: dict[str, Callable[[int], object]] = {
            "op": (lambda i: ops.gather_pages(caches, id_sets[i], packed[i], layout=layout)) if gather else
                  (lambda i: ops.scatter_pages(packed[i], id_sets[i], caches, layout=layout)),
            "kernel": lambda i, kernels=kernels: kernels[i](),
            "memcpy": lambda i: memcpy(scratch[i], packed[i].view(-1).view(torch.uint8)),
            "torch": (lambda i: torch_gather(layout.kind, caches, id_sets[i], packed[i])) if gather else
                     (lambda i: torch_scatter(layout.kind, packed[i], id_sets[i], caches)),
        }
        clock = Clock(device)
        step = 0
        names = list(variants)
        for round_ in range(args.warmup + args.iters):
            # Rotate the order too, so that no variant always runs right after the same other one.
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                fn = variants[name]
                # Each call takes the next ids and buffers in the rotation, so no variant finds data that the
                # one before it left in the cache.
                clock.time(name, lambda fn=fn, step=step: fn(step % rotation))
                step += 1
            clock.end_round()
        rows.append(make_row(op, n, layout, nbytes, clock.samples, args.warmup, device))
    return rows


def make_row(op: str, n: int, layout: KVLayout, nbytes: int, samples, warmup: int, device) -> Row:
    timed = {name: values[warmup:] for name, values in samples.items()}
    median = {name: stats.median(values) for name, values in timed.items()}
    gbps = {name: nbytes / t / 1e9 for name, t in median.items()}
    # Ratios are medians of per-round ratios: the variants of one round ran back to back, under the same load.
    vs_memcpy = stats.median([m / o for m, o in zip(timed["memcpy"], timed["op"], strict=True)])
    vs_torch = stats.median([t / o for t, o in zip(timed["torch"], timed["op"], strict=True)])
    want_memcpy, want_torch = TARGETS[device.type]
    if layout.page_nbytes < MIN_TARGET_PAGE:
        verdict = "n/a"
    else:
        verdict = "yes" if vs_memcpy >= want_memcpy and vs_torch >= want_torch else "no"
    return Row(op=op, blocks=n, page_kib=layout.page_nbytes / 1024, mib=nbytes / (1 << 20), op_gbps=gbps["op"],
               op_p50_us=median["op"] * 1e6, op_p99_us=stats.percentile(timed["op"], 99) * 1e6,
               kernel_gbps=gbps["kernel"], memcpy_gbps=gbps["memcpy"], torch_gbps=gbps["torch"],
               vs_memcpy=vs_memcpy, vs_torch=vs_torch, meets_target=verdict)


# -- report ----------------------------------------------------------------------------------------------------------
_SPECS = [("op", "<7"), ("blocks", ">6"), ("page_kib", ">8.0f"), ("mib", ">8.1f"), ("op_gbps", ">8.2f"),
          ("op_p50_us", ">10.0f"), ("op_p99_us", ">10.0f"), ("kernel_gbps", ">11.2f"), ("memcpy_gbps", ">11.2f"),
          ("torch_gbps", ">10.2f"), ("vs_memcpy", ">9.2f"), ("vs_torch", ">8.1f"), ("meets_target", ">12")]


def format_table(rows: list[Row]) -> str:
    # headers are the field names, right-aligned over the width the first row's value takes
    widths = {name: len(format(getattr(rows[0], name), spec)) if rows else len(name) for name, spec in _SPECS}
    columns = [Column(name, spec, name, header_spec=f">{widths[name]}") for name, spec in _SPECS]
    return table.format_table(columns, rows, rule=True)


def describe_machine(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB"
    m = machine()
    return f"{m['cpu']}, {m['logical_cpus']} cores, kernel threads {torch.get_num_threads()}, memcpy 1 thread"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_pages", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--blocks", help="comma-separated block counts (default: cpu 1..256, cuda 1..2048)")
    p.add_argument("--ops", default="gather,scatter", help="comma-separated: gather, scatter")
    p.add_argument("--kind", default="vllm_flash_nhd", choices=[k.value for k in KVLayoutKind])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cache-blocks", type=int, help="blocks per layer cache (default: 2x the largest request)")
    p.add_argument("--iters", type=int, help="timed iterations per size (default: cpu 10, cuda 50)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, help="CPU kernel threads (torch.set_num_threads); default: torch's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the rows and the setup as JSON")
    args = p.parse_args(argv)
    args.blocks = [int(b) for b in (args.blocks or DEFAULT_BLOCKS[args.device]).split(",")]
    args.ops = [o.strip() for o in args.ops.split(",")]
    if not set(args.ops) <= {"gather", "scatter"}:
        p.error(f"--ops takes gather and/or scatter, got {args.ops}")
    args.iters = args.iters or (50 if args.device == "cuda" else 10)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA GPU visible", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    heads = 1 if args.kind == "mla" else args.kv_heads
    layout = KVLayout(kind=args.kind, num_layers=args.layers, num_kv_heads=heads, head_dim=args.head_dim,
                      block_size=args.block_size, dtype=args.dtype, model_id="bench")
    num_cache = args.cache_blocks or 2 * max(args.blocks)
    caches = [torch.empty(layout.cache_shape(num_cache), dtype=layout.dtype, device=device)
              for _ in range(layout.num_layers)]
    for cache in caches:
        cache.view(torch.uint8).fill_(7)
    torch.manual_seed(args.seed)
    rows = [row for n in args.blocks for row in bench_size(layout, caches, n, args, device)]
    want_memcpy, want_torch = TARGETS[device.type]
    print(f"bench_pages: {args.device}: {describe_machine(device)}; torch {torch.__version__}")
    print(f"layout {layout.kind.name} layers={layout.num_layers} kv_heads={layout.num_kv_heads} "
          f"head_dim={layout.head_dim} block_size={layout.block_size} {args.dtype}; cache {num_cache} blocks/layer "
          f"({num_cache * layout.block_nbytes / (1 << 30):.2f} GiB); {args.iters} iters after {args.warmup} warm-up; "
          f"cold memory")
    print(f"target for pages >= 16 KiB: op >= {want_memcpy} x memcpy and >= {want_torch} x the torch loop")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "pages", "device": args.device, "machine": describe_machine(device),
                       "torch": torch.__version__, "layout": layout.to_dict(), "cache_blocks": num_cache,
                       "args": {k: v for k, v in vars(args).items() if k != "json"},
                       "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
