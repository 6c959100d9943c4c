"""``python -m benchmarks.pd compare --engine vllm`` through the product: real vLLM OpenAI servers behind
``kvstore router``, the trace sent over HTTP.

Per architecture a fleet starts once (kvstore.router.fleet, the launcher of ``kvstore pd up``) and serves every
source in turn:

- ``colocated``: two vLLM OpenAI servers that move no KV, whole-prompt prefill steps
  (``--no-enable-chunked-prefill``, ``--max-num-batched-tokens`` = the model length), the router's
  ``--colocated`` pool;
- ``chunked``: the same two with chunked prefill, ``--chunk-budget`` tokens per step;
- ``disaggregated``: a kv_producer (``--prefill``) and a kv_consumer (``--decode``) with the kvstore connector,
  sharing a ``kvstore serve`` daemon (``--store``): the router's verified hand-off.

Equal compute: each instance's engine is one OpenMP thread bound to its own core (``--cores``); the router and
the daemon are not pinned. ``kvstore router`` runs as its own process with ``--admission`` and the SLO as its
budgets. The client (this process, aiohttp) sends every request at its arrival offset as a streaming
``/v1/completions`` of the trace's token ids (``ignore_eos``, greedy) and times the SSE events itself:
TTFT = arrival -> the first token event; TPOT = (last - first token event) / (tokens - 1). A 429 is a shed
request (counted, never retried); a 503, a connection error or an error event is retried after its
``Retry-After`` until ``--request-timeout`` (the client restarts the stream: ``attempts``).

Faults (``--inject-fault decode-crash@T``): T seconds into each run the decode instance (disaggregated) or the
second instance (colocated, chunked) is SIGKILLed with its process group and started again on the same port;
the router ejects it and readmits it when it answers, and the fault block says what the clients saw.

Traces whose requests exceed the context are fitted, not refused (:func:`fit_trace`, reported).

Steps and KV per request: every instance runs the kvstore connector with a step log (``step_log``,
docs/vllm.md; the colocated and chunked ones with ``transfers: false``: no store, nothing moved, only the
record). After each run the logs are read back (:func:`collect_logs`, waiting up to 15 s for a prefill's saves
still landing) and joined to the client's rows by the ``X-Request-Id`` the client gave each attempt
(:func:`request_id`, which vLLM's request ids contain):

- ``timeline.jsonl``: every step of the run on every instance (``worker`` = the instance's index, ``start_s`` /
  ``end_s`` = the step from the scheduler's metadata to vLLM asking for the connector's stats, i.e. the
  forward pass and its bookkeeping, ``prefill_tokens`` / ``decode_tokens``, ``running``, ``kv_usage``);
- per request, under the in-process rows' names (record.py, vllm_deployment.py): ``prefill_worker``,
  ``decode_worker``, ``handed_off`` (the prefill hop's promise saved blocks and a decode hop followed),
  ``prefill_start_s`` / ``prefill_end_s`` (the first step that scheduled it on the instance that ran its prompt,
  the end of the step that finished the prompt), ``prefill_queue_s``, ``decode_ready_s`` (disaggregated: the
  end of the prefill hop's last step; else ``prefill_end_s``), ``decode_admit_s`` (the decode instance's first
  step with it; its load and the router's turnaround come before it), ``decode_queue_s``, ``kv_bytes_saved`` /
  ``kv_blocks_saved`` (the prefill instance's connector), ``kv_bytes_loaded`` / ``kv_blocks_loaded`` (the decode
  instance's), ``kv_bytes_transferred`` (= loaded, when handed off), ``publish_s`` (save seconds), ``fetch_s``
  (load seconds), ``transfer_s`` (their sum), ``kv_transfer_params`` (the prefill's promise), ``kv_bytes``
  (prompt x KV bytes per token), ``token_times_s`` (each token at the engine: the end of the decode instance's
  step that sampled it, as in the in-process rows; ``token_times_at`` says ``client`` where the log's count did
  not match the tokens streamed and the client's are used), ``client_token_times_s`` (each token's SSE event
  at the client; an event of n tokens gives n equal times). TTFT and TPOT stay the client's.

So metrics.py's ``scorecard`` and verdict.py's ``verdicts`` read the HTTP run as they read the in-process one:
interference (a request's inter-token gaps at its decode instance with a prefill step starting there in between),
burst, transfer (bytes, hand-offs, share of TTFT), memory (weights: the model's files per instance; peak KV:
the largest block-pool usage x the cache), CPU seconds (each instance's process group: API server, engine core
and worker; the router's and the daemon's processes) and energy. Times in every row and step are seconds since
the run's start (the client's ``time.monotonic()``, the clock the instances log with).

Outputs: ``<source>/<arch>/requests.jsonl`` (a row per request), ``<source>/<arch>/timeline.jsonl``,
``<source>/<arch>/summary.json`` (the in-process run's summary format), ``<source>/<arch>/router_metrics.json``
(the router's counters over the run), ``summary.json`` (per source x arch: the client's results merged with
the scorecard; ``verdicts``) and ``report.md`` (with an interference and transfer table and the verdicts).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import secrets
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.pd.compare import _unique_names
from benchmarks.pd.deployment import Arch
from benchmarks.pd.energy import EnergyMeter
from benchmarks.pd.make_model import read_shape
from benchmarks.pd.metrics import by_class, scorecard, slo_block
from benchmarks.pd.summary import _throughput, _transfer, distribution
from benchmarks.pd.trace import TokenRequest, TokenTrace
from benchmarks.pd.vllm_compare import VllmCompareConfig
from benchmarks.pd.vllm_deployment import ROLE_NAMES, VllmConfig
from benchmarks.pd.vllm_deployment import ROLES as VLLM_ROLES
from kvstore.integrations.vllm.steplog import StepLog, read_step_log
from kvstore.router.fleet import Child, Fleet, FleetError, project_env, spawn, vllm_command, wait_http
from kvstore.router.request import verified
from kvstore.workloads.slo import SLO

#: The router's pools and each instance's kv_role, per architecture.
POOLS = {Arch.COLOCATED: (("colocated", None), ("colocated", None)),
         Arch.CHUNKED: (("colocated", None), ("colocated", None)),
         Arch.DISAGGREGATED: (("prefill", "kv_producer"), ("decode", "kv_consumer"))}
#: Router counters copied into each run's results (their deltas over the run).
ROUTER_COUNTERS = ("kvstore_router_routes_total", "kvstore_router_prefill_retries_total",
                   "kvstore_router_shed_total", "kvstore_router_hop_errors_total", "kvstore_router_ejections_total",
                   "kvstore_router_store_lookups_total", "kvstore_router_requests_total")


@dataclass(frozen=True, slots=True)
class HttpCompareConfig(VllmCompareConfig):
    """The in-process comparison's settings, plus what the router adds: its admission, and each hop's timeout."""

    admission: str = "budget"
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        VllmCompareConfig.__post_init__(self)
        if self.admission not in ("none", "budget"):
            raise ValueError(f"admission must be none or budget, got {self.admission!r}")


# -- fitting a trace into the context ----------------------------------------------------------------------
def fit_trace(trace: TokenTrace, max_model_len: int) -> tuple[TokenTrace, dict]:
    """The trace with every request fitted into ``max_model_len`` tokens (prompt + output), and how.

    Rule: a request that does not fit keeps its output up to half the context, and its prompt is cut to what
    is left (its first tokens are kept: shared prefixes stay shared). Fitted requests are marked ``capped``."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    out, fitted, dropped_prompt, dropped_output = [], 0, 0, 0
    for r in trace.requests:
        if r.prompt_tokens + r.output_tokens <= max_model_len:
            out.append(r)
            continue
        output = min(r.output_tokens, max_model_len // 2)
        prompt = r.prompt_ids[:max_model_len - output]
        fitted += 1
        dropped_prompt += r.prompt_tokens - len(prompt)
        dropped_output += r.output_tokens - output
        out.append(dataclasses.replace(r, prompt_ids=prompt, output_tokens=output, capped=True))
    note = {"max_model_len": max_model_len, "requests_fitted": fitted, "prompt_tokens_cut": dropped_prompt,
            "output_tokens_cut": dropped_output,
            "rule": "a request longer than the context keeps its output up to half the context and its prompt's "
                    "first tokens up to the rest"}
    return dataclasses.replace(trace, requests=tuple(out)), note


# -- the fleet -------------------------------------------------------------------------------------------------
def _vllm_args(engine: VllmConfig, arch: Arch, model_has_tokenizer: bool) -> tuple[str, ...]:
    batched = engine.chunk_budget if arch is Arch.CHUNKED else engine.max_model_len
    args = ["--dtype", engine.dtype, "--block-size", str(engine.block_size), "--kv-cache-memory-bytes",
            str(engine.kv_cache_bytes), "--max-model-len", str(engine.max_model_len), "--enforce-eager",
            "--seed", "0", "--max-num-batched-tokens", str(batched), "--no-enable-prefix-caching",
            "--enable-chunked-prefill" if arch is Arch.CHUNKED else "--no-enable-chunked-prefill"]
    if not model_has_tokenizer:
        args.append("--skip-tokenizer-init")  # the trace is token ids; the router never tokenizes them
    return tuple(args)


def _instance_env(core: int) -> dict:
    env = project_env()
    env.update(VLLM_CPU_OMP_THREADS_BIND=str(core), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"))
    return env


class HttpFleet:
    """A daemon (disaggregated), two vLLM OpenAI servers and ``kvstore router``; stopped on exit.

    Every instance runs the kvstore connector with a step log (``step_logs[i]``: one file per process that
    served as instance ``i``, a replacement after a fault gets its own): the disaggregated pair as
    kv_producer / kv_consumer, the colocated ones with ``transfers: false`` (no store, nothing moved)."""

    def __init__(self, engine: VllmConfig, arch: Arch, workdir: Path, admission: str, slo: SLO):
        self.engine, self.arch, self.workdir = engine, arch, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.fleet = Fleet(str(workdir), project_env())
        self.instances: list[tuple[Child, int, dict, str]] = []  # child, port, env, url
        self.step_logs: list[list[str]] = []
        self.admission, self.slo = admission, slo
        self.router_url = ""
        self.router: Child | None = None
        self.daemon: Child | None = None
        self.store: str | None = None
        self._args: tuple[str, ...] = ()

    def _command(self, index: int, port: int) -> list[str]:
        """Instance ``index``'s command with a fresh step-log file."""
        logs = self.step_logs[index]
        path = str((self.workdir / f"steps-{index}-{len(logs)}.jsonl").resolve())
        logs.append(path)
        role = POOLS[self.arch][index][1]
        extra: dict = {"step_log": path}
        if role is None:  # colocated: the connector records steps and moves nothing
            return vllm_command(self.engine.model, port, "kv_both", "", connector_extra={**extra, "transfers": False},
                                args=self._args)
        extra.update(transport=self.engine.transport, timeout_s=10.0)
        return vllm_command(self.engine.model, port, role, self.store, connector_extra=extra, args=self._args)

    def __enter__(self) -> HttpFleet:
        try:
            self._start()
        except BaseException:
            self.fleet.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.fleet.stop()

    def _start(self) -> None:
        e = self.engine
        if self.arch is Arch.DISAGGREGATED:
            sock = f"/tmp/kvstore-pdhttp-{os.getpid()}-{id(self)}.sock"
            self.store = self.fleet.daemon(sock, e.store_capacity)
            self.daemon = self.fleet.children[-1]
        tokenizer = Path(e.model, "tokenizer.json").is_file() or Path(e.model, "tokenizer.model").is_file()
        self._args = _vllm_args(e, self.arch, tokenizer)
        pools: dict[str, list[str]] = {"prefill": [], "decode": [], "colocated": []}
        for i, (pool, _role) in enumerate(POOLS[self.arch]):
            port = _free_port()
            self.step_logs.append([])
            cmd = self._command(i, port)
            env = _instance_env(e.cores[i])
            child = spawn(f"{self.arch.value}-{i}", cmd, str(self.workdir), env)
            self.fleet.children.append(child)
            url = f"http://127.0.0.1:{port}"
            self.instances.append((child, port, env, url))
            pools[pool].append(url)
        for child, _, _, url in self.instances:
            wait_http(child, url + "/health", e.start_timeout_s)
        port = _free_port()
        cmd = [sys.executable, "-m", "kvstore.cli", "router", "--listen", f"127.0.0.1:{port}", "--admission",
               self.admission, "--slo-ttft", str(self.slo.ttft_s), "--slo-tpot", str(self.slo.tpot_s),
               "--block-size", str(e.block_size), "--health-interval", "0.5", "--log-level", "warning"]
        for pool, urls in pools.items():
            for url in urls:
                cmd += [f"--{pool}", url]
        if self.store:
            cmd += ["--store", self.store]
        router = self.router = self.fleet.start("router", cmd)
        self.router_url = f"http://127.0.0.1:{port}"
        wait_http(router, self.router_url + "/health", 60.0)

    def victim(self) -> int:
        """Which instance a decode crash kills: the decode instance, or the second colocated one."""
        return len(self.instances) - 1

    def kill_and_restart(self, index: int) -> float:
        """SIGKILL instance ``index``'s process group, start it again on its port; seconds until it answers."""
        child, port, env, url = self.instances[index]
        killed = time.monotonic()
        try:
            os.killpg(child.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.proc.wait(30)
        fresh = spawn(child.name + "-replacement", self._command(index, port), str(self.workdir), env)
        self.fleet.children.append(fresh)
        self.instances[index] = (fresh, port, env, url)
        wait_http(fresh, url + "/health", self.engine.start_timeout_s)
        return time.monotonic() - killed


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_counters(base: str) -> dict[str, float]:
    """The router's counters of :data:`ROUTER_COUNTERS`, ``name{labels}`` -> value."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for m in re.finditer(r"^(kvstore_router_[a-z_]+_total)(\{[^}]*\})? (\S+)$", text, re.M):
        if m.group(1) in ROUTER_COUNTERS:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


# -- the client ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ClientRow:
    id: str
    klass: str
    arrival_s: float
    prompt_tokens: int
    target_output_tokens: int
    capped: bool
    status: int | None = None
    shed: bool = False
    lost: bool = False
    attempts: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    output_tokens: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_text: str = ""
    errors: list[str] = dataclasses.field(default_factory=list)  # the first 5
    failures: int = 0  # failed attempts (their errors beyond the first 5 are not kept)
    token_times_s: list[float] = dataclasses.field(default_factory=list)  # per token, when its event arrived
    request_id: str = ""  # the last attempt's X-Request-Id (the instances' step logs name it)

    def to_dict(self) -> dict:
        ttft = None if self.first_token_s is None else round(self.first_token_s - self.arrival_s, 6)
        tpot = None
        if self.first_token_s is not None and self.last_token_s is not None and self.output_tokens > 1:
            tpot = round((self.last_token_s - self.first_token_s) / (self.output_tokens - 1), 6)
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update({"class": self.klass, "ttft_s": ttft, "tpot_s": tpot,
                  "e2e_s": None if self.last_token_s is None else round(self.last_token_s - self.arrival_s, 6)})
        return d


def request_id(nonce: str, index: int, attempt: int) -> str:
    """The X-Request-Id of attempt ``attempt`` of the trace's ``index``-th request (vLLM's request ids contain
    it: :data:`REQUEST_ID` finds it in the step logs)."""
    return f"pdh{nonce}r{index}a{attempt}"


REQUEST_ID = re.compile(r"pdh([0-9a-f]+)r(\d+)a(\d+)(?!\d)")


async def _one(session, base: str, model: str, r: TokenRequest, t0: float, deadline_s: float, index: int = 0,
               nonce: str = "0") -> ClientRow:
    import aiohttp

    row = ClientRow(r.id, r.klass, r.arrival_s, r.prompt_tokens, r.output_tokens, r.capped)
    await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.monotonic()))
    body = {"model": model, "prompt": list(r.prompt_ids), "max_tokens": r.output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    give_up = t0 + r.arrival_s + deadline_s
    while time.monotonic() < give_up:
        row.attempts += 1
        row.request_id = request_id(nonce, index, row.attempts)
        headers = {"X-Request-Id": row.request_id, "X-Request-Class": r.klass}
        row.first_token_s = row.last_token_s = None
        row.output_tokens, row.output_token_ids, row.output_text, row.token_times_s = 0, [], "", []
        retry_after = 1.0
        try:
            async with session.post(base + "/v1/completions", json=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=max(1.0, give_up - time.monotonic()))) as resp:
                row.status = resp.status
                if resp.status == 429:
                    row.shed = True
                    return row
                if resp.status != 200:
                    retry_after = float(resp.headers.get("Retry-After", "1") or 1)
                    _note(row, f"HTTP {resp.status}: {(await resp.text())[:200]}")
                    if resp.status < 500:
                        break
                elif await _read_stream(resp, row, t0):
                    return row
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            _note(row, f"{type(exc).__name__}: {exc}"[:200])
        await asyncio.sleep(min(retry_after, 2.0))
    row.lost = True
    return row


def _note(row: ClientRow, error: str) -> None:
    """Keep the first few errors of a request (a request retried for minutes would list hundreds)."""
    row.failures += 1
    if len(row.errors) < 5:
        row.errors.append(error)


async def _read_stream(resp, row: ClientRow, t0: float) -> bool:
    """Read one SSE answer into ``row`` (times in seconds since ``t0``, the run's start, as ``arrival_s``); True
    when it ended with [DONE] and no error event."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        if payload == b"[DONE]":
            return row.output_tokens > 0
        event = json.loads(payload)
        if "error" in event:
            _note(row, str(event["error"].get("message", event["error"]))[:200])
            return False
        now = time.monotonic() - t0
        for choice in event.get("choices") or ():
            ids = choice.get("token_ids")
            n = len(ids) if isinstance(ids, list) else (1 if choice.get("text") or choice.get("finish_reason")
                                                        is None else 0)
            if isinstance(ids, list):
                row.output_token_ids += ids
            row.output_text += choice.get("text") or ""
            if n:
                if row.first_token_s is None:
                    row.first_token_s = now
                row.last_token_s = now
                row.output_tokens += n
                row.token_times_s += [round(now, 6)] * n
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            row.output_tokens = usage["completion_tokens"]
    return False


async def replay(base: str, model: str, trace: TokenTrace, deadline_s: float, t0: float,
                 nonce: str = "0") -> list[ClientRow]:
    """Every request of ``trace`` at its arrival offset after ``t0`` (monotonic); the rows in trace order.
    ``nonce`` (hex) makes this replay's request ids its own."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return list(await asyncio.gather(*(_one(session, base, model, r, t0, deadline_s, i, nonce)
                                           for i, r in enumerate(trace.requests))))


# -- one run, the comparison -----------------------------------------------------------------------------------
def _served_model(base: str) -> str:
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _warm_up(base: str, model: str, block_size: int) -> None:
    """One request through the router (first-request costs of both hops are not a run's)."""
    from benchmarks.pd.trace import TraceScaling

    r = TokenRequest("warm-up", 0.0, tuple(range(3, 3 + 2 * block_size + 1)), 2, 0, 0)
    trace = TokenTrace("warm-up", "warm-up", (r,), TraceScaling(), 0)
    rows = asyncio.run(replay(base, model, trace, 300.0, time.monotonic()))
    if rows[0].lost:
        raise FleetError(f"the warm-up request through the router failed: {rows[0].errors}")


def run_source(fleet: HttpFleet, trace: TokenTrace, run_dir: Path, cfg: HttpCompareConfig, describe: dict) -> dict:
    """Serve ``trace`` through the fleet's router; write the run's files; its results (:func:`results` merged
    with metrics.py's scorecard of the run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    model = _served_model(fleet.router_url)
    before = router_counters(fleet.router_url)
    fault_block = None
    nonce = secrets.token_hex(4)
    others = {"router": fleet.router, "store_daemon": fleet.daemon}
    cpu0 = {k: proc_cpu_s(c.proc.pid) for k, c in others.items() if c is not None}
    group0 = {c.proc.pid: group_cpu_s(c.proc.pid) for c, *_ in fleet.instances}
    meter = EnergyMeter()
    meter.start()
    t0 = time.monotonic()

    async def go() -> list[ClientRow]:
        task = asyncio.create_task(replay(fleet.router_url, model, trace, cfg.request_timeout_s, t0, nonce))
        nonlocal fault_block
        if cfg.fault is not None:
            await asyncio.sleep(max(0.0, t0 + cfg.fault.at_s - time.monotonic()))
            victim = fleet.victim()
            at = time.monotonic() - t0
            ready = await asyncio.to_thread(fleet.kill_and_restart, victim)
            fault_block = {"injected": str(cfg.fault), "victim_instance": victim, "killed_at_s": round(at, 3),
                           "replacement_ready_s": round(ready, 3)}
        return await task

    rows = asyncio.run(go())
    wall = time.monotonic() - t0
    meter.stop()
    after = router_counters(fleet.router_url)
    counters = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}
    cpu = {k: round(proc_cpu_s(others[k].proc.pid) - v, 3) for k, v in cpu0.items()}  # type: ignore[union-attr]
    workers_cpu = {str(i): round(group_cpu_s(c.proc.pid) - group0.get(c.proc.pid, 0.0), 3)
                   for i, (c, *_) in enumerate(fleet.instances)}
    logs, t_end = collect_logs(fleet, rows, nonce)
    dicts = attribute(rows, logs, fleet.arch, nonce, t0, describe["kv_bytes_per_token"])
    timeline = timeline_rows(logs, fleet.arch, t0, t_end)
    if fault_block is not None:
        fault_block.update(requests_retried=sum(r.attempts > 1 for r in rows), requests_lost=sum(r.lost for r in rows))
    res = results(dicts, cfg.slo, wall, counters, fault_block)
    summary = run_summary(dicts, res, logs, fleet, describe, t0, t_end, {"workers": workers_cpu, **cpu},
                          meter.result())
    card = scorecard(summary, dicts, timeline, cfg.slo)
    with open(run_dir / "requests.jsonl", "w") as f:
        for d in dicts:
            f.write(json.dumps(d) + "\n")
    with open(run_dir / "timeline.jsonl", "w") as f:
        for step in timeline:
            f.write(json.dumps(step) + "\n")
    (run_dir / "router_metrics.json").write_text(json.dumps(counters, indent=2) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return {**res, **card, "requests": {**card["requests"], **res["requests"]},
            "throughput": {**card["throughput"], **res["throughput"]}, "fault": fault_block,
            "run_dir": str(run_dir.relative_to(run_dir.parent.parent))}


# -- the instances' step logs: timeline and per-request attribution ---------------------------------------------
def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds so far of the live processes of process group ``pgid``: a vLLM OpenAI server's API process,
    engine core and worker (each instance is spawned as its own group)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@dataclass(slots=True)
class InstanceLog:
    """One instance's step logs (one per process that served as it), and the run's request ids found in them."""

    index: int
    pool: str
    files: list[StepLog]
    ids: dict[str, str]  # our X-Request-Id -> vLLM's request id

    def request(self, hid: str) -> dict | None:
        rid = self.ids.get(hid)
        return None if rid is None else next((f.requests[rid] for f in self.files if rid in f.requests), None)

    def transfer(self, hid: str) -> dict | None:
        rid = self.ids.get(hid)
        return None if rid is None else next((f.transfers[rid] for f in self.files if rid in f.transfers), None)


def read_logs(fleet: HttpFleet, nonce: str) -> list[InstanceLog]:
    out = []
    for i, paths in enumerate(fleet.step_logs):
        files = [read_step_log(p) for p in paths]
        ids = {}
        for f in files:
            for rid in f.requests:
                m = REQUEST_ID.search(rid)
                if m and m.group(1) == nonce:
                    ids[m.group(0)] = rid
        out.append(InstanceLog(i, POOLS[fleet.arch][i][0], files, ids))
    return out


def collect_logs(fleet: HttpFleet, rows: list[ClientRow], nonce: str, wait_s: float = 15.0
                 ) -> tuple[list[InstanceLog], float]:
    """The instances' logs once every completed request's record is in (a prefill's saves still in flight when
    its answer came are logged when they land), or after ``wait_s``; and the monotonic time they were read."""
    deadline = time.monotonic() + wait_s
    while True:
        logs = read_logs(fleet, nonce)
        done = [r.request_id for r in rows if not r.lost and not r.shed]
        served = all(any(lg.request(h) for lg in logs if lg.pool != "prefill") for h in done)
        saved = all(lg.transfer(h) for lg in logs if lg.pool == "prefill" for h in done
                    if (lg.request(h) or {}).get("kv_transfer_params"))
        if (served and saved) or time.monotonic() > deadline:
            return logs, time.monotonic()
        time.sleep(0.2)


def _run_t(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 6)


def attribute(rows: list[ClientRow], logs: list[InstanceLog], arch: Arch, nonce: str, t0: float,
              kv_bytes_per_token: int) -> list[dict]:
    """The client's rows with what the instances logged for each request's last attempt, under the in-process
    rows' field names (record.py / vllm_deployment.py): which instance prefilled and decoded it, its steps'
    times (seconds since the run's start), and the KV the connector moved for it (saved by the prefill
    instance, loaded by the decode instance)."""
    out = []
    for r in rows:
        d = r.to_dict()
        hid = r.request_id
        pre = next(((lg, rec) for lg in logs if lg.pool == "prefill" and (rec := lg.request(hid))), None)
        dec = next(((lg, rec) for lg in logs if lg.pool != "prefill" and (rec := lg.request(hid))), None)
        # the router's "handoff" route: the prefill hop's promise saved blocks, and a decode hop followed
        handed_off = pre is not None and dec is not None and verified(pre[1]["kv_transfer_params"])
        first = pre or dec
        saved = (pre[0].transfer(hid) if pre else None) or {}
        loaded = (dec[0].transfer(hid) if dec else None) or {}
        publish = saved.get("save_seconds", 0.0) + saved.get("load_seconds", 0.0)
        fetch = loaded.get("load_seconds", 0.0)
        prefill_start = _run_t(first[1]["first_start"], t0) if first else None
        prefill_end = _run_t((pre or dec)[1]["prefill_end"], t0) if first else None  # type: ignore[index]
        ready = _run_t(pre[1]["end"], t0) if handed_off else prefill_end  # type: ignore[index]
        admit = _run_t(dec[1]["first_start"], t0) if handed_off else prefill_end  # type: ignore[index]
        ends = (dec[1].get("token_ends") or []) if dec else []
        engine_times = len(ends) == r.output_tokens > 0  # one step end per token the client got
        d.update({
            "client_token_times_s": d.pop("token_times_s"),
            "token_times_s": [round(t - t0, 6) for t in ends] if engine_times else r.token_times_s,
            "token_times_at": "engine" if engine_times else "client",
            "prefill_worker": first[0].index if first else None, "decode_worker": dec[0].index if dec else None,
            "handed_off": handed_off, "dispatch_s": round(r.arrival_s, 6),
            "prefill_start_s": prefill_start, "prefill_end_s": prefill_end,
            "prefill_queue_s": None if prefill_start is None else round(prefill_start - r.arrival_s, 6),
            "decode_ready_s": ready, "decode_admit_s": admit,
            "decode_queue_s": None if ready is None or admit is None else round(max(admit - ready, 0.0), 6),
            "kv_bytes": r.prompt_tokens * kv_bytes_per_token,
            "kv_bytes_saved": int(saved.get("save_bytes", 0)), "kv_blocks_saved": int(saved.get("saved_blocks", 0)),
            "kv_bytes_loaded": int(loaded.get("load_bytes", 0)),
            "kv_blocks_loaded": int(loaded.get("loaded_blocks", 0)),
            "kv_bytes_transferred": int(loaded.get("load_bytes", 0)) if handed_off else 0,
            "publish_s": round(publish, 6) if handed_off else 0.0, "fetch_s": round(fetch, 6) if handed_off else 0.0,
            "transfer_s": round(publish + fetch, 6) if handed_off else 0.0,
            "kv_transfer_params": pre[1]["kv_transfer_params"] if pre else None,
            "recomputed": r.attempts - 1 if r.attempts else 0, "refetched": 0,
        })
        out.append(d)
    return out


def _window(f: StepLog, t0: float, t_end: float) -> list[dict]:
    """The steps of one log inside the run's window (the warm-up's and earlier runs' are before it)."""
    return [s for s in f.steps if s["start"] >= t0 and s["end"] <= t_end]


def timeline_rows(logs: list[InstanceLog], arch: Arch, t0: float, t_end: float) -> list[dict]:
    """timeline.jsonl: every logged step of the run (metrics.py reads ``worker``, ``start_s``, ``end_s``,
    ``prefill_tokens``; ``running`` is the step's scheduled requests, ``kv_usage`` the share of KV blocks in
    use after scheduling)."""
    out = []
    for lg in logs:
        for f in lg.files:
            for s in _window(f, t0, t_end):
                out.append({"worker": lg.index, "role": ROLE_NAMES[VLLM_ROLES[arch][lg.index]],
                            "start_s": round(s["start"] - t0, 6), "end_s": round(s["end"] - t0, 6),
                            "prefill_tokens": s["prefill"], "decode_tokens": s["decode"], "running": s["reqs"],
                            "kv_usage": s["kv_usage"]})
    return sorted(out, key=lambda s: (s["worker"], s["start_s"]))


def _weight_bytes(model: str) -> int:
    """The model's weight files' bytes (each instance holds one copy)."""
    return sum(p.stat().st_size for p in Path(model).iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))


def run_summary(rows: list[dict], res: dict, logs: list[InstanceLog], fleet: HttpFleet, describe: dict, t0: float,
                t_end: float, cpu: dict, energy: dict) -> dict:
    """summary.json of one run, in the in-process run's format (summary.py), for metrics.py's scorecard."""
    done = [r for r in rows if not r["lost"] and not r["shed"]]

    def dist(name: str) -> dict | None:
        return distribution([r[name] for r in done if r.get(name) is not None])

    kv_cache = fleet.engine.kv_cache_bytes
    peak = {}
    for lg in logs:
        usage = [s["kv_usage"] for f in lg.files for s in _window(f, t0, t_end) if s["kv_usage"] is not None]
        peak[str(lg.index)] = int(max(usage, default=0.0) * kv_cache)
    weights = [_weight_bytes(fleet.engine.model)] * len(logs)
    throughput = _throughput(done) if any(r["token_times_s"] for r in done) else {"duration_s": 0.0}
    summary = {
        "deployment": describe, "requests": {**res["requests"], "recomputed": sum(r["recomputed"] for r in rows)},
        "throughput": throughput, "ttft_s": dist("ttft_s"), "tpot_s": dist("tpot_s"), "e2e_s": dist("e2e_s"),
        "prefill_queue_s": dist("prefill_queue_s"), "decode_queue_s": dist("decode_queue_s"),
        "transfer": _transfer([r for r in rows if not r["shed"]]),
        "memory": {"weight_bytes_per_worker": weights,
                   "model_memory_duplication": round(sum(weights) / weights[0], 3) if weights and weights[0] else None,
                   "kv_cache_bytes_per_worker": [kv_cache] * len(logs), "peak_kv_bytes_per_worker": peak,
                   "peak_kv_bytes_total": sum(peak.values()),
                   "note": "weights: the model's files; peak KV: the step logs' largest block-pool usage x the cache"},
        "steps": {str(lg.index): sum(len(_window(f, t0, t_end)) for f in lg.files) for lg in logs},
        "step_logs": {str(lg.index): {"files": len(lg.files), "truncated": any(f.truncated for f in lg.files)}
                      for lg in logs},
        "cpu_s": {**cpu, "note": "workers: CPU seconds of each instance's processes (API server, engine core, "
                                 "worker) over the run (a process killed by a fault: its part is not counted); "
                                 "router, store_daemon: their processes'"},
        "energy": energy, "fault": res["fault"],
        "definitions": "benchmarks/pd/http_run.py: TTFT and token times at the client; steps, prefill/decode "
                       "times and KV moved from the instances' step logs",
    }
    if fleet.store is not None:
        summary["store"] = _store_at_end(fleet.store)
    return summary


def _store_at_end(url: str) -> dict:
    import kvstore

    try:
        with kvstore.connect(url, timeout=5.0) as client:
            s = client.stats()
    except Exception as exc:  # noqa: BLE001 - the daemon may be gone after a fault run: reported, not fatal
        return {"used_bytes_at_end": None, "error": str(exc)[:200]}
    return {"used_bytes_at_end": s["used_bytes"], "objects_at_end": s["objects"], "capacity_bytes": s["capacity_bytes"]}


def results(rows: list[dict], slo: SLO, wall_s: float, counters: dict, fault: dict | None) -> dict:
    done = [r for r in rows if not r["lost"] and not r["shed"]]
    duration = max((r["e2e_s"] + r["arrival_s"] for r in done if r["e2e_s"] is not None), default=wall_s)

    def pcts(name: str) -> dict | None:
        d = distribution([r[name] for r in done if r[name] is not None])
        return None if d is None else {k: d[k] for k in ("p50", "p90", "p99")}

    return {"requests": {"total": len(rows), "completed": len(done), "shed_429": sum(r["shed"] for r in rows),
                         "lost": sum(r["lost"] for r in rows), "retried": sum(r["attempts"] > 1 for r in rows),
                         "fitted": sum(r["capped"] for r in rows)},
            "ttft_s": pcts("ttft_s"), "tpot_s": pcts("tpot_s"), "e2e_s": pcts("e2e_s"),
            "throughput": {"duration_s": round(duration, 3), "run_wall_s": round(wall_s, 3),
                           "output_tokens_per_s": round(sum(r["output_tokens"] for r in done) / duration, 3)
                           if duration > 0 else 0.0},
            "slo": slo_block(rows, slo, duration), "by_class": by_class(rows, slo),
            "router": counters, "fault": fault}


def compare_http(cfg: HttpCompareConfig) -> dict:
    """Every architecture over every source through ``kvstore router``; summary.json and report.md."""
    from benchmarks.pd.compare import machine
    from benchmarks.pd.verdict import verdicts

    started = time.monotonic()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = read_shape(cfg.engine.model)
    fitted, notes = [], {}
    for source in cfg.sources:
        trace, note = fit_trace(source.build(cfg.num_requests, cfg.seed, hf["vocab_size"], cfg.rate_scale),
                                cfg.engine.max_model_len)
        fitted.append(trace)
        notes[trace.name] = note
    names = _unique_names(fitted)
    results_by: dict[str, dict[str, dict]] = {n: {} for n in names}
    for arch in cfg.archs:
        with HttpFleet(cfg.engine, arch, out / "_instances" / arch.value, cfg.admission, cfg.slo) as fleet:
            _warm_up(fleet.router_url, _served_model(fleet.router_url), cfg.engine.block_size)
            for name, trace in zip(names, fitted, strict=True):
                results_by[name][arch.value] = run_source(fleet, trace, out / name / arch.value, cfg,
                                                          cfg.engine.describe(arch, hf))
    doc = {"machine": machine(),
           "setup": {"engine_kind": "vllm-openai", "via": "kvstore router (HTTP, streaming; timed at the client)",
                     "archs": [a.value for a in cfg.archs], "admission": cfg.admission,
                     "slo": dataclasses.asdict(cfg.slo), "fault": str(cfg.fault) if cfg.fault else None,
                     "engine": {"model": cfg.engine.model, "block_size": cfg.engine.block_size,
                                "max_model_len": cfg.engine.max_model_len, "chunk_budget": cfg.engine.chunk_budget,
                                "kv_cache_bytes": cfg.engine.kv_cache_bytes, "dtype": cfg.engine.dtype,
                                "cores": list(cfg.engine.cores), "transport": cfg.engine.transport},
                     "seed": cfg.seed, "num_requests": cfg.num_requests, "rate_scale": cfg.rate_scale,
                     "traces": {n: {**t.describe(), "fitted": notes[t.name]}
                                for n, t in zip(names, fitted, strict=True)}},
           "results": results_by}
    doc["verdicts"] = verdicts(results_by, cfg.slo)
    doc["outputs"] = outputs_check(out, names, [a.value for a in cfg.archs])
    doc["wall_s"] = round(time.monotonic() - started, 1)
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "report.md").write_text(report(doc))
    return doc


def outputs_check(out: Path, names: list[str], archs: list[str]) -> dict:
    """Per source: did every architecture stream the first one's greedy tokens (by id when the server returns
    them, else by text) for the requests all of them completed?"""
    checks = {}
    for name in names:
        rows = {a: {r["id"]: r for r in map(json.loads, (out / name / a / "requests.jsonl").read_text().splitlines())}
                for a in archs}
        ref = rows[archs[0]]
        diff = {}
        for a in archs[1:]:
            bad = [i for i, r in rows[a].items() if i in ref and not r["shed"] and not r["lost"]
                   and not ref[i]["shed"] and not ref[i]["lost"]
                   and (r["output_token_ids"], r["output_text"]) != (ref[i]["output_token_ids"], ref[i]["output_text"])]
            if bad:
                diff[a] = sorted(bad)
        checks[name] = {"reference": archs[0], "identical": not diff, "mismatched_requests": diff}
    return checks


def _ms(d: dict | None) -> str:
    return "-" if d is None else "/".join(f"{d[k] * 1000:.0f}" for k in ("p50", "p90", "p99"))


HEAD = ("source", "arch", "done/total", "shed 429", "lost", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms",
        "goodput req/s", "meets SLO", "routes")


def table_rows(doc: dict) -> list[tuple]:
    rows = []
    for name, by_arch in doc["results"].items():
        for arch, res in by_arch.items():
            routes = {k.split('route="')[1].rstrip('"}'): int(v) for k, v in res["router"].items()
                      if k.startswith("kvstore_router_routes_total{")}
            rows.append((name, arch, f"{res['requests']['completed']}/{res['requests']['total']}",
                         res["requests"]["shed_429"], res["requests"]["lost"], _ms(res["ttft_s"]), _ms(res["tpot_s"]),
                         res["slo"]["goodput_rps"], "yes" if res["slo"]["met"] else "no",
                         " ".join(f"{k}={v}" for k, v in sorted(routes.items()))))
    return rows


def report(doc: dict) -> str:
    s = doc["setup"]
    lines = ["# P/D comparison through `kvstore router` (vLLM OpenAI servers)", "",
             f"Machine: {doc['machine'].get('cpu')}. Admission: {s['admission']}; SLO TTFT {s['slo']['ttft_s']} s, "
             f"TPOT {s['slo']['tpot_s']} s. Fault: {s['fault'] or 'none'}. Timed at the client (streaming).", "",
             "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in table_rows(doc)]
    lines.append("")
    for name, t in s["traces"].items():
        f = t["fitted"]
        lines.append(f"- {name}: {t['requests']} requests from {t['source']}; fitted into {f['max_model_len']} "
                     f"tokens: {f['requests_fitted']} requests ({f['prompt_tokens_cut']} prompt and "
                     f"{f['output_tokens_cut']} output tokens cut; {f['rule']})")
    for name, o in doc["outputs"].items():
        lines.append(f"- {name}: greedy outputs identical across architectures: {o['identical']}")
    cost = cost_rows(doc)
    if cost:
        lines += ["", "Interference and transfer (the instances' step logs and the connector's per-request bytes):",
                  "", "| " + " | ".join(COST_HEAD) + " |", "|" + "---|" * len(COST_HEAD)]
        lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in cost]
    for name, v in (doc.get("verdicts") or {}).items():
        lines += ["", f"**{name}**: {v['text']}"]
    return "\n".join(lines) + "\n"


COST_HEAD = ("source", "arch", "gaps with prefill", "gap p50 with / without prefill ms", "TPOT inflation",
             "KV moved MiB", "hand-offs", "transfer p50 ms", "transfer share of TTFT p50", "engine CPU s")


def cost_rows(doc: dict) -> list[tuple]:
    """Per run with a scorecard: interference (metrics.py) and transfer cost."""
    rows = []
    for name, by_arch in doc["results"].items():
        for arch, res in by_arch.items():
            i, t = res.get("interference"), res.get("transfer")
            if i is None or t is None:
                continue
            ms = (lambda x: "-" if x is None else f"{x * 1000:.0f}")
            rows.append((name, arch, f"{i['gaps_with_prefill']}/{i['gaps']}",
                         f"{ms(i['gap_p50_with_prefill_s'])} / {ms(i['gap_p50_decode_only_s'])}",
                         f"{i['tpot_inflation']:+.0%}", f"{t['kv_bytes_transferred'] / (1 << 20):.2f}", t["handoffs"],
                         ms((t["transfer_s"] or {}).get("p50")), f"{t['share_of_ttft']['p50']:.0%}",
                         round(sum(res["compute"]["cpu_s"]["workers"].values()), 1)))
    return rows


def http_compare_config(args, sources: tuple, archs: tuple[Arch, ...]) -> HttpCompareConfig:
    from benchmarks.pd.vllm_cli import vllm_compare_config

    base = vllm_compare_config(args, sources, archs)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return HttpCompareConfig(**fields, admission=args.admission, request_timeout_s=base.engine.request_timeout_s)


def main_http(cfg: HttpCompareConfig) -> int:
    doc = compare_http(cfg)
    print("  ".join(f"{h:<20}" for h in HEAD))
    for row in table_rows(doc):
        print("  ".join(f"{x!s:<20}" for x in row))
    for name, o in doc["outputs"].items():
        print(f"[{name}] greedy outputs identical across architectures: {o['identical']}")
    for name, v in doc["verdicts"].items():
        print(f"[{name}] {v['text']}")
    out = Path(cfg.out_dir)
    print(f"\n-> {out / 'summary.json'}, {out / 'report.md'}")
    return 0
