"""Fused checksums: gather (or scatter) alone, the copy plus a separate xxh3 pass, and the copy that hashes as it
goes (``ops.gather_pages(..., checksum=True)`` / ``scatter_pages(..., expect_checksum=...)``), against a memcpy
of the same bytes in the same run.

    python -m benchmarks.bench_fused_checksum [--blocks 64] [--chunk-blocks 16] [--threads 1,2] [--iters 15]
                                              [--json PATH]

Geometry: Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bf16, block 16: 2 MiB a block) in vLLM's
flash-attention layout; ``--blocks`` blocks with random ids from a cache twice that size, copied in chunks of
``--chunk-blocks`` as ``KVHandoff`` does (each chunk into its own buffer, one digest per chunk). Every variant
copies the same bytes; the variants run round-robin (medians of ``--iters`` rounds); "x memcpy" is memcpy time /
variant time (single-thread memcpy into a pre-faulted buffer, measured just before).
"""

from __future__ import annotations

import argparse
import json

import torch
import xxhash

from benchmarks.baseline import memcpy
from benchmarks.common.machine import describe, machine
from benchmarks.common.timing import sample, timing_of
from kvstore import KVLayout, KVLayoutKind, ops

LLAMA = dict(kind=KVLayoutKind.VLLM_FLASH_NHD, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
             dtype=torch.bfloat16, model_id="llama-3-8b")


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _native_fused(layout: KVLayout, caches, chunks, outs, gather: bool, piece_bytes: int):
    """The fused kernel with an explicit hash-piece size (validated once, like ops.prepare_*)."""
    import kvstore._C as native

    fn = native.gather_pages_xxh3 if gather else native.scatter_pages_xxh3
    calls = []
    for c, o in zip(chunks, outs, strict=True):
        pages = ops._inspect(layout.kind.value, caches, c, o, "out")
        calls.append(dict(layer_ptrs=[t.data_ptr() for t in caches], **ops._launch_args(pages, c, o)))

    def run():
        for kwargs in calls:
            fn(**kwargs, num_threads=torch.get_num_threads(), piece_bytes=piece_bytes)
    return run


def run(blocks: int, chunk_blocks: int, threads: list[int], iters: int, pieces: list[int] = ()) -> dict:
    layout = KVLayout(**LLAMA)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(layout.cache_shape(2 * blocks), generator=gen).to(layout.dtype)
              for _ in range(layout.num_layers)]
    dst = [torch.zeros_like(c) for c in caches]
    ids = torch.randperm(2 * blocks, generator=gen)[:blocks]
    chunks = [ids[b:b + chunk_blocks] for b in range(0, blocks, chunk_blocks)]
    outs = [torch.empty(ops.packed_shape(layout, len(c)), dtype=layout.dtype) for c in chunks]
    for out in outs:
        out.fill_(0)  # pre-fault
    nbytes = ops.packed_nbytes(layout, blocks)
    digests = [ops.gather_pages(caches, c, o, layout=layout, checksum=True)[1] for c, o in
               zip(chunks, outs, strict=True)]
    for o, d in zip(outs, digests, strict=True):
        assert d == xxhash.xxh3_64_intdigest(_bytes(o)), "fused checksum differs from xxh3 of the bytes"

    def gather():
        for c, o in zip(chunks, outs, strict=True):
            ops.gather_pages(caches, c, o, layout=layout)

    def gather_then_hash():
        for c, o in zip(chunks, outs, strict=True):
            ops.gather_pages(caches, c, o, layout=layout)
            xxhash.xxh3_64_intdigest(_bytes(o))

    def gather_fused():
        for c, o in zip(chunks, outs, strict=True):
            ops.gather_pages(caches, c, o, layout=layout, checksum=True)

    def scatter():
        for c, o in zip(chunks, outs, strict=True):
            ops.scatter_pages(o, c, dst, layout=layout)

    def hash_then_scatter():
        for c, o, d in zip(chunks, outs, digests, strict=True):
            assert xxhash.xxh3_64_intdigest(_bytes(o)) == d
            ops.scatter_pages(o, c, dst, layout=layout)

    def scatter_fused():
        for c, o, d in zip(chunks, outs, digests, strict=True):
            ops.scatter_pages(o, c, dst, layout=layout, expect_checksum=d)

    variants = {"gather": gather, "gather + xxh3 pass": gather_then_hash, "gather, fused xxh3": gather_fused,
                "scatter": scatter, "xxh3 pass + scatter": hash_then_scatter, "scatter, fused xxh3": scatter_fused}
    for kib in pieces:
        variants[f"gather fused, {kib} KiB"] = _native_fused(layout, caches, chunks, outs, True, kib << 10)
        variants[f"scatter fused, {kib} KiB"] = _native_fused(layout, dst, chunks, outs, False, kib << 10)
    rows = []
    saved = torch.get_num_threads()
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            base = memcpy(nbytes, iters)
            for fn in variants.values():  # warm-up
                fn()
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(iters):  # round-robin, so that every variant sees the same machine load
                for name, fn in variants.items():
                    times[name].extend(sample(fn, 1, 0))
            for name in variants:
                t = timing_of(nbytes, times[name])
                rows.append({"threads": n_threads, "op": name, "bytes": nbytes, "p50_ms": t.p50_s * 1e3,
                             "gbps": t.gbps, "memcpy_gbps": base.gbps, "x_memcpy": base.p50_s / t.p50_s})
    finally:
        torch.set_num_threads(saved)
    return {"machine": machine(), "fused": ops.fused_checksums() or "yes", "blocks": blocks,
            "chunk_blocks": chunk_blocks, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--chunk-blocks", type=int, default=16)
    parser.add_argument("--threads", default="1,2", help="torch thread counts to run with (default %(default)s)")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--pieces", default="", help="also time the fused kernels with these hash-piece sizes "
                        "(KiB, comma-separated)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    result = run(args.blocks, args.chunk_blocks, [int(t) for t in args.threads.split(",")], args.iters,
                 [int(k) for k in args.pieces.split(",") if k])
    print(f"# fused checksum benchmark — {describe(result['machine'])}; fused: {result['fused']}")
    print(f"{'threads':>7} {'op':<24} {'p50 ms':>8} {'GB/s':>6} {'memcpy':>7} {'x memcpy':>8}")
    for r in result["rows"]:
        print(f"{r['threads']:>7} {r['op']:<24} {r['p50_ms']:>8.2f} {r['gbps']:>6.2f} {r['memcpy_gbps']:>7.2f} "
              f"{r['x_memcpy']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
