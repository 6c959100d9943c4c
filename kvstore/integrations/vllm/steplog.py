"""The connector's step log: what one vLLM engine ran, step by step, and what it moved per request.

Opt-in (``kv_connector_extra_config={"step_log": "/path/engine.jsonl"}``); off by default. The scheduler half
appends one JSON line per engine step that ran tokens and one per finished request to ``step_log``; each worker
half appends one line per request it moved KV for to ``<step_log>.worker<rank>``. At most
``step_log_max_records`` lines per file: past it a ``{"t": "truncated"}`` line is written and the rest dropped
(counted in memory, never an error). A write error (disk full) is logged once and turns the log off: a
request never fails because of it. The records (times are ``time.monotonic()`` seconds: one clock for every
process on the host, so a client on the same host can put them beside its own):

- ``{"t": "open", "side": "scheduler"|"worker", "pid", "rank", "block_bytes"}``: the file's first line per
  process that opened it (``block_bytes``, worker: the bytes of one block of this layout);
- ``{"t": "step", "start", "end", "prefill", "decode", "reqs", "kv_usage"}``: ``start`` is when vLLM's
  scheduler built the step's connector metadata (the end of ``schedule()``, right before the model runs),
  ``end`` when it asked the connector for its stats (``get_kv_connector_stats``, inside
  ``update_from_output``, right after the model ran), so ``end - start`` is the forward pass plus the output
  bookkeeping. ``prefill`` / ``decode``: tokens scheduled below / at or past the request's prompt length (a
  request whose KV was loaded computes its last prompt token: 1 prefill token); ``reqs``: requests scheduled;
  ``kv_usage``: the share of vLLM's KV blocks in use after scheduling (None before vLLM binds its cache
  manager). Steps that scheduled no token are not logged;
- ``{"t": "request", "id", "prompt", "first_start", "prefill_end", "end", "token_ends", "kv_transfer_params"}``
  at the end of the step in which vLLM finished the request: ``id`` is vLLM's request id (the OpenAI server's
  contains the client's ``X-Request-Id``), ``first_start`` the start of the first step that scheduled it,
  ``prefill_end`` the end of the step that computed its last prompt token (None if none did),
  ``token_ends`` the end of every step that computed it up to or past its prompt (each samples one output
  token: the engine-side time of each token, without speculative decoding; at most ``MAX_TOKEN_TIMES``),
  ``kv_transfer_params`` what this connector returned for it (a prefill's hand-off promise);
- ``{"t": "transfer", "id", "at", "load_bytes", "load_seconds", "loaded_blocks", "save_bytes", "save_seconds",
  "saved_blocks"}`` (worker): what this worker moved for the request, once complete: when the request finished
  (its loads are done by then) or, when vLLM kept its blocks for saves in flight, once they landed.

:func:`read_step_log` reads a scheduler file and its workers' files back (:class:`StepLogError` on a line that
is not a record).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("kvstore.integrations.vllm")

#: lines per file at most, by default (a step line is about 150 bytes: about 150 MB).
DEFAULT_MAX_RECORDS = 1_000_000
#: token times kept per request at most (a request line then stays under about 1 MB)
MAX_TOKEN_TIMES = 65_536


class StepLogError(ValueError):
    """A step-log setting is invalid, its file cannot be opened, or a line read back is not a record."""


def worker_path(path: str, rank: int) -> str:
    return f"{path}.worker{rank}"


class StepLogWriter:
    """Appends JSON lines to ``path`` (flushed per line), at most ``max_records``; thread-safe."""

    def __init__(self, path: str, max_records: int = DEFAULT_MAX_RECORDS):
        if not isinstance(path, str) or not path:
            raise StepLogError(f"kvstore connector: step_log must be a file path, got {path!r}")
        if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 2:
            raise StepLogError(f"kvstore connector: step_log_max_records must be an int >= 2, got {max_records!r}")
        self.path, self.max_records = path, max_records
        try:
            self._file: Any = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise StepLogError(f"kvstore connector: cannot open step_log {path!r} for appending: {exc}") from None
        self.written = 0
        self.dropped = 0
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                self.dropped += 1
                return
            if self.written >= self.max_records - 1:
                if self.written == self.max_records - 1:
                    self._put('{"t":"truncated"}\n')
                    log.warning("kvstore connector: step_log %s reached %d records; later records are dropped",
                                self.path, self.max_records)
                self.dropped += 1
                return
            self._put(line)

    def _put(self, line: str) -> None:
        try:
            self._file.write(line)
            self._file.flush()
            self.written += 1
        except OSError as exc:
            log.warning("kvstore connector: writing step_log %s failed (%s); step logging is off", self.path, exc)
            self._close()

    def _close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._close()


def _r(t: float | None) -> float | None:
    return None if t is None else round(t, 6)


@dataclass(slots=True)
class _Open:
    """A step built but not yet ended."""

    start: float
    prefill: int
    decode: int
    reqs: int
    kv_usage: float | None
    prompt_done: list[str]
    emits: list[str]
    finished: list[tuple[str, int, dict | None]] = field(default_factory=list)


class SchedulerSteps:
    """The scheduler half's recorder: :meth:`on_schedule` from ``build_connector_meta``, :meth:`on_finished` from
    ``request_finished``, :meth:`on_step_end` from ``get_kv_connector_stats`` (once per ``update_from_output``).
    Steps pair with their ends first in, first out (one open step at a time without asynchronous scheduling)."""

    #: open steps kept at most: past it (a vLLM that stopped asking for stats) the oldest ends at the next's start
    MAX_OPEN = 8

    def __init__(self, writer: StepLogWriter, clock=time.monotonic):
        self.writer, self.clock = writer, clock
        self.block_pool: Any = None
        self._open: deque[_Open] = deque()
        self._prompt: dict[str, int] = {}
        self._first: dict[str, float] = {}
        self._prefill_end: dict[str, float] = {}
        self._tokens: dict[str, list[float]] = {}
        writer.write({"t": "open", "side": "scheduler", "pid": os.getpid(), "rank": None, "block_bytes": None})

    def _usage(self) -> float | None:
        try:
            return None if self.block_pool is None else round(float(self.block_pool.get_usage()), 6)
        except Exception:  # noqa: BLE001 - a vLLM without get_usage: the field is unknown, the step still logged
            return None

    def on_schedule(self, scheduler_output: Any) -> None:
        start = self.clock()
        scheduled: dict[str, int] = dict(getattr(scheduler_output, "num_scheduled_tokens", None) or {})
        computed: dict[str, int] = {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            prompt = getattr(new, "prompt_token_ids", None)
            if prompt is not None:
                self._prompt[new.req_id] = len(prompt)
            computed[new.req_id] = int(getattr(new, "num_computed_tokens", 0) or 0)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            for req_id, n in zip(cached.req_ids, cached.num_computed_tokens, strict=False):
                computed[req_id] = int(n)
        prefill = decode = 0
        done: list[str] = []
        emits: list[str] = []
        for req_id, n in scheduled.items():
            self._first.setdefault(req_id, start)
            prompt = self._prompt.get(req_id)
            before = computed.get(req_id, 0)
            p = 0 if prompt is None else max(0, min(n, prompt - before))
            prefill += p
            decode += n - p
            if prompt is not None and before + n >= prompt:
                emits.append(req_id)
                if p:
                    done.append(req_id)
        if len(self._open) >= self.MAX_OPEN:
            self._end(self._open.popleft(), start)
        self._open.append(_Open(start, prefill, decode, len(scheduled), self._usage(), done, emits))

    def on_finished(self, req_id: str, prompt_tokens: int | None, params: dict | None) -> None:
        if prompt_tokens is not None:
            self._prompt.setdefault(req_id, prompt_tokens)
        item = (req_id, self._prompt.get(req_id, prompt_tokens or 0), params)
        if self._open:  # inside update_from_output: written at this step's end
            self._open[0].finished.append(item)
        else:  # aborted between steps
            self._write_request(item, self.clock())

    def on_step_end(self) -> None:
        if self._open:
            self._end(self._open.popleft(), self.clock())

    def _end(self, step: _Open, end: float) -> None:
        for req_id in step.prompt_done:
            self._prefill_end[req_id] = end
        t = _r(end)
        for req_id in step.emits:
            times = self._tokens.setdefault(req_id, [])
            if len(times) < MAX_TOKEN_TIMES:
                times.append(t)  # type: ignore[arg-type]
        if step.prefill or step.decode:
            self.writer.write({"t": "step", "start": _r(step.start), "end": _r(end), "prefill": step.prefill,
                               "decode": step.decode, "reqs": step.reqs, "kv_usage": step.kv_usage})
        for item in step.finished:
            self._write_request(item, end)

    def _write_request(self, item: tuple[str, int, dict | None], end: float) -> None:
        req_id, prompt, params = item
        self.writer.write({"t": "request", "id": req_id, "prompt": prompt,
                           "first_start": _r(self._first.pop(req_id, None)),
                           "prefill_end": _r(self._prefill_end.pop(req_id, None)), "end": _r(end),
                           "token_ends": self._tokens.pop(req_id, []), "kv_transfer_params": params})
        self._prompt.pop(req_id, None)


class WorkerTransfers:
    """The worker half's recorder: one ``transfer`` line per request it moved KV for, once complete."""

    def __init__(self, writer: StepLogWriter, rank: int, block_bytes: int, clock=time.monotonic):
        self.writer, self.clock = writer, clock
        writer.write({"t": "open", "side": "worker", "pid": os.getpid(), "rank": rank, "block_bytes": block_bytes})

    def done(self, req_id: str, record: dict | None) -> None:
        if not record:
            return
        self.writer.write({"t": "transfer", "id": req_id, "at": _r(self.clock()),
                           **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in record.items()
                              if k != "save_pending_bytes"}})


