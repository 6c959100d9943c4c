"""Cluster benchmark: aggregate put / get throughput with 1, 2 and 3 daemons, Redis round trips per operation,
and directory latency, against a real redis-server started for the run.

    python -m benchmarks.bench_cluster [--nodes 1,2,3] [--size 64KiB] [--ops 1000] [--transport tcp] [--json PATH]

One client process per daemon, each homed on its daemon (placement local). Phases, all clients at once:
``put`` (each into its own daemon), ``bput`` (the same through ``batch_put``, 32 objects per call), ``get``
(each reads the objects of the next daemon: remote when there are several), ``bget`` (the same through
``batch_get_into``, 32 keys per call), ``hget`` (each reads its own objects back through the cluster client: the
home daemon's, over shared memory with ``--transport auto``), ``uget`` (the same through a plain client of its
daemon's Unix socket, always over shared memory). Per op: ``client RT`` counts the client's own directory calls,
``daemon RT`` the daemons' flushes and lookups, ``redis RT`` every request Redis received (heartbeats and
health checks included), ``redis cmds`` every command it executed, those inside the directory scripts too,
and ``redis us`` the CPU time Redis spent on them (INFO commandstats): the load a request puts on Redis.
Directory latency: one-key lookups from a client, and the daemons' publish flushes, with a Redis PING from the
same client as the physical baseline. ``--transport tcp`` (default) moves every payload over loopback TCP, as
between hosts; ``auto`` uses shared memory, which every daemon here shares.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common.daemon import Daemon, free_port
from benchmarks.common.machine import describe, machine
from benchmarks.common.table import Column, format_table
from kvstore.units import format_size, parse_size
from kvstore.workloads.stats import percentiles

BATCH = 32
PHASES = ("put", "bput", "get", "bget", "hget", "uget")
# commands a client sends itself (one round trip each); everything else runs inside the directory scripts
_TOP_LEVEL = ("evalsha", "eval", "scan", "ping", "subscribe", "script", "client", "hello", "select", "auth")


@contextlib.contextmanager
def redis_server(workdir: str):
    import redis

    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=5)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield port, client
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def daemons(n: int, redis_port: int, namespace: str, capacity: str, transport: str, workdir: str):
    """``n`` cluster daemons on loopback TCP ports and Unix sockets; yields {node id: unix URL} once all have
    joined."""
    import redis

    nodes, names = [], [f"n{i}" for i in range(n)]
    peer = "tcp" if transport == "tcp" else "auto"
    try:
        for name in names:
            args = ("--cluster", f"redis://127.0.0.1:{redis_port}/0", "--node-id", name, "--cluster-namespace",
                    namespace, "--peer-transport", peer)
            nodes.append(Daemon(workdir, capacity=capacity, args=args, log_level="warning",
                                log_path=os.path.join(workdir, f"{namespace}-{name}.log")).start(timeout=60))
        client = redis.Redis(port=redis_port)
        deadline = time.monotonic() + 60
        while sum(client.exists(f"{namespace}:node:{m}") for m in names) < n:
            if time.monotonic() > deadline or not all(d.running() for d in nodes):
                raise RuntimeError(f"daemons did not join; logs in {workdir}")
            time.sleep(0.05)
        yield {name: d.unix_url for name, d in zip(names, nodes, strict=True)}
    finally:
        for d in nodes:
            d.terminate(signal.SIGTERM, timeout=30)


def commands(client) -> tuple[int, int, int]:
    """(requests clients sent, commands Redis executed including those inside scripts, microseconds of Redis
    CPU they took), INFO excluded."""
    stats = {k: v for k, v in client.info("commandstats").items() if k != "cmdstat_info"}
    top = sum(v["calls"] for k, v in stats.items() if k.removeprefix("cmdstat_").split("|")[0] in _TOP_LEVEL)
    inner = sum(v["usec"] for k, v in stats.items() if k.removeprefix("cmdstat_").split("|")[0] not in _TOP_LEVEL)
    # a script's own usec already includes the commands it ran
    return top, sum(v["calls"] for v in stats.values()), sum(v["usec"] for v in stats.values()) - inner


# ---- one client process ------------------------------------------------------------------------------
def worker(url: str, unix_url: str, mine: str, theirs: str, ops: int, size: int, transport: str) -> None:
    """Runs phases named on stdin; answers each with a JSON line {seconds, round_trips}."""
    import kvstore

    store = kvstore.connect(url, transport=transport, timeout=30)
    plain = kvstore.connect(unix_url, timeout=30)  # same host: shared memory
    value = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    buf = np.empty(size, dtype=np.uint8)
    print("ready", flush=True)
    for line in sys.stdin:
        phase = line.strip()
        if phase == "quit":
            break
        before, began = store.redis_round_trips, time.perf_counter()
        if phase == "put":
            for i in range(ops):
                store.put(f"{mine}/{i}", value)
        elif phase == "bput":
            for start in range(0, ops, BATCH):
                store.batch_put([(f"{mine}/b{i}", value) for i in range(start, min(ops, start + BATCH))])
        elif phase == "get":
            for i in range(ops):
                store.get_into(f"{theirs}/{i}", buf)
        elif phase == "bget":
            outs = [np.empty(size, dtype=np.uint8) for _ in range(BATCH)]
            for start in range(0, ops, BATCH):
                keys = [f"{theirs}/{i}" for i in range(start, min(ops, start + BATCH))]
                store.batch_get_into(keys, outs[:len(keys)])
        elif phase == "hget":
            for i in range(ops):
                store.get_into(f"{mine}/{i}", buf)
        elif phase == "uget":
            for i in range(ops):
                plain.get_into(f"{mine}/{i}", buf)
        print(json.dumps({"seconds": time.perf_counter() - began, "round_trips": store.redis_round_trips - before}),
              flush=True)
    plain.close()
    store.close()


def run_cluster(n: int, port: int, rds, args, workdir: str) -> tuple[list[dict], dict]:
    namespace = f"bench{n}"
    rows = []
    with daemons(n, port, namespace, args.capacity, args.transport, workdir) as unix_urls:
        names = list(unix_urls)
        base = f"kvcluster://127.0.0.1:{port}/0?namespace={namespace}"
        clients = [subprocess.Popen([sys.executable, "-m", "benchmarks.bench_cluster", "--worker", base + f"&node={m}",
                                     unix_urls[m], f"k/{m}", f"k/{names[(i + 1) % n]}", str(args.ops), str(args.size),
                                     args.transport], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                   for i, m in enumerate(names)]
        try:
            for c in clients:
                assert c.stdout.readline().strip() == "ready"
            for phase in PHASES:
                before_cmds, before_nodes = commands(rds), node_counters(base, names)
                for c in clients:
                    c.stdin.write(phase + "\n")
                    c.stdin.flush()
                results = [json.loads(c.stdout.readline()) for c in clients]
                after_nodes = node_counters(base, names)
                after_cmds = commands(rds)
                total_ops = args.ops * n
                wall = max(r["seconds"] for r in results)
                rows.append({"nodes": n, "phase": phase, "ops": total_ops, "ops_per_s": total_ops / wall,
                             "mib_per_s": total_ops * args.size / wall / (1 << 20),
                             "client_rt_per_op": sum(r["round_trips"] for r in results) / total_ops,
                             "daemon_rt_per_op": (after_nodes["rt"] - before_nodes["rt"]) / total_ops,
                             "redis_rt_per_op": (after_cmds[0] - before_cmds[0]) / total_ops,
                             "redis_cmds_per_op": (after_cmds[1] - before_cmds[1]) / total_ops,
                             "redis_us_per_op": (after_cmds[2] - before_cmds[2]) / total_ops})
            flush = node_counters(base, names)["flush"]
        finally:
            for c in clients:
                with contextlib.suppress(Exception):
                    c.stdin.write("quit\n")
                    c.stdin.flush()
                c.wait(60)
    return rows, flush


def node_counters(url: str, names: list[str]) -> dict:
    """Directory round trips the daemons made (flushes + lookups) and their flush latencies."""
    import kvstore

    rt, p50, p99 = 0, [], []
    with contextlib.closing(kvstore.connect(url, timeout=30)) as store:
        for s in store.stats()["nodes"].values():
            d = s["cluster"]["directory"]
            rt += d["flushes"] + d["reads"]
            if d["flush_p50_ms"] is not None:
                p50.append(d["flush_p50_ms"])
                p99.append(d["flush_p99_ms"])
    return {"rt": rt, "flush": {"p50_ms": max(p50, default=None), "p99_ms": max(p99, default=None)}}


def directory_latency(port: int, rds, samples: int) -> dict:
    """One-key lookups (the Redis part of a remote get), against PING on the same connection kind."""
    from kvstore.cluster.config import Names
    from kvstore.cluster.directory import Directory

    directory = Directory(rds, Names("bench1"))
    out = {}
    for name, fn in (("ping", rds.ping), ("lookup", lambda: directory.lookup(["k/n0/1"]))):
        for _ in range(50):
            fn()
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        p50, p99 = percentiles(times, (50, 99))
        out[name] = {"p50_us": 1e6 * p50, "p99_us": 1e6 * p99}
    return out


COLUMNS = [Column("nodes", ">5", "nodes"), Column("phase", "<6", "phase"), Column("ops/s", ">10.0f", "ops_per_s"),
           Column("MiB/s", ">9.1f", "mib_per_s"), Column("client RT/op", ">13.3f", "client_rt_per_op"),
           Column("daemon RT/op", ">13.3f", "daemon_rt_per_op"), Column("redis RT/op", ">12.3f", "redis_rt_per_op"),
           Column("redis cmds/op", ">14.3f", "redis_cmds_per_op"), Column("redis us/op", ">12.2f", "redis_us_per_op")]


def print_table(result: dict) -> None:
    a = result["args"]
    print(f"kvstore cluster benchmark: {result['machine']}; {format_size(a['size'])} objects, {a['ops']} per client, "
          f"transport {a['transport']}")
    print(format_table(COLUMNS, result["rows"]))
    lat = result["latency"]
    print(f"directory lookup (1 key): p50 {lat['lookup']['p50_us']:.0f} us, p99 {lat['lookup']['p99_us']:.0f} us; "
          f"Redis PING baseline p50 {lat['ping']['p50_us']:.0f} us, p99 {lat['ping']['p99_us']:.0f} us")
    for n, f in result["flush"].items():
        print(f"directory publish flush ({n} nodes): p50 {f['p50_ms']} ms, p99 {f['p99_ms']} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=7, metavar=("URL", "UNIX_URL", "MINE", "THEIRS", "OPS", "SIZE", "TRANSPORT"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--nodes", default="1,2,3", help="cluster sizes to run (default %(default)s)")
    parser.add_argument("--size", default="64KiB", help="object size (default %(default)s)")
    parser.add_argument("--ops", type=int, default=1000, help="objects per client and phase (default %(default)s)")
    parser.add_argument("--capacity", default="1GiB", help="capacity of each daemon (default %(default)s)")
    parser.add_argument("--transport", default="tcp", choices=["tcp", "auto"], help="data path (default %(default)s)")
    parser.add_argument("--samples", type=int, default=2000, help="directory latency samples (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.worker:
        url, unix_url, mine, theirs, ops, size, transport = args.worker
        worker(url, unix_url, mine, theirs, int(ops), int(size), transport)
        return 0
    if shutil.which("redis-server") is None:
        print("bench_cluster needs redis-server on PATH (apt-get install -y redis-server)", file=sys.stderr)
        return 2
    args.size = parse_size(args.size)
    np.random.seed(0)
    workdir = tempfile.mkdtemp(prefix="kvbench-cluster-")
    result = {"machine": describe(machine()), "args": {"size": args.size, "ops": args.ops, "transport": args.transport},
              "rows": [], "flush": {}}
    try:
        with redis_server(workdir) as (port, rds):
            for n in [int(x) for x in args.nodes.split(",")]:
                rows, flush = run_cluster(n, port, rds, args, workdir)
                result["rows"] += rows
                result["flush"][n] = flush
            result["latency"] = directory_latency(port, rds, args.samples)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
