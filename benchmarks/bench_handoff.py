"""Hand-off benchmark: ``KVHandoff.publish`` / ``fetch`` of a request's paged KV through the embedded store and
a real ``kvstore serve`` daemon (shm and tcp), against a memcpy of the same bytes measured in the same run.

    python -m benchmarks.bench_handoff [--blocks 1,16,64,256] [--layouts llama,mla] [--json PATH] [--plot PNG]
                                       [--no-mooncake]
    python -m benchmarks.bench_handoff --checksums [--blocks 16,64] [--paths ...] [--json PATH]

Geometry: Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bf16, block 16: 2 MiB a block) in vLLM's
flash-attention layout, and an MLA layout (DeepSeek-V3-like: 61 layers, latent 576, bf16, block 64). Block ids
are a random permutation of a cache twice the request's size. ``publish`` is timed to ``.wait()`` (committed);
``fetch`` includes the wait for the meta, the layout checks, checksum verification and the scatter. The memcpy
baseline copies the request's bytes once into a pre-faulted buffer (single thread); the target is publish >=
0.7x and fetch >= 0.8x of it, publish + fetch <= 2.5x one memcpy. ``copy path`` rows time the v1 method in the
same run (gather into a fresh tensor + ``batch_put``; ``batch_get_into`` + hash + scatter) for comparison.
When Mooncake Store is installed, its ``batch_put_from`` / ``batch_get_into`` of the same chunks over TCP is
measured in the same run (the anchor; ``--no-mooncake`` skips it). ``--checksums`` measures instead what the
chunk checksums cost: publish and fetch with the checksum fused into the gather/scatter, with a separate xxh3
pass (the fallback), and fetch with ``verify=False``, round-robin in one process beside a memcpy.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch
import xxhash

import kvstore
from benchmarks.baseline import memcpy
from benchmarks.common.daemon import Daemon
from benchmarks.common.machine import describe, machine
from benchmarks.common.timing import Timing, sample, timing_of
from kvstore import KVLayout, KVLayoutKind, ops
from kvstore.handoff import KVHandoff

LAYOUTS = {
    "llama": dict(kind=KVLayoutKind.VLLM_FLASH_NHD, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                  dtype=torch.bfloat16, model_id="llama-3-8b"),
    "mla": dict(kind=KVLayoutKind.MLA, num_layers=61, num_kv_heads=1, head_dim=576, block_size=64,
                dtype=torch.bfloat16, model_id="deepseek-v3"),
}


def _timed(fn, n: int, size: int, warmup: int = 2) -> Timing:
    return timing_of(size, sample(fn, n, warmup))


def _caches(layout: KVLayout, num_blocks: int, fill: bool, device: str) -> list[torch.Tensor]:
    shape = layout.cache_shape(num_blocks)
    if fill:
        return [torch.randn(shape, device=device).to(layout.dtype) for _ in range(layout.num_layers)]
    return [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]


def _v1_publish(store: kvstore.KVStore, layout: KVLayout, caches, ids: torch.Tensor, key: str) -> None:
    packed = torch.empty(ops.packed_shape(layout, len(ids)), dtype=layout.dtype, device=ids.device)
    ops.gather_pages(caches, ids, packed, layout=layout)
    packed = packed.cpu()
    raw = memoryview(packed.view(torch.uint8).reshape(-1).numpy())
    xxhash.xxh3_64_intdigest(raw)
    store.batch_put([(key, raw)])


def _v1_fetch(store: kvstore.KVStore, layout: KVLayout, caches, ids: torch.Tensor, key: str) -> None:
    packed = torch.empty(ops.packed_shape(layout, len(ids)), dtype=layout.dtype)
    store.batch_get_into([key], [packed])
    xxhash.xxh3_64_intdigest(memoryview(packed.view(torch.uint8).reshape(-1).numpy()))
    ops.scatter_pages(packed.to(ids.device), ids, caches, layout=layout)


def bench_one(store: kvstore.KVStore, path: str, layout: KVLayout, name: str, blocks: int, n: int,
              src, dst) -> list[dict]:
    gen = torch.Generator().manual_seed(blocks)
    device = src[0].device
    src_ids = torch.randperm(2 * blocks, generator=gen)[:blocks].to(device)
    dst_ids = torch.randperm(2 * blocks, generator=gen)[:blocks].to(device)
    handoff = KVHandoff(store, layout)
    nbytes = ops.packed_nbytes(layout, blocks)
    seq = iter(range(10**9))

    def publish() -> None:
        handoff.publish(f"bench-{next(seq)}", src, src_ids, num_tokens=blocks * layout.block_size).wait()

    def pub_fetch() -> None:
        rid = f"bench-{next(seq)}"
        handoff.publish(rid, src, src_ids, num_tokens=blocks * layout.block_size).wait()
        handoff.fetch(rid, dst, dst_ids, timeout=30)

    # fetch alone: publish outside the timer
    fetch_times = []
    for i in range(n + 2):
        rid = f"bench-f{i}"
        handoff.publish(rid, src, src_ids, num_tokens=blocks * layout.block_size).wait()
        t0 = time.perf_counter()
        handoff.fetch(rid, dst, dst_ids, timeout=30)
        if i >= 2:
            fetch_times.append(time.perf_counter() - t0)
    fetch = timing_of(nbytes, fetch_times)
    unverified = []
    for i in range(n + 2):
        rid = f"bench-u{i}"
        handoff.publish(rid, src, src_ids, num_tokens=blocks * layout.block_size).wait()
        t0 = time.perf_counter()
        handoff.fetch(rid, dst, dst_ids, timeout=30, verify=False)
        if i >= 2:
            unverified.append(time.perf_counter() - t0)
    ok = all(torch.equal(d[:, dst_ids] if layout.kind is not KVLayoutKind.MLA else d[dst_ids],
                         s[:, src_ids] if layout.kind is not KVLayoutKind.MLA else s[src_ids])
             for d, s in zip(dst[:2], src[:2], strict=True))
    if not ok:
        raise RuntimeError(f"{path} {name} {blocks}: fetched pages differ from the published ones")
    rows = {"publish": _timed(publish, n, nbytes), "fetch": fetch, "fetch, verify=False": timing_of(nbytes, unverified),
            "publish+fetch": _timed(pub_fetch, n, nbytes)}
    key = "bench/v1"
    rows["copy path: publish"] = _timed(lambda: _v1_publish(store, layout, src, src_ids, key), n, nbytes)
    rows["copy path: fetch"] = _timed(lambda: _v1_fetch(store, layout, dst, dst_ids, key), n, nbytes)
    store.remove(key)
    return [{"path": path, "layout": name, "blocks": blocks, "bytes": nbytes, "op": op, "p50_ms": t.p50_s * 1e3,
             "p99_ms": t.p99_s * 1e3, "gbps": t.gbps} for op, t in rows.items()]


@contextlib.contextmanager
def _stores(kinds: list[str], capacity: str):
    with contextlib.ExitStack() as stack:
        out = {}
        if "embedded" in kinds:
            out["embedded"] = stack.enter_context(kvstore.KVStore.embedded(capacity=capacity))
        if any(k.startswith("daemon") for k in kinds):
            d = stack.enter_context(Daemon(capacity=capacity, log_level="warning"))
            unix_url, tcp_url = d.unix_url, d.tcp_url
            if "daemon-shm" in kinds:
                out["daemon-shm"] = stack.enter_context(kvstore.connect(unix_url, transport="shm", timeout=60))
            if "daemon-tcp" in kinds:
                out["daemon-tcp"] = stack.enter_context(kvstore.connect(tcp_url, transport="tcp", timeout=60))
        yield out


def run(blocks: list[int], layouts: list[str], kinds: list[str], iters: int, device: str = "cpu",
        mooncake: bool = True) -> dict:
    torch.set_num_threads(1)
    rows, baselines = [], {}
    biggest = max(blocks)
    for name in layouts:
        layout = KVLayout(**LAYOUTS[name])
        capacity = f"{max(64, 4 * ops.packed_nbytes(layout, biggest) >> 20)}MiB"
        src, dst = _caches(layout, 2 * biggest, True, device), _caches(layout, 2 * biggest, False, device)
        for b in blocks:
            nbytes = ops.packed_nbytes(layout, b)
            baselines[f"{name}/{b}"] = memcpy(nbytes, n=max(5, iters)).as_dict()
        with _stores(kinds, capacity) as stores:
            for path, store in stores.items():
                for b in blocks:
                    n = max(3, min(iters, (2 << 30) // max(ops.packed_nbytes(layout, b), 1)))
                    for row in bench_one(store, path, layout, name, b, n, src, dst):
                        base = baselines[f"{name}/{b}"]
                        row["memcpy_gbps"] = base["gbps"]
                        row["x_memcpy"] = base["p50_us"] / 1e3 / row["p50_ms"]
                        rows.append(row)
    result = {"machine": describe(machine()), "rows": rows, "baselines": baselines}
    result["mooncake"] = mooncake_anchor(blocks, rows, baselines) if mooncake and "llama" in layouts \
        else {"available": False, "reason": "skipped" if not mooncake else "measured for the llama geometry only"}
    return result


def checksum_ab(blocks: list[int], kinds: list[str], iters: int) -> dict:
    """``--checksums``: the cost of the chunk checksums, fused into the gather/scatter or as a separate xxh3 pass
    (``KVSTORE_NO_FUSED_HASH=1``, the code's own fallback), and of ``verify`` at all, per transport. The variants
    run round-robin in one process with a memcpy of the same bytes in every round, so each sees the same load."""
    import os

    import numpy as np

    torch.set_num_threads(1)
    layout = KVLayout(**LAYOUTS["llama"])
    biggest = max(blocks)
    src, dst = _caches(layout, 2 * biggest, True, "cpu"), _caches(layout, 2 * biggest, False, "cpu")
    capacity = f"{max(64, 4 * ops.packed_nbytes(layout, biggest) >> 20)}MiB"
    rows = []

    def separate(on: bool) -> None:
        if on:
            os.environ["KVSTORE_NO_FUSED_HASH"] = "1"
        else:
            os.environ.pop("KVSTORE_NO_FUSED_HASH", None)

    with _stores(kinds, capacity) as stores:
        for path, store in stores.items():
            for b in blocks:
                gen = torch.Generator().manual_seed(b)
                src_ids = torch.randperm(2 * b, generator=gen)[:b]
                dst_ids = torch.randperm(2 * b, generator=gen)[:b]
                handoff = KVHandoff(store, layout)
                nbytes = ops.packed_nbytes(layout, b)
                m_src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
                m_dst = np.ones(nbytes, dtype=np.uint8)
                times: dict[str, list[float]] = {}
                n = max(3, min(iters, (2 << 30) // nbytes))
                for i in range(n + 1):  # round 0 warms up
                    t0 = time.perf_counter()
                    m_dst[:] = m_src
                    record = {"memcpy": time.perf_counter() - t0}
                    for variant, sep, verify in (("fused", False, True), ("separate pass", True, True),
                                                 ("verify=False", False, False)):
                        separate(sep)
                        rid = f"ab-{path}-{b}-{i}-{variant}"
                        t0 = time.perf_counter()
                        handoff.publish(rid, src, src_ids, num_tokens=b * layout.block_size).wait()
                        t1 = time.perf_counter()
                        handoff.fetch(rid, dst, dst_ids, timeout=30, verify=verify)
                        t2 = time.perf_counter()
                        if variant != "verify=False":
                            record[f"publish, {variant}"] = t1 - t0
                        record[f"fetch, {variant}"] = t2 - t1
                    separate(False)
                    if i:
                        for k, v in record.items():
                            times.setdefault(k, []).append(v)
                base = timing_of(nbytes, times.pop("memcpy"))
                for op, ts in times.items():
                    t = timing_of(nbytes, ts)
                    rows.append({"path": path, "blocks": b, "bytes": nbytes, "op": op, "p50_ms": t.p50_s * 1e3,
                                 "gbps": t.gbps, "memcpy_gbps": base.gbps, "x_memcpy": base.p50_s / t.p50_s})
    return {"machine": describe(machine()), "fused": ops.fused_checksums() or "yes", "rows": rows}


def print_checksum_ab(result: dict) -> None:
    print(f"# hand-off checksum cost, round-robin in one process — {result['machine']}; fused: {result['fused']}")
    print(f"{'path':<11} {'blocks':>6} {'MiB':>5} {'op':<24} {'p50 ms':>8} {'GB/s':>6} {'memcpy':>7} {'x memcpy':>8}")
    for r in result["rows"]:
        print(f"{r['path']:<11} {r['blocks']:>6} {r['bytes'] / 2**20:>5.0f} {r['op']:<24} {r['p50_ms']:>8.2f} "
              f"{r['gbps']:>6.2f} {r['memcpy_gbps']:>7.2f} {r['x_memcpy']:>8.2f}")


def mooncake_anchor(blocks: list[int], rows: list[dict], baselines: dict) -> dict:
    """Mooncake Store in the same run: ``batch_put_from`` / ``batch_get_into`` over its TCP transport of the
    chunks a Llama-3-8B hand-off of each size stores (the same chunk split), from / into one registered buffer.
    Mooncake moves already-packed chunks: it does no gather, scatter or checksum, which kvstore's rows include."""
    from benchmarks import mooncake_baseline

    result = mooncake_baseline.measure_handoff_batches(blocks)
    if not result["available"]:
        return {"available": False, "reason": result["reason"]}
    out = []
    for r in result["rows"]:
        op = {"batch_put_from": "publish", "batch_get_into": "fetch"}.get(r["op"])
        if op is None:
            continue
        base = baselines[f"llama/{r['blocks']}"]
        row = {"path": "mooncake+tcp", "layout": "llama", "blocks": r["blocks"], "bytes": r["size"],
               "op": f"{op} ({r['op']})", "p50_ms": r["p50_us"] / 1e3, "p99_ms": r["p99_us"] / 1e3,
               "gbps": r["gbps"], "memcpy_gbps": base["gbps"], "x_memcpy": base["p50_us"] / r["p50_us"]}
        for path in ("daemon-tcp", "daemon-shm"):
            ours = next((x for x in rows if (x["path"], x["layout"], x["blocks"], x["op"]) ==
                         (path, "llama", r["blocks"], op)), None)
            if ours is not None:
                row[f"speedup_{path}"] = row["p50_ms"] / ours["p50_ms"]
        out.append(row)
    return {"available": True, "rows": out, "package": result.get("package")}


def print_table(result: dict) -> None:
    print(f"# kvstore hand-off benchmark — {result['machine']}")
    print(f"{'path':<11} {'layout':<6} {'blocks':>6} {'MiB':>6} {'op':<20} {'p50 ms':>8} {'p99 ms':>8} {'GB/s':>6} "
          f"{'memcpy':>7} {'x memcpy':>8}")
    for r in result["rows"]:
        ratio = r["x_memcpy"] if r["op"] != "publish+fetch" else r["p50_ms"] / (r["bytes"] / r["memcpy_gbps"] / 1e6)
        label = "x memcpy" if r["op"] != "publish+fetch" else "/memcpy"
        print(f"{r['path']:<11} {r['layout']:<6} {r['blocks']:>6} {r['bytes'] / 2**20:>6.0f} {r['op']:<20} "
              f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['gbps']:>6.2f} {r['memcpy_gbps']:>7.2f} "
              f"{ratio:>7.2f}{'' if label == 'x memcpy' else ' t'}")
    print("# x memcpy: memcpy time / op time (higher is better); for publish+fetch 't' marks op time / one memcpy")
    mc = result.get("mooncake", {"available": False, "reason": "not measured"})
    if not mc["available"]:
        print(f"# Mooncake Store: not measured ({mc['reason']})")
        return
    print("# Mooncake Store over TCP, same run: batch_put_from / batch_get_into of the same chunks (packed already:"
          " no gather, scatter or checksum)")
    for r in mc["rows"]:
        speedups = "  ".join(f"kvstore {p[8:]} {r[p]:.1f}x faster" for p in ("speedup_daemon-tcp", "speedup_daemon-shm")
                             if p in r)
        print(f"{r['path']:<12} {r['blocks']:>6} {r['bytes'] / 2**20:>6.0f} {r['op']:<26} {r['p50_ms']:>8.2f} "
              f"{r['p99_ms']:>8.2f} {r['gbps']:>6.2f} {r['x_memcpy']:>7.2f}  {speedups}")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (p, lay, op) in sorted({(r["path"], r["layout"], r["op"]) for r in result["rows"]}):
        if op not in ("publish", "fetch"):
            continue
        pts = sorted((r["bytes"], r["gbps"]) for r in result["rows"]
                     if (r["path"], r["layout"], r["op"]) == (p, lay, op))
        ax.plot([x / 2**20 for x, _ in pts], [y for _, y in pts], marker="o", label=f"{p} {lay} {op}")
    base = sorted((int(k.split("/")[1]), v) for k, v in result["baselines"].items() if k.startswith("llama/"))
    if base:
        rows = {r["blocks"]: r["bytes"] for r in result["rows"] if r["layout"] == "llama"}
        ax.plot([rows[b] / 2**20 for b, _ in base], [v["gbps"] for _, v in base], "k--", label="memcpy (llama)")
    ax.set_xscale("log")
    ax.set_xlabel("request KV (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"kvstore hand-off — {result['machine']}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default="1,16,64,256", help="comma-separated block counts (default %(default)s)")
    parser.add_argument("--layouts", default="llama,mla", help="llama, mla (default %(default)s)")
    parser.add_argument("--paths", default="embedded,daemon-shm,daemon-tcp", help="default %(default)s")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations at most (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="where the caches live: cpu or cuda (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="PNG", help="also plot GB/s against size with the memcpy line")
    parser.add_argument("--no-mooncake", action="store_true", help="do not measure Mooncake Store (the anchor)")
    parser.add_argument("--checksums", action="store_true", help="instead: the cost of fused vs separate checksums "
                        "and of verify, per path (llama, CPU caches; round-robin)")
    args = parser.parse_args(argv)
    if args.checksums:
        result = checksum_ab([int(b) for b in args.blocks.split(",")], args.paths.split(","), args.iters)
        print_checksum_ab(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return 0
    unknown = set(args.layouts.split(",")) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}; known: {sorted(LAYOUTS)}")
    result = run([int(b) for b in args.blocks.split(",")], args.layouts.split(","), args.paths.split(","), args.iters,
                 args.device, mooncake=not args.no_mooncake)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