@dataclass(slots=True)
class StepLog:
    """A step log read back: the scheduler's steps and requests, the workers' transfers by request id."""

    steps: list[dict] = field(default_factory=list)
    requests: dict[str, dict] = field(default_factory=dict)
    transfers: dict[str, dict] = field(default_factory=dict)
    block_bytes: int | None = None
    truncated: bool = False
    opens: int = 0


_TRANSFER_SUMS = ("load_bytes", "load_seconds", "loaded_blocks", "save_bytes", "save_seconds", "saved_blocks")


def read_step_log(path: str) -> StepLog:
    """The scheduler file ``path`` and every ``<path>.worker<rank>`` beside it (transfers of one request on
    several ranks are summed). A missing scheduler file reads as empty; a line that is not a record is a
    StepLogError naming the file and line (a last line cut short by a killed engine is skipped)."""
    out = StepLog()
    for name in [path, *sorted(glob.glob(glob.escape(path) + ".worker*"))]:
        try:
            with open(name, encoding="utf-8") as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StepLogError(f"cannot read step log {name}: {exc}") from None
        last = len(lines) - 1
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                kind = rec["t"]
            except (ValueError, KeyError, TypeError):
                if i == last:  # no newline yet: the writer was killed mid-line
                    continue
                raise StepLogError(f"{name}:{i + 1}: not a step-log record: {line[:120]!r}") from None
            _add(out, rec, kind, f"{name}:{i + 1}")
    out.steps.sort(key=lambda s: s["start"])
    return out


def _add(out: StepLog, rec: dict, kind: str, where: str) -> None:
    try:
        if kind == "step":
            out.steps.append({k: rec[k] for k in ("start", "end", "prefill", "decode", "reqs", "kv_usage")})
        elif kind == "request":
            out.requests[rec["id"]] = rec
        elif kind == "transfer":
            prev = out.transfers.get(rec["id"])
            if prev is None:
                out.transfers[rec["id"]] = {**{k: rec[k] for k in _TRANSFER_SUMS}, "at": rec["at"]}
            else:
                for k in _TRANSFER_SUMS:
                    prev[k] += rec[k]
                prev["at"] = max(prev["at"], rec["at"])
        elif kind == "open":
            out.opens += 1
            if rec.get("block_bytes"):
                out.block_bytes = rec["block_bytes"]
        elif kind == "truncated":
            out.truncated = True
        else:
            raise StepLogError(f"{where}: unknown step-log record kind {kind!r}")
    except KeyError as exc:
        raise StepLogError(f"{where}: {kind} record without {exc}") from None
