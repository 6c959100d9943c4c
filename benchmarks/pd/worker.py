"""An engine worker: builds the model and engine for one role and turns router messages into engine work.

The same :class:`Worker` runs in its own process (:func:`process_main`, one torch thread, so total
compute is countable) or inline in the router's process (tests, ``--inline``).

Router -> worker messages: ``add`` (a new request to prefill), ``decode`` (a prefilled request to fetch and
decode; ``refetch`` when a dead decode worker had fetched it before), ``start`` (the run's clock origin),
``stop``. Worker -> router: ``ready``, ``prefilled`` (collocated: a prompt is done), ``finished``,
``handed_off``, ``failed``, and ``stats`` (timeline and memory figures) in answer to ``stop``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from benchmarks.pd.channel import Channel, ChannelClosedError
from benchmarks.pd.engine import Engine, KVPort, StepOutcome
from benchmarks.pd.kv_cache import CacheSpec
from benchmarks.pd.model import LlamaModel, ModelConfig
from benchmarks.pd.request import Request
from benchmarks.pd.scheduler import Policy, SchedulerConfig
from benchmarks.pd.transfer import KVTransfer, StoreSpec, Transport

IDLE_WAIT_S = 0.05


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    index: int
    policy: Policy
    model: ModelConfig = field(default_factory=ModelConfig)
    num_blocks: int = 4096
    block_size: int = 16
    token_budget: int = 512
    max_running: int = 64
    threads: int = 1
    store: StoreSpec | None = None  # required for the prefill-only and decode-only roles

    @property
    def cache_spec(self) -> CacheSpec:
        m = self.model
        return CacheSpec(m.num_layers, self.num_blocks, self.block_size, m.num_kv_heads, m.head_dim, m.torch_dtype)

    def to_wire(self) -> dict:
        store = None
        if self.store is not None:
            store = {"url": self.store.url, "transport": self.store.transport.value, "capacity": self.store.capacity,
                     "ttl_s": self.store.ttl_s, "fetch_timeout_s": self.store.fetch_timeout_s,
                     "prefix_keys": self.store.prefix_keys}
        model = {name: getattr(self.model, name) for name in ModelConfig.__dataclass_fields__}
        return {"index": self.index, "policy": self.policy.value, "model": model, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "token_budget": self.token_budget, "max_running": self.max_running,
                "threads": self.threads, "store": store}

    @classmethod
    def from_wire(cls, d: dict) -> WorkerSpec:
        store = d["store"]
        if store is not None:
            store = StoreSpec(**{**store, "transport": Transport(store["transport"])})
        return cls(**{**d, "policy": Policy(d["policy"]), "model": ModelConfig(**d["model"]), "store": store})


def request_to_wire(r: Request) -> dict:
    t = r.times
    return {"id": r.id, "output_ids": r.output_ids, "queued_s": t.queued_s, "admitted_s": t.admitted_s,
            "prefill_start_s": t.prefill_start_s, "prefill_end_s": t.prefill_end_s, "publish_s": t.publish_s,
            "fetch_s": t.fetch_s, "token_times_s": t.token_times_s, "error": r.error}


class Worker:
    """One engine plus its bookkeeping; ``handle`` takes router messages, ``step`` returns messages back."""

    def __init__(self, spec: WorkerSpec, store: Any | None = None, port: KVPort | None = None):
        """``store``: a shared (embedded) store for the hand-off; ``port``: replaces the hand-off entirely."""
        self.spec = spec
        torch.set_num_threads(spec.threads)
        self.t0 = time.monotonic()
        self.cpu0 = time.process_time()
        self.model = LlamaModel(spec.model)
        if port is None and spec.policy in (Policy.PREFILL_ONLY, Policy.DECODE_ONLY):
            if spec.store is None:
                raise ValueError(f"worker {spec.index}: role {spec.policy.value} needs a store")
            port = KVTransfer(spec.store, spec.cache_spec, spec.model.model_id, store=store)
        self.port = port
        sched = SchedulerConfig(spec.policy, spec.token_budget, spec.max_running)
        self.engine = Engine(self.model, spec.cache_spec, sched, port, clock=self.clock)
        self.timeline: list[list] = []
        self._warm_up()

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.cpu0 = time.process_time()

    def ready_info(self) -> dict:
        return {"worker": self.spec.index, "pid": os.getpid(), "role": self.spec.policy.value,
                "threads": torch.get_num_threads(), "weight_bytes": self.model.weight_bytes,
                "kv_cache_bytes": self.spec.cache_spec.total_bytes}

    def has_work(self) -> bool:
        return self.engine.has_work()

    def handle(self, msg: dict) -> None:
        if msg["op"] not in ("add", "decode"):
            raise ValueError(f"worker {self.spec.index}: unknown message op {msg['op']!r}")
        r = msg["req"]
        request = Request(r["id"], list(r["prompt_ids"]), int(r["max_output"]),
                          output_ids=list(r.get("output_ids", [])), refetch=bool(r.get("refetch", False)))
        if msg["op"] == "decode" and len(request.output_ids) != 1:
            raise ValueError(f"decode of {request.id} needs exactly the first output token, got {request.output_ids}")
        self.engine.add(request)

    def step(self) -> list[dict]:
        """One engine step; the messages it produced for the router."""
        outcome: StepOutcome = self.engine.step()
        if outcome.event is not None:
            self.timeline.append(outcome.event.to_wire())
        out = [{"op": "prefilled", "req": {"id": r.id, "prefill_end_s": r.times.prefill_end_s}}
               for r in outcome.prefilled]
        out += [{"op": "finished", "req": request_to_wire(r)} for r in outcome.finished]
        out += [{"op": "handed_off", "req": request_to_wire(r)} for r in outcome.handed_off]
        out += [{"op": "failed", "req": request_to_wire(r)} for r in outcome.failed]
        for m in out:
            m["worker"] = self.spec.index
        return out

    def stats(self) -> dict:
        return {"worker": self.spec.index, "role": self.spec.policy.value, "timeline": self.timeline,
                "cpu_s": round(time.process_time() - self.cpu0, 3),
                "peak_blocks": self.engine.allocator.peak_used,
                "peak_kv_bytes": self.engine.allocator.peak_used * self.spec.cache_spec.block_bytes}

    def close(self) -> None:
        close = getattr(self.port, "close", None)
        if close is not None:
            close()

    def _warm_up(self) -> None:
        """Run one short request through the model, and through the hand-off when this role has one, so
        first-call costs (allocations, store connection, segment mapping) stay out of the measurement."""
        from benchmarks.pd.attention import AttentionBatch, SeqChunk

        cache, alloc = self.engine.cache, self.engine.allocator
        rid = f"warmup-{os.getpid()}-{self.spec.index}"
        blocks = alloc.allocate(rid, cache.spec.blocks_for(33))
        # token ids unique to this process: hand-off chunk keys hash the tokens, and two workers warming up
        # with the same ids would share (and drop) each other's chunks
        gen = torch.Generator().manual_seed(os.getpid() * 1000 + self.spec.index)
        ids = torch.randint(0, self.spec.model.vocab_size, (32,), generator=gen)
        self.model(ids, AttentionBatch.build([SeqChunk(blocks, 0, 32)], cache), cache)
        self.model(ids[:1], AttentionBatch.build([SeqChunk(blocks, 32, 1)], cache), cache)
        if self.port is not None:
            request = Request(rid, ids.tolist(), 1)
            prompt_blocks = blocks[: cache.spec.blocks_for(32)]
            self.port.publish(request, cache, prompt_blocks)
            self.port.fetch(request, cache, prompt_blocks)
        alloc.free(rid)
        alloc.peak_used = 0


def process_main(spec_frame: bytes, conn: Any) -> None:
    """Entry point of a worker process: build, report ready, wait for start, then serve until stop."""
    chan = Channel(conn)
    worker = Worker(WorkerSpec.from_wire(msgpack.unpackb(spec_frame, raw=False)))
    try:
        chan.send("ready", **worker.ready_info())
        _serve(worker, chan)
    except ChannelClosedError:
        pass  # the router went away: nothing left to report to
    finally:
        worker.close()


def _serve(worker: Worker, chan: Channel) -> None:
    while True:
        wait = 0.0 if worker.has_work() else IDLE_WAIT_S
        while chan.poll(wait):
            msg = chan.recv()
            if msg["op"] == "stop":
                chan.send("stats", **worker.stats())
                return
            if msg["op"] == "start":
                worker.start(float(msg["t0"]))
            else:
                worker.handle(msg)
            wait = 0.0
        for out in worker.step():
            chan.send(out.pop("op"), **out)
