"""WorkerSide: the connector's half in each vLLM worker: registers the caches, loads and saves blocks.

Loads are queued in ``start_load_kv`` for the loader thread (:mod:`.loader`) and reported by ``get_finished``
(``async_loads: false``: loaded there, before the forward pass). Saves are queued in ``wait_for_save`` for the
saver thread (:mod:`.saver`), which gathers straight from the cache while vLLM keeps the blocks
(``save_mode: sync``: saved there, on the engine thread). Every failure is local to the blocks it touches: a
load failure is reported through ``get_block_ids_with_load_errors`` (vLLM recomputes those blocks), a failed
save is dropped and counted.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.block_io import BlockIO, LoadResult
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.events import WorkerEventLog
from kvstore.integrations.vllm.keys import CacheLayout, block_key, layout_key, model_layouts_prefix
from kvstore.integrations.vllm.loader import AsyncLoader, unpin_loaded
from kvstore.integrations.vllm.request_bytes import RequestTransfer, RequestTransfers
from kvstore.integrations.vllm.saver import AsyncSaver
from kvstore.integrations.vllm.scheduler import KVStoreConnectorMetadata
from kvstore.integrations.vllm.stats import Counters
from kvstore.integrations.vllm.store_link import CONNECTION_ERRORS, StoreLink, StoreUnavailable, log

_COUNTER_FIELDS = frozenset(f.name for f in dataclasses.fields(Counters))
_REQUEST_FIELDS = frozenset(f.name for f in dataclasses.fields(RequestTransfer))


class WorkerSide:
    def __init__(self, config: ConnectorConfig, layout: CacheLayout, layer_names: list[str], counters: Counters,
                 role: str = "kv_both", events: WorkerEventLog | None = None):
        self.config = config
        #: keys saved and found gone, for vLLM's KV events (records nothing unless they are enabled)
        self.events = events if events is not None else WorkerEventLog(False)
        #: the decode side of a hand-off unpins the pinned blocks it loaded (their TTL stays the backstop)
        self.unpin_loaded = role == "kv_consumer"
        self.async_saves = config.save_mode != "sync"
        self.saver: AsyncSaver | None = None
        self.loader: AsyncLoader | None = None
        self._held: set[str] = set()  # finished requests whose blocks vLLM keeps until we report their saves
        self.requests = RequestTransfers()  # per request: what was loaded and saved for it
        #: called with (request id, its record as a dict or None) once a request's transfers are complete
        #: (the step log's worker records); None: nobody listens
        self.on_request_done: Callable[[str, dict | None], None] | None = None
        self._count_lock = threading.Lock()
        self.layout = layout
        self.fingerprint = layout.fingerprint()
        self.layer_names = layer_names
        self.counters = counters          # totals since start
        self.interval = Counters()        # since the last get_kv_connector_stats
        self.link = StoreLink(config.url, timeout=config.timeout_s, retry_s=config.retry_s,
                              transport=config.transport, name="worker")
        self.io: BlockIO | None = None
        self._load_errors: set[int] = set()
        self._warned_save_error = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.layer_names if name not in kv_caches]
        if missing:
            raise ValueError(f"kvstore connector: no KV cache registered for layers {missing}")
        self.io = BlockIO([kv_caches[name] for name in self.layer_names], self.layout, verify=self.config.verify)
        if self.async_saves:
            self.saver = AsyncSaver(self.io, self._link("saver"), self._count, ttl=self.config.ttl_s,
                                    max_bytes=self.config.max_pending_save_bytes, on_saved=self.events.stored)
        if self.config.async_loads:
            self.loader = AsyncLoader(self.io, self._link("loader"), unpin=self.unpin_loaded, count=self._count)
        log.info("kvstore worker: %d layers, %s/%s %s, block %d tokens = %d bytes, layout %s", len(self.layer_names),
                 self.layout.backend, self.layout.packing, self.layout.dtype, self.layout.block_size,
                 self.layout.block_nbytes, self.fingerprint)
        self._publish_layout()

    def _link(self, name: str) -> StoreLink:
        return StoreLink(self.config.url, timeout=self.config.timeout_s, retry_s=self.config.retry_s,
                         transport=self.config.transport, name=name)

    def _publish_layout(self) -> None:
        """Store the layout next to the blocks (``vllm/<fingerprint>/layout``) so that ``kvstore ls`` and
        ``kvstore inspect`` show what the blocks under a fingerprint are. Best effort."""
        key = layout_key(self.fingerprint)
        mine = self.layout.to_dict()
        try:
            store = self.link.client()
            store.put(key, json.dumps(mine).encode(), meta=mine)
            # The model's index: every fingerprint its instances used, so a mismatch is loud, not a silent miss.
            store.put(model_layouts_prefix(self.layout.model) + self.fingerprint, b"", meta=mine)
            others = [k for k in store.keys(model_layouts_prefix(self.layout.model))
                      if not k.endswith(self.fingerprint)]
            for other in others[:4]:
                theirs = store.inspect(other).get("meta") or {}
                diff = {f: (theirs.get(f), v) for f, v in mine.items()
                        if f not in ("tp_rank",) and theirs.get(f) != v}
                if not diff:
                    continue  # another TP rank of the same layout: its shards are not ours to load
                log.warning("kvstore worker: the store holds blocks of model %s under layout %s, which differs from "
                            "this instance's layout %s in %s (theirs vs ours): those blocks never hit here; give "
                            "every instance sharing this store the same settings", self.layout.model,
                            other.rsplit("/", 1)[-1], self.fingerprint,
                            ", ".join(f"{f}={a!r} vs {b!r}" for f, (a, b) in diff.items()) or "nothing visible")
        except (StoreUnavailable, KVStoreError, *CONNECTION_ERRORS) as exc:
            log.info("kvstore worker: layout not published under %s (%s)", key, exc)

    def _count(self, req_id: str | None = None, **deltas: float) -> None:
        """Add to the counters (the saver thread counts too); with ``req_id``, to that request's record."""
        with self._count_lock:
            for name, value in deltas.items():
                if name in _COUNTER_FIELDS:
                    setattr(self.counters, name, getattr(self.counters, name) + value)
                    setattr(self.interval, name, getattr(self.interval, name) + value)
        if req_id is not None:
            mine = {name: value for name, value in deltas.items() if name in _REQUEST_FIELDS}
            if mine:
                self.requests.add(req_id, **mine)

    def request_transfers(self, req_id: str, *, pop: bool = True) -> RequestTransfer | None:
        """What this worker loaded and saved for ``req_id`` (None: nothing); ``pop`` forgets it."""
        return self.requests.pop(req_id) if pop else self.requests.get(req_id)

    # ---- loads ----------------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVStoreConnectorMetadata) -> None:
        self._held.update(meta.held)
        for transfer in meta.loads:
            items = [(block_key(self.fingerprint, bytes.fromhex(d)), b)
                     for d, b in zip(transfer.digests, transfer.block_ids, strict=True)]
            if meta.async_loads:
                self.loader.submit(transfer.req_id, items)
                continue
            try:
                store = self.link.client()
            except StoreUnavailable:
                self._fail_load(transfer.block_ids)
                continue
            result = self.io.load(store, items)
            if result.connection_lost:
                self.link.fault(ConnectionError("connection lost during a load"))
            self._account_load(transfer.req_id, result)
            if self.unpin_loaded and result.loaded:
                failed = set(result.failed_blocks)
                self._count(unpinned_blocks=unpin_loaded(self.link, [k for k, b in items if b not in failed]))

    def _account_load(self, req_id: str, result: LoadResult) -> None:
        if result.connection_lost:
            self._count(store_faults=1)
        if result.failed_blocks:
            self._fail_load(result.failed_blocks)
        self._count(req_id, loaded_blocks=result.loaded, load_bytes=result.nbytes, load_seconds=result.seconds,
                    checksum_errors=result.checksum_errors, missing_blocks=result.missing,
                    corrupt_removed=result.corrupt_removed)
        self.events.removed(result.missing_keys + result.corrupt_keys)
        if result.checksum_errors:
            log.warning("kvstore worker: %d block(s) of request %s failed their checksum; recomputing them",
                        result.checksum_errors, req_id)

    def _fail_load(self, block_ids) -> None:
        self._load_errors.update(block_ids)
        self._count(load_errors=len(block_ids))

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose held blocks vLLM may free: their saves landed or were dropped, requests whose
        asynchronous load ended). A load's failed blocks go to ``get_block_ids_with_load_errors``, which vLLM
        reads right after this in the same step."""
        recving = set()
        if self.loader is not None:
            for req_id, result in self.loader.take():
                self._account_load(req_id, result)
                self._count(async_loads=1)
                recving.add(req_id)
        sending = self.saver.finished(self._held) if self.saver is not None else set(self._held)
        self._held -= sending
        self._count(held_requests=len(sending))
        if self.on_request_done is not None:
            # complete: finished without saves in flight (its loads were done before it ran), or saves landed
            for req_id in sorted((set(finished_req_ids or ()) - self._held) | sending):
                record = self.requests.get(req_id)
                self.on_request_done(req_id, None if record is None else record.as_dict())
        return sending or None, recving or None

    def handle_preemptions(self, meta: KVStoreConnectorMetadata) -> None:
        """Preempted requests' blocks go back to vLLM's pool after this step: their queued saves must read
        them first."""
        if self.saver is None or not meta.preempted:
            return
        if not self.saver.wait_for(meta.preempted, self.config.timeout_s):
            log.warning("kvstore worker: saves of preempted requests %s still running after %.1f s; their blocks "
                        "may be reused under them", meta.preempted, self.config.timeout_s)

    # ---- saves ----------------------------------------------------------------------------------------
    def wait_for_save(self, meta: KVStoreConnectorMetadata) -> None:
        ttl = self.config.handoff_ttl_s if meta.pinned else self.config.ttl_s
        if self.saver is not None:
            for transfer in meta.saves:
                self.saver.submit(transfer.req_id, self._items(transfer), pin=meta.pinned, ttl=ttl)
            return
        items = [item for transfer in meta.saves for item in self._items(transfer)]
        if not items:
            return
        try:
            store = self.link.client()
        except StoreUnavailable:
            self._count(dropped_saves=len(items))
            return
        start = time.perf_counter()
        try:
            nbytes = self.io.save(store, items, ttl=ttl, pin=meta.pinned)
        except CONNECTION_ERRORS as exc:
            self.link.fault(exc)
            self._count(dropped_saves=len(items), store_faults=1)
            return
        except KVStoreError as exc:  # store full of pinned data, a bad key...: drop, warn once
            self._count(dropped_saves=len(items))
            if not self._warned_save_error:
                self._warned_save_error = True
                log.warning("kvstore worker: dropping saves (%s: %s); further drops are only counted",
                            type(exc).__name__, exc)
            return
        seconds = time.perf_counter() - start
        self._count(saved_blocks=len(items), save_bytes=nbytes, save_seconds=seconds)
        self.events.stored([key for key, _ in items])
        for transfer in meta.saves:  # one write for the step's requests: each gets its blocks' share
            share = len(transfer.block_ids) / len(items)
            self.requests.add(transfer.req_id, saved_blocks=len(transfer.block_ids),
                              save_bytes=len(transfer.block_ids) * self.layout.block_nbytes,
                              save_seconds=seconds * share)

    def _items(self, transfer) -> list[tuple[str, int]]:
        return [(block_key(self.fingerprint, bytes.fromhex(d)), b)
                for d, b in zip(transfer.digests, transfer.block_ids, strict=True)]

    def drain_saves(self, timeout: float) -> bool:
        """Wait for queued asynchronous saves; False if some were still queued after ``timeout`` seconds."""
        return self.saver.drain(timeout) if self.saver is not None else True

    def take_interval_stats(self) -> dict[str, Any] | None:
        with self._count_lock:
            data = self.interval.as_dict()
            if not any(data.values()):
                return None
            self.interval = Counters()
        return data

    def shutdown(self) -> None:
        if self.saver is not None:
            self.saver.close(2 * self.config.timeout_s)
        if self.loader is not None:
            self.loader.close(2 * self.config.timeout_s)
        self.link.close()
