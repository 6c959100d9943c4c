"""A kvstore client run on one of the namespace hosts (tests/integration/hosts): one operation, one JSON line.

    python host_client.py URL transport                          {"transport": ...}
    python host_client.py URL put KEY SIZE SEED                  {"ok": true} or {"error": "StoreTimeoutError", ...}
    python host_client.py URL get KEY SIZE SEED                  {"ok": true, "equal": true} or {"error": ...}
    python host_client.py URL exists KEY                         {"exists": false}
    python host_client.py URL stats                              the daemon's stats
    python host_client.py URL publish RID NUM_BLOCKS SEED        KVHandoff.publish, waits until committed
    python host_client.py URL fetch RID NUM_BLOCKS SEED          KVHandoff.fetch; {"equal": ...} against the seed

``put`` and ``get`` print ``{"started": true}`` first, so that a test can cut the link or kill the daemon while
the payload moves. Options: ``--timeout S`` (the client's), ``--transport NAME`` (default auto),
``--compression MODE``. Errors are reported by class name with the seconds the operation took before it raised.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import kvstore
from kvstore.errors import KVStoreError


def payload(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def timed(action):
    started = time.monotonic()
    try:
        result = action()
    except KVStoreError as exc:
        say(error=type(exc).__name__, message=str(exc), seconds=time.monotonic() - started)
        return None
    return result


def run(store, args) -> None:
    op, rest = args.op, args.args
    if op == "transport":
        say(transport=store.transport)
    elif op == "put":
        key, size, seed = rest[0], int(rest[1]), int(rest[2])
        data = payload(size, seed)
        say(started=True)
        if timed(lambda: store.put(key, data) or True):
            say(ok=True)
    elif op == "get":
        key, size, seed = rest[0], int(rest[1]), int(rest[2])
        buf = bytearray(size)
        say(started=True)
        if timed(lambda: store.get_into(key, buf) or True):
            say(ok=True, equal=bytes(buf) == payload(size, seed))
    elif op == "exists":
        say(exists=store.exists(rest[0]))
    elif op == "stats":
        say(**store.stats())
    else:
        handoff(store, op, rest[0], int(rest[1]), int(rest[2]))


def handoff(store, op: str, rid: str, num_blocks: int, seed: int) -> None:
    import torch

    from kvstore.handoff import KVHandoff

    layout = kvstore.KVLayout(kind="vllm_flash_nhd", num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
                              dtype="bfloat16", model_id="hosts-test")
    g = torch.Generator().manual_seed(seed)
    ref = [torch.randn(layout.cache_shape(num_blocks), generator=g).to(torch.bfloat16)
           for _ in range(layout.num_layers)]
    h = KVHandoff(store, layout, chunk_blocks=4)
    if op == "publish":
        h.publish(rid, ref, list(range(num_blocks)), num_tokens=num_blocks * 16, ttl=60).wait(30)
        say(published=rid)
    elif op == "fetch":
        dst = [torch.zeros_like(t) for t in ref]
        timed(lambda: h.fetch(rid, dst, list(range(num_blocks)), timeout=30))
        say(equal=all(torch.equal(a, b) for a, b in zip(ref, dst, strict=True)))
    else:
        raise SystemExit(f"unknown op {op!r}")
    h.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("op")
    parser.add_argument("args", nargs="*")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--compression", default=None)
    args = parser.parse_args()
    extra = {"compression": args.compression} if args.compression else {}
    store = timed(lambda: kvstore.connect(args.url, timeout=args.timeout, transport=args.transport, **extra))
    if store is None:
        sys.exit(1)
    try:
        run(store, args)
    finally:
        store.close()


if __name__ == "__main__":
    main()
