"""``python -m benchmarks.pd compare --engine vllm`` through the product: real vLLM OpenAI servers behind
``kvstore router``, the trace sent over HTTP.

Per architecture a fleet starts once (kvstore.router.fleet, the launcher of ``kvstore pd up``) and serves every
source in turn:

- ``colocated``: two kv-less vLLM OpenAI servers, whole-prompt prefill steps (``--no-enable-chunked-prefill``,
  ``--max-num-batched-tokens`` = the model length), the router's ``--colocated`` pool;
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

Outputs: ``<source>/<arch>/requests.jsonl`` (a row per request), ``<source>/<arch>/router_metrics.json``
(the router's counters over the run), ``summary.json`` and ``report.md``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.pd.compare import _unique_names
from benchmarks.pd.deployment import Arch
from benchmarks.pd.make_model import read_shape
from benchmarks.pd.metrics import by_class, slo_block
from benchmarks.pd.summary import distribution
from benchmarks.pd.trace import TokenRequest, TokenTrace
from benchmarks.pd.vllm_compare import VllmCompareConfig
from benchmarks.pd.vllm_deployment import VllmConfig
from kvstore.router.fleet import Child, Fleet, FleetError, project_env, spawn, vllm_command, wait_http
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
    """A daemon (disaggregated), two vLLM OpenAI servers and ``kvstore router``; stopped on exit."""

    def __init__(self, engine: VllmConfig, arch: Arch, workdir: Path, admission: str, slo: SLO):
        self.engine, self.arch, self.workdir = engine, arch, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.fleet = Fleet(str(workdir), project_env())
        self.instances: list[tuple[Child, list[str], dict, str]] = []  # child, command, env, url
        self.admission, self.slo = admission, slo
        self.router_url = ""
        self.store: str | None = None

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
        tokenizer = Path(e.model, "tokenizer.json").is_file() or Path(e.model, "tokenizer.model").is_file()
        args = _vllm_args(e, self.arch, tokenizer)
        extra = {"transport": e.transport, "timeout_s": 10.0}
        pools: dict[str, list[str]] = {"prefill": [], "decode": [], "colocated": []}
        for i, (pool, role) in enumerate(POOLS[self.arch]):
            port = _free_port()
            cmd = vllm_command(e.model, port, role, self.store, connector_extra=extra, args=args)
            env = _instance_env(e.cores[i])
            child = spawn(f"{self.arch.value}-{i}", cmd, str(self.workdir), env)
            self.fleet.children.append(child)
            url = f"http://127.0.0.1:{port}"
            self.instances.append((child, cmd, env, url))
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
        router = self.fleet.start("router", cmd)
        self.router_url = f"http://127.0.0.1:{port}"
        wait_http(router, self.router_url + "/health", 60.0)

    def victim(self) -> int:
        """Which instance a decode crash kills: the decode instance, or the second colocated one."""
        return len(self.instances) - 1

    def kill_and_restart(self, index: int) -> float:
        """SIGKILL instance ``index``'s process group, start it again on its port; seconds until it answers."""
        child, cmd, env, url = self.instances[index]
        killed = time.monotonic()
        try:
            os.killpg(child.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.proc.wait(30)
        fresh = spawn(child.name + "-replacement", cmd, str(self.workdir), env)
        self.fleet.children.append(fresh)
        self.instances[index] = (fresh, cmd, env, url)
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

    def to_dict(self) -> dict:
        ttft = None if self.first_token_s is None else round(self.first_token_s - self.arrival_s, 6)
        tpot = None
        if self.first_token_s is not None and self.last_token_s is not None and self.output_tokens > 1:
            tpot = round((self.last_token_s - self.first_token_s) / (self.output_tokens - 1), 6)
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update({"class": self.klass, "ttft_s": ttft, "tpot_s": tpot,
                  "e2e_s": None if self.last_token_s is None else round(self.last_token_s - self.arrival_s, 6)})
        return d


async def _one(session, base: str, model: str, r: TokenRequest, t0: float, deadline_s: float) -> ClientRow:
    import aiohttp

    row = ClientRow(r.id, r.klass, r.arrival_s, r.prompt_tokens, r.output_tokens, r.capped)
    await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.monotonic()))
    body = {"model": model, "prompt": list(r.prompt_ids), "max_tokens": r.output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    give_up = t0 + r.arrival_s + deadline_s
    while time.monotonic() < give_up:
        row.attempts += 1
        headers = {"X-Request-Id": f"{r.id}-{os.getpid()}-{row.attempts}", "X-Request-Class": r.klass}
        row.first_token_s = row.last_token_s = None
        row.output_tokens, row.output_token_ids, row.output_text = 0, [], ""
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
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            row.output_tokens = usage["completion_tokens"]
    return False


async def replay(base: str, model: str, trace: TokenTrace, deadline_s: float, t0: float) -> list[ClientRow]:
    """Every request of ``trace`` at its arrival offset after ``t0`` (monotonic); the rows in trace order."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return list(await asyncio.gather(*(_one(session, base, model, r, t0, deadline_s) for r in trace.requests)))


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


def run_source(fleet: HttpFleet, trace: TokenTrace, run_dir: Path, cfg: HttpCompareConfig) -> dict:
    """Serve ``trace`` through the fleet's router; write the run's files; its results."""
    run_dir.mkdir(parents=True, exist_ok=True)
    model = _served_model(fleet.router_url)
    before = router_counters(fleet.router_url)
    fault_block = None
    t0 = time.monotonic()

    async def go() -> list[ClientRow]:
        task = asyncio.create_task(replay(fleet.router_url, model, trace, cfg.request_timeout_s, t0))
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
    after = router_counters(fleet.router_url)
    counters = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}
    dicts = [r.to_dict() for r in rows]
    with open(run_dir / "requests.jsonl", "w") as f:
        for d in dicts:
            f.write(json.dumps(d) + "\n")
    (run_dir / "router_metrics.json").write_text(json.dumps(counters, indent=2) + "\n")
    if fault_block is not None:
        fault_block.update(requests_retried=sum(r.attempts > 1 for r in rows), requests_lost=sum(r.lost for r in rows))
    return results(dicts, cfg.slo, wall, counters, fault_block)


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
                results_by[name][arch.value] = run_source(fleet, trace, out / name / arch.value, cfg)
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
    return "\n".join(lines) + "\n"


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
    out = Path(cfg.out_dir)
    print(f"\n-> {out / 'summary.json'}, {out / 'report.md'}")
    return 0
