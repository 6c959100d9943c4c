"""The three deployments and one run of a trace through one of them.

Equal compute: every architecture gets ``num_workers`` engine workers of ``threads_per_worker`` torch threads
(default 2 x 1). Collocated and chunked run that many full replicas, the router splitting requests between
them; disaggregated runs ``prefill_workers`` prefill-only and the rest decode-only workers, plus a
``kvstore serve`` daemon for the hand-off (its CPU time is reported, not counted as engine compute).

Outputs in ``out_dir``: ``requests.jsonl`` (one :class:`RequestRecord` per line), ``summary.json``, and
``timeline.jsonl`` (one line per engine step of every worker, for interference and timeline plots).
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.pd.admission import Admission, Immediate
from benchmarks.pd.energy import EnergyMeter
from benchmarks.pd.fault import FaultSpec, recovery_report
from benchmarks.pd.model import ModelConfig
from benchmarks.pd.pool import InlinePool, ProcessPool
from benchmarks.pd.router import Router
from benchmarks.pd.scheduler import Policy
from benchmarks.pd.store_daemon import StoreDaemon
from benchmarks.pd.summary import summarize
from benchmarks.pd.trace import TokenTrace
from benchmarks.pd.transfer import StoreSpec, Transport
from benchmarks.pd.worker import WorkerSpec
from kvstore.workloads import runschema
from kvstore.workloads.arch import Arch  # the one Arch, shared with the planner and run logs

TIMELINE_FIELDS = ("start_s", "end_s", "prefill_tokens", "decode_tokens", "prefill_seqs", "running", "blocks_used",
                   "transfer_s")


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    arch: Arch
    model: ModelConfig = field(default_factory=ModelConfig)
    num_workers: int = 2
    prefill_workers: int = 1  # disaggregated only; the other workers decode
    threads_per_worker: int = 1
    num_blocks: int = 4096  # per worker
    block_size: int = 16
    chunk_budget: int = 256  # chunked: tokens per step (decodes + prompt chunks)
    prefill_batch_tokens: int = 1024  # prefill-first / prefill-only: prompt tokens batched into one step
    max_running: int = 64
    transport: Transport = Transport.AUTO
    inline: bool = False  # all workers in this process (stepped in turn), embedded store; for tests
    store_capacity: str = "2GiB"
    fetch_timeout_s: float = 10.0
    handoff_ttl_s: float = 60.0
    # publish hand-offs under prefix keys (chained hashes of the prompt's tokens) or request-scoped keys.
    # Prefix keys are what prefix reuse needs, but with kvstore.handoff as of this writing a fetch removes
    # chunks that a concurrent request with the same prefix still needs (it then aborts and is recomputed).
    handoff_prefix_keys: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.arch, Arch):
            raise TypeError(f"arch must be an Arch, got {self.arch!r}")
        for name in ("num_workers", "threads_per_worker", "num_blocks", "block_size", "chunk_budget",
                     "prefill_batch_tokens", "max_running"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"DeploymentConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.arch is Arch.DISAGGREGATED and not 1 <= self.prefill_workers < self.num_workers:
            raise ValueError(f"disaggregated needs 1 <= prefill_workers < num_workers, got "
                             f"{self.prefill_workers} of {self.num_workers}")

    def policies(self) -> list[Policy]:
        if self.arch is Arch.DISAGGREGATED:
            decode = self.num_workers - self.prefill_workers
            return [Policy.PREFILL_ONLY] * self.prefill_workers + [Policy.DECODE_ONLY] * decode
        return [Policy.PREFILL_FIRST if self.arch is Arch.COLOCATED else Policy.CHUNKED] * self.num_workers

    def worker_specs(self, store: StoreSpec | None) -> list[WorkerSpec]:
        specs = []
        for index, policy in enumerate(self.policies()):
            budget = self.chunk_budget if policy is Policy.CHUNKED else self.prefill_batch_tokens
            specs.append(WorkerSpec(index, policy, self.model, self.num_blocks, self.block_size, budget,
                                    self.max_running, self.threads_per_worker, store))
        return specs

    @property
    def max_request_tokens(self) -> int:
        return min(self.model.max_position, self.num_blocks * self.block_size)

    def describe(self) -> dict:
        m = self.model
        return {
            "arch": self.arch.value, "inline": self.inline,
            "workers": [{"index": i, "role": p.value, "threads": self.threads_per_worker, "process": not self.inline}
                        for i, p in enumerate(self.policies())],
            "engine_threads_total": self.num_workers * self.threads_per_worker,
            "chunk_budget": self.chunk_budget, "prefill_batch_tokens": self.prefill_batch_tokens,
            "max_running": self.max_running, "num_blocks_per_worker": self.num_blocks, "block_size": self.block_size,
            "transport": self.transport.value if self.arch is Arch.DISAGGREGATED else None,
            "store": None if self.arch is not Arch.DISAGGREGATED else ("embedded" if self.inline else "daemon"),
            "handoff_keys": None if self.arch is not Arch.DISAGGREGATED else (
                "prefix" if self.handoff_prefix_keys else "request"),
            "model": {name: getattr(m, name) for name in ModelConfig.__dataclass_fields__},
            "kv_bytes_per_token": m.kv_bytes_per_token,
        }


def _store(config: DeploymentConfig, stack: ExitStack,
           out_dir: Path) -> tuple[StoreSpec | None, StoreDaemon | None]:
    """Disaggregated: the hand-off store (embedded when inline, else a daemon started for this run)."""
    if config.arch is not Arch.DISAGGREGATED:
        return None, None
    common = {"capacity": config.store_capacity, "ttl_s": config.handoff_ttl_s,
              "fetch_timeout_s": config.fetch_timeout_s, "prefix_keys": config.handoff_prefix_keys}
    if config.inline:
        return StoreSpec(url=None, **common), None
    daemon = stack.enter_context(StoreDaemon(config.store_capacity, log_path=out_dir / "kvstore.log"))
    return StoreSpec(url=daemon.url, transport=config.transport, **common), daemon


def run(config: DeploymentConfig, trace: TokenTrace, out_dir: str | Path, *, progress: bool = False,
        admission: Admission | None = None, fault: FaultSpec | None = None) -> dict:
    """Serve ``trace`` on ``config``'s deployment in real time; write the outputs; return the summary.

    ``admission``: the router's admission policy (default: none, every request sent at once); ``fault``: a
    worker to kill during the run (needs worker processes). A worker that dies is replaced (worker
    processes only) and its requests re-fetched or re-prefilled; see router.py."""
    out_dir = Path(out_dir)
    trace.check_fits(config.max_request_tokens)
    if fault is not None and config.inline:
        raise ValueError("fault injection kills a worker process; it cannot run with inline workers")
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = config.worker_specs(None)[0].cache_spec
    cpu0: dict[str, float | None] = {}
    meter = EnergyMeter()
    with ExitStack() as stack:
        store, daemon = _store(config, stack, out_dir)
        pool = InlinePool(config.worker_specs(store)) if config.inline else ProcessPool(config.worker_specs(store))
        bar = stack.enter_context(_progress(len(trace.requests), config.arch.value, progress))

        def on_begin() -> None:
            meter.start()
            cpu0.update(router=time.process_time(), daemon=daemon.cpu_seconds() if daemon else None)

        def on_finish(record) -> None:
            bar.update(1)
            if not router.unfinished:
                meter.stop()  # the serving window ends with the last request, before the shutdown

        router = Router(trace, pool, config.policies(), lambda n: cache.blocks_for(n) * cache.block_bytes,
                        on_finish=on_finish, on_begin=on_begin, admission=admission, fault=fault,
                        respawn=not config.inline,
                        refetch=config.arch is Arch.DISAGGREGATED and config.handoff_prefix_keys)
        records, stats = router.run()
        meter.stop()
        store_stats = _store_stats(daemon)
        cpu = {"router": time.process_time() - cpu0["router"]}
        daemon_end = daemon.cpu_seconds() if daemon is not None else None
        if daemon_end is not None and cpu0["daemon"] is not None:
            cpu["store_daemon"] = daemon_end - cpu0["daemon"]
    summary = summarize(records, worker_info=router.worker_info, worker_stats=stats, deployment=config.describe(),
                        trace=trace.describe())
    summary["cpu_s"] = {"workers": {str(s["worker"]): s["cpu_s"] for s in stats},
                        **{k: round(v, 3) for k, v in cpu.items()},
                        "note": "process CPU seconds from the run's start to its end (start-up excluded); "
                                "inline workers share the router's process; a killed worker's are lost"}
    summary["energy"] = meter.result()
    summary["admission"] = (admission or Immediate()).describe()
    summary["fault"] = recovery_report(router.fault_log, [r.to_json() for r in records])
    summary["respawned_workers"] = router.respawned_info
    if daemon is not None:
        summary["store"] = store_stats
        summary["store_daemon_exit_code"] = daemon.exit_code
    _write_outputs(out_dir, records, summary, stats)
    return summary


def _store_stats(daemon: StoreDaemon | None) -> dict | None:
    """The hand-off store's occupancy after the run: fetched prefix-keyed chunks stay until their TTL."""
    if daemon is None:
        return None
    import kvstore

    with kvstore.connect(daemon.url, timeout=5.0) as client:
        s = client.stats()
    return {"used_bytes_at_end": s["used_bytes"], "objects_at_end": s["objects"],
            "capacity_bytes": s["capacity_bytes"]}


def _write_outputs(out_dir: Path, records: list, summary: dict, stats: list[dict]) -> None:
    with open(out_dir / runschema.REQUESTS_FILE, "w") as f:
        for record in records:
            f.write(json.dumps(record.to_json()) + "\n")
    with open(out_dir / runschema.TIMELINE_FILE, "w") as f:
        for s in stats:
            for step in s["timeline"]:
                fields = dict(zip(TIMELINE_FIELDS, step, strict=True))
                f.write(json.dumps({"worker": s["worker"], "role": s["role"], **fields})
                        + "\n")
    (out_dir / runschema.SUMMARY_FILE).write_text(json.dumps({**runschema.summary_header(), **summary}, indent=2)
                                                  + "\n")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _progress(total: int, label: str, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", leave=False)
