"""Measured runs of the small engine (``benchmarks/pd run --out DIR``) as the planner reads them, and
the same format written from a simulation (so a prediction can be diffed against a measurement).

``DIR/requests.jsonl`` has one request per line (id, arrival_s, prompt_tokens, output_tokens,
prefill_queue_s, prefill_start_s, prefill_end_s, ttft_s, decode_queue_s, token_times_s, kv_bytes,
transfer_s, ...); ``DIR/summary.json`` the aggregates and, where the engine records them, the
architecture, worker counts, chunk budget and model geometry. Times may be absolute on the run's clock or
relative to each request's arrival; which one is detected per field and normalised to absolute.
``DIR/timeline.jsonl`` (optional: one engine step per line with worker, start_s, end_s, prefill_tokens,
decode_tokens, prefill_seqs) tells which steps mixed prompt chunks into decodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvstore.planner.deployment import Arch, Deployment
from kvstore.workloads.trace import Trace, TraceRequest

_REQUIRED = ("arrival_s", "prompt_tokens", "prefill_start_s", "prefill_end_s", "ttft_s", "token_times_s")


@dataclass(frozen=True, slots=True)
class RunRequest:
    """One measured request, every time absolute on the run's clock (seconds)."""

    id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefill_start_s: float
    prefill_end_s: float
    ttft_s: float
    token_times_s: tuple[float, ...]
    kv_bytes: int = 0
    transfer_s: float = 0.0
    publish_s: float = 0.0  # the sender's part of transfer_s, when the run records it
    prefill_worker: int | None = None
    decode_worker: int | None = None

    @property
    def tpot_s(self) -> float | None:
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


@dataclass(frozen=True, slots=True)
class RunLog:
    path: str
    requests: tuple[RunRequest, ...]
    summary: dict
    arch: Arch | None
    timeline: tuple[dict, ...] = ()

    def find(self, *names: str):
        """The first value stored under any of ``names`` anywhere in summary.json (depth first)."""
        return _find(self.summary, names)

    def trace(self) -> Trace:
        reqs = sorted(self.requests, key=lambda r: r.arrival_s)
        t0 = reqs[0].arrival_s
        return Trace(name=Path(self.path).name, requests=tuple(
            TraceRequest(i, r.arrival_s - t0, r.prompt_tokens, r.output_tokens) for i, r in enumerate(reqs)))

    def deployment(self) -> Deployment:
        """The run's deployment as summary.json describes it (engine defaults where it is silent)."""
        if self.arch is None:
            raise ValueError(f"{self.path}: summary.json does not say the arch (colocated/chunked/disaggregated)")
        workers = self.find_list("workers")
        if workers and all(isinstance(w, dict) for w in workers):
            total = len(workers)
            prefill = sum(1 for w in workers if str(w.get("role", "")).startswith("prefill-only"))
        else:
            total = int(self.find("workers", "num_workers", "n_workers") or 2)
            prefill = int(self.find("prefill_workers", "num_prefill_workers") or 1)
        common = dict(max_batch=int(self.find("max_running", "max_batch") or 256),
                      max_prefill_tokens=int(self.find("prefill_batch_tokens", "max_prefill_tokens") or 16384))
        if self.arch is Arch.DISAGGREGATED:
            return Deployment(Arch.DISAGGREGATED, gpus=total, prefill_workers=max(1, prefill), **common)
        chunk = int(self.find("chunk_budget", "chunk_tokens", "token_budget") or 512)
        return Deployment(self.arch, gpus=total, chunk_tokens=chunk, **common)

    def find_list(self, name: str) -> list | None:
        deployment = self.summary.get("deployment", self.summary)
        value = deployment.get(name) if isinstance(deployment, dict) else None
        return value if isinstance(value, list) else None

    @property
    def kv_capacity_tokens(self) -> int | None:
        """KV tokens one worker holds, if the summary says (blocks per worker x block size)."""
        blocks, size = self.find("num_blocks_per_worker", "num_blocks"), self.find("block_size")
        return int(blocks) * int(size) if blocks and size else None


