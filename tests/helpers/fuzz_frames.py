"""Valid request frames, the seeds that the fuzz tests mutate (tests/unit/protocol/test_wire_fuzz.py and
tests/integration/daemon/test_fuzz.py)."""

from __future__ import annotations

import msgpack

from kvstore.core.meta import ObjectMeta

GOOD = [
    {"v": 1, "id": 1, "op": "hello", "client": "c", "token": "t", "transport": "auto", "host": "h", "pid": 1,
     "transports": ["shm", "tcp"]},
    {"v": 1, "id": 2, "op": "put", "key": "k", "size": 12, "mode": "stream", "if_absent": False,
     "meta": ObjectMeta(key="k", size=12, kind="numpy", dtype="<f4", shape=(3,)).to_wire()},
    {"v": 1, "id": 3, "op": "get", "key": "k", "mode": "region"},
    {"v": 1, "id": 4, "op": "commit_many", "put_ids": [1, 2], "checksums": [None, 5]},
    {"v": 1, "id": 5, "op": "wait", "keys": ["a", "b"], "timeout": 1.5},
    {"v": 1, "id": 6, "op": "ls", "prefix": "p", "limit": 10},
    {"v": 1, "id": 7, "op": "ucx_connect", "address": b"\x01\x02", "via": "auto"},
]
GOOD_BODIES = [msgpack.packb(m, use_bin_type=True) for m in GOOD]
