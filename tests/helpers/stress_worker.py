"""One client process of the soak test: mixed put / get / get_into / lease / remove on a shared key space.

Usage: stress_worker.py URL TRANSPORT SECONDS SEED KEYSPACE MAX_SIZE

Every value is self-describing: a 24-byte header (magic, payload length, xxh3 of the key, xxh3 of the
payload) and random payload bytes, so any reader can check that it got exactly the bytes some writer of
that key wrote. Prints one JSON line: op counts, documented errors by type, and every other error.
"""

from __future__ import annotations

import json
import struct
import sys
import time
import traceback

import numpy as np
import xxhash

import kvstore

HEADER = struct.Struct("<4sIQQ")
MAGIC = b"KVST"
DOCUMENTED = (kvstore.KeyNotFoundError, kvstore.StoreFullError, kvstore.ObjectBusyError)


def make_value(key: str, rng: np.random.Generator, max_size: int) -> bytes:
    """KV-chunk-like sizes: a small inline class and a large data-path class, slightly jittered."""
    n = int(rng.choice([max_size // 32, max_size]) * rng.uniform(0.97, 1.0))
    payload = rng.bytes(n)
    return HEADER.pack(MAGIC, n, xxhash.xxh3_64_intdigest(key.encode()), xxhash.xxh3_64_intdigest(payload)) + payload


def check_value(key: str, data) -> str | None:
    """None if ``data`` is a value some writer wrote under ``key``; else what is wrong with it."""
    data = memoryview(data).cast("B")
    if len(data) < HEADER.size:
        return f"{key}: {len(data)} bytes, shorter than the header"
    magic, n, key_hash, checksum = HEADER.unpack_from(data)
    if magic != MAGIC:
        return f"{key}: bad magic {bytes(magic)!r}"
    if n != len(data) - HEADER.size:
        return f"{key}: header says {n} payload bytes, got {len(data) - HEADER.size}"
    if key_hash != xxhash.xxh3_64_intdigest(key.encode()):
        return f"{key}: value belongs to another key"
    if checksum != xxhash.xxh3_64_intdigest(data[HEADER.size:]):
        return f"{key}: payload checksum mismatch (torn or corrupt read)"
    return None


def main() -> None:
    url, transport, seconds, seed, keyspace, max_size = sys.argv[1:7]
    seconds, seed, keyspace, max_size = float(seconds), int(seed), int(keyspace), int(max_size)
    rng = np.random.default_rng(seed)
    counts = {"put": 0, "get": 0, "get_into": 0, "lease": 0, "remove": 0, "verified": 0}
    documented: dict[str, int] = {}
    unexpected: list[str] = []
    buf = np.empty(max_size + HEADER.size, np.uint8)
    with kvstore.connect(url, transport=transport, timeout=60) as store:
        print("READY", flush=True)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and len(unexpected) < 20:
            key = f"stress/{rng.integers(keyspace)}"
            r = rng.random()
            try:
                if r < 0.45:
                    store.put(key, make_value(key, rng, max_size))
                    counts["put"] += 1
                elif r < 0.65:
                    n = store.get_into(key, buf)
                    counts["get_into"] += 1
                    problem = check_value(key, buf[:n])
                elif r < 0.80:
                    obj = store.get(key)
                    counts["get"] += 1
                    problem = check_value(key, obj)
                elif r < 0.88:
                    with store.lease(key):
                        n = store.get_into(key, buf)
                        counts["lease"] += 1
                        problem = check_value(key, buf[:n])
                else:
                    store.remove(key)
                    counts["remove"] += 1
                if 0.45 <= r < 0.88:
                    if problem:
                        unexpected.append(f"bad read: {problem}")
                    else:
                        counts["verified"] += 1
            except DOCUMENTED as exc:
                documented[type(exc).__name__] = documented.get(type(exc).__name__, 0) + 1
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the test
                unexpected.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
    print(json.dumps({"counts": counts, "documented": documented, "unexpected": unexpected}), flush=True)


if __name__ == "__main__":
    main()
