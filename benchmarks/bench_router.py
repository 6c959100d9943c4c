"""What ``kvstore router`` costs, and what its admission control buys under overload.

One vLLM OpenAI server (no connector: the router's own cost, not the hand-off's) and routers in front of it,
all measured in the same run:

1. **Added latency**: streaming TTFT (request sent → first SSE event) straight to the instance and through
   the router, requests alternating one by one (the same load on both); medians, p99s and the paired
   difference.
2. **Throughput**: closed loop, ``--concurrency`` clients of one-token requests, straight vs through the router
   (requests/s, and the ratio).
3. **Overload**: the instance's capacity for the overload request shape is measured straight (closed loop),
   then the same seeded Poisson arrivals at ``--overload`` × capacity, half interactive and half background,
   go through a router with ``--admission none`` and one with ``--admission budget``. Goodput = requests/s
   answered within both budgets (TTFT and mean TPOT). The budgets default to the p90 TTFT and TPOT the
   instance gives at capacity (``--capacity-clients`` closed-loop clients): what it can serve.

    python -m benchmarks.bench_router [--model DIR] [--requests 40] [--overload 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import time

import aiohttp

from benchmarks.common.daemon import free_port, project_env, short_tmpdir
from benchmarks.common.machine import describe, machine
from benchmarks.common.table import Column, format_table
from kvstore.router.fleet import Fleet, vllm_command, wait_http
from kvstore.workloads.stats import percentiles

VLLM_ARGS = ("--dtype", "bfloat16", "--block-size", "128", "--kv-cache-memory-bytes", str(512 << 20),
             "--max-model-len", "4096", "--enforce-eager", "--seed", "0", "--max-num-seqs", "32")


def prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 1024) for _ in range(n)]


async def one(session: aiohttp.ClientSession, base: str, ids: list[int], max_tokens: int, stream: bool = True,
              klass: str = "interactive") -> dict:
    """Send one completion; its status, TTFT and TPOT (seconds). TPOT is (last event - first event) / (tokens
    - 1), tokens from the final usage: a busy server merges several tokens into one event."""
    body = {"prompt": ids, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    start = time.monotonic()
    times: list[float] = []
    tokens = 1
    async with session.post(base + "/v1/completions", json=body, headers={"X-Request-Class": klass}) as resp:
        if resp.status != 200 or not stream:
            await resp.read()
            times.append(time.monotonic())
        else:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    now, event = time.monotonic(), json.loads(line[6:])
                    if event.get("choices"):
                        times.append(now)
                    tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    ttft = times[0] - start if times else float("nan")
    tpot = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else 0.0
    return {"status": resp.status, "ttft_s": ttft, "tpot_s": tpot, "klass": klass}


def _p(values: list[float]) -> tuple[float, float]:
    p50, p99 = percentiles(values, (50, 99))
    return p50, p99


async def added_latency(session, direct: str, router: str, args, rng) -> dict:
    for _ in range(3):  # warm both paths
        await one(session, direct, prompt(args.prompt_tokens, rng), 2)
        await one(session, router, prompt(args.prompt_tokens, rng), 2)
    d, r, diffs = [], [], []
    for i in range(args.requests):
        order = [(direct, d), (router, r)] if i % 2 == 0 else [(router, r), (direct, d)]
        for base, out in order:  # a fresh prompt each: no prefix-cache hit on the second of a pair
            out.append(await one(session, base, prompt(args.prompt_tokens, rng), args.max_tokens))
        diffs.append(r[-1]["ttft_s"] - d[-1]["ttft_s"])
    rows = {}
    for name, res in (("direct", d), ("router", r)):
        p50, p99 = _p([x["ttft_s"] for x in res])
        t50, _ = _p([x["tpot_s"] for x in res])
        rows[name] = {"ttft_p50_ms": p50 * 1e3, "ttft_p99_ms": p99 * 1e3, "tpot_p50_ms": t50 * 1e3}
    added50, added99 = _p(diffs)
    rows["added"] = {"paired_p50_ms": added50 * 1e3, "paired_p99_ms": added99 * 1e3,
                     "p50_ms": rows["router"]["ttft_p50_ms"] - rows["direct"]["ttft_p50_ms"],
                     "p99_ms": rows["router"]["ttft_p99_ms"] - rows["direct"]["ttft_p99_ms"]}
    return rows


async def closed_loop(session, base: str, clients: int, seconds: float, tokens: int, max_tokens: int,
                      stream: bool, rng) -> tuple[float, list[dict]]:
    """(requests/s answered 200, their results) of ``clients`` clients sending back to back for ``seconds``."""
    end, done = time.monotonic() + seconds, []

    async def client():
        while time.monotonic() < end:
            res = await one(session, base, prompt(tokens, rng), max_tokens, stream)
            if res["status"] == 200:
                done.append(res)

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    return len(done) / (time.monotonic() - start), done


async def open_loop(session, base: str, arrivals: list[tuple[float, list[int], str]], max_tokens: int) -> list:
    start = time.monotonic()

    async def send(at, ids, klass):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        return await one(session, base, ids, max_tokens, True, klass)

    return await asyncio.gather(*(send(*a) for a in arrivals))


def overload_row(name: str, results: list[dict], seconds: float, ttft: float, tpot: float) -> dict:
    ok = [r for r in results if r["status"] == 200]
    good = [r for r in ok if r["ttft_s"] <= ttft and r["tpot_s"] <= tpot]
    inter = [r for r in ok if r["klass"] == "interactive"]
    p50, p99 = _p([r["ttft_s"] for r in inter]) if inter else (float("nan"), float("nan"))
    count = lambda klass, status: sum(r["klass"] == klass and r["status"] == status for r in results)
    return {"admission": name, "goodput_rps": len(good) / seconds, "answered": len(ok),
            "interactive_good": sum(r["klass"] == "interactive" for r in good),
            "interactive_ttft_p50_ms": p50 * 1e3, "interactive_ttft_p99_ms": p99 * 1e3,
            "shed_interactive": count("interactive", 429), "shed_background": count("background", 429),
            "errors": sum(r["status"] not in (200, 429) for r in results)}


def start_router(fleet: Fleet, name: str, instance: str, *args: str) -> str:
    port = free_port()
    child = fleet.start(name, [sys.executable, "-m", "kvstore.cli", "router", "--colocated", instance,
                               "--listen", f"127.0.0.1:{port}", "--log-level", "warning", *args])
    wait_http(child, f"http://127.0.0.1:{port}/health", 60)
    return f"http://127.0.0.1:{port}"


async def measure(fleet: Fleet, instance: str, args) -> dict:
    rng = random.Random(args.seed)
    out: dict = {}
    router = start_router(fleet, "router-none", instance)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        out["latency"] = await added_latency(session, instance, router, args, rng)
        rates = {}
        for name, base in (("direct", instance), ("router", router)):
            rates[name], _ = await closed_loop(session, base, args.concurrency, args.seconds, 16, 1, False, rng)
        out["throughput"] = {**{f"{k}_rps": v for k, v in rates.items()}, "ratio": rates["router"] / rates["direct"]}
        # capacity: the instance kept busy by --capacity-clients; the budgets: the p90 latencies it gives there
        capacity, served = await closed_loop(session, instance, args.capacity_clients, 2 * args.seconds,
                                             args.prompt_tokens, args.max_tokens, True, rng)
        ttft = args.slo_ttft or percentiles([r["ttft_s"] for r in served], (90,))[0]
        tpot = args.slo_tpot or percentiles([r["tpot_s"] for r in served], (90,))[0]
        rate = args.overload * capacity
        arrivals, t, arng = [], 0.0, random.Random(args.seed + 1)
        while t < args.overload_seconds:
            arrivals.append((t, prompt(args.prompt_tokens, arng), "background" if arng.random() < 0.5
                             else "interactive"))
            t += arng.expovariate(rate)
        budget = start_router(fleet, "router-budget", instance, "--admission", "budget", "--slo-ttft", str(ttft),
                              "--slo-tpot", str(tpot))
        rows = []
        for name, base in (("none", router), ("budget", budget)):
            results = await open_loop(session, base, arrivals, args.max_tokens)
            rows.append(overload_row(name, results, args.overload_seconds, ttft, tpot))
            await asyncio.sleep(2)  # let the instance drain before the next policy
        out["overload"] = {"capacity_rps": capacity, "rate_rps": rate, "arrivals": len(arrivals),
                           "slo_ttft_s": ttft, "slo_tpot_s": tpot, "rows": rows}
    return out


def report(out: dict) -> None:
    print(f"# kvstore router — {describe(out['machine'])}; load average {out['loadavg']}")
    lat = out["latency"]
    rows = [{"path": k, **v} for k, v in lat.items() if k != "added"]
    print(format_table([Column("path", "<8", "path"), Column("TTFT p50 ms", ">12.2f", "ttft_p50_ms"),
                        Column("TTFT p99 ms", ">12.2f", "ttft_p99_ms"), Column("TPOT p50 ms", ">12.2f",
                                                                              "tpot_p50_ms")], rows))
    a = lat["added"]
    print(f"added by the router: p50 {a['p50_ms']:.2f} ms, p99 {a['p99_ms']:.2f} ms (paired differences: "
          f"p50 {a['paired_p50_ms']:.2f} ms, p99 {a['paired_p99_ms']:.2f} ms); targets: p50 <= 2 ms, p99 <= 10 ms")
    t = out["throughput"]
    print(f"throughput (one-token requests): direct {t['direct_rps']:.1f} req/s, router {t['router_rps']:.1f} "
          f"req/s ({t['ratio']:.2f} x)")
    o = out["overload"]
    print(f"overload: capacity {o['capacity_rps']:.2f} req/s, arrivals {o['rate_rps']:.2f} req/s "
          f"({o['arrivals']} requests), budgets TTFT {o['slo_ttft_s'] * 1e3:.0f} ms, TPOT "
          f"{o['slo_tpot_s'] * 1e3:.0f} ms")
    print(format_table([Column("admission", "<9", "admission"), Column("goodput/s", ">9.2f", "goodput_rps"),
                        Column("answered", ">8d", "answered"), Column("inter. good", ">11d", "interactive_good"),
                        Column("inter. TTFT p50", ">15.0f", "interactive_ttft_p50_ms"),
                        Column("p99 ms", ">8.0f", "interactive_ttft_p99_ms"),
                        Column("429 inter.", ">10d", "shed_interactive"),
                        Column("429 backgr.", ">11d", "shed_background"), Column("errors", ">6d", "errors")],
                       o["rows"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the tiny random Llama with its tokenizer)")
    p.add_argument("--requests", type=int, default=40, help="paired requests for the latency (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="clients of the throughput loop")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each closed loop")
    p.add_argument("--overload", type=float, default=2.0, help="arrival rate as a multiple of capacity")
    p.add_argument("--overload-seconds", type=float, default=20.0)
    p.add_argument("--capacity-clients", type=int, default=4,
                   help="closed-loop clients that define the instance's capacity (default %(default)s)")
    p.add_argument("--slo-ttft", type=float, help="default: the TTFT p90 at capacity")
    p.add_argument("--slo-tpot", type=float, help="default: the TPOT p90 at capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    workdir = short_tmpdir("kvs-bench-router-")
    try:
        model = args.model
        if model is None:
            from kvstore.integrations.vllm.tiny_model import build_tiny_llama, build_tiny_tokenizer

            model = build_tiny_tokenizer(build_tiny_llama(os.path.join(workdir, "tiny"), dtype="bfloat16"))
        with Fleet(workdir, project_env()) as fleet:
            port = free_port()
            child = fleet.start("vllm", vllm_command(model, port, None, None, args=VLLM_ARGS))
            instance = f"http://127.0.0.1:{port}"
            wait_http(child, instance + "/health", 900)
            out = asyncio.run(measure(fleet, instance, args))
        out.update(machine=machine(), loadavg=[round(x, 1) for x in os.getloadavg()], args=vars(args))
        report(out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
