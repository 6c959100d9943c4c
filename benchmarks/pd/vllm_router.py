"""The router in front of a :class:`~benchmarks.pd.vllm_deployment.Fleet`: one trace in real time.

Each request is sent at its arrival offset. Colocated / chunked: to the instance with the fewest outstanding
tokens (prompt + output not yet generated), as the small engine's router does. Disaggregated: to the prefill
instance with ``max_tokens=1``; when it reports the request done, the same prompt goes to the decode instance
with the request's full ``max_tokens`` and the prefill's ``kv_transfer_params`` (its promise: the decode side
waits, bounded, for saves still in flight).
Outputs of one run: ``requests.jsonl``, ``timeline.jsonl``, ``summary.json`` (deployment.py's format).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.pd.admission import Immediate
from benchmarks.pd.deployment import TIMELINE_FIELDS, Arch
from benchmarks.pd.energy import EnergyMeter
from benchmarks.pd.fault import FaultSpec, recovery_report
from benchmarks.pd.summary import summarize
from benchmarks.pd.trace import TokenTrace
from benchmarks.pd.vllm_deployment import Fleet, VllmConfig, VllmRecord
from benchmarks.pd.vllm_fault import FaultInjector


class _Serving:
    """One trace's state: records, what each instance has outstanding, the events handled."""

    def __init__(self, fleet: Fleet, trace: TokenTrace, kv_bytes_per_token: int, fault: FaultSpec | None = None):
        self.fleet, self.trace = fleet, trace
        self.disagg = fleet.arch is Arch.DISAGGREGATED
        self.records = {r.id: VllmRecord(r.id, r.klass, r.arrival_s, r.prompt_tokens, r.output_tokens,
                                         r.prompt_tokens * kv_bytes_per_token) for r in trace.requests}
        self.prompts = {r.id: list(r.prompt_ids) for r in trace.requests}
        self.outstanding = [0] * len(fleet.instances)
        self.promises: dict[str, dict | None] = {}  # the prefill's kv_transfer_params, until decode is done
        self.on: list[set[str]] = [set() for _ in fleet.instances]  # request ids each instance has
        self.fault = FaultInjector(fault, self) if fault is not None else None
        self.left = len(trace.requests)
        self.start = 0.0

    def now(self) -> float:
        return time.monotonic() - self.start

    def t(self, instance_time: float) -> float:
        return self.fleet.run_time(instance_time, self.start)

    def dispatch(self, rid: str) -> None:
        rec = self.records[rid]
        rec.dispatch_s, rec.attempts = self.now(), rec.attempts + 1
        if self.disagg:
            self._send(0, rid, 1)
        else:
            live = [i for i in range(len(self.outstanding)) if self.fault is None or self.fault.usable(i)]
            target = min(live, key=lambda i: (self.outstanding[i], i))
            self._send(target, rid, rec.output_tokens)

    def _send(self, index: int, rid: str, max_tokens: int, kv_transfer_params: dict | None = None) -> None:
        self.outstanding[index] += len(self.prompts[rid]) + max_tokens
        self.on[index].add(rid)
        self.fleet.instances[index].send({"op": "add", "id": rid, "prompt": self.prompts[rid],
                                          "max_tokens": max_tokens, "kv_transfer_params": kv_transfer_params})

    def on_done(self, index: int, ev: dict) -> None:
        rec = self.records[ev["id"]]
        self.outstanding[index] -= len(self.prompts[rec.id]) + len(ev["output_ids"])
        self.on[index].discard(rec.id)
        r = {"prefill_start_s": self.t(ev["prefill_start_s"]), "prefill_end_s": self.t(ev["prefill_end_s"]),
             "output_ids": ev["output_ids"], "token_times_s": [self.t(x) for x in ev["token_times_s"]]}
        if not self.disagg:
            rec.on_colocated_done(index, {**r, "publish_s": 0.0})
            self.left -= 1
        elif index == 0:  # prefill done: its blocks are saved; the decode instance takes it from here
            rec.on_handed_off(index, {**r, "publish_s": ev["kv_s"]})
            # saves may still be in flight at the step's end: the promise sent with decode makes it wait for them
            rec.decode_ready_s, rec.saved_bytes = rec.prefill_end_s, ev["kv_bytes"]
            self.promises[rec.id] = ev.get("kv_transfer_params")
            if self.fault is None or not self.fault.hold(rec.id):
                self.send_decode(rec.id)
        else:
            rec.on_decode_done(index, {"admitted_s": r["prefill_start_s"], "fetch_s": ev["kv_s"],
                                       "output_ids": r["output_ids"], "token_times_s": r["token_times_s"]})
            rec.loaded_bytes, rec.cached_tokens = ev["kv_bytes"], ev["cached_tokens"]
            self.promises.pop(rec.id, None)
            self.left -= 1

    def send_decode(self, rid: str) -> None:
        self._send(1, rid, self.records[rid].output_tokens, self.promises.get(rid))  # kept for a refetch

    def serve(self, timeout_s: float) -> None:
        pending = sorted(self.trace.requests, key=lambda r: (r.arrival_s, r.id))
        self.start = time.monotonic()
        deadline = self.start + timeout_s
        i = 0
        while self.left:
            while i < len(pending) and pending[i].arrival_s <= self.now():
                self.dispatch(pending[i].id)
                i += 1
            if self.fault is not None and self.fault.due(self.now()):
                self.fault.kill(self.now())
            wait = pending[i].arrival_s - self.now() if i < len(pending) else deadline - time.monotonic()
            if self.fault is not None and not self.fault.log.injected:
                wait = min(wait, self.fault.log.spec.at_s - self.now())
            try:
                index, ev = self.fleet.next_event(min(wait, deadline - time.monotonic()))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                continue
            self._handle(index, ev)

    def _handle(self, index: int, ev: dict) -> None:
        if ev["ev"] == "done":
            self.on_done(index, ev)
        elif ev["ev"] == "ready":
            self.fleet.instances[index].ready = ev
            if self.fault is not None:
                self.fault.on_ready(index, self.now())
        elif ev["ev"] == "exit" and not (self.fault is not None and self.fault.on_exit(index, self.now())):
            raise RuntimeError(f"vLLM instance {index} exited (code {ev['code']}) mid-run; see "
                               f"{self.fleet.out_dir}/instance{index}.log")


