"""KVStoreConnector: kvstore as a vLLM V1 KV connector (shared prefix cache, and prefill/decode hand-off).

    from vllm.config import KVTransferConfig
    KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
                     kv_role="kv_both",  # or kv_producer / kv_consumer
                     kv_connector_extra_config={"url": "unix:///run/kvstore.sock"})

vLLM builds one instance in the scheduler (:class:`~.scheduler.SchedulerSide`) and one per worker
(:class:`~.worker.WorkerSide`); this class only routes vLLM's calls to the right half. ``docs/vllm.md`` has
the keys, the fault behaviour and the measured costs.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.errors import StoreConnectionError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.events import EventBook, WorkerEventLog, WorkerEvents, kv_events_enabled
from kvstore.integrations.vllm.keys import layout_from_vllm_config
from kvstore.integrations.vllm.scheduler import KVStoreConnectorMetadata, SchedulerSide
from kvstore.integrations.vllm.stats import Counters, KVStoreConnectorStats
from kvstore.integrations.vllm.steplog import SchedulerSteps, StepLogWriter, WorkerTransfers, worker_path
from kvstore.integrations.vllm.store_link import CONNECTION_ERRORS, log
from kvstore.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.distributed.kv_events import KVCacheEvent

_LIVE: weakref.WeakSet = weakref.WeakSet()


def live_connectors() -> list[KVStoreConnector]:
    """The connectors alive in this process (tests and benchmarks read their :attr:`counters`)."""
    return list(_LIVE)


class KVStoreConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        self.kv_role = str(transfer.kv_role or "kv_both")
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise NotImplementedError("kvstore's vLLM connector does not support pipeline parallelism yet")
        self.counters = Counters()
        self._reported = Counters()  # the scheduler half's counters at the last get_kv_connector_stats
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._steps: SchedulerSteps | None = None
        self._transfers_log: WorkerTransfers | None = None
        self._log_writer: StepLogWriter | None = None
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        events = kv_events_enabled(vllm_config)
        if not self.config.transfers:
            # moves nothing: no store, no halves; only the step log (if any)
            if role == KVConnectorRole.SCHEDULER and self.config.step_log:
                self._log_writer = StepLogWriter(self.config.step_log, self.config.step_log_max_records)
                self._steps = SchedulerSteps(self._log_writer)
            log.info("kvstore connector: transfers off (step log %s)", self.config.step_log or "off")
        elif role == KVConnectorRole.SCHEDULER:
            layouts = [layout_from_vllm_config(vllm_config, kv_cache_config, r) for r in range(tp_size)]
            block_size = vllm_config.cache_config.block_size
            book = EventBook(events, [layout.fingerprint() for layout in layouts], block_size, self.config.max_events)
            self._scheduler = SchedulerSide(self.config, layouts, self.kv_role, block_size, self.counters, book)
            if self.config.step_log:
                self._log_writer = StepLogWriter(self.config.step_log, self.config.step_log_max_records)
                self._steps = SchedulerSteps(self._log_writer)
            self._connect_at_start(self._scheduler.link)
            if not self.config.keep_load_failure_policy and transfer.kv_load_failure_policy != "recompute":
                # A store fault must never fail a request: vLLM recomputes blocks reported as load errors.
                transfer.kv_load_failure_policy = "recompute"
                log.info("kvstore connector: kv_load_failure_policy set to 'recompute'")
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            layout = layout_from_vllm_config(vllm_config, kv_cache_config, rank)
            layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
            self._worker = WorkerSide(self.config, layout, layer_names, self.counters, self.kv_role,
                                      WorkerEventLog(events, self.config.max_events))
            if self.config.step_log:
                self._log_writer = StepLogWriter(worker_path(self.config.step_log, rank),
                                                 self.config.step_log_max_records)
                self._transfers_log = WorkerTransfers(self._log_writer, rank, layout.block_nbytes)
                self._worker.on_request_done = self._transfers_log.done
            self._connect_at_start(self._worker.link)
        _LIVE.add(self)

    def _connect_at_start(self, link: Any) -> None:
        try:
            link.connect()
        except CONNECTION_ERRORS as exc:
            if self.config.require_store_at_start:
                raise StoreConnectionError(
                    f"kvstore connector: no kvstore daemon answers at {self.config.url} ({exc}). Start one with "
                    f"`kvstore serve --listen {self.config.url}`, or pass require_store_at_start=False in "
                    "kv_connector_extra_config to start without it (lookups miss and saves are dropped until "
                    "it is reachable)") from None
            link.fault(exc)

    def pause(self, paused: bool = True) -> None:
        """Scheduler half: stop (or resume) lookups and saves, so that one engine can be measured with and
        without the connector. No effect on a worker half."""
        if self._scheduler is not None:
            self._scheduler.paused = paused

    def wait_for_saves(self, timeout: float = 30.0) -> bool:
        """Worker half: block until queued asynchronous saves are in the store (True) or ``timeout`` passes."""
        return self._worker.drain_saves(timeout) if self._worker is not None else True

    def request_transfers(self, req_id: str, *, pop: bool = True) -> dict[str, int | float] | None:
        """Worker half: the KV this worker loaded and saved for ``req_id`` (``load_bytes``, ``load_seconds``,
        ``loaded_blocks``, ``save_bytes``, ``save_seconds``, ``saved_blocks`` landed, ``save_pending_bytes``
        still queued), whatever step it landed in; None when it moved nothing (or on the scheduler half).
        ``pop`` forgets the record (records are otherwise kept for the last 4096 requests)."""
        if self._worker is None:
            return None
        record = self._worker.request_transfers(req_id, pop=pop)
        return None if record is None else record.as_dict()

    def request_transfer_ids(self) -> list[str]:
        """Worker half: the request ids :meth:`request_transfers` holds a record for (oldest first)."""
        return self._worker.requests.ids() if self._worker is not None else []

    # ---- scheduler side -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._steps is not None:  # the step log reads the pool's usage at each step
            self._steps.block_pool = getattr(kv_cache_manager, "block_pool", None)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        if self._steps is not None:
            self._steps.on_schedule(scheduler_output)
        if self._scheduler is None:
            return KVStoreConnectorMetadata()
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        hold, params = self._scheduler.request_finished(request, block_ids) if self._scheduler else (False, None)
        if self._steps is not None:
            self._steps.on_finished(request.request_id, getattr(request, "num_prompt_tokens", None), params)
        return hold, params

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The connector's KV events since the last step (``BlockStored``/``BlockRemoved`` with medium
        STORAGE): vLLM's scheduler publishes them with its own (:mod:`.events`)."""
        if self._scheduler is None:
            return ()
        book = self._scheduler.events
        self.counters.events_dropped += book.take_dropped()
        return book.take()

    def has_pending_push_work(self) -> bool:
        # Finished requests' blocks are held for saves in flight: keep the engine stepping so that the
        # workers' get_finished reports them and vLLM frees the blocks, even with no request left.
        return self._scheduler is not None and self._scheduler.holds_blocks()

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.holds_blocks()

    @property
    def requires_kv_delivery(self) -> bool:
        # A shared prefix cache's dropped save is a future miss; only a prefill instance hands KV off.
        return self.kv_role == "kv_producer"

    # ---- worker side ----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # synchronous loads complete in start_load_kv; asynchronous ones are not in this step

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # all layers are saved together in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            self._worker.wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids) if self._worker else (None, None)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KVStoreConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker else set()

    def get_kv_connector_kv_cache_events(self) -> WorkerEvents | None:
        """Worker half: the keys saved and found gone since the last step, carried to the scheduler half in
        ``KVConnectorOutput.kv_cache_events`` (None when there are none or KV events are off)."""
        return self._worker.events.take() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        if self._steps is not None:  # vLLM asks once per update_from_output: the step's end
            self._steps.on_step_end()
        if self._worker is not None:
            data = self._worker.take_interval_stats()
        else:  # the scheduler half's counters since the last call (vLLM adds them to the workers')
            delta = self.counters.minus(self._reported)
            self._reported = dataclasses.replace(self.counters)
            data = delta.as_dict() if any(delta.as_dict().values()) else None
        return None if data is None else KVStoreConnectorStats(data=data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from kvstore.integrations.vllm.metrics import KVStorePromMetrics

        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStoreConnectorStats:
        return KVStoreConnectorStats(data=data) if data is not None else KVStoreConnectorStats()

    def _metadata(self) -> KVStoreConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVStoreConnectorMetadata):
            raise TypeError(f"kvstore connector got {type(meta).__name__} metadata")
        return meta

    def shutdown(self) -> None:
        for half in (self._scheduler, self._worker):
            if half is not None:
                half.shutdown()
        if self._log_writer is not None:
            self._log_writer.close()
