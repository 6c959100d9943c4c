"""One vLLM instance of the comparison, run as its own process: ``python -m benchmarks.pd.vllm_engine SPEC``.

``SPEC`` is an :class:`InstanceSpec` as JSON. The instance is a single-process CPU ``LLMEngine``
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with one OpenMP thread bound to one core, stepped by this module's
loop. The router speaks JSON lines (never pickle):

- stdin: ``{"op": "add", "id": ID, "prompt": [token ids], "max_tokens": N[, "kv_transfer_params": {...}]}`` and
  ``{"op": "stop"}``.
- stdout: ``{"ev": "ready", ...}`` once the engine is built, ``{"ev": "done", "id": ID, ...}`` per finished
  request (its token ids, the time of every token, when its first step started and ended, and the KV bytes
  and seconds the connector moved for it), and ``{"ev": "stats", ...}`` at stop (the step timeline, CPU
  seconds, RSS, the connector's counters).

Times are ``time.monotonic()`` (one clock for every process on the host) minus the run's ``t0``. A request's
KV bytes and seconds are the connector's own per-request record (``KVStoreConnector.request_transfers``: its
loader and saver threads count under the request, whatever step a transfer lands in); a producer's include
its saves still in flight when it finished. The connector's counters are also read around every step (the
timeline's transfer seconds).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import resource
import sys
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One instance: ``role`` is ``colocated`` (whole-prompt prefill steps), ``chunked`` (``max_batched_tokens``
    per step), ``kv_producer`` or ``kv_consumer`` (the connector to the daemon at ``url``)."""

    index: int
    role: str
    model: str
    core: int
    t0: float
    max_model_len: int
    max_batched_tokens: int
    block_size: int = 128
    kv_cache_bytes: int = 256 << 20
    dtype: str = "bfloat16"
    max_num_seqs: int = 64
    url: str = ""
    transport: str = "auto"

    def __post_init__(self) -> None:
        if self.role not in ("colocated", "chunked", "kv_producer", "kv_consumer"):
            raise ValueError(f"unknown instance role {self.role!r}")
        if self.role.startswith("kv_") and not self.url:
            raise ValueError(f"role {self.role} needs the store's url")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> InstanceSpec:
        return cls(**json.loads(text))


