"""The three architectures on a real vLLM (CPU), and one trace served through one of them.

Equal compute: every architecture runs two vLLM instances (processes :mod:`benchmarks.pd.vllm_engine`), each
one OpenMP thread bound to its own core, behind the same router in this process:

- ``colocated``: two full instances, whole-prompt prefill steps (``max_num_batched_tokens`` = the model length);
- ``chunked``: two full instances with chunked prefill, ``chunk_budget`` tokens per step;
- ``disaggregated``: a ``kv_producer`` (prefill, ``max_tokens=1``; its full prompt blocks saved through
  ``kvstore.integrations.vllm.KVStoreConnector``) and a ``kv_consumer`` (loads them, decodes), joined by a
  ``kvstore serve`` daemon whose CPU seconds are reported beside the instances'.

Instances start once per architecture and serve every trace in turn (a vLLM start costs tens of seconds
here); each trace's timeline and CPU seconds are taken from its own window. The outputs of one run are the
small engine's (deployment.py): ``requests.jsonl``, ``timeline.jsonl`` and ``summary.json``, so metrics.py,
verdict.py and report.py read them unchanged. TTFT in a disaggregated run is the first token from the decode
instance (the prefill's hand-off, the router's forwarding and the consumer's load are inside it).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common.daemon import project_env
from benchmarks.pd.deployment import Arch
from benchmarks.pd.record import RequestRecord
from benchmarks.pd.store_daemon import StoreDaemon
from benchmarks.pd.vllm_engine import InstanceSpec, env_for

ROLES = {Arch.COLOCATED: ("colocated", "colocated"), Arch.CHUNKED: ("chunked", "chunked"),
         Arch.DISAGGREGATED: ("kv_producer", "kv_consumer")}
ROLE_NAMES = {"colocated": "prefill-first", "chunked": "chunked", "kv_producer": "prefill-only",
              "kv_consumer": "decode-only"}


@dataclass(frozen=True, slots=True)
class VllmConfig:
    model: str
    block_size: int = 128
    chunk_budget: int = 256
    max_model_len: int = 4096
    kv_cache_bytes: int = 256 << 20
    dtype: str = "bfloat16"
    transport: str = "auto"
    store_capacity: str = "2GiB"
    cores: tuple[int, int] = (0, 1)
    start_timeout_s: float = 300.0
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("block_size", "chunk_budget", "max_model_len", "kv_cache_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"VllmConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if not Path(self.model, "config.json").is_file():
            raise ValueError(f"--model {self.model}: no config.json there; build one with "
                             f"`python -m benchmarks.pd make-model --out DIR`")

    def spec(self, index: int, role: str, t0: float, url: str = "") -> InstanceSpec:
        batched = self.chunk_budget if role == "chunked" else self.max_model_len
        return InstanceSpec(index=index, role=role, model=self.model, core=self.cores[index], t0=t0,
                            max_model_len=self.max_model_len, max_batched_tokens=batched,
                            block_size=self.block_size, kv_cache_bytes=self.kv_cache_bytes, dtype=self.dtype,
                            url=url, transport=self.transport)

    def describe(self, arch: Arch, hf: dict) -> dict:
        roles = ROLES[arch]
        kv_per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * _head_dim(hf) * _itemsize(self.dtype)
        return {
            "engine": "vllm", "arch": arch.value,
            "workers": [{"index": i, "role": ROLE_NAMES[r], "vllm_role": r, "threads": 1, "core": self.cores[i],
                         "process": True} for i, r in enumerate(roles)],
            "engine_threads_total": len(roles), "chunk_budget": self.chunk_budget,
            "max_num_batched_tokens": {r: self.spec(i, r, 0.0, "x").max_batched_tokens for i, r in enumerate(roles)},
            "block_size": self.block_size, "kv_cache_bytes_per_worker": self.kv_cache_bytes,
            "num_blocks_per_worker": self.kv_cache_bytes // max(kv_per_token * self.block_size, 1),
            "transport": self.transport if arch is Arch.DISAGGREGATED else None,
            "store": "daemon" if arch is Arch.DISAGGREGATED else None,
            "model": {"path": self.model, "num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"],
                      "num_heads": hf["num_attention_heads"], "num_kv_heads": hf["num_key_value_heads"],
                      "head_dim": _head_dim(hf), "vocab_size": hf["vocab_size"], "dtype": self.dtype},
            "kv_bytes_per_token": kv_per_token, "prefix_caching": False,
        }


def _head_dim(hf: dict) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


class InstanceProcess:
    """One ``vllm_engine`` child; its events go to the shared ``events`` queue as ``(index, event)``."""

    def __init__(self, spec: InstanceSpec, events: queue.Queue, log_path: Path):
        self.spec, self.events = spec, events
        env = project_env(env_for(spec))
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.pd.vllm_engine", spec.to_json()],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        self.ready: dict | None = None
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put((self.spec.index, json.loads(line)))
        self.events.put((self.spec.index, {"ev": "exit", "code": self.proc.wait()}))

    def send(self, msg: dict) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def close(self, timeout: float = 30.0) -> None:
        try:
            if self.proc.poll() is None:
                self.send({"op": "stop"})
                self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Fleet:
    """The instances of one architecture (and its store daemon), started together, stopped on exit."""

    def __init__(self, config: VllmConfig, arch: Arch, out_dir: Path):
        self.config, self.arch, self.out_dir = config, arch, out_dir
        self.events: queue.Queue = queue.Queue()
        self.stack = ExitStack()
        self.daemon: StoreDaemon | None = None
        self.instances: list[InstanceProcess] = []
        self.epoch = time.monotonic()

    def __enter__(self) -> Fleet:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        url = ""
        if self.arch is Arch.DISAGGREGATED:
            self.daemon = self.stack.enter_context(StoreDaemon(self.config.store_capacity,
                                                               log_path=self.out_dir / "kvstore.log"))
            url = self.daemon.url
        for i, role in enumerate(ROLES[self.arch]):
            spec = self.config.spec(i, role, self.epoch, url)
            inst = InstanceProcess(spec, self.events, self.out_dir / f"instance{i}.log")
            self.stack.callback(inst.close)
            self.instances.append(inst)
        self._await_ready()
        return self

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while any(i.ready is None for i in self.instances):
            index, ev = self.next_event(deadline - time.monotonic())
            if ev["ev"] != "ready":
                raise RuntimeError(f"vLLM instance {index} ({self.arch.value}) exited while starting "
                                   f"(code {ev.get('code')}); see {self.out_dir}/instance{index}.log")
            self.instances[index].ready = ev

    def respawn(self, index: int) -> InstanceProcess:
        """Start a replacement of instance ``index`` (same spec); its ``ready`` event comes through the queue."""
        old = self.instances[index]
        log = self.out_dir / f"instance{index}-replacement{sum(1 for _ in self.out_dir.glob(f'instance{index}-*'))}.log"
        inst = InstanceProcess(old.spec, self.events, log)
        self.stack.callback(inst.close)
        self.instances[index] = inst
        return inst

    def next_event(self, timeout: float) -> tuple[int, dict]:
        try:
            return self.events.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            raise TimeoutError(f"no event from the {self.arch.value} vLLM instances in {timeout:.0f} s; "
                               f"logs in {self.out_dir}") from None

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def run_time(self, t: float, run_start: float) -> float:
        """An instance time (seconds since the fleet's epoch) as seconds since ``run_start`` (monotonic)."""
        return t + self.epoch - run_start


@dataclass(slots=True)
class VllmRecord(RequestRecord):
    """A request record whose KV bytes are what the connector moved for it (saved by the producer, loaded by
    the consumer), not a model's estimate."""

    saved_bytes: int = 0
    loaded_bytes: int = 0
    cached_tokens: int = 0

    def to_json(self) -> dict:
        row = RequestRecord.to_json(self)
        row["kv_bytes_transferred"] = self.loaded_bytes if self.handed_off else 0
        row.update(kv_bytes_saved=self.saved_bytes, kv_bytes_loaded=self.loaded_bytes,
                   store_hit_tokens=self.cached_tokens)
        return row
