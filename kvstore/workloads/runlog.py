"""Measured runs of the small engine (``benchmarks/pd run --out DIR``) as the planner reads them, and
the same format written from a simulation (so a prediction can be diffed against a measurement).

The files, field names, units and which times are absolute are :mod:`kvstore.workloads.runschema`, which
the writers (``benchmarks/pd/record.py``, :func:`write_run`) use too. A log whose summary.json names that
schema is read as it says. A log that does not (older runs, other engines) may store the absolute times
relative to each request's arrival instead; for those, which one is detected per field and normalised.
``DIR/timeline.jsonl`` (optional: one engine step per line with worker, start_s, end_s, prefill_tokens,
decode_tokens, prefill_seqs) tells which steps mixed prompt chunks into decodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.workloads import runschema as schema
from kvstore.workloads.arch import Arch
from kvstore.workloads.trace import Trace, TraceRequest


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
    summary: dict[str, Any]
    arch: Arch | None
    timeline: tuple[dict[str, Any], ...] = ()
    unfinished: int = 0  # requests in the log with no output token (lost, or cut off): not in ``requests``

    def find(self, *names: str) -> Any:
        """The first value stored under any of ``names`` anywhere in summary.json (depth first)."""
        return _find(self.summary, names)

    def trace(self) -> Trace:
        reqs = sorted(self.requests, key=lambda r: r.arrival_s)
        t0 = reqs[0].arrival_s
        return Trace(name=Path(self.path).name, requests=tuple(
            TraceRequest(i, r.arrival_s - t0, r.prompt_tokens, r.output_tokens) for i, r in enumerate(reqs)))

    def find_list(self, name: str) -> list[Any] | None:
        deployment = self.summary.get("deployment", self.summary)
        value = deployment.get(name) if isinstance(deployment, dict) else None
        return value if isinstance(value, list) else None

    @property
    def kv_capacity_tokens(self) -> int | None:
        """KV tokens one worker holds, if the summary says (blocks per worker x block size)."""
        blocks, size = self.find("num_blocks_per_worker", "num_blocks"), self.find("block_size")
        return int(blocks) * int(size) if blocks and size else None


def _find(obj: Any, names: tuple[str, ...]) -> Any:
    if isinstance(obj, dict):
        for name in names:
            if name in obj and not isinstance(obj[name], (dict, list)):
                return obj[name]
        for value in obj.values():
            found = _find(value, names)
            if found is not None:
                return found
    return None


def _parse(rec: dict[str, Any], where: str, ours: bool) -> RunRequest:
    missing = schema.missing_fields(rec)
    if missing:
        raise ValueError(f"{where}: missing fields {missing}")
    arrival = float(rec["arrival_s"])
    ttft = float(rec["ttft_s"])
    times = [float(t) for t in rec["token_times_s"]]
    start, end = float(rec["prefill_start_s"]), float(rec["prefill_end_s"])
    if not ours:
        times, start, end = _foreign_times(rec, arrival, ttft, times, start, end)
    return RunRequest(id=str(rec.get("id", where)), arrival_s=arrival, prompt_tokens=int(rec["prompt_tokens"]),
                      output_tokens=int(rec.get("output_tokens") or len(times)),
                      prefill_start_s=start, prefill_end_s=end, ttft_s=ttft, token_times_s=tuple(times),
                      kv_bytes=int(rec.get("kv_bytes") or 0), transfer_s=float(rec.get("transfer_s") or 0.0),
                      publish_s=float(rec.get("publish_s") or 0.0),
                      prefill_worker=_int_or_none(rec.get("prefill_worker")),
                      decode_worker=_int_or_none(rec.get("decode_worker")))


def _foreign_times(rec: dict[str, Any], arrival: float, ttft: float, times: list[float], start: float,
                   end: float) -> tuple[list[float], float, float]:
    """A log not written to the schema: its absolute times may be relative to arrival; detect and add it."""
    if times and abs(times[0] - ttft) < abs(times[0] - (arrival + ttft)):
        times = [t + arrival for t in times]
    queue = rec.get("prefill_queue_s")
    # relative to arrival if the start equals the queue wait rather than arrival + queue wait
    relative = (abs(start - float(queue)) < abs(start - arrival - float(queue))) if queue is not None \
        else start < arrival
    if relative:
        start, end = start + arrival, end + arrival
    return times, start, end


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def read_run(directory: str | Path) -> RunLog:
    """Read ``DIR/requests.jsonl`` and ``DIR/summary.json`` (the latter optional)."""
    directory = Path(directory)
    path = directory / schema.REQUESTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(directory)!r} is not a run directory: no {schema.REQUESTS_FILE}")
    summary_path = directory / schema.SUMMARY_FILE
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    ours = summary.get(schema.SCHEMA_KEY) == schema.SCHEMA_VERSION
    reqs, unfinished = [], 0
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from None
        if isinstance(rec, dict) and (rec.get("lost") or rec.get("token_times_s") == []):
            unfinished += 1  # no token, so no latency to learn from (its ttft_s is null)
            continue
        reqs.append(_parse(rec, f"{path}:{lineno}", ours))
    if not reqs:
        raise ValueError(f"{path} has no requests")
    arch = _find(summary, ("arch", "architecture"))
    timeline_path = directory / schema.TIMELINE_FILE
    timeline = tuple(json.loads(line) for line in timeline_path.read_text().splitlines() if line.strip()) \
        if timeline_path.is_file() else ()
    return RunLog(str(directory), tuple(reqs), summary, Arch.parse(arch) if arch else None, timeline,
                  unfinished)


def write_run(directory: str | Path, result: Any, summary: dict[str, Any] | None = None) -> None:
    """Write a simulation (a ``kvstore.planner`` SimResult run with ``record_tokens=True``, a layer above this
    one, hence Any) in the engine's run format."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dep = result.deployment
    lines = []
    for r in result.requests:
        if r.rejected:
            continue
        lines.append(json.dumps(schema.request_row({
            "id": r.id, "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens, "prefill_queue_s": r.prefill_queue_s,
            "prefill_start_s": r.prefill_start_s, "prefill_end_s": r.prefill_end_s, "ttft_s": r.ttft_s,
            "decode_queue_s": r.decode_queue_s, "token_times_s": list(r.token_times_s or ()),
            "output_token_ids": [], "kv_bytes": r.kv_bytes if r.transferred else 0,
            "transfer_s": r.transfer_s - r.link_wait_s})))  # the engine's definition: the copy, not the queue
    (directory / schema.REQUESTS_FILE).write_text("\n".join(lines) + "\n")
    doc = {**schema.summary_header(), "arch": dep.arch.value, "workers": dep.workers,
           "prefill_workers": dep.prefill_workers, "decode_workers": dep.decode_workers,
           "chunk_tokens": dep.chunk_tokens, "source": "kvstore plan"}
    doc.update(summary or {})
    (directory / schema.SUMMARY_FILE).write_text(json.dumps(doc, indent=1))