def warm_up(fleet: Fleet, block_size: int, timeout_s: float = 120.0) -> None:
    """One request through every instance of ``fleet`` (disaggregated: prefill, the store, decode), then a fresh
    stats window: the first store connection, segment mapping and kernel dispatch are not charged to a trace."""
    prompt = [(7 * i) % 97 + 3 for i in range(2 * block_size + 5)]
    hops = [(0, 1), (1, 4)] if fleet.arch is Arch.DISAGGREGATED else [(i, 4) for i in range(len(fleet.instances))]
    deadline = time.monotonic() + timeout_s
    for index, max_tokens in hops:
        fleet.instances[index].send({"op": "add", "id": f"warmup-{index}", "prompt": prompt,
                                     "max_tokens": max_tokens})
        if fleet.arch is Arch.DISAGGREGATED:  # the hand-off: decode only once prefill has saved
            _await_done(fleet, {f"warmup-{index}"}, deadline)
    if fleet.arch is not Arch.DISAGGREGATED:
        _await_done(fleet, {f"warmup-{i}" for i, _ in hops}, deadline)
    _collect_stats(fleet, timeout_s)


def _await_done(fleet: Fleet, ids: set[str], deadline: float) -> None:
    while ids:
        index, ev = fleet.next_event(deadline - time.monotonic())
        if ev["ev"] == "exit":
            raise RuntimeError(f"vLLM instance {index} exited (code {ev['code']}) during the warm-up")
        ids.discard(ev.get("id"))


def _collect_stats(fleet: Fleet, timeout_s: float) -> dict[int, dict]:
    for inst in fleet.instances:
        inst.send({"op": "stats"})
    stats: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(stats) < len(fleet.instances):
        index, ev = fleet.next_event(deadline - time.monotonic())
        if ev["ev"] == "stats":
            stats[index] = ev
        elif ev["ev"] == "ready":  # a replacement that became ready after the trace's last request
            fleet.instances[index].ready = ev
        elif ev["ev"] == "exit":
            raise RuntimeError(f"vLLM instance {index} exited (code {ev['code']}) before its stats")
    return stats