def _find(obj, names: tuple[str, ...]):
    if isinstance(obj, dict):
        for name in names:
            if name in obj and not isinstance(obj[name], (dict, list)):
                return obj[name]
        for value in obj.values():
            found = _find(value, names)
            if found is not None:
                return found
    return None


def _parse(rec: dict, where: str) -> RunRequest:
    missing = [k for k in _REQUIRED if k not in rec]
    if missing:
        raise ValueError(f"{where}: missing fields {missing}")
    arrival = float(rec["arrival_s"])
    ttft = float(rec["ttft_s"])
    times = [float(t) for t in rec["token_times_s"]]
    if times and abs(times[0] - ttft) < abs(times[0] - (arrival + ttft)):
        times = [t + arrival for t in times]  # stored relative to arrival
    start, end = float(rec["prefill_start_s"]), float(rec["prefill_end_s"])
    queue = rec.get("prefill_queue_s")
    # relative to arrival if the start equals the queue wait rather than arrival + queue wait
    relative = (abs(start - float(queue)) < abs(start - arrival - float(queue))) if queue is not None \
        else start < arrival
    if relative:
        start, end = start + arrival, end + arrival
    return RunRequest(id=str(rec.get("id", where)), arrival_s=arrival, prompt_tokens=int(rec["prompt_tokens"]),
                      output_tokens=int(rec.get("output_tokens") or len(times)),
                      prefill_start_s=start, prefill_end_s=end, ttft_s=ttft, token_times_s=tuple(times),
                      kv_bytes=int(rec.get("kv_bytes") or 0), transfer_s=float(rec.get("transfer_s") or 0.0),
                      publish_s=float(rec.get("publish_s") or 0.0),
                      prefill_worker=_int_or_none(rec.get("prefill_worker")),
                      decode_worker=_int_or_none(rec.get("decode_worker")))


def _int_or_none(value) -> int | None:
    return None if value is None else int(value)


def read_run(directory: str | Path) -> RunLog:
    """Read ``DIR/requests.jsonl`` and ``DIR/summary.json`` (the latter optional)."""
    directory = Path(directory)
    path = directory / "requests.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{str(directory)!r} is not a run directory: no requests.jsonl")
    reqs = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                reqs.append(_parse(json.loads(line), f"{path}:{lineno}"))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from None
    if not reqs:
        raise ValueError(f"{path} has no requests")
    summary_path = directory / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    arch = _find(summary, ("arch", "architecture"))
    timeline_path = directory / "timeline.jsonl"
    timeline = tuple(json.loads(line) for line in timeline_path.read_text().splitlines() if line.strip()) \
        if timeline_path.is_file() else ()
    return RunLog(str(directory), tuple(reqs), summary, Arch.parse(arch) if arch else None, timeline)


def write_run(directory: str | Path, result, summary: dict | None = None) -> None:
    """Write a simulation (a SimResult run with ``record_tokens=True``) in the engine's run format."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dep = result.deployment
    lines = []
    for r in result.requests:
        if r.rejected:
            continue
        lines.append(json.dumps({
            "id": r.id, "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens, "prefill_queue_s": r.prefill_queue_s,
            "prefill_start_s": r.prefill_start_s, "prefill_end_s": r.prefill_end_s, "ttft_s": r.ttft_s,
            "decode_queue_s": r.decode_queue_s, "token_times_s": list(r.token_times_s or ()),
            "output_token_ids": [], "kv_bytes": r.kv_bytes if r.transferred else 0,
            "transfer_s": r.transfer_s - r.link_wait_s}))  # the engine's definition: the copy, not the queue
    (directory / "requests.jsonl").write_text("\n".join(lines) + "\n")
    doc = {"arch": dep.arch.value, "workers": dep.workers, "prefill_workers": dep.prefill_workers,
           "decode_workers": dep.decode_workers, "chunk_tokens": dep.chunk_tokens, "source": "kvstore plan"}
    doc.update(summary or {})
    (directory / "summary.json").write_text(json.dumps(doc, indent=1))
