"""The engine's side of the prefill -> decode hand-off: a thin, timed adapter over ``kvstore.handoff.KVHandoff``.

The engine only knows :class:`benchmarks.pd.engine.KVPort` (``publish`` / ``fetch`` returning seconds spent);
this module is the one place that speaks the store's API, so the benchmark uses the library exactly as a
serving engine would. ``kvstore`` is imported on first use, not at import time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from benchmarks.pd.kv_cache import CacheSpec, PagedKVCache
from benchmarks.pd.request import Request


class Transport(Enum):
    AUTO = "auto"
    SHM = "shm"
    TCP = "tcp"


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """Where hand-offs go: a daemon at ``url`` (``unix:///path`` or ``tcp://host:port``), or, when ``url`` is
    None, an embedded store shared by every worker of one process."""

    url: str | None = None
    transport: Transport = Transport.AUTO
    capacity: str = "2GiB"
    ttl_s: float = 60.0
    fetch_timeout_s: float = 10.0
    # True: publish with the prompt's token ids, so chunks get chained prefix keys (shareable, lookup-able);
    # False: request-scoped chunk keys. See the deployment's ``handoff_prefix_keys``.
    prefix_keys: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.transport, Transport):
            raise TypeError(f"transport must be a Transport, got {self.transport!r}")
        if self.ttl_s <= 0 or self.fetch_timeout_s <= 0:
            raise ValueError(f"ttl_s and fetch_timeout_s must be > 0, got {self.ttl_s}, {self.fetch_timeout_s}")


def kv_layout(cache_spec: CacheSpec, model_id: str) -> Any:
    """The ``kvstore.KVLayout`` describing a :class:`PagedKVCache` of ``cache_spec``."""
    from kvstore import KVLayout, KVLayoutKind
    return KVLayout(kind=KVLayoutKind.VLLM_FLASH_NHD, num_layers=cache_spec.num_layers,
                    num_kv_heads=cache_spec.num_kv_heads, head_dim=cache_spec.head_dim,
                    block_size=cache_spec.block_size, dtype=cache_spec.dtype, model_id=model_id)


def open_store(spec: StoreSpec) -> Any:
    """Connect to the daemon named by ``spec.url``, or create an embedded store when it is None."""
    import kvstore

    if spec.url is None:
        return kvstore.KVStore.embedded(capacity=spec.capacity)
    return kvstore.connect(spec.url, transport=spec.transport.value)


class KVTransfer:
    """Publishes and fetches one request's prompt KV; each call returns the seconds it took."""

    def __init__(self, spec: StoreSpec, cache_spec: CacheSpec, model_id: str, store: Any | None = None):
        self.spec = spec
        self._layout = kv_layout(cache_spec, model_id)
        self._owns_store = store is None
        self._store = store if store is not None else open_store(spec)
        from kvstore.handoff import KVHandoff

        self._handoff = KVHandoff(self._store, self._layout)

    def publish(self, request: Request, cache: PagedKVCache, block_ids: list[int]) -> float:
        start = time.monotonic()
        token_ids = request.prompt_ids if self.spec.prefix_keys else None
        ticket = self._handoff.publish(request.id, cache.layers, block_ids, num_tokens=request.num_prompt,
                                       token_ids=token_ids, ttl=self.spec.ttl_s)
        ticket.wait(timeout=self.spec.fetch_timeout_s)  # TimeoutError (an OSError): the request is re-prefilled
        return time.monotonic() - start

    def fetch(self, request: Request, cache: PagedKVCache, block_ids: list[int]) -> float:
        start = time.monotonic()
        if request.refetch and self._refetch(request, cache, block_ids):
            return time.monotonic() - start
        self._handoff.fetch(request.id, cache.layers, block_ids, timeout=self.spec.fetch_timeout_s,
                            num_tokens=request.num_prompt)
        return time.monotonic() - start

    def _refetch(self, request: Request, cache: PagedKVCache, block_ids: list[int]) -> bool:
        """Recovery after a decode worker died: its request's hand-off record was consumed by the dead
        worker's fetch, but prefix-keyed chunks stay in the store until their TTL, so the whole prompt's KV
        can be fetched again by token prefix. False when it cannot (request-scoped keys, or chunks gone);
        the caller then tries the hand-off record, which is still there if the dead worker never fetched it."""
        if not self.spec.prefix_keys:
            return False
        fetched = self._handoff.fetch_prefix(request.prompt_ids, cache.layers, block_ids)
        if fetched != request.num_prompt:
            return False
        self._handoff.cancel(request.id)  # the hand-off record, if the dead worker had not fetched it yet
        return True

    def close(self) -> None:
        self._handoff.close()
        if self._owns_store:
            self._store.close()
