"""KVStorePromMetrics: the connector's counters on vLLM's ``/metrics`` (``build_prom_metrics``).

vLLM sums every step's :class:`~.stats.KVStoreConnectorStats` (the workers' and the scheduler's) and hands the
sum to :meth:`observe` in the API server's process; each counter becomes ``vllm:kvstore_<name>_total`` with
vLLM's per-engine labels: hits (``hit_tokens``, ``loaded_blocks``), misses and errors (``load_errors``,
``checksum_errors``, ``missing_blocks``, ``lookup_errors``, ``store_faults``), bytes and seconds spent
(``load_bytes``/``load_seconds``, ``save_bytes``/``save_seconds``: rate(bytes) / rate(seconds) is the
bandwidth), ``dropped_saves``, and the hand-off (``promised_requests``, ``promised_misses``, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from kvstore.integrations.vllm.stats import Counters

_HELP = {
    "lookups": "Batched store lookups answered", "lookup_errors": "Lookups that failed (store unavailable)",
    "hit_tokens": "Prompt tokens found in the store", "loaded_blocks": "Blocks loaded from the store",
    "load_bytes": "Bytes loaded from the store", "load_seconds": "Seconds spent loading",
    "load_errors": "Blocks whose load failed (recomputed)", "checksum_errors": "Loaded blocks with a bad checksum",
    "missing_blocks": "Blocks found at lookup but gone at load", "saved_blocks": "Blocks saved to the store",
    "save_bytes": "Bytes saved to the store", "save_seconds": "Seconds spent saving",
    "dropped_saves": "Blocks not saved (store full, unavailable, or too much pending)",
    "store_faults": "Store connection faults", "async_loads": "Requests loaded asynchronously",
    "held_requests": "Finished requests whose blocks were held until their saves landed",
    "promised_requests": "Decode requests carrying a kvstore hand-off promise",
    "handoff_waits": "Scheduler steps a promised request waited for blocks in flight",
    "promised_misses": "Promised requests that found fewer blocks than promised",
    "promised_missing_blocks": "Promised blocks missing from the store",
    "promise_layout_mismatches": "Promises made under another layout fingerprint",
    "unpinned_blocks": "Pinned hand-off blocks unpinned once the decode side loaded them",
    "corrupt_removed": "Blocks that failed their checksum, removed from the store (recomputed)",
    "reloads_refused": "Lookups skipped for requests whose loads kept failing (recomputed)",
    "events_dropped": "KV events dropped because nobody took them (bounded queues)",
}


class KVStorePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_cls = metric_types[Counter]
        self.counters = {}
        for f in dataclasses.fields(Counters):
            metric = counter_cls(name=f"vllm:kvstore_{f.name}", documentation=_HELP.get(f.name, f.name),
                                 labelnames=labelnames)
            self.counters[f.name] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
