"""A hand-off across a real, shaped link: prefill on host a, decode on host b, against the raw socket on the link.

    sudo python -m benchmarks.bench_link [--rates 1,10,25] [--blocks 16,64,256] [-n 5]
                                         [--compression default,lz4,auto] [--codec-only] [--json PATH]

Hosts are network namespaces with private /dev/shm and /tmp (``kvstore.testing.hosts``), joined by a veth pair
shaped with ``tc tbf`` to each rate in turn. A ``kvstore serve`` daemon runs on host a; a publisher on a writes
each request through it (Unix socket, shared memory); a fetcher on b reads it over the link (``tcp://``, the
simple deployment: one remote daemon). Geometry: Llama-3-8B (32 layers x 2 x 8 KV heads x 128 x bf16 x 16 tokens
= 2 MiB a block) in vLLM's flash-attention layout.

For every rate and request size, in the same run: the raw socket moving the request's bytes from a to b
(``kvstore.testing.rawlink``: sendall / recv_into, acknowledged), then ``n`` hand-offs (publish, then fetch:
wait, layout checks, transfer, fused checksums, scatter). ``fetch/raw`` is the raw socket's median time over the
fetch's (target >= 0.8); ``e2e/raw`` the same for publish + fetch. ``--compression`` names the fetchers'
wire modes to compare (``default`` is the library's default, off), each a client of its own on host b.

First, the compressor on this CPU (one thread), on random bytes, on random-weight KV (randn in bf16) and on the
KV that the benchmark engine's model (benchmarks.pd, random weights, bf16) writes for a 1,024-token prompt:
``send`` / ``receive`` GB/s and ``ratio`` of the frames as they go on the wire (``kvstore.protocol.compression``:
xxh3 per frame, stored frames once lz4 gives up), and lz4 itself on every chunk (``lz4 ...``: what a sender
pays while it keeps trying); then, for each rate, the ratio that KV would need for lz4 to pay, from lz4's own
speeds on the model's KV (see ``needed_ratio``).
``--codec-only`` stops there (no root needed). Needs root for the link part; exits with the reason where
namespaces cannot be made.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time

from benchmarks.common.machine import describe, machine
from benchmarks.common.table import Column, format_table
from benchmarks.common.timing import timing_of
from kvstore.testing import hosts as H

PORT = 7070
BLOCK_BYTES = 2 << 20  # one Llama-3-8B block (see the docstring)


class Worker:
    """A ``benchmarks.link_worker`` process on a host, driven one JSON line at a time."""

    def __init__(self, host: H.Host, url: str, env: dict, compression: str | None):
        cmd = [sys.executable, "-m", "benchmarks.link_worker", url] + (["--compression", compression]
                                                                       if compression else [])
        self.proc = host.popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"link worker exited ({self.proc.wait(10)}); see its stderr above")
        return json.loads(line)

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


def _env() -> dict:
    import kvstore

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvstore.__file__)))
    env = dict(os.environ, PYTHONUNBUFFERED="1", KVSTORE_TOKEN_FILE="/tmp/token")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def start_daemon(a: H.Host, address: str, capacity: str, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", "unix:///tmp/kv.sock", "--listen",
           f"tcp://{address}:{PORT}", "--token-file", "/tmp/token", "--capacity", capacity, "--log-level", "warning"]
    daemon = a.popen(cmd, env=env)
    if not a.wait_listening(PORT, 60, daemon):
        raise RuntimeError("kvstore serve on host a did not start")
    return daemon


def _write_token(hosts: H.Hosts) -> None:
    token = secrets.token_hex(16)
    for host in hosts.hosts.values():
        fd = os.open(host.path("/tmp/token"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, token.encode())
        os.close(fd)


def bench_rate(link: H.Link, pub: Worker, fetcher_for, rate: float, blocks: list[int], modes: list[str],
               n: int) -> list[dict]:
    """One rate: the raw socket for each request size, then each wire mode's hand-offs, one fetcher process at a
    time (``fetcher_for(mode)``; each holds its caches and staging buffers: three at once did not fit here)."""
    link.shape(rate)
    raws = {nb: H.measure_link(link, nb * BLOCK_BYTES, n) for nb in blocks}
    rows = []
    for mode in modes:
        fetcher = fetcher_for(mode)
        try:
            for nb in blocks:
                rows.append(_handoffs(pub, fetcher, rate, nb, mode, raws[nb], n))
                print(format_table(COLUMNS, rows[-1:]).splitlines()[-1], flush=True)
        finally:
            fetcher.close()
    return rows


def _handoffs(pub: Worker, fetcher: Worker, rate: float, nb: int, mode: str, raw: H.LinkRate, n: int) -> dict:
    nbytes = nb * BLOCK_BYTES
    raw_t = timing_of(nbytes, raw.seconds)
    pubs, fetches, e2e = [], [], []
    for i in range(n + 1):  # the first is a warm-up (caches made, connections warm) and checks the pages
        rid = f"r-{rate}-{nb}-{mode}-{i}"
        p = pub.call(op="publish", rid=rid, blocks=nb)["s"]
        f = fetcher.call(op="fetch", rid=rid, blocks=nb, check=i == 0)
        if i == 0:
            if not f.get("equal"):
                raise RuntimeError(f"fetched pages differ from the published ones ({rate} Gbit/s, {nb})")
            continue
        pubs.append(p)
        fetches.append(f["s"])
        e2e.append(p + f["s"])
    ft, et, pt = timing_of(nbytes, fetches), timing_of(nbytes, e2e), timing_of(nbytes, pubs)
    return {"rate_gbit": rate, "blocks": nb, "mib": nbytes >> 20, "compression": mode,
            "raw_gbit_s": raw.gbit_s, "raw_p50_ms": raw_t.p50_s * 1e3, "raw_p99_ms": raw_t.p99_s * 1e3,
            "publish_p50_ms": pt.p50_s * 1e3, "fetch_p50_ms": ft.p50_s * 1e3,
            "fetch_p99_ms": ft.p99_s * 1e3, "fetch_gbit_s": nbytes * 8 / ft.p50_s / 1e9,
            "fetch_vs_raw": raw_t.p50_s / ft.p50_s, "e2e_p50_ms": et.p50_s * 1e3,
            "e2e_p99_ms": et.p99_s * 1e3, "e2e_vs_raw": raw_t.p50_s / et.p50_s, "n": n}


COLUMNS = [
    Column("Gbit/s", ">6g", "rate_gbit"), Column("blocks", ">6", "blocks"), Column("MiB", ">5", "mib"),
    Column("wire", "<6", "compression"), Column("raw Gbit/s", ">10.2f", "raw_gbit_s"),
    Column("raw p50 ms", ">10.1f", "raw_p50_ms"), Column("publish ms", ">10.1f", "publish_p50_ms"),
    Column("fetch p50", ">9.1f", "fetch_p50_ms"), Column("fetch p99", ">9.1f", "fetch_p99_ms"),
    Column("fetch Gbit/s", ">12.2f", "fetch_gbit_s"), Column("fetch/raw", ">9.2f", "fetch_vs_raw"),
    Column("e2e p50", ">8.1f", "e2e_p50_ms"), Column("e2e/raw", ">7.2f", "e2e_vs_raw"),
]


def run(args: argparse.Namespace) -> dict:
    blocks = [int(b) for b in args.blocks.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    modes = args.compression.split(",")
    capacity_mib = max(blocks) * 2 * 2 + 256  # one request in flight, room to spare
    env = _env()
    with H.Hosts(("a", "b"), rate_gbit=rates[0], shm_size=f"{capacity_mib + 256}m") as hosts:
        _write_token(hosts)
        link = hosts.link("a", "b")
        a, b = hosts["a"], hosts["b"]
        daemon = start_daemon(a, link.address(a), f"{capacity_mib}MiB", env)
        pub = Worker(a, "unix:///tmp/kv.sock", env, None)
        paths = {"publisher": pub.hello["transport"]}

        def fetcher_for(mode: str) -> Worker:
            w = Worker(b, f"tcp://{link.address(a)}:{PORT}", env, None if mode == "default" else mode)
            paths[mode] = w.hello["transport"]
            return w

        print(format_table(COLUMNS, []), flush=True)
        rows = []
        try:
            for rate in rates:
                rows += bench_rate(link, pub, fetcher_for, rate, blocks, modes, args.n)
        finally:
            pub.close()
            daemon.terminate()
            daemon.wait(30)
        print(f"# paths {paths}", flush=True)
    return {"machine": machine(), "paths": paths, "rows": rows, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime())}


def _model_kv(tokens: int = 1024) -> bytes:
    """The KV cache the benchmark engine's model (random weights, bf16) writes while prefilling ``tokens``."""
    import torch

    from benchmarks.pd.attention import AttentionBatch, SeqChunk
    from benchmarks.pd.kv_cache import CacheSpec, PagedKVCache
    from benchmarks.pd.model import LlamaModel, ModelConfig

    cfg = ModelConfig(dtype="bfloat16")
    blocks = -(-tokens // 16)
    cache = PagedKVCache(CacheSpec(cfg.num_layers, blocks, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16))
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    batch = AttentionBatch.build([SeqChunk(list(range(blocks)), 0, tokens)], cache)
    LlamaModel(cfg)(ids, batch, cache)
    return b"".join(t.view(torch.uint8).numpy().tobytes() for t in cache.layers)


def codec_rows(nbytes: int = 32 << 20) -> list[dict]:
    """lz4 and lz4-shuffle frames on three kinds of data: ratio, compress and decompress GB/s (median of 3)."""
    import numpy as np
    import torch

    from kvstore.protocol import compression as cz

    model_kv = _model_kv()
    data = {"random bytes": np.random.default_rng(0).bytes(nbytes),
            "randn bf16": torch.randn(nbytes // 2, generator=torch.Generator().manual_seed(0)).to(
                torch.bfloat16).view(torch.uint8).numpy().tobytes(),
            "model KV bf16": (model_kv * (nbytes // len(model_kv) + 1))[:nbytes]}
    rows = []
    for name, raw in data.items():
        for codec in cz.CODECS:
            times_c, times_d = [], []
            for _ in range(3):
                t0 = time.perf_counter()
                encoder = cz.Encoder(memoryview(raw), codec)
                frames = list(encoder)
                times_c.append(time.perf_counter() - t0)
                out, pos = memoryview(bytearray(len(raw))), 0
                t0 = time.perf_counter()
                for header, body in frames:
                    frame = cz.parse_header(header, len(raw) - pos)
                    cz.decode(frame, body, out[pos:pos + frame.raw_len])
                    pos += frame.raw_len
                times_d.append(time.perf_counter() - t0)
            alone = _lz4_alone(raw, cz.CODECS[codec])
            rows.append({"data": name, "codec": codec, "ratio": len(raw) / encoder.wire_bytes,
                         "frames_compressed": encoder.compressed, "frames": encoder.count,
                         "compress_gbs": len(raw) / sorted(times_c)[1] / 1e9,
                         "decompress_gbs": len(raw) / sorted(times_d)[1] / 1e9, **alone})
    return rows


def _lz4_alone(raw: bytes, elem: int) -> dict:
    """lz4 itself on every 1 MiB chunk (what a sender pays while it keeps trying): GB/s both ways and ratio."""
    import lz4.block

    from kvstore.protocol import compression as cz

    chunks = [memoryview(raw)[i:i + cz.CHUNK] for i in range(0, len(raw), cz.CHUNK)]
    comp, decomp = [], []
    for _ in range(3):  # the median of 3
        t0 = time.perf_counter()
        packed = [lz4.block.compress(cz.shuffle(c, elem) if elem else c, store_size=False) for c in chunks]
        t1 = time.perf_counter()
        for p, c in zip(packed, chunks, strict=True):
            lz4.block.decompress(p, uncompressed_size=len(c))
        comp.append(t1 - t0)
        decomp.append(time.perf_counter() - t1)
    return {"lz4_ratio": len(raw) / sum(len(p) for p in packed),
            "lz4_compress_gbs": len(raw) / sorted(comp)[1] / 1e9,
            "lz4_decompress_gbs": len(raw) / sorted(decomp)[1] / 1e9}


def needed_ratio(link_gbs: float, compress_gbs: float, decompress_gbs: float) -> tuple[float, float]:
    """The ratio r at which a compressed transfer matches a plain one on a link of ``link_gbs`` GB/s.
    Serial (compress, send, decompress one after the other): S/c + S/(rL) + S/d = S/L, so r = 1 / (1 - L/c - L/d)
    (infinite when L/c + L/d >= 1). Overlapped (the three run at once, as frames pipeline): the slowest stage
    sets the pace, min(c, d, rL) = L, so any r > 1 pays while c and d both exceed L, none otherwise."""
    spare = 1 - link_gbs / compress_gbs - link_gbs / decompress_gbs
    serial = 1 / spare if spare > 0 else float("inf")
    overlapped = 1.0 if min(compress_gbs, decompress_gbs) > link_gbs else float("inf")
    return serial, overlapped


CODEC_COLUMNS = [Column("data", "<14", "data"), Column("codec", "<12", "codec"), Column("ratio", ">7.3f", "ratio"),
                 Column("lz4 frames", ">10", lambda r: f"{r['frames_compressed']}/{r['frames']}"),
                 Column("send GB/s", ">9.2f", "compress_gbs"), Column("receive GB/s", ">12.2f", "decompress_gbs"),
                 Column("lz4 ratio", ">9.3f", "lz4_ratio"), Column("lz4 comp GB/s", ">13.2f", "lz4_compress_gbs"),
                 Column("lz4 decomp GB/s", ">15.2f", "lz4_decompress_gbs")]


def print_codec(rows: list[dict], rates: list[float]) -> list[dict]:
    print(format_table(CODEC_COLUMNS, rows), flush=True)
    kv = next(r for r in rows if r["data"] == "model KV bf16" and r["codec"] == "lz4")
    needs = []
    for rate in rates:
        c, d = kv["lz4_compress_gbs"], kv["lz4_decompress_gbs"]
        serial, overlapped = needed_ratio(rate / 8, c, d)
        needs.append({"rate_gbit": rate, "serial": serial, "overlapped": overlapped, "lz4_ratio": kv["lz4_ratio"]})
        print(f"# {rate:g} Gbit/s = {rate / 8:.3f} GB/s: lz4 at {c:.2f} / {d:.2f} GB/s (model KV) pays above ratio "
              f"{serial:.2f} (serial) / {overlapped:.2f} (overlapped); model KV has {kv['lz4_ratio']:.3f}", flush=True)
    return needs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default=",".join(str(r) for r in H.RATES_GBIT), help="Gbit/s, comma-separated")
    parser.add_argument("--blocks", default="16,64,256", help="request sizes in blocks of 2 MiB")
    parser.add_argument("-n", type=int, default=5, help="timed hand-offs per rate and size (after one warm-up)")
    parser.add_argument("--compression", default="default",
                        help="the fetcher's wire compression modes to compare, comma-separated")
    parser.add_argument("--codec-only", action="store_true", help="measure the compressor only (no namespaces)")
    parser.add_argument("--no-codec", action="store_true", help="skip the compressor measurement")
    parser.add_argument("--codec-mib", type=int, default=32, help="MiB of each kind of data the compressor gets")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"-n must be at least 1, got {args.n}")
    print(f"# {describe(machine())}", flush=True)
    result: dict = {"machine": machine()}
    if not args.no_codec:
        result["codec"] = codec_rows(args.codec_mib << 20)
        result["needed_ratio"] = print_codec(result["codec"], [float(r) for r in args.rates.split(",")])
    if not args.codec_only:
        reason = H.unavailable_reason()
        if reason is not None:
            print(f"bench_link: {reason}", file=sys.stderr)
            return 2
        result.update(run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
