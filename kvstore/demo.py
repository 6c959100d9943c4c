"""The main job in one command: start a ``kvstore serve`` daemon, store and read a KV-shaped tensor over
shared memory and over TCP, hand a request's paged KV from a "prefill" process to a "decode" process, show
what the daemon holds, and stop it.

    python -m kvstore.demo
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time

import torch

import kvstore
from kvstore.handoff import KVHandoff

LAYOUT = dict(kind="vllm_flash_nhd", num_layers=8, num_kv_heads=8, head_dim=128, block_size=16,
              dtype="bfloat16", model_id="demo-llama")


def _caches(num_blocks: int, seed: int) -> list[torch.Tensor]:
    layout = kvstore.KVLayout(**LAYOUT)
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(layout.cache_shape(num_blocks), generator=g).to(layout.dtype)
            for _ in range(layout.num_layers)]


def _prefill(url: str) -> None:
    with kvstore.connect(url) as store:
        h = KVHandoff(store, kvstore.KVLayout(**LAYOUT))
        prompt = list(range(500))
        h.publish("req-1", _caches(64, seed=1), list(range(32)), num_tokens=len(prompt), token_ids=prompt).wait()
        h.close()


def main() -> int:
    tmp = tempfile.mkdtemp(prefix="kvdemo-")
    url = f"unix://{tmp}/kv.sock"
    daemon = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--listen", url,
                               "--capacity", "512MiB", "--log-level", "warning",
                               "--exit-with", str(os.getpid())])
    try:
        for _ in range(200):
            try:
                kvstore.connect(url, timeout=1).close()
                break
            except kvstore.StoreConnectionError:
                time.sleep(0.05)
        print(f"daemon pid {daemon.pid} serving {url}")
        kv = torch.randn(2, 16, 8, 128).to(torch.bfloat16)
        for transport in ("shm", "tcp"):
            with kvstore.connect(url, transport=transport) as store:
                meta = store.put(f"demo/{transport}", kv, meta={"layer": 0})
                back = store.get(f"demo/{transport}", verify=True).tensor()
                t0 = time.perf_counter()
                out = torch.empty_like(kv)
                store.get_into(f"demo/{transport}", out)
                took = (time.perf_counter() - t0) * 1e6
                print(f"[{transport}] put {meta.size} B (xxh3 {meta.checksum:016x}); get -> {tuple(back.shape)} "
                      f"{back.dtype}, equal={torch.equal(back, kv)}; get_into {took:.0f} us")
        ctx = mp.get_context("spawn")
        producer = ctx.Process(target=_prefill, args=(url,))
        producer.start()
        with kvstore.connect(url) as store:
            layout = kvstore.KVLayout(**LAYOUT)
            h = KVHandoff(store, layout)
            dst = [torch.zeros(layout.cache_shape(64), dtype=layout.dtype) for _ in range(layout.num_layers)]
            block_ids = list(range(63, 31, -1))  # a different block order from the producer's
            meta = h.fetch("req-1", dst, block_ids, timeout=60)
            producer.join()
            src = _caches(64, seed=1)
            same = all(torch.equal(d[:, block_ids], s[:, :32]) for d, s in zip(dst, src, strict=True))
            print(f"hand-off req-1: {meta.num_tokens} tokens, {meta.num_blocks} blocks, {meta.nbytes} B in "
                  f"{h.last_fetch.transfer_s * 1e3:.1f} ms; decode cache matches prefill: {same}")
            for r in KVHandoff.requests(store):
                print(f"request {r['request_id']}: {r['state']}, {r['bytes']} B, {r['chunks']} chunks")
            stats = store.stats()
            print(f"daemon: {stats['objects']} objects, {stats['used_bytes']} of {stats['capacity_bytes']} B used, "
                  f"{stats['leases']} leases")
        subprocess.run([sys.executable, "-m", "kvstore.cli", "inspect", "demo/shm", "--url", url], check=True)
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(30)
        print(f"daemon stopped (exit {code})")
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
