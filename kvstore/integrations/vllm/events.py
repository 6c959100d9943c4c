"""KV events: what the connector put into the store and found gone from it, for cache-aware routers.

With vLLM's ``KVEventsConfig(enable_kv_cache_events=True)`` the scheduler publishes, each step, its own
block pool's events and those of the connector's ``take_events`` in one ``KVEventBatch`` (``zmq``
publisher: what a router subscribes to). This connector adds, with ``medium="STORAGE"`` and
``ownership="kvstore"``:

- ``BlockStored`` for blocks whose save landed in the store on every TP rank (block hashes are vLLM's own
  block hashes of the request, as in its GPU events, with the blocks' token ids, parent hash and LoRA), and
- ``BlockRemoved`` for blocks found gone: a lookup hit that was missing at load (evicted), a block that failed
  its checksum (removed from the store by the worker), blocks a prefill instance promised that the store does
  not hold.

The saves land and the failures are found on the workers' threads: each worker keeps a bounded log
(:class:`WorkerEventLog`) that vLLM carries to the scheduler in ``KVConnectorOutput.kv_cache_events``
(``get_kv_connector_kv_cache_events``); the scheduler (:class:`EventBook`) turns store keys back into the
blocks it planned and queues vLLM events, bounded too, for ``take_events``. Nothing is recorded when vLLM's
KV events are off. Every bound drops the oldest and counts it (``events_dropped``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

OWNERSHIP = "kvstore"
STORED = "stored"
REMOVED = "removed"


def external_hash(block_hash: bytes) -> Any:
    """A block hash as vLLM's own events publish it (an int by default: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    return maybe_convert_block_hash(BlockHash(block_hash))


def kv_events_enabled(vllm_config: Any) -> bool:
    """True when vLLM publishes KV events (``kv_events_config.enable_kv_cache_events``)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


class WorkerEvents(KVConnectorKVEvents):
    """One worker's records since the last step: ``(kind, key)`` with kind :data:`STORED` or :data:`REMOVED`.

    vLLM's output aggregator (TP > 1) merges the workers' containers with ``add_events``; each key names its
    rank through its layout fingerprint, so the scheduler can tell when every rank saved a block."""

    def __init__(self, records: list[tuple[str, str]] | None = None, dropped: int = 0):
        self.records: list[tuple[str, str]] = list(records or ())
        self.dropped = dropped
        self.workers = 1

    def add_events(self, events: list[Any]) -> None:
        self.records.extend(events)

    def aggregate(self) -> WorkerEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.records)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.records.clear()
        self.workers = 1

    def merge(self, other: KVConnectorKVEvents) -> WorkerEvents:
        self.add_events(other.get_all_events())
        self.dropped += getattr(other, "dropped", 0)
        return self

    def __repr__(self) -> str:
        return f"<kvstore WorkerEvents {len(self.records)} records, {self.dropped} dropped>"


class WorkerEventLog:
    """The worker's record of keys saved and found gone, taken once per step (the saver and loader threads
    write, the engine thread takes). At most ``limit`` records wait; older ones are dropped and counted."""

    def __init__(self, enabled: bool, limit: int = 10_000):
        self.enabled = enabled
        self._records: deque[tuple[str, str]] = deque(maxlen=limit)
        self._dropped = 0
        self._lock = threading.Lock()

    def _add(self, kind: str, keys: list[str]) -> None:
        if not self.enabled or not keys:
            return
        with self._lock:
            self._dropped += max(0, len(self._records) + len(keys) - (self._records.maxlen or 0))
            self._records.extend((kind, k) for k in keys)

    def stored(self, keys: list[str]) -> None:
        self._add(STORED, keys)

    def removed(self, keys: list[str]) -> None:
        self._add(REMOVED, keys)

    def take(self) -> WorkerEvents | None:
        with self._lock:
            if not self._records and not self._dropped:
                return None
            out = WorkerEvents(list(self._records), self._dropped)
            self._records.clear()
            self._dropped = 0
        return out


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What a vLLM event says about one block: its hash (vLLM's, or the connector's digest when vLLM's is not
    known), its parent's, its tokens, its LoRA."""

    block_hash: Any
    parent_hash: Any
    token_ids: tuple[int, ...]
    lora_id: int | None = None
    lora_name: str | None = None


