"""SchedulerSide: the connector's half in vLLM's scheduler: lookups and the per-step load/save plan.

Per request it keeps the chained digests of the prompt's full blocks (computed once), the request's block
ids, and how many leading blocks need no save (found locally, loaded, or already saved). Each step,
``build_connector_meta`` tells the workers which blocks to load (planned at lookup) and which newly computed
full prompt blocks to save. Workers form the store keys from the digests with their own layout fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.errors import KVStoreError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.keys import CacheLayout, block_hashes, block_key
from kvstore.integrations.vllm.stats import Counters
from kvstore.integrations.vllm.store_link import CONNECTION_ERRORS, StoreLink, StoreUnavailable, log


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


@dataclass(slots=True)
class _Request:
    prompt: list[int]
    cacheable: bool = True         # False: KV depends on more than token ids; never looked up nor saved
    digests: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    local_blocks: int = 0          # leading blocks vLLM's own prefix cache had at lookup
    hit_blocks: int = 0            # blocks after those that the store had at lookup
    done_blocks: int = 0           # leading blocks that need no save
    load: list[tuple[bytes, int]] | None = None  # planned at alloc, sent with the next metadata


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, layouts: list[CacheLayout], role: str, block_size: int,
                 counters: Counters):
        self.config = config
        self.fingerprints = [layout.fingerprint() for layout in layouts]  # one per TP rank
        self.loads_enabled = role in ("kv_both", "kv_consumer")
        self.saves_enabled = role in ("kv_both", "kv_producer")
        self.block_size = block_size
        self.counters = counters
        self.root = "vllm-prompt"
        #: True: no lookups and no saves (the engine runs as without a connector): A/B measurement in one engine.
        self.paused = False
        self.link = StoreLink(config.url, timeout=config.timeout_s, retry_s=config.retry_s,
                              transport=config.transport, name="scheduler")
        self._requests: dict[str, _Request] = {}

    # ---- lookups --------------------------------------------------------------------------------------
    def _state(self, request: Any) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _Request(list(request.prompt_token_ids or ()),
                                                                  cacheable=not _uncacheable(request))
        return state

    def _digests(self, state: _Request, n: int) -> list[bytes]:
        if len(state.digests) < n:
            prev = state.digests[-1] if state.digests else None
            state.digests += block_hashes(state.prompt[:n * self.block_size], self.block_size, self.root,
                                          start=len(state.digests), previous=prev)
        return state.digests[:n]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._state(request)
        state.local_blocks = num_computed_tokens // self.block_size
        state.hit_blocks = 0
        if self.paused or not self.loads_enabled or not state.cacheable:
            return 0, False
        claimable = (len(state.prompt) - 1) // self.block_size  # never the prompt's last token
        if claimable <= state.local_blocks:
            return 0, False
        digests = self._digests(state, claimable)[state.local_blocks:]
        keys = [block_key(fp, d) for d in digests for fp in self.fingerprints]
        try:
            present = self.link.client().batch_exists(keys)
        except StoreUnavailable:
            self.counters.lookup_errors += 1
            return 0, False
        except CONNECTION_ERRORS as exc:
            self.link.fault(exc)
            self.counters.lookup_errors += 1
            self.counters.store_faults += 1
            return 0, False
        except KVStoreError as exc:
            log.warning("kvstore scheduler: lookup failed (%s: %s); treating as a miss", type(exc).__name__, exc)
            self.counters.lookup_errors += 1
            return 0, False
        self.counters.lookups += 1
        ranks = len(self.fingerprints)
        hits = 0
        while hits < len(digests) and all(present[hits * ranks:(hits + 1) * ranks]):
            hits += 1
        state.hit_blocks = hits
        return hits * self.block_size, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._state(request)
        state.block_ids = list(blocks.get_block_ids()[0])
        n = num_external_tokens // self.block_size if self.loads_enabled else 0
        first = state.local_blocks
        if n > 0:
            digests = self._digests(state, first + n)[first:]
            state.load = list(zip(digests, state.block_ids[first:first + n], strict=True))
            self.counters.hit_tokens += n * self.block_size
        state.done_blocks = max(state.done_blocks, first + n)

    # ---- the step's plan ------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                state = self._requests[new.req_id] = _Request(list(new.prompt_token_ids or ()),
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
        return meta

    def _plan(self, meta: KVStoreConnectorMetadata, req_id: str, state: _Request, computed_after: int) -> None:
        if state.load:
            meta.loads.append(BlockTransfer(req_id, [d.hex() for d, _ in state.load], [b for _, b in state.load]))
            state.load = None
        if self.paused or not (self.saves_enabled and state.cacheable):
            return
        upto = min(len(state.prompt) // self.block_size, computed_after // self.block_size, len(state.block_ids))
        if upto > state.done_blocks:
            digests = self._digests(state, upto)
            meta.saves.append(BlockTransfer(req_id, [d.hex() for d in digests[state.done_blocks:upto]],
                                            state.block_ids[state.done_blocks:upto]))
            state.done_blocks = upto

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        # Saves are synchronous (done in the worker's wait_for_save of the step that computed the blocks,
        # before the scheduler learns the request finished), so the blocks can be freed now.
        self._requests.pop(request.request_id, None)
        return False, None

    def shutdown(self) -> None:
        self.link.close()


def _uncacheable(request: Any) -> bool:
    """Requests whose KV is not a function of their token ids alone (images, audio, LoRA, embeddings)."""
    return bool(getattr(request, "mm_features", None) or getattr(request, "lora_request", None)
                or getattr(request, "prompt_embeds", None) is not None)


__all__ = ["BlockTransfer", "KVStoreConnectorMetadata", "SchedulerSide"]