def _worker_stats(fleet: Fleet, stats: dict[int, dict], start: float) -> list[dict]:
    out = []
    for inst in fleet.instances:
        s = stats[inst.spec.index]
        timeline = [[round(fleet.run_time(st[0], start), 6), round(fleet.run_time(st[1], start), 6), *st[2:]]
                    for st in s["timeline"]]
        out.append({"worker": inst.spec.index, "role": inst.spec.role, "timeline": timeline,
                    "peak_kv_bytes": s["peak_kv_bytes"], "cpu_s": s["cpu_s"], "counters": s["counters"],
                    "rss_bytes": s["rss_bytes"], "peak_rss_bytes": s["peak_rss_bytes"]})
    return out


def _worker_info(fleet: Fleet, stats: list[dict], config: VllmConfig) -> list[dict]:
    info = []
    for inst, s in zip(fleet.instances, stats, strict=True):
        ready = inst.ready or {}
        info.append({"index": inst.spec.index, "role": inst.spec.role, "pid": ready.get("pid"),
                     "weight_bytes": ready.get("weight_bytes") or 0, "kv_cache_bytes": config.kv_cache_bytes,
                     "rss_bytes_ready": ready.get("rss_bytes"), "rss_bytes_end": s["rss_bytes"],
                     "peak_rss_bytes": s["peak_rss_bytes"]})
    return info


def serve_trace(fleet: Fleet, config: VllmConfig, trace: TokenTrace, out_dir: Path, describe: dict,
                fault: FaultSpec | None = None) -> dict:
    """Serve ``trace`` on the running ``fleet``; write the run's outputs into ``out_dir``; return its summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    trace.check_fits(config.max_model_len)
    meter = EnergyMeter()
    daemon = fleet.daemon
    cpu0 = (time.process_time(), daemon.cpu_seconds() if daemon else None)
    serving = _Serving(fleet, trace, describe["kv_bytes_per_token"], fault)
    meter.start()
    serving.serve(config.request_timeout_s)
    meter.stop()
    stats = _worker_stats(fleet, _collect_stats(fleet, 60.0), serving.start)
    records = list(serving.records.values())
    summary = summarize(records, worker_info=_worker_info(fleet, stats, config), worker_stats=stats,
                        deployment=describe, trace=trace.describe())
    cpu = {"router": round(time.process_time() - cpu0[0], 3)}
    if daemon is not None and cpu0[1] is not None:
        cpu["store_daemon"] = round((daemon.cpu_seconds() or 0.0) - cpu0[1], 3)
    summary["cpu_s"] = {"workers": {str(s["worker"]): s["cpu_s"] for s in stats}, **cpu,
                        "note": "process CPU seconds of each vLLM instance over this trace's window"}
    summary["energy"] = meter.result()
    summary["admission"] = Immediate().describe()
    rows = [r.to_json() for r in records]
    summary["fault"] = recovery_report(serving.fault.log if serving.fault else None, rows)
    summary["connector"] = {str(s["worker"]): s["counters"] for s in stats}
    summary["memory"]["rss_bytes_per_worker"] = [s["rss_bytes"] for s in stats]
    summary["memory"]["weight_copies_resident"] = len(stats)
    if daemon is not None:
        summary["store"] = _store_stats(daemon)
    _write(out_dir, records, summary, stats)
    return summary


def _write(out_dir: Path, records: list, summary: dict, stats: list[dict]) -> None:
    with open(out_dir / "requests.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record.to_json()) + "\n")
    with open(out_dir / "timeline.jsonl", "w") as f:
        for s in stats:
            for step in s["timeline"]:
                f.write(json.dumps({"worker": s["worker"], "role": s["role"],
                                    **dict(zip(TIMELINE_FIELDS, step, strict=True))}) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _store_stats(daemon) -> dict:
    """What the store holds after the run (the producer's saved blocks, until evicted) and its RSS."""
    import kvstore

    with kvstore.connect(daemon.url, timeout=5.0) as client:
        s = client.stats()
    return {"used_bytes_at_end": s["used_bytes"], "objects_at_end": s["objects"],
            "capacity_bytes": s["capacity_bytes"], "daemon_rss_bytes": daemon.rss_bytes()}