class EventBook:
    """Scheduler side: the blocks planned for saves and loads (by digest), the ranks that saved each, and the
    vLLM events waiting for ``take_events``. All three are bounded by ``limit`` (oldest dropped, counted)."""

    def __init__(self, enabled: bool, fingerprints: list[str], block_size: int, limit: int = 10_000):
        self.enabled = enabled
        self.block_size = block_size
        self.limit = limit
        self._rank_of = {fp: rank for rank, fp in enumerate(fingerprints)}
        self._ranks = len(fingerprints)
        self._blocks: OrderedDict[str, BlockInfo] = OrderedDict()   # digest hex -> block
        self._saving: OrderedDict[str, set[int]] = OrderedDict()    # digest hex -> ranks whose save landed
        self._out: deque[KVCacheEvent] = deque(maxlen=limit)
        self.dropped = 0

    # ---- what the scheduler planned ---------------------------------------------------------------------
    def note(self, digests: list[str], infos: list[BlockInfo]) -> None:
        if not self.enabled:
            return
        for digest, info in zip(digests, infos, strict=True):
            self._blocks[digest] = info
            self._blocks.move_to_end(digest)
        while len(self._blocks) > self.limit:
            self._blocks.popitem(last=False)

    # ---- what happened ------------------------------------------------------------------------------------
    def on_worker_events(self, events: Any) -> None:
        if not self.enabled or not isinstance(events, WorkerEvents):
            return
        self.dropped += events.dropped
        for kind, key in events.get_all_events():
            prefix, _, digest = key.rpartition("/")  # kvp/<fingerprint>/<digest>
            rank = self._rank_of.get(prefix.rpartition("/")[2])
            if rank is None:
                continue
            if kind == STORED:
                self._stored(digest, rank)
            elif kind == REMOVED:
                self.removed([digest])

    def _stored(self, digest: str, rank: int) -> None:
        ranks = self._saving.get(digest)
        if ranks is None:
            ranks = self._saving[digest] = set()
            while len(self._saving) > self.limit:
                self._saving.popitem(last=False)
        ranks.add(rank)
        if len(ranks) < self._ranks:
            return
        del self._saving[digest]
        info = self._info(digest)
        self._emit(BlockStored(block_hashes=[info.block_hash], parent_block_hash=info.parent_hash,
                               token_ids=list(info.token_ids), block_size=self.block_size if info.token_ids else 0,
                               lora_id=info.lora_id, medium=MEDIUM_STORAGE, lora_name=info.lora_name,
                               group_idx=0, ownership=OWNERSHIP))

    def removed(self, digests: list[str]) -> None:
        """Blocks the store no longer holds (missing at load, corrupt and removed, promised but absent)."""
        if not self.enabled or not digests:
            return
        for digest in digests:
            self._saving.pop(digest, None)
        self._emit(BlockRemoved(block_hashes=[self._info(d).block_hash for d in digests], medium=MEDIUM_STORAGE,
                                group_idx=0, ownership=OWNERSHIP))

    def _info(self, digest: str) -> BlockInfo:
        info = self._blocks.get(digest)
        return info if info is not None else BlockInfo(external_hash(bytes.fromhex(digest)), None, ())

    def _emit(self, event: KVCacheEvent) -> None:
        if len(self._out) == self._out.maxlen:
            self.dropped += 1
        self._out.append(event)

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call (vLLM's scheduler calls ``take_events`` every step)."""
        out = list(self._out)
        self._out.clear()
        return out

    def take_dropped(self) -> int:
        dropped, self.dropped = self.dropped, 0
        return dropped


__all__ = ["OWNERSHIP", "BlockInfo", "EventBook", "WorkerEventLog", "WorkerEvents", "external_hash",
           "kv_events_enabled"]