def env_for(spec: InstanceSpec) -> dict[str, str]:
    """The instance's environment: one process, one OpenMP thread bound to ``spec.core``."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": str(spec.core),
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}


def build_engine(spec: InstanceSpec):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if spec.role.startswith("kv_"):
        extra = {"url": spec.url, "transport": spec.transport, "timeout_s": 10.0}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role=spec.role, kv_connector_extra_config=extra)
    return LLM(model=spec.model, skip_tokenizer_init=True, dtype=spec.dtype, block_size=spec.block_size,
               kv_cache_memory_bytes=spec.kv_cache_bytes, max_model_len=spec.max_model_len, enforce_eager=True,
               max_num_batched_tokens=spec.max_batched_tokens, max_num_seqs=spec.max_num_seqs,
               enable_chunked_prefill=spec.role == "chunked", enable_prefix_caching=False, seed=0, **kw)


def _counters() -> dict[str, float]:
    try:
        from kvstore.integrations.vllm import live_connectors
    except ImportError:
        return {}
    total: dict[str, float] = {}
    for conn in live_connectors():
        for k, v in conn.counters.as_dict().items():
            total[k] = total.get(k, 0) + v
    return total


def _request_transfers(req_id: str) -> tuple[int, float]:
    """(bytes, seconds) the connector moved for a request: loaded, saved, and still being saved."""
    try:
        from kvstore.integrations.vllm import live_connectors
    except ImportError:
        return 0, 0.0
    nbytes, seconds = 0, 0.0
    for conn in live_connectors():
        record = conn.request_transfers(req_id)
        if record:
            nbytes += record["load_bytes"] + record["save_bytes"] + record["save_pending_bytes"]
            seconds += record["load_seconds"] + record["save_seconds"]
    return int(nbytes), seconds


class _Request:
    __slots__ = ("id", "prompt_tokens", "first_start", "first_end", "token_times", "ids", "kv_bytes", "kv_s")

    def __init__(self, rid: str, prompt_tokens: int):
        self.id, self.prompt_tokens = rid, prompt_tokens
        self.first_start = self.first_end = None
        self.token_times: list[float] = []
        self.ids: list[int] = []
        self.kv_bytes, self.kv_s = 0, 0.0


class Instance:
    """The engine and its loop; :meth:`serve` returns when the router says stop."""

    def __init__(self, spec: InstanceSpec, out=sys.stdout):
        self.spec, self.out = spec, out
        self.inbox: queue.Queue = queue.Queue()
        self.llm = build_engine(spec)
        self.engine = self.llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        self.live: dict[str, _Request] = {}  # vLLM's request id -> ours
        self.timeline: list[list] = []
        self.cpu0 = time.process_time()
        self.counters0: dict[str, float] = _counters()
        # counters as last read: the connector's threads also move bytes between steps, and those count too
        self._seen: dict[str, float] = dict(self.counters0)
        self.peak_kv_bytes = 0

    def now(self) -> float:
        return time.monotonic() - self.spec.t0

    def emit(self, event: dict) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()

    def _add(self, msg: dict) -> None:
        from vllm import SamplingParams

        # the prefill's promise (kv_transfer_params) rides with the decode request: the connector waits, bounded,
        # for saves still in flight instead of recomputing
        extra = {"kv_transfer_params": msg["kv_transfer_params"]} if msg.get("kv_transfer_params") else None
        params = SamplingParams(max_tokens=msg["max_tokens"], temperature=0.0, ignore_eos=True, extra_args=extra)
        internal = self.engine.add_request(msg["id"], {"prompt_token_ids": msg["prompt"]}, params)
        self.live[internal] = _Request(msg["id"], len(msg["prompt"]))

    def _drain(self, block: bool) -> bool:
        """Take the router's messages; False once it said stop."""
        while True:
            try:
                msg = self.inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return True
            if msg is None or msg["op"] == "stop":
                return False
            if msg["op"] == "stats":
                self.emit_stats()
            else:
                self._add(msg)
            block = False

    def _computed(self) -> dict[str, int]:
        return {rid: r.num_computed_tokens for rid, r in self.scheduler.requests.items()}

    def step(self) -> None:
        before, c0, start = self._computed(), self._seen, self.now()
        outputs = self.engine.step()
        end, c1, after = self.now(), _counters(), self._computed()
        self._seen = c1
        prefill = decode = 0
        started = []
        for rid, req in self.live.items():
            done = before.get(rid, 0)
            # a request that finished in this step has left the scheduler: it ran its prompt's rest, or a token
            n = after.get(rid, req.prompt_tokens if done < req.prompt_tokens else done + 1)
            if n <= done:
                continue
            if done < req.prompt_tokens:
                prefill += min(n, req.prompt_tokens) - done
            else:
                decode += n - done
            if req.first_start is None:
                req.first_start, req.first_end = start, end
                started.append(req)
        moved = {k: c1.get(k, 0) - c0.get(k, 0) for k in ("load_seconds", "save_seconds")}
        blocks, used = self._kv_used()
        self.peak_kv_bytes = max(self.peak_kv_bytes, used)
        self.timeline.append([round(start, 6), round(end, 6), prefill, decode, len(started), len(self.live),
                              blocks, round(moved["load_seconds"] + moved["save_seconds"], 6)])
        for out in outputs:
            self._on_output(out, end)

    def _kv_used(self) -> tuple[int, int]:
        """KV-cache blocks and bytes in use after the step, from vLLM's own block pool."""
        pool = self.scheduler.kv_cache_manager.block_pool
        usage = pool.get_usage()
        return round(usage * pool.num_gpu_blocks), int(usage * self.spec.kv_cache_bytes)

    def _on_output(self, out, t: float) -> None:
        rid = next((k for k in (out.request_id, getattr(out, "external_req_id", None)) if k in self.live), None)
        if rid is None:
            rid = next((k for k, r in self.live.items() if r.id == out.request_id), None)
        if rid is None:
            return
        req = self.live[rid]
        ids = list(out.outputs[0].token_ids)
        req.token_times += [round(t, 6)] * (len(ids) - len(req.ids))
        req.ids = ids
        if out.finished:
            del self.live[rid]
            req.kv_bytes, req.kv_s = _request_transfers(rid)
            if req.first_start is None:  # finished within one step that the scan above did not see
                req.first_start, req.first_end = req.token_times[0], req.token_times[0]
            self.emit({"ev": "done", "id": req.id, "output_ids": req.ids, "token_times_s": req.token_times,
                       "prefill_start_s": req.first_start, "prefill_end_s": req.first_end,
                       "kv_bytes": req.kv_bytes, "kv_s": round(req.kv_s, 6),
                       "cached_tokens": out.num_cached_tokens or 0,
                       "kv_transfer_params": getattr(out, "kv_transfer_params", None)})

    def serve(self) -> None:
        running = True
        while running or self.engine.has_unfinished_requests():
            if running:
                running = self._drain(block=not self.engine.has_unfinished_requests())
            if self.engine.has_unfinished_requests():
                self.step()
        self.emit_stats()

    def emit_stats(self) -> None:
        """The window since the last stats: its steps, CPU seconds and connector counters; then a new window."""
        counters = _counters()
        delta = {k: v - self.counters0.get(k, 0) for k, v in counters.items()}
        self.emit({"ev": "stats", "timeline": self.timeline, "cpu_s": round(time.process_time() - self.cpu0, 3),
                   "counters": delta, "rss_bytes": rss_bytes(), "peak_rss_bytes": peak_rss_bytes(),
                   "peak_kv_bytes": self.peak_kv_bytes})
        self.timeline, self.cpu0, self.counters0, self.peak_kv_bytes = [], time.process_time(), counters, 0


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _read_stdin(inbox: queue.Queue) -> None:
    for line in sys.stdin:
        if line.strip():
            inbox.put(json.loads(line))
    inbox.put(None)  # the router went away: finish what is running and stop


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m benchmarks.pd.vllm_engine SPEC_JSON", file=sys.stderr)
        return 2
    spec = InstanceSpec.from_json(argv[0])
    for key, value in env_for(spec).items():
        os.environ.setdefault(key, value)
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's prints must not corrupt the event stream
    rss0 = rss_bytes()
    instance = Instance(spec, out)
    instance.emit({"ev": "ready", "pid": os.getpid(), "rss_bytes": rss_bytes(), "rss_before_engine": rss0,
                   "weight_bytes": _weight_bytes(instance.llm)})
    threading.Thread(target=_read_stdin, args=(instance.inbox,), daemon=True).start()
    instance.serve()
    return 0


def _weight_bytes(llm) -> int | None:
    """The model's parameter bytes as the instance holds them (vLLM's own model object)."""
    try:
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        return sum(p.numel() * p.element_size() for p in model.parameters())
    except AttributeError:
        return None


if __name__ == "__main__":
    sys.exit(main())
