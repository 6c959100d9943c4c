"""One side of ``bench_link``'s hand-off, run on a namespace host: publishes or fetches requests on command.

    python -m benchmarks.link_worker URL [--compression MODE] [--seed N]

Reads one JSON command a line on stdin and answers one JSON line on stdout:
``{"op": "publish", "rid": "r1", "blocks": 64}`` -> ``{"s": seconds}`` (``KVHandoff.publish`` to committed);
``{"op": "fetch", "rid": "r1", "blocks": 64, "check": true}`` -> ``{"s": seconds, "transfer_s": ..., "equal": ...}``
(``KVHandoff.fetch``: wait, checks, transfer, checksums, scatter; with ``check`` the pages are compared with
the publisher's, which both sides derive from the seed). ``{"op": "stats"}`` -> the client's ``stats()``.
Caches are made once per block count (1.25x the request, block ids a seeded random permutation), so a timed
call moves pages and nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import kvstore
from kvstore import KVLayout, KVLayoutKind
from kvstore.handoff import KVHandoff

#: Llama-3-8B in vLLM's flash-attention layout: 32 layers x 2 x 8 KV heads x 128 x bf16 x 16 tokens = 2 MiB/block
LLAMA = dict(kind=KVLayoutKind.VLLM_FLASH_NHD, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
             dtype=torch.bfloat16, model_id="llama-3-8b")


class Side:
    def __init__(self, store: kvstore.KVStore, seed: int):
        self.layout = KVLayout(**LLAMA)
        self.handoff = KVHandoff(store, self.layout, chunk_blocks=16)
        self.seed = seed
        self._caches: dict[int, tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor] | None]] = {}

    def caches(self, blocks: int, fill: bool):
        """(caches, block ids, the publisher's caches for a check) for requests of ``blocks`` blocks."""
        if blocks not in self._caches:
            total = blocks + max(1, blocks // 4)
            gen = torch.Generator().manual_seed(self.seed + blocks)
            ids = torch.randperm(total, generator=gen)[:blocks]
            shape = self.layout.cache_shape(total)
            ref = [torch.randn(shape, generator=gen).to(self.layout.dtype) for _ in range(self.layout.num_layers)]
            caches = ref if fill else [torch.zeros_like(t) for t in ref]
            self._caches = {blocks: (caches, ids, None if fill else ref)}  # one size held at a time: memory
        return self._caches[blocks]

    def publish(self, rid: str, blocks: int) -> dict:
        caches, ids, _ = self.caches(blocks, fill=True)
        t0 = time.perf_counter()
        self.handoff.publish(rid, caches, ids, num_tokens=blocks * self.layout.block_size, ttl=120).wait(600)
        return {"s": time.perf_counter() - t0}

    def fetch(self, rid: str, blocks: int, check: bool) -> dict:
        caches, ids, ref = self.caches(blocks, fill=False)
        t0 = time.perf_counter()
        self.handoff.fetch(rid, caches, ids, timeout=600)
        seconds = time.perf_counter() - t0
        out = {"s": seconds, "transfer_s": self.handoff.last_fetch.transfer_s}
        if check:
            out["equal"] = all(torch.equal(c.index_select(1, ids), r.index_select(1, ids))  # [2, blocks, ...]
                               for c, r in zip(caches, ref, strict=True))
            for c in caches:
                c.zero_()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("--compression", default=None, help="the client's wire compression (default: the library's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    extra = {"compression": args.compression} if args.compression else {}
    store = kvstore.connect(args.url, timeout=600, **extra)
    side = Side(store, args.seed)
    print(json.dumps({"ready": True, "transport": store.transport}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "publish":
            reply = side.publish(cmd["rid"], cmd["blocks"])
        elif cmd["op"] == "fetch":
            reply = side.fetch(cmd["rid"], cmd["blocks"], cmd.get("check", False))
        elif cmd["op"] == "stats":
            reply = store.stats()
        else:
            break
        print(json.dumps(reply, default=str), flush=True)
    side.handoff.close()
    store.close()


if __name__ == "__main__":
    main()
