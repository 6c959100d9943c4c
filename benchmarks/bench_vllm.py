"""kvstore inside vLLM (CPU): time to first token on a prefix hit vs recomputing it, the connector's cost
on a miss, the decode stall of running streams while long prompts' KV arrives, and the connector's load/save
bandwidth against a memcpy of the same bytes, all in one run.

    python -m benchmarks.bench_vllm                       # random Llama with Llama-3-8B's KV shape, 1k/4k prompts
    python -m benchmarks.bench_vllm --geometry tiny --tokens 1024,8192 --repeats 9 --json out.json
    python -m benchmarks.bench_vllm --anchors nixl --variants ''   # only the P->D hand-off, kvstore vs NIXL

The default model has Llama-3-8B's KV geometry per layer (8 KV heads x 128, bf16) and 8 layers, so a 128-token
block is 4 MiB, with thin other weights (random, built offline).

Variants, each a fresh single-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) in its own process, on
the same prompts (fixed seed): ``none`` (no connector), ``kvstore`` (KVStoreConnector, kv_both, a
``kvstore serve`` daemon started for the run) and ``example`` (vLLM's ExampleConnector, its disk-backed
reference, under a temporary directory), an in-run anchor.

In-run anchors (``--anchors``, default ``all``; ``pip install -e ".[peers]"`` and ``apt-get install -y
libibverbs1`` for the last two; an anchor whose package is missing is skipped, its reason printed):
``example`` above, and the prefill -> decode hand-off (``benchmarks.vllm_handoff``: a producer engine and a
consumer engine a connector, one after the other) of kvstore's connector (``kv_producer`` / ``kv_consumer``
on the run's daemon) against ``nixl`` (vLLM's NixlConnector on the CPU platform: ``kv_buffer_device: cpu``,
the UCX backend, side channels on free loopback ports; the consumer pulls the blocks the producer holds for
it) and ``mooncake`` (vLLM's MooncakeStoreConnector with ``mooncake-transfer-engine-non-cuda`` 0.3.13.post1
on a ``mooncake_master`` started for the run: TCP transport, 1 GB embedded segments; it runs on the CPU
build). Each round times the consumer recomputing a fresh prompt, the producer's prefill and the consumer's
hit (the same prompt with the producer's ``kv_transfer_params``); "kvstore hit x" is kvstore's hit median
over the anchor's, both from the same run (not interleaved: one pair of engines at a time). kvstore's
consumer waits (bounded) for saves still in flight as part of its hit; MooncakeStoreConnector has no such
signal (a decode request finds what has landed), so its producer is stepped until its saves are done,
untimed, before the consumer's request. ``cached`` is the fewest tokens any hit did not compute (0: a hand-off
that fell back to recomputing).

TTFT is the wall time of ``generate`` of one prompt with ``max_tokens=1``. A miss is a prompt never seen
(for the connectors it includes the lookup and saving every full block; kvstore's kv_both saves are
asynchronous and drained, untimed, before the next prompt); a hit is the same prompt again after
``reset_prefix_cache()``, so vLLM's own cache is empty and every full block but the last token's comes from
the connector. "paused" is the kvstore engine with its connector paused (no lookup, no save), run just
before each miss: "miss x paused" is the median of those paired ratios, the connector's cost on a miss
measured in one engine. No chunked prefill (``max_num_batched_tokens`` covers the longest prompt):
ExampleConnector saves only a prompt's first chunk. Load/save GB/s are the connector's own ``BlockIO``
moving the blocks of the longest prompt through the daemon, against ``torch`` copying the same number of
bytes, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common.daemon import Daemon
from benchmarks.common.machine import describe, machine
from benchmarks.vllm_handoff import missing_package, run_handoff
from kvstore.workloads.stats import median, percentile

DEFAULT_TOKENS = "1024,4096"
VARIANTS = ("none", "kvstore", "example")
# in-run anchors: vLLM's ExampleConnector beside the single-engine variants; NixlConnector and
# MooncakeStoreConnector against kvstore's connector in the prefill -> decode hand-off
ANCHORS = ("example", "nixl", "mooncake")
HANDOFF_ANCHORS = ("nixl", "mooncake")


def parse_anchors(text: str) -> list[str]:
    """``--anchors``: ``all``, ``none`` or a comma-separated subset of :data:`ANCHORS`, in that order."""
    names = {t.strip() for t in text.split(",") if t.strip()}
    if names == {"all"}:
        return list(ANCHORS)
    if names <= {"none"}:
        return []
    unknown = sorted(names - set(ANCHORS))
    if unknown:
        raise ValueError(f"unknown anchor(s) {', '.join(unknown)}: choose from all, none, {', '.join(ANCHORS)}")
    return [a for a in ANCHORS if a in names]


def plan_runs(variants: list[str], anchors: list[str], missing=None) -> tuple[list[str], list[str], dict[str, str]]:
    """Which single-engine variants and which hand-off connectors run, and why each skipped anchor is skipped.

    ``example`` runs among the variants only when it is an anchor; the hand-off runs kvstore against each
    hand-off anchor whose package is installed (``missing(name)`` says why one is not), and not at all when
    none of them can run."""
    missing = missing or missing_package
    single = [v for v in variants if v != "example" or "example" in anchors]
    skipped = {a: why for a in anchors if a in HANDOFF_ANCHORS and (why := missing(a))}
    handoff = [a for a in anchors if a in HANDOFF_ANCHORS and a not in skipped]
    return single, (["kvstore", *handoff] if handoff else []), skipped


def summary(values: list[float]) -> dict:
    if not values:
        return {"median": float("nan"), "p99": float("nan"), "n": 0}
    return {"median": median(values), "p99": percentile(values, 99), "n": len(values)}


# ---- one engine (a child process) ------------------------------------------------------------------------
def transfer_config(variant: str, url: str, workdir: str):
    from vllm.config import KVTransferConfig

    if variant == "kvstore":
        return KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
                                kv_role="kv_both", kv_connector_extra_config={"url": url})
    if variant == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                kv_connector_extra_config={"shared_storage_path": os.path.join(workdir, "example")})
    return None


def time_prompt(llm, params, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start


def engine_main(args) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    lengths = [int(t) for t in args.tokens.split(",")]
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, kv_cache_memory_bytes=args.kv_bytes,
              max_model_len=max(lengths) + 16, enforce_eager=True,
              # no chunked prefill: ExampleConnector saves only the first chunk of a prompt
              max_num_batched_tokens=max(lengths) + 16, enable_prefix_caching=True, seed=0,
              kv_transfer_config=transfer_config(args.worker, args.url, args.workdir))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(args.seed)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
    for _ in range(2):  # warm-up: first-call allocations, lazy imports, the connector's first connection
        time_prompt(llm, params, prompt(256))
        llm.reset_prefix_cache()
    samples: dict[str, dict[str, list[float]]] = {str(n): {"miss": [], "hit": [], "off": []} for n in lengths}
    for _ in range(args.repeats):
        for n in lengths:
            if args.worker == "kvstore":  # the same engine with the connector paused: no lookup, no save
                pause(True)
                samples[str(n)]["off"].append(time_prompt(llm, params, prompt(n)))
                wait_for_saves(llm)
                llm.reset_prefix_cache()
                pause(False)
            p = prompt(n)
            samples[str(n)]["miss"].append(time_prompt(llm, params, p))
            wait_for_saves(llm)  # asynchronous saves land before the hit (untimed)
            llm.reset_prefix_cache()
            if args.worker != "none":
                samples[str(n)]["hit"].append(time_prompt(llm, params, p))
                llm.reset_prefix_cache()
    out = {"variant": args.worker, "ttft": samples, "stall": stall_bench(llm, args, prompt, max(lengths))}
    if args.worker == "kvstore":
        out["io"] = io_bench(max(lengths), args.repeats)
        out["counters"] = connector_counters()
    with open(args.out, "w") as f:
        json.dump(out, f)


def stall_bench(llm, args, prompt, tokens: int) -> dict:
    """Running streams' TPOT while ``args.arrivals`` prompts of ``tokens`` tokens arrive (store hits for a
    connector, computed without one), vs without arrivals. kvstore: with asynchronous loads, then synchronous."""
    from benchmarks.vllm_stall import decode_stall

    arrivals = [prompt(tokens) for _ in range(args.arrivals)]
    if args.worker != "none":  # put the arrivals in the connector's store first
        from vllm import SamplingParams

        for p in arrivals:  # one at a time: each prefill in one chunk (ExampleConnector saves only the first)
            llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
        wait_for_saves(llm)

    def fresh() -> None:
        wait_for_saves(llm)
        llm.reset_prefix_cache()

    out = {"async" if args.worker == "kvstore" else "default": decode_stall(llm, prompt, arrivals, args.repeats,
                                                                            before_round=fresh)}
    if args.worker == "kvstore":
        set_async_loads(False)
        out["sync"] = decode_stall(llm, prompt, arrivals, args.repeats, before_round=fresh)
        set_async_loads(True)
    return out


def set_async_loads(enabled: bool) -> None:
    import dataclasses

    from kvstore.integrations.vllm import live_connectors

    for conn in live_connectors():
        if conn._scheduler is not None:  # the workers follow the metadata's flag
            conn._scheduler.config = dataclasses.replace(conn._scheduler.config, async_loads=enabled)


def pause(paused: bool) -> None:
    from kvstore.integrations.vllm import live_connectors

    for conn in live_connectors():
        conn.pause(paused)


def wait_for_saves(llm=None) -> None:
    """Every queued save in the store; with ``llm``, also vLLM's blocks held for them freed (an idle offline
    engine takes no step by itself, and ``reset_prefix_cache`` refuses while blocks are held)."""
    from kvstore.integrations.vllm import live_connectors

    for conn in live_connectors():
        conn.wait_for_saves(60.0)
    for _ in range(100):
        if llm is None or not any(c.has_pending_push_work() for c in live_connectors()):
            return
        llm.llm_engine.step()  # no request scheduled: the workers' get_finished reports the held requests


def connector_counters() -> dict:
    from kvstore.integrations.vllm import live_connectors

    total: dict = {}
    for conn in live_connectors():
        for k, v in conn.counters.as_dict().items():
            total[k] = total.get(k, 0) + v
    return total


def io_bench(tokens: int, repeats: int) -> dict:
    """The worker's BlockIO saving and loading the blocks of ``tokens`` tokens vs torch memcpy, interleaved."""
    import torch

    from kvstore.integrations.vllm import live_connectors

    (worker,) = [c._worker for c in live_connectors() if c._worker is not None]
    store, io = worker.link.client(), worker.io
    n = max(1, tokens // io.layout.block_size)
    items = [(f"bench-vllm/{os.getpid()}/{i}", i) for i in range(n)]
    nbytes = n * io.layout.block_nbytes
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.copy_(src)
    times: dict[str, list[float]] = {"save": [], "load": [], "memcpy": [], "round_trip": []}
    for _ in range(max(5, repeats)):
        t0 = time.perf_counter()
        io.save(store, items)
        t1 = time.perf_counter()
        result = io.load(store, items)
        t2 = time.perf_counter()
        dst.copy_(src)
        t3 = time.perf_counter()
        store.exists(items[0][0])
        t4 = time.perf_counter()
        if result.failed_blocks:
            raise RuntimeError(f"benchmark load failed for blocks {result.failed_blocks}")
        for name, dt in zip(("save", "load", "memcpy", "round_trip"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3),
                            strict=True):
            times[name].append(dt)
    for key, _ in items:
        store.remove(key)
    return {"blocks": n, "bytes": nbytes, "times": times}


# ---- the driver ------------------------------------------------------------------------------------------
def run_variant(variant: str, args, url: str, workdir: str) -> dict:
    out = os.path.join(workdir, f"{variant}.json")
    cmd = [sys.executable, "-m", "benchmarks.bench_vllm", "--worker", variant, "--out", out, "--url", url,
           "--workdir", workdir, "--model", args.model, "--tokens", args.tokens, "--repeats", str(args.repeats),
           "--dtype", args.dtype, "--kv-bytes", str(args.kv_bytes), "--seed", str(args.seed),
           "--arrivals", str(args.arrivals)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"[{variant}] failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {"variant": variant, "error": proc.stderr[-3000:]}
    with open(out) as f:
        return json.load(f)


def table(results: dict[str, dict], lengths: list[str]) -> tuple[list[dict], dict]:
    rows = []
    none = results.get("none", {}).get("ttft", {})
    for n in lengths:
        base = summary(none.get(n, {}).get("miss", []))
        rows.append({"tokens": int(n), "variant": "none", "case": "recompute", **_ms(base), "vs_recompute": 1.0})
        for variant in ("kvstore", "example"):
            ttft = results.get(variant, {}).get("ttft", {}).get(n)
            if not ttft:
                continue
            off = summary(ttft.get("off", []))
            if off["n"]:  # the miss overhead against the same engine with the connector paused, interleaved
                rows.append({"tokens": int(n), "variant": variant, "case": "paused", **_ms(off),
                             "vs_recompute": off["median"] / base["median"] if base["n"] else float("nan")})
            for case in ("miss", "hit"):
                s = summary(ttft[case])
                row = {"tokens": int(n), "variant": variant, "case": case, **_ms(s),
                       "vs_recompute": s["median"] / base["median"] if base["n"] else float("nan")}
                if off["n"] and case == "miss":
                    row["miss_vs_paused"] = _paired_ratio(ttft["miss"], ttft["off"])
                rows.append(row)
    io = results.get("kvstore", {}).get("io")
    bandwidth = {}
    if io:
        for name in ("save", "load", "memcpy"):
            s = summary(io["times"][name])
            bandwidth[name] = {"GBps": io["bytes"] / s["median"] / 1e9, "median_ms": s["median"] * 1e3,
                               "p99_ms": s["p99"] * 1e3}
        rtt = statistics.median(io["times"]["round_trip"])
        bandwidth["round_trip_us"] = rtt * 1e6
        bandwidth["bytes"] = io["bytes"]
        bandwidth["load_vs_memcpy_plus_rtt"] = (bandwidth["load"]["median_ms"] / 1e3
                                                / (bandwidth["memcpy"]["median_ms"] / 1e3 + rtt))
    return rows, bandwidth


def stall_table(results: dict[str, dict]) -> list[dict]:
    """TPOT of the running streams, quiet vs during arrivals, per variant (and kvstore's load mode)."""
    rows = []
    for variant in VARIANTS:
        for mode, gaps in results.get(variant, {}).get("stall", {}).items():
            quiet, busy = summary(gaps["quiet"]), summary(gaps["arrivals"])
            rows.append({"variant": variant, "loads": mode, "quiet_p50_ms": quiet["median"] * 1e3,
                         "quiet_p99_ms": quiet["p99"] * 1e3, "arrivals_p50_ms": busy["median"] * 1e3,
                         "arrivals_p99_ms": busy["p99"] * 1e3, "p99_ratio": busy["p99"] / quiet["p99"],
                         "n": busy["n"]})
    return rows


def handoff_table(results: dict[str, dict], lengths: list[str]) -> list[dict]:
    """Per prompt length and connector: the decode side's recompute, the prefill, the hand-off's hit TTFT
    (p50 / p99), hit x recompute, the tokens the decode side did not compute, and kvstore's hit over this
    connector's (medians of the same run)."""
    rows = []
    kvs = results.get("kvstore", {}).get("samples", {})
    for n in lengths:
        for connector, res in results.items():
            if "error" in res:
                rows.append({"tokens": int(n), "connector": connector, "error": res["error"].splitlines()[-1:]})
                continue
            s = res["samples"][n]
            rec, pre, hit = summary(s["recompute"]), summary(s["prefill"]), summary(s["hit"])
            row = {"tokens": int(n), "connector": connector, "recompute_ms": rec["median"] * 1e3,
                   "prefill_ms": pre["median"] * 1e3, "hit_ms": hit["median"] * 1e3, "hit_p99_ms": hit["p99"] * 1e3,
                   "hit_vs_recompute": hit["median"] / rec["median"], "cached": min(s["cached"]), "n": hit["n"]}
            if connector != "kvstore" and kvs.get(n, {}).get("hit"):
                row["kvstore_hit_vs_this"] = median(kvs[n]["hit"]) / hit["median"]
            rows.append(row)
    return rows


def print_handoff(rows: list[dict], skipped: dict[str, str]) -> None:
    print("\nprefill -> decode hand-off: TTFT on the decode instance (ms), two engines a connector")
    print(f"{'tokens':>7} {'connector':<9} {'recompute':>10} {'prefill':>9} {'hit p50':>9} {'p99':>8} "
          f"{'x recompute':>12} {'cached':>7} {'kvstore hit x':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['tokens']:>7} {r['connector']:<9} failed: {' '.join(r['error'])}")
            continue
        vs = f"{r['kvstore_hit_vs_this']:>14.2f}" if "kvstore_hit_vs_this" in r else ""
        print(f"{r['tokens']:>7} {r['connector']:<9} {r['recompute_ms']:>10.1f} {r['prefill_ms']:>9.1f} "
              f"{r['hit_ms']:>9.1f} {r['hit_p99_ms']:>8.1f} {r['hit_vs_recompute']:>12.2f} {r['cached']:>7} {vs}")
    for name, why in skipped.items():
        print(f"  {name}: skipped, {why}")


def print_stall(rows: list[dict], arrivals: int, tokens: int) -> None:
    print(f"\ndecode stall: TPOT of 4 running streams, quiet vs while {arrivals} prompts of {tokens} tokens arrive")
    print(f"{'variant':<8} {'loads':<8} {'quiet p50':>10} {'p99':>8} {'arrivals p50':>13} {'p99':>8} {'p99 ratio':>10}")
    for r in rows:
        print(f"{r['variant']:<8} {r['loads']:<8} {r['quiet_p50_ms']:>10.1f} {r['quiet_p99_ms']:>8.1f} "
              f"{r['arrivals_p50_ms']:>13.1f} {r['arrivals_p99_ms']:>8.1f} {r['p99_ratio']:>10.2f}")


def _paired_ratio(a: list[float], b: list[float]) -> float:
    """Median of per-repeat ratios a[i] / b[i] (each pair ran back to back, under the same load)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _ms(s: dict) -> dict:
    return {"median_ms": s["median"] * 1e3, "p99_ms": s["p99"] * 1e3, "n": s["n"]}


def print_table(rows: list[dict], bandwidth: dict, header: str) -> None:
    print(header)
    print(f"{'tokens':>7} {'variant':<8} {'case':<10} {'TTFT p50 ms':>12} {'p99 ms':>9} {'x recompute':>12} "
          f"{'miss x paused':>14}")
    for r in rows:
        paired = f"{r['miss_vs_paused']:>14.3f}" if "miss_vs_paused" in r else ""
        print(f"{r['tokens']:>7} {r['variant']:<8} {r['case']:<10} {r['median_ms']:>12.1f} {r['p99_ms']:>9.1f} "
              f"{r['vs_recompute']:>12.2f} {paired}")
    if bandwidth:
        mib = bandwidth["bytes"] / (1 << 20)
        print(f"\nblock I/O through the daemon, {mib:.1f} MiB (the longest prompt's blocks), interleaved:")
        for name in ("save", "load", "memcpy"):
            b = bandwidth[name]
            print(f"  {name:<7} {b['GBps']:>6.2f} GB/s   p50 {b['median_ms']:>7.2f} ms   p99 {b['p99_ms']:>7.2f} ms")
        print(f"  round trip {bandwidth['round_trip_us']:.0f} us; load / (memcpy + 1 round trip) = "
              f"{bandwidth['load_vs_memcpy_plus_rtt']:.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="a local model directory (default: the tiny random Llama)")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="prompt lengths, comma separated")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="single-engine variants (none, kvstore, example; '' for none of them)")
    p.add_argument("--anchors", default="all",
                   help="in-run anchors: all, none, or a comma-separated subset of example,nixl,mooncake "
                        "(an anchor whose package is missing is skipped with the reason)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-bytes", type=int, default=1 << 30, help="vLLM's KV cache size (bytes)")
    p.add_argument("--capacity", default="3GiB", help="the daemon's capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--geometry", choices=("realistic", "tiny"), default="realistic",
                   help="random-weight model: Llama-3-8B's KV shape (8 KV heads x 128, 8 layers: 4 MiB bf16 "
                        "blocks) or the 2-layer test model (128 KiB blocks)")
    p.add_argument("--arrivals", type=int, default=2, help="long prompts arriving during the decode-stall run")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    p.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        engine_main(args)
        return 0
    try:
        anchors = parse_anchors(args.anchors)
    except ValueError as e:
        p.error(str(e))
    variants, handoff, skipped = plan_runs([v for v in args.variants.split(",") if v], anchors)
    for name, why in skipped.items():
        print(f"[anchor {name}] skipped: {why}", file=sys.stderr)
    workdir = tempfile.mkdtemp(prefix="kvs-bench-vllm-", dir="/tmp")
    if not args.model:
        from kvstore.integrations.vllm.tiny_model import KV_REALISTIC_CONFIG, TINY_CONFIG, build_tiny_llama

        config = KV_REALISTIC_CONFIG if args.geometry == "realistic" else TINY_CONFIG
        args.model = build_tiny_llama(os.path.join(tempfile.gettempdir(), f"kvstore-{args.geometry}-llama"),
                                      config=config)
    lengths = args.tokens.split(",")
    load_at_start = loadavg()
    daemon = Daemon(workdir, capacity=args.capacity, tcp=False).start()
    try:
        results = {v: run_variant(v, args, daemon.unix_url, workdir) for v in variants}
        handoff_results = {c: run_handoff(c, model=args.model, lengths=[int(n) for n in lengths],
                                          repeats=args.repeats, workdir=workdir, url=daemon.unix_url,
                                          dtype=args.dtype, kv_bytes=args.kv_bytes, seed=args.seed,
                                          log=lambda m: print(m, file=sys.stderr))
                           for c in handoff}
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    header = f"bench_vllm: {args.model} ({args.dtype}), {describe()}, repeats={args.repeats}, " \
             f"{load_at_start} at the start, {loadavg()} at the end"
    rows, bandwidth, stall = [], {}, []
    if results:
        rows, bandwidth = table(results, lengths)
        print_table(rows, bandwidth, header)
        stall = stall_table(results)
        print_stall(stall, args.arrivals, max(int(n) for n in lengths))
    else:
        print(header)
    hand = handoff_table(handoff_results, lengths)
    if hand or skipped:
        print_handoff(hand, skipped)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "model": args.model, "rows": rows, "bandwidth": bandwidth,
                       "stall": stall, "handoff": hand, "skipped_anchors": skipped,
                       "raw": {**results, "handoff": handoff_results}}, f, indent=1)
    return 0


def loadavg() -> str:
    try:
        return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "load average ?"


if __name__ == "__main__":
    sys.exit(main())
