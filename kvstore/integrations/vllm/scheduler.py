"""SchedulerSide: the connector's half in vLLM's scheduler: lookups, the per-step load/save plan, the hand-off.

Per request it keeps the chained digests of the prompt's full blocks (computed once), the request's block
ids, and how many leading blocks need no save (found locally, loaded, or already saved). Lookups run on a
thread (:mod:`.lookup`): ``get_num_new_matched_tokens`` answers None ("ask me again next step") while one is
in flight. A hit is loaded asynchronously by default: vLLM parks the request in WAITING_FOR_REMOTE_KVS and
the workers report it through ``get_finished``. Each step, ``build_connector_meta`` tells the workers which
blocks to load, which newly computed full prompt blocks to save, which finished requests' blocks vLLM keeps
until their saves land (``request_finished`` returned True for them) and which requests were preempted.
Workers form the store keys from the digests with their own layout fingerprint. ``docs/vllm.md`` has the
protocol (who holds which blocks when).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.integrations.vllm import transfer_params
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.events import BlockInfo, EventBook, external_hash
from kvstore.integrations.vllm.keys import PROMPT_ROOT, CacheLayout, block_hashes, block_key, prompt_root
from kvstore.integrations.vllm.lookup import Lookup, Lookups
from kvstore.integrations.vllm.stats import Counters
from kvstore.integrations.vllm.store_link import StoreLink, log

ROOT = PROMPT_ROOT
#: A decode request waiting for promised blocks asks the store again at most this often.
PROMISE_POLL_S = 0.005
#: Loads one request may try. vLLM reschedules a request whose load failed (recompute policy) and asks the
#: connector again; a block that keeps failing (corrupt bytes the worker could not remove, a store that fails
#: every load) must not send it round again forever: past this, the request computes its prompt.
MAX_LOAD_ATTEMPTS = 2


@dataclass(slots=True)
class BlockTransfer:
    """Blocks of one request to move this step: ``digests[i]`` (hex) goes to or from ``block_ids[i]``."""

    req_id: str
    digests: list[str]
    block_ids: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    async_loads: bool = False      # the loads complete on a worker thread and are reported by get_finished
    held: list[str] = field(default_factory=list)       # finished; vLLM keeps their blocks until reported
    preempted: list[str] = field(default_factory=list)  # their blocks may be reused after this step
    pinned: bool = False           # saves are hand-off blocks: pinned in the store until handoff_ttl_s


@dataclass(slots=True)
class _Request:
    prompt: list[int]
    root: str = ROOT
    cacheable: bool = True         # False: KV depends on more than token ids and salt; never looked up nor saved
    digests: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    local_blocks: int = 0          # leading blocks vLLM's own prefix cache had at lookup
    done_blocks: int = 0           # leading blocks that need no save (planned, loaded or local)
    load: list[tuple[bytes, int]] | None = None  # planned at alloc, sent with the next metadata
    lookup: Lookup | None = None
    promise: transfer_params.Promise | None = None
    deadline: float = 0.0          # until when a promise's missing blocks are waited for
    saves_planned: bool = False
    load_attempts: int = 0         # loads planned for this request (a failed one is rescheduled by vLLM)
    hashes: list[bytes] | None = None  # vLLM's block hashes of the request (KV events name blocks by them)
    lora: tuple[int | None, str | None] = (None, None)


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, layouts: list[CacheLayout], role: str, block_size: int,
                 counters: Counters, events: EventBook | None = None):
        self.config = config
        self.role = role
        self.fingerprints = [layout.fingerprint() for layout in layouts]  # one per TP rank
        self.loads_enabled = role in ("kv_both", "kv_consumer")
        self.saves_enabled = role in ("kv_both", "kv_producer")
        self.async_saves = config.save_mode != "sync"
        self.block_size = block_size
        self.counters = counters
        #: KV events for vLLM's publisher (take_events); off unless vLLM's kv_events_config enables them
        self.events = events if events is not None else EventBook(False, self.fingerprints, block_size)
        #: True: no lookups and no saves (the engine runs as without a connector): A/B measurement in one engine.
        self.paused = False
        self.link = StoreLink(config.url, timeout=config.timeout_s, retry_s=config.retry_s,
                              transport=config.transport, name="scheduler")
        self.lookups = Lookups(self.link)
        self._requests: dict[str, _Request] = {}
        self._to_load: list[str] = []
        self._held: set[str] = set()        # request_finished returned True; not yet reported by the workers
        self._held_new: list[str] = []      # ... and not yet told to the workers

    # ---- lookups --------------------------------------------------------------------------------------
    def _state(self, request: Any) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = self._new_state(request)
        return state

    def _new_state(self, request: Any) -> _Request:
        state = _Request(list(request.prompt_token_ids or ()), root=key_root(request),
                         cacheable=not _uncacheable(request))
        if self.events.enabled:
            hashes = getattr(request, "block_hashes", None)
            # vLLM hashes blocks of its own hash block size: usable only when it is ours (one hash per block)
            if isinstance(hashes, list) and len(hashes) == len(state.prompt) // self.block_size:
                state.hashes = hashes
            lora = getattr(request, "lora_request", None)
            if lora is not None:
                state.lora = (getattr(lora, "adapter_id", None), getattr(lora, "name", None))
        try:
            state.promise = transfer_params.parse(getattr(request, "kv_transfer_params", None))
        except transfer_params.BadParams as exc:
            log.warning("kvstore scheduler: request %s: ignoring its kv_transfer_params (%s)",
                        getattr(request, "request_id", getattr(request, "req_id", "?")), exc)
        if state.promise is not None:
            self.counters.promised_requests += 1
            state.deadline = time.monotonic() + self.config.handoff_wait_s
            if state.promise.fingerprint not in self.fingerprints:
                self.counters.promise_layout_mismatches += 1
                log.warning("kvstore scheduler: request %s was prepared by an instance with layout %s but this "
                            "instance's layout is %s: its KV cannot be used here (another model, dtype, block "
                            "size or attention kernel) and is recomputed", request.request_id,
                            state.promise.fingerprint, self.fingerprints[0])
                state.promise = None
        return state

    def _digests(self, state: _Request, n: int) -> list[bytes]:
        if len(state.digests) < n:
            prev = state.digests[-1] if state.digests else None
            state.digests += block_hashes(state.prompt[:n * self.block_size], self.block_size, state.root,
                                          start=len(state.digests), previous=prev)
        return state.digests[:n]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        state.local_blocks = local = num_computed_tokens // self.block_size
        if self.paused or not self.loads_enabled or not state.cacheable:
            return 0, False
        # An asynchronous load may cover the whole prompt: once it lands vLLM recomputes only the last token
        # (its num_computed_tokens drops to num_tokens - 1) to sample the next one. A synchronous hit must leave
        # the last token's block to compute: vLLM schedules at least one token of a fresh request.
        whole = len(state.prompt) if self.config.async_loads else len(state.prompt) - 1
        claimable = whole // self.block_size
        if claimable <= local:
            return 0, False
        if state.load_attempts >= MAX_LOAD_ATTEMPTS:
            self.counters.reloads_refused += 1
            return 0, False
        lookup = state.lookup
        if lookup is None or lookup.local_blocks != local:
            digests = self._digests(state, claimable)[local:]
            lookup = state.lookup = self.lookups.submit(
                [block_key(fp, d) for d in digests for fp in self.fingerprints], local)
        if not lookup.done.wait(self.config.lookup_wait_s):
            return None, False  # in flight: vLLM asks again on a later step
        if lookup.error is not None:
            self._count_lookup_error(lookup.error)
            state.lookup = None
            return 0, False
        hits = self._leading_hits(lookup.present)
        if self._wait_for_promise(request, state, local, claimable, hits):
            return None, False
        state.lookup = None
        self.counters.lookups += 1
        return hits * self.block_size, hits > 0 and self.config.async_loads

    def _leading_hits(self, present: list[bool]) -> int:
        ranks = len(self.fingerprints)
        hits = 0
        while (hits + 1) * ranks <= len(present) and all(present[hits * ranks:(hits + 1) * ranks]):
            hits += 1
        return hits

    def _count_lookup_error(self, error: str) -> None:
        self.counters.lookup_errors += 1
        if error == "fault":
            self.counters.store_faults += 1

    def _wait_for_promise(self, request: Any, state: _Request, local: int, claimable: int, hits: int) -> bool:
        """True while blocks promised by the prefill instance are missing and still worth waiting for (the
        lookup is asked again); at the deadline, or at once when nothing was still being saved, the missing
        blocks are a promised miss: counted and logged, then computed."""
        promise = state.promise
        if promise is None:
            return False
        promised = min(promise.num_tokens // self.block_size, claimable)
        if local + hits >= promised:
            state.promise = None
            return False
        now = time.monotonic()
        if promise.pending and now < state.deadline:
            if now - state.lookup.asked_at >= PROMISE_POLL_S:
                state.lookup = None  # ask again on the next call
            self.counters.handoff_waits += 1
            return True
        missing = promised - local - hits
        if self.events.enabled:
            self._note_blocks(state, local + hits, promised)
            self.events.removed([d.hex() for d in self._digests(state, promised)[local + hits:promised]])
        self.counters.promised_misses += 1
        self.counters.promised_missing_blocks += missing
        log.warning("kvstore scheduler: request %s was promised %d blocks (%d tokens) by its prefill instance but "
                    "%d are missing from the store%s (evicted, expired, or the prefill's saves failed); computing "
                    "them (counted as promised_misses)", request.request_id, promised, promise.num_tokens, missing,
                    f" after waiting {self.config.handoff_wait_s:.1f} s" if promise.pending else "")
        state.promise = None
        return False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._state(request)
        state.block_ids = list(blocks.get_block_ids()[0])
        state.lookup = None
        n = num_external_tokens // self.block_size if self.loads_enabled else 0
        first = state.local_blocks
        if n > 0:
            digests = self._digests(state, first + n)[first:]
            state.load = list(zip(digests, state.block_ids[first:first + n], strict=True))
            self._note_blocks(state, first, first + n)
            self._to_load.append(request.request_id)
            state.load_attempts += 1
            self.counters.hit_tokens += n * self.block_size
        # A producer saves its locally cached blocks too: the decode instance needs them in the store.
        skipped = first if self.role != "kv_producer" else 0
        state.done_blocks = max(state.done_blocks, skipped + n)

    # ---- the step's plan ------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(async_loads=self.config.async_loads, pinned=self.role == "kv_producer")
        for req_id in self._to_load:  # an async load's request is not scheduled this step: sent from here
            state = self._requests.get(req_id)
            if state is not None and state.load:
                meta.loads.append(BlockTransfer(req_id, [d.hex() for d, _ in state.load],
                                                [b for _, b in state.load]))
                state.load = None
        self._to_load = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                state = self._requests[new.req_id] = _Request(list(new.prompt_token_ids or ()), root=key_root(new),
                                                              cacheable=not _uncacheable(new))
            state.block_ids = list(new.block_ids[0])
            self._plan(meta, new.req_id, state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = list(new_ids[0])
            elif new_ids is not None:
                state.block_ids += new_ids[0]
            self._plan(meta, req_id, state, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        meta.held, self._held_new = self._held_new, []
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        return meta

    def _plan(self, meta: KVStoreConnectorMetadata, req_id: str, state: _Request, computed_after: int) -> None:
        if self.paused or not (self.saves_enabled and state.cacheable):
            return
        upto = min(len(state.prompt) // self.block_size, computed_after // self.block_size, len(state.block_ids))
        if upto > state.done_blocks:
            digests = self._digests(state, upto)
            meta.saves.append(BlockTransfer(req_id, [d.hex() for d in digests[state.done_blocks:upto]],
                                            state.block_ids[state.done_blocks:upto]))
            self._note_blocks(state, state.done_blocks, upto)
            state.done_blocks = upto
            state.saves_planned = True

    def _note_blocks(self, state: _Request, start: int, end: int) -> None:
        """Tell the event book what blocks ``start:end`` of the request are (their vLLM hashes, tokens)."""
        if not self.events.enabled:
            return
        digests = self._digests(state, end)
        hashes = state.hashes if state.hashes is not None else digests
        size = self.block_size
        infos = [BlockInfo(external_hash(hashes[i]), external_hash(hashes[i - 1]) if i else None,
                           tuple(state.prompt[i * size:(i + 1) * size]), *state.lora) for i in range(start, end)]
        self.events.note([d.hex() for d in digests[start:end]], infos)

    # ---- finishing: the hand-off ----------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Asynchronous saves still need the request's blocks: True (vLLM keeps them until a worker reports
        the request in ``finished_sending``). A saving instance returns the hand-off's ``kv_transfer_params``."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        hold = state.saves_planned and self.async_saves
        if hold:
            self._held.add(request.request_id)
            self._held_new.append(request.request_id)
        params = None
        if self.saves_enabled and state.cacheable and not self.paused:
            full = len(state.prompt) // self.block_size
            saved = min(state.done_blocks, full)
            params = transfer_params.Promise(self.fingerprints[0], num_tokens=saved * self.block_size,
                                             saved_blocks=saved, dropped_blocks=full - saved,
                                             pending=hold).to_params()
        return hold, params

    def update_connector_output(self, output: Any) -> None:
        for req_id in getattr(output, "finished_sending", None) or ():
            self._held.discard(req_id)
        self.events.on_worker_events(getattr(output, "kv_cache_events", None))
        invalid = getattr(output, "invalid_block_ids", None)
        if invalid:
            self._recompute_from(invalid)

    def _recompute_from(self, invalid: set[int]) -> None:
        """Blocks whose load failed are recomputed by vLLM: a saving instance saves them (and the ones after
        them) again once computed, instead of counting them as done."""
        for state in self._requests.values():
            for i, block_id in enumerate(state.block_ids[:state.done_blocks]):
                if block_id in invalid:
                    state.done_blocks = i
                    break

    def holds_blocks(self) -> bool:
        """Finished requests whose blocks vLLM keeps for a save in flight (the engine keeps stepping)."""
        return bool(self._held)

    def shutdown(self) -> None:
        self.lookups.close()
        self.link.close()


def key_root(request: Any) -> str:
    """The digest chain's root of a vLLM request (:func:`~kvstore.integrations.vllm.keys.prompt_root`)."""
    salt = getattr(request, "cache_salt", None) or ""
    lora = getattr(request, "lora_request", None)
    adapter = f"{lora.lora_name}@{getattr(lora, 'lora_path', '')}" if lora is not None else ""
    return prompt_root(salt, adapter)


def _uncacheable(request: Any) -> bool:
    """Requests whose KV is not a function of their token ids, salt and adapter (images, audio, embeddings)."""
    return bool(getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None)


__all__ = ["BlockTransfer", "KVStoreConnectorMetadata", "SchedulerSide", "key_root"]
