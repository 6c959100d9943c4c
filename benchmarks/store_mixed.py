"""The mixed workload of ``bench_store --workload mixed``: how full a daemon gets before it first evicts or
refuses a put, under KV-like traffic that leaves the free space in pieces.

Four client processes (shm transport) each put values, half of a few fixed chunk sizes (32 KiB, 128 KiB,
512 KiB, 2 MiB: KV chunks of a few layouts) and half log-uniform between 1 KiB and 8 MiB, and remove one of
their own objects at random about as often as they put (requests ending), so the store fills slowly while
objects come and go everywhere. The daemon runs with both watermarks at 1.0: it evicts only when a put finds
no room, so the fill at the first eviction is the allocator's (and relocation's) doing, not the watermark's.
The daemon records that fill itself (``fill_at_first_eviction`` / ``fill_at_first_refusal`` in its stats).
After the first eviction the clients go on for a while; the steady state is sampled from the stats: fill,
fragmentation, bytes relocated per byte put. Each run is a fresh daemon and its own seed; the same seeds run
against a daemon started with ``--no-relocate`` as the in-run baseline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np

import kvstore
from benchmarks.common.daemon import Daemon
from kvstore.workloads.stats import percentile

KiB, MiB = 1 << 10, 1 << 20
FIXED_SIZES = (32 * KiB, 128 * KiB, 512 * KiB, 2 * MiB)
REMOVE_P = 0.49
CLIENTS = 4


def sizes(rng: np.random.Generator, n: int, largest: int) -> np.ndarray:
    fixed = rng.choice(np.array([s for s in FIXED_SIZES if s <= largest]), n)
    spread = (2.0 ** rng.uniform(10, np.log2(largest), n)).astype(np.int64)
    return np.where(rng.random(n) < 0.5, fixed, spread)


def client(url: str, seed: int, largest: int, stop, counts) -> None:
    """One client process: put and remove its own keys until ``stop`` is set."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, largest, dtype=np.uint8)
    mine: list[str] = []
    put_bytes = refused = n = 0
    with kvstore.connect(url, transport="shm") as store:
        while not stop.is_set():
            batch = sizes(rng, 256, largest)
            for size in batch:
                if mine and rng.random() < REMOVE_P:
                    store.remove(mine.pop(int(rng.integers(len(mine)))))
                    continue
                key = f"c{seed}/{n}"
                n += 1
                try:
                    store.put(key, data[:int(size)])
                except kvstore.StoreFullError:
                    refused += 1
                    continue
                mine.append(key)
                put_bytes += int(size)
    counts.put((put_bytes, refused))


def one_run(seed: int, capacity: str, largest: int, relocate: bool, steady_s: float) -> dict:
    args = ["--high-watermark", "1.0", "--low-watermark", "1.0"] + ([] if relocate else ["--no-relocate"])
    ctx = mp.get_context("spawn")
    with Daemon(capacity=capacity, args=args, log_level="warning") as d, kvstore.connect(d.unix_url) as probe:
        stop, counts = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=client, args=(d.unix_url, seed * 100 + i, largest, stop, counts))
                 for i in range(CLIENTS)]
        for p in procs:
            p.start()
        t0 = time.monotonic()
        first, samples = None, []
        deadline = t0 + 600
        while time.monotonic() < deadline:
            time.sleep(0.05)
            s = probe.stats()
            if first is None and (s["evictions"] or s["refusals"]):
                first = time.monotonic()
            if first is not None:
                samples.append((s["used_bytes"] / s["capacity_bytes"], s["fragmentation"]))
                if time.monotonic() - first >= steady_s:
                    break
        stop.set()
        totals = [counts.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        s = probe.stats()
    fills = [f for f in (s["fill_at_first_eviction"], s["fill_at_first_refusal"]) if f is not None]
    put_bytes = sum(t[0] for t in totals)
    return {"seed": seed, "relocate": relocate, "first_fill": min(fills) if fills else None,
            "to_first_s": None if first is None else first - t0,
            "steady_fill_p50": percentile([f for f, _ in samples], 50) if samples else None,
            "steady_fragmentation_p50": percentile([g for _, g in samples], 50) if samples else None,
            "evictions": s["evictions"], "refusals": s["refusals"], "client_refusals": sum(t[1] for t in totals),
            "relocations": s["relocations"], "relocated_per_put_byte": s["relocated_bytes"] / max(put_bytes, 1),
            "put_bytes": put_bytes}


def run(runs: int = 5, capacity: str = "256MiB", largest: int = 8 * MiB, steady_s: float = 3.0) -> dict:
    rows = [one_run(seed, capacity, largest, relocate, steady_s)
            for seed in range(1, runs + 1) for relocate in (True, False)]
    summary = {}
    for relocate in (True, False):
        mine = [r for r in rows if r["relocate"] is relocate]
        firsts = [r["first_fill"] for r in mine if r["first_fill"] is not None]
        steady = [r["steady_fill_p50"] for r in mine if r["steady_fill_p50"] is not None]
        frag = [r["steady_fragmentation_p50"] for r in mine if r["steady_fragmentation_p50"] is not None]
        summary["relocate" if relocate else "no-relocate"] = {
            "first_fill": {f"p{p}": percentile(firsts, p) for p in (10, 50, 90)} if firsts else None,
            "steady_fill_p50": percentile(steady, 50) if steady else None,
            "steady_fragmentation_p50": percentile(frag, 50) if frag else None,
            "relocated_per_put_byte_p50": percentile([r["relocated_per_put_byte"] for r in mine], 50),
            "refusals": sum(r["refusals"] for r in mine)}
    return {"capacity": capacity, "largest": largest, "runs": runs, "cpus": os.cpu_count(), "rows": rows,
            "summary": summary}


def print_table(result: dict, machine: str) -> None:
    print(f"# kvstore mixed workload — {machine}; {result['capacity']} daemon, {CLIENTS} clients, 1 KiB–"
          f"{result['largest'] >> 20} MiB + fixed chunks, {result['runs']} runs each")
    print(f"{'daemon':<12} {'first fill p10':>14} {'p50':>6} {'p90':>6} {'steady fill':>11} {'steady frag':>11} "
          f"{'moved/put B':>11} {'refusals':>8}")
    for name, s in result["summary"].items():
        ff = s["first_fill"] or {"p10": float("nan"), "p50": float("nan"), "p90": float("nan")}
        nan = float("nan")
        print(f"{name:<12} {ff['p10']:>14.3f} {ff['p50']:>6.3f} {ff['p90']:>6.3f} {s['steady_fill_p50'] or nan:>11.3f} "
              f"{s['steady_fragmentation_p50'] or nan:>11.3f} {s['relocated_per_put_byte_p50']:>11.3f} "
              f"{s['refusals']:>8}")
    base, ours = result["summary"]["no-relocate"]["first_fill"], result["summary"]["relocate"]["first_fill"]
    if base and ours:
        print(f"# first-eviction fill p50: {ours['p50']:.3f} with relocation vs {base['p50']:.3f} without "
              f"(x{ours['p50'] / base['p50']:.2f})")
