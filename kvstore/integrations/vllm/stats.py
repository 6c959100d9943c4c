"""KVStoreConnectorStats: the worker half's counters, reported through vLLM's ``KVConnectorStats``.

vLLM collects them from every worker each step (``get_kv_connector_stats``), sums them with
:meth:`aggregate` and logs :meth:`reduce`. The scheduler half's lookup counters live in
:class:`Counters` too and are reachable through :func:`kvstore.integrations.vllm.connector.live_connectors`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass(slots=True)
class Counters:
    lookups: int = 0            # scheduler: batched existence checks
    lookup_errors: int = 0      # scheduler: lookups skipped or failed because the store was unavailable
    hit_tokens: int = 0         # scheduler: tokens promised from the store
    loaded_blocks: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    load_errors: int = 0        # blocks reported through get_block_ids_with_load_errors
    checksum_errors: int = 0
    missing_blocks: int = 0     # found at lookup, gone at load (evicted, or a producer's save not landed)
    saved_blocks: int = 0
    save_bytes: int = 0
    save_seconds: float = 0.0
    dropped_saves: int = 0      # blocks not saved because of a store fault
    store_faults: int = 0
    async_loads: int = 0        # worker: requests whose blocks loaded on the loader thread
    held_requests: int = 0      # worker: finished requests whose blocks vLLM kept until their saves landed
    promised_requests: int = 0  # scheduler: decode requests carrying a kvstore hand-off promise
    handoff_waits: int = 0      # scheduler: steps a promised request waited for blocks still being saved
    promised_misses: int = 0    # scheduler: promised requests that found fewer blocks than promised
    promised_missing_blocks: int = 0
    promise_layout_mismatches: int = 0  # scheduler: promises made under another layout fingerprint
    unpinned_blocks: int = 0    # worker (kv_consumer): pinned hand-off blocks unpinned once loaded
    corrupt_removed: int = 0    # worker: blocks that failed their checksum, removed from the store
    reloads_refused: int = 0    # scheduler: lookups skipped for a request whose loads failed MAX_LOAD_ATTEMPTS times
    events_dropped: int = 0     # scheduler: KV events dropped because nobody took them (bounded queues)

    def add(self, other: Counters) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def minus(self, other: Counters) -> Counters:
        return Counters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Counters:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=lambda: Counters().as_dict())

    def reset(self) -> None:
        self.data = Counters().as_dict()

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        total = Counters.from_dict(self.data)
        total.add(Counters.from_dict(other.data))
        self.data = total.as_dict()
        return self

    def reduce(self) -> dict[str, int | float]:
        c = Counters.from_dict(self.data)
        out: dict[str, int | float] = {k: v for k, v in c.as_dict().items() if not k.endswith("_seconds")}
        out["load_GBps"] = round(c.load_bytes / c.load_seconds / 1e9, 3) if c.load_seconds else 0.0
        out["save_GBps"] = round(c.save_bytes / c.save_seconds / 1e9, 3) if c.save_seconds else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())
