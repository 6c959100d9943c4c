"""``python -m benchmarks.pd compare --engine vllm --link 1,10,25``: disaggregation across a shaped link.

The colocated and chunked runs stay on one host (:func:`benchmarks.pd.http_run.compare_http`, unchanged). The
disaggregated pair runs on two network-namespace hosts (:mod:`kvstore.testing.hosts`) joined by a veth link
shaped with tc tbf, started once and reshaped to each ``--link`` rate in turn:

- host a: Redis (the cluster directory, on a's end of the link), ``kvstore serve --cluster`` (advertising
  ``tcp://<a>:7070``) and the prefill vLLM OpenAI server (kv_producer, on a's link address);
- host b: its own cluster daemon, the decode server (kv_consumer) and ``kvstore router --prefill http://<a>
  --decode http://127.0.0.1``; the trace client runs on b too (``python -m benchmarks.pd.link replay``), so
  the only thing crossing the link is the prefill hop's HTTP and the KV the decode side's daemon pulls node to
  node from a's.

Each host has a private /tmp and /dev/shm: the model directory, the token and the sockets are copied / made in
each. Per rate the raw socket rate across the link is measured (:func:`kvstore.testing.hosts.measure_link`) in
the same run, and reported next to the results.

The planner check (:func:`planner_check`): the planner's step cost model (:class:`kvstore.planner.CostModel`)
is fitted to calibration probes served alone by the decode server before the trace (:func:`probe_traces`:
two short and two long prompts, one at a time; decode step = their TPOT p50, prompt cost per token = the TTFT
slope between the two lengths), the KV size per token comes from the model's geometry, the link is the
measured rate (:class:`kvstore.planner.TransferModel`, + 1 ms assumed per hand-off); the planner's simulator
then predicts the colocated and the disaggregated (per link) TTFT/TPOT p50 of the trace, compared with the
measured ones (signed relative error per metric). The simulator has no admission control, so each prediction
is of the requests that run's router admitted (its 429s left out, :func:`admitted_trace`); the router's skip
rules (a short or cached prompt recomputed by the decode server, no hand-off) are not in it (the report shows
the routes).

Per link rate the trace's token ids are shifted by the rate's index (same arrivals and lengths), so no run
finds blocks a previous rate's run left in the daemons.

"Where disaggregation stops paying" (:func:`stops_paying`): per trace (prompt lengths), disaggregation pays on
a link when its SLO goodput and completed requests are at least the best single-host architecture's and its
end-to-end p50 is lower;
the statement names the narrowest link where it still pays and the widest where it does not.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.pd.compare import _unique_names
from benchmarks.pd.deployment import Arch
from benchmarks.pd.http_run import HttpCompareConfig, _vllm_args, compare_http, fit_trace, results
from benchmarks.pd.make_model import read_shape
from benchmarks.pd.trace import TokenTrace
from kvstore.router.fleet import connector_config
from kvstore.workloads.report import md_table
from kvstore.workloads.slo import SLO

REDIS_PORT = 6379
NODE_PORT = 7070
PREFILL_PORT = 8100
DECODE_PORT = 8200
ROUTER_PORT = 8300
SOCK = "unix:///tmp/kv.sock"
#: the link shaping the tests and the README run use when --link is given without rates
DEFAULT_RATES = (1.0, 10.0, 25.0)
#: assumed fixed cost of one KV hand-off across the link (the daemons' RPCs), on top of bytes / measured rate
HANDOFF_LATENCY_S = 1e-3


def parse_rates(text: str) -> tuple[float, ...]:
    """``"1,10,25"`` -> (1.0, 10.0, 25.0) Gbit/s; distinct, positive, at most 100 (ValueError otherwise)."""
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--link wants Gbit/s rates like 1,10,25, got {text!r}") from None
    if not rates or any(not 0 < r <= 100 for r in rates) or len(set(rates)) != len(rates):
        raise ValueError(f"--link wants distinct rates in (0, 100] Gbit/s, got {text!r}")
    return rates


def link_label(rate_gbit: float) -> str:
    return f"disaggregated@{rate_gbit:g}gbit"


def kv_bytes_per_token(shape: dict, dtype: str) -> int:
    """K and V of every layer for one token, from a Hugging Face config."""
    heads = shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or shape["hidden_size"] // heads
    width = {"float32": 4}.get(dtype, 2)
    return 2 * shape["num_hidden_layers"] * shape.get("num_key_value_heads", heads) * head_dim * width


# -- the fleet across two hosts ----------------------------------------------------------------------------------
class LinkFleet:
    """Redis, two cluster daemons, the prefill server (a), the decode server and the router (b)."""

    def __init__(self, hosts, cfg: HttpCompareConfig, workdir: Path):
        self.hosts, self.cfg, self.workdir = hosts, cfg, workdir
        self.a, self.b = hosts["a"], hosts["b"]
        self.link = hosts.link("a", "b")
        self.env = _child_env()

    @property
    def addr_a(self) -> str:
        return self.link.address(self.a)

    def start(self) -> None:
        e = self.cfg.engine
        token = secrets.token_hex(16)
        for host in (self.a, self.b):
            fd = os.open(host.path("/tmp/token"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, token.encode())
            os.close(fd)
            shutil.copytree(e.model, host.path("/tmp/model"))
        redis = self._spawn(self.a, "redis", ["redis-server", "--port", str(REDIS_PORT), "--bind", self.addr_a,
                                              "--save", "", "--appendonly", "no", "--dir", "/tmp",
                                              "--protected-mode", "no"])
        self._listening(self.a, REDIS_PORT, redis, 30)
        for host in (self.a, self.b):
            addr = f"tcp://{self.link.address(host)}:{NODE_PORT}"
            cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--listen", SOCK, "--listen", addr,
                   "--token-file", "/tmp/token", "--capacity", e.store_capacity, "--log-level", "warning",
                   "--cluster", f"redis://{self.addr_a}:{REDIS_PORT}/0", "--node-id", f"n{host.name}",
                   "--advertise", addr, "--exit-with", str(os.getpid())]
            self._listening(host, NODE_PORT, self._spawn(host, f"daemon-{host.name}", cmd), 60)
        args = _vllm_args(e, Arch.DISAGGREGATED, _has_tokenizer(e.model))
        extra = {"url": SOCK, "transport": e.transport, "timeout_s": 10.0}
        servers = []
        for host, port, role, core, listen in ((self.a, PREFILL_PORT, "kv_producer", e.cores[0], self.addr_a),
                                               (self.b, DECODE_PORT, "kv_consumer", e.cores[1], "127.0.0.1")):
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/tmp/model", "--host",
                   listen, "--port", str(port), *args, "--kv-transfer-config",
                   connector_config(role, SOCK, {k: v for k, v in extra.items() if k != "url"})]
            env = {**self.env, "VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1",
                   "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                   "VLLM_LOGGING_LEVEL": self.env.get("VLLM_LOGGING_LEVEL", "WARNING")}
            servers.append((host, self._spawn(host, f"vllm-{role}", cmd, env), f"http://{listen}:{port}"))
        for host, proc, url in servers:
            self._healthy(host, proc, url + "/health", e.start_timeout_s)
        cmd = [sys.executable, "-m", "kvstore.cli", "router", "--listen", f"127.0.0.1:{ROUTER_PORT}",
               "--admission", self.cfg.admission, "--slo-ttft", str(self.cfg.slo.ttft_s), "--slo-tpot",
               str(self.cfg.slo.tpot_s), "--block-size", str(e.block_size), "--health-interval", "0.5",
               "--log-level", "warning", "--prefill", f"http://{self.addr_a}:{PREFILL_PORT}",
               "--decode", f"http://127.0.0.1:{DECODE_PORT}", "--store", SOCK]
        self._healthy(self.b, self._spawn(self.b, "router", cmd), f"http://127.0.0.1:{ROUTER_PORT}/health", 60)

    def _spawn(self, host, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        try:
            return host.popen(cmd, env=env or self.env, stdin=subprocess.DEVNULL, stdout=log,
                              stderr=subprocess.STDOUT)
        finally:
            log.close()

    def _log(self, proc: subprocess.Popen) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.workdir.glob("*.log"))

    def _listening(self, host, port: int, proc: subprocess.Popen, timeout: float) -> None:
        if not host.wait_listening(port, timeout, proc):
            raise RuntimeError(f"nothing listens on {host.name}:{port}:\n{self._log(proc)}")

    def _healthy(self, host, proc: subprocess.Popen, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        probe = [sys.executable, "-c", "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)",
                 url]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with {proc.returncode}:\n{self._log(proc)}")
            if host.run(probe, timeout=30, check=False, env=self.env).returncode == 0:
                return
            time.sleep(2)
        raise RuntimeError(f"{url} did not answer within {timeout:.0f} s:\n{self._log(proc)}")

    def remote_counters(self) -> dict[str, float]:
        """Host b's cluster daemon's node-to-node counters (``stats()["cluster"]``, numbers only)."""
        done = self.b.run([sys.executable, "-m", "kvstore.cli", "stats", "--url", SOCK, "--json"], timeout=60,
                          check=False, env=self.env)
        if done.returncode != 0:
            return {}
        cluster = json.loads(done.stdout).get("cluster") or {}
        return {k: v for k, v in cluster.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def replay(self, trace: TokenTrace | None, warm_up: bool = False, probes: list[TokenTrace] | None = None) -> dict:
        """The trace replayed by a client on host b through the router; its rows and the router's counters.
        ``probes``: traces sent one after the other straight to the decode server (calibration)."""
        base = f"http://127.0.0.1:{DECODE_PORT if probes else ROUTER_PORT}"
        job = {"router": base, "trace": trace, "deadline_s": self.cfg.request_timeout_s,
               "block_size": self.cfg.engine.block_size, "warm_up": warm_up, "probes": probes}
        with open(self.b.path("/tmp/job.pkl"), "wb") as f:
            pickle.dump(job, f)
        done = self.b.run([sys.executable, "-m", "benchmarks.pd.link", "replay", "/tmp/job.pkl", "/tmp/rows.json"],
                          timeout=self.cfg.request_timeout_s + 600, check=False, env=self.env)
        if done.returncode != 0:
            raise RuntimeError(f"the client on host b failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(Path(self.b.path("/tmp/rows.json")).read_text())


def _has_tokenizer(model: str) -> bool:
    return Path(model, "tokenizer.json").is_file() or Path(model, "tokenizer.model").is_file()


def _child_env() -> dict:
    from kvstore.router.fleet import project_env

    env = project_env()
    env.update(KVSTORE_TOKEN_FILE="/tmp/token", VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONHASHSEED="0")
    return env


def _replay_main(job_path: str, out_path: str) -> int:
    """Inside host b: warm up or replay one trace through the router; rows and counter deltas to ``out_path``."""
    from benchmarks.pd.http_run import _served_model, _warm_up, replay, router_counters

    with open(job_path, "rb") as f:
        job = pickle.load(f)  # noqa: S301 - written by this process's parent a moment ago
    base = job["router"]
    model = _served_model(base)
    if job["warm_up"]:
        _warm_up(base, model, job["block_size"])
        Path(out_path).write_text("{}")
        return 0
    if job.get("probes"):  # one at a time: a step's cost without queueing or interference
        rows = []
        for probe in job["probes"]:
            rows += asyncio.run(replay(base, model, probe, job["deadline_s"], time.monotonic()))
        Path(out_path).write_text(json.dumps({"rows": [r.to_dict() for r in rows]}))
        return 0
    before = router_counters(base)
    t0 = time.monotonic()
    rows = asyncio.run(replay(base, model, job["trace"], job["deadline_s"], t0))
    wall = time.monotonic() - t0
    after = router_counters(base)
    counters = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}
    Path(out_path).write_text(json.dumps({"rows": [r.to_dict() for r in rows], "wall_s": wall,
                                          "counters": counters}))
    return 0


# -- the planner check -------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Calibration:
    """The planner's cost model coefficients fitted to a single-host run: one decode step, one prompt token."""

    decode_step_s: float
    prefill_token_s: float

    @classmethod
    def from_rows(cls, rows: list[dict]) -> Calibration:
        """From probe rows (requests served alone): the decode step is their TPOT p50; the cost of a prompt
        token is the slope of TTFT over prompt length between the shortest and the longest probes (their p50s),
        or, with one length only, the p50 of (TTFT - one step) / prompt tokens."""
        from statistics import median

        done = [r for r in rows if r.get("ttft_s") is not None and r.get("tpot_s") is not None]
        if not done:
            raise ValueError("no completed request with a TTFT and a TPOT to calibrate on")
        step = median(r["tpot_s"] for r in done)
        lo, hi = min(r["prompt_tokens"] for r in done), max(r["prompt_tokens"] for r in done)
        if hi > lo:
            t_lo = median(r["ttft_s"] for r in done if r["prompt_tokens"] == lo)
            t_hi = median(r["ttft_s"] for r in done if r["prompt_tokens"] == hi)
            per_token = max(0.0, (t_hi - t_lo) / (hi - lo))
        else:
            per_token = median(max(0.0, r["ttft_s"] - step) / r["prompt_tokens"] for r in done)
        return cls(step, per_token)

    def cost_model(self, kv_bytes: int, kv_capacity_tokens: int):
        from kvstore.planner import CostModel

        return CostModel(name="vllm-cpu (fitted to probes served alone)", base_s=self.decode_step_s, weight_s=0.0,
                         token_s=self.prefill_token_s, seq_s=0.0, pair_s=0.0, ctx_s=0.0,
                         kv_bytes_per_token=kv_bytes, weight_bytes=0.0, kv_capacity_tokens=kv_capacity_tokens)


def rel_error(predicted: float, measured: float) -> float | None:
    """(predicted - measured) / measured; None when nothing was measured."""
    return None if not measured else (predicted - measured) / measured


def planner_trace(trace: TokenTrace):
    from kvstore.planner import Trace as PTrace
    from kvstore.planner import TraceRequest as PRequest

    return PTrace(trace.name, tuple(PRequest(i, r.arrival_s, r.prompt_tokens, r.output_tokens)
                                    for i, r in enumerate(trace.requests)))


def admitted_trace(name: str, rows: list[dict]):
    """The planner's trace of the requests a run's router admitted (its 429s left out: the simulator has no
    admission control), from the run's request rows (same arrivals, lengths and output targets)."""
    from kvstore.planner import Trace as PTrace
    from kvstore.planner import TraceRequest as PRequest

    kept = [r for r in rows if not r["shed"]]
    if not kept:
        raise ValueError(f"{name}: every request was shed; nothing to predict")
    return PTrace(name, tuple(PRequest(i, r["arrival_s"], r["prompt_tokens"], r["target_output_tokens"])
                              for i, r in enumerate(kept)))


def predict(trace, cost, arch: str, max_prefill_tokens: int, link_gbit: float | None,
            slo) -> dict[str, float]:
    """The planner's TTFT/TPOT p50 for ``trace`` on two workers of ``arch`` (disaggregated: over ``link_gbit``)."""
    from kvstore.planner import SLO, Deployment, Simulator, TransferModel
    from kvstore.planner import Arch as PArch
    from kvstore.planner.metrics import summarize

    kind = PArch(arch)
    dep = Deployment(kind, gpus=2, prefill_workers=1 if kind is PArch.DISAGGREGATED else 0,
                     max_prefill_tokens=max_prefill_tokens, chunk_tokens=max_prefill_tokens)
    transfer = None
    if link_gbit is not None:
        transfer = TransferModel(f"veth {link_gbit:.2f} Gbit/s (measured)", HANDOFF_LATENCY_S, link_gbit * 1e9 / 8)
    ptrace = planner_trace(trace) if isinstance(trace, TokenTrace) else trace
    m = summarize(Simulator(cost, dep, transfer).run(ptrace), SLO(slo.ttft_s, slo.tpot_s))
    return {"ttft_p50_s": m.ttft_p50, "tpot_p50_s": m.tpot_p50}


def check_row(label: str, predicted: dict[str, float], measured: dict) -> dict:
    """One arch's predicted vs measured p50s and the signed relative error of each."""
    meas = {"ttft_p50_s": (measured.get("ttft_s") or {}).get("p50"),
            "tpot_p50_s": (measured.get("tpot_s") or {}).get("p50")}
    return {"arch": label, "predicted": predicted, "measured": meas,
            "error": {k: None if meas[k] is None else rel_error(predicted[k], meas[k]) for k in predicted}}


def planner_check(runs: dict[str, list[dict]], res: dict[str, dict], rates: dict[str, float], kv_bytes: int,
                  kv_capacity: int, max_model_len: int, slo, cal: Calibration) -> dict:
    """Planner vs measured for one trace: ``runs`` / ``res`` arch label -> the run's request rows / results
    (``colocated`` and each link's), ``rates`` label -> measured Gbit/s. Each prediction is of the requests
    that run admitted."""
    cost = cal.cost_model(kv_bytes, kv_capacity)
    rows = [check_row("colocated", predict(admitted_trace("colocated", runs["colocated"]), cost, "colocated",
                                           max_model_len, None, slo), res["colocated"])]
    for label, gbit in rates.items():
        rows.append(check_row(label, predict(admitted_trace(label, runs[label]), cost, "disaggregated",
                                             max_model_len, gbit, slo), res[label]))
    return {"calibration": dataclasses.asdict(cal), "kv_bytes_per_token": kv_bytes, "checks": rows,
            "handoff_latency_s": HANDOFF_LATENCY_S}


def within(check: dict, tolerance: float) -> bool:
    errs = [e for e in check["error"].values()]
    return all(e is not None and abs(e) <= tolerance for e in errs)


# -- where disaggregation stops paying --------------------------------------------------------------------------
def pays(disagg: dict, single: list[dict]) -> bool:
    """Disaggregation pays against the single-host runs: SLO goodput and completed requests (not shed, not lost)
    at least the best of theirs, and an e2e p50 below theirs (the best of those with that goodput)."""
    best = max(s["slo"]["goodput_rps"] for s in single)
    if disagg["slo"]["goodput_rps"] < best:
        return False
    done = [s["requests"]["completed"] for s in single if "requests" in s]
    if done and disagg.get("requests", {}).get("completed", 0) < max(done):
        return False
    rivals = [s["e2e_s"]["p50"] for s in single if s["slo"]["goodput_rps"] == best and s["e2e_s"]]
    return bool(disagg["e2e_s"]) and (not rivals or disagg["e2e_s"]["p50"] < min(rivals))


def stops_paying(name: str, prompt_p50: float, by_rate: dict[float, bool]) -> str:
    """The statement for one trace from whether disaggregation paid at each link rate."""
    rates = sorted(by_rate)
    paid = [r for r in rates if by_rate[r]]
    lost = [r for r in rates if not by_rate[r]]
    head = f"{name} (prompt p50 {prompt_p50:.0f} tokens): "
    if not lost:
        return head + f"disaggregation pays on every link down to {rates[0]:g} Gbit/s (it did not stop paying here)"
    if not paid:
        return head + f"disaggregation does not pay on any link, even at {rates[-1]:g} Gbit/s"
    if max(lost) < min(paid):
        return head + (f"disaggregation stops paying below {min(paid):g} Gbit/s (pays at {min(paid):g}, not at "
                       f"{max(lost):g})")
    return head + ("no monotone threshold: pays at " + ", ".join(f"{r:g}" for r in paid) + " Gbit/s, not at "
                   + ", ".join(f"{r:g}" for r in lost) + " Gbit/s (noise on a shared machine)")


def run_rows(out: Path, name: str, labels: list[str]) -> dict[str, list[dict]]:
    """The request rows of each run of trace ``name`` under a comparison's directory."""
    rows = {}
    for label in labels:
        path = out / name / label / "requests.jsonl"
        if not path.exists():
            path = out / "single_host" / name / label / "requests.jsonl"
        rows[label] = [json.loads(x) for x in path.read_text().splitlines()]
    return rows


def verdicts(doc: dict) -> dict[str, str]:
    """Per trace of a summary: where disaggregation stops paying (:func:`pays` on each link)."""
    out = {}
    for name, by_arch in doc["results"].items():
        singles = [res for arch, res in by_arch.items() if not arch.startswith("disaggregated")]
        paid = {doc["links"][k]["shaped_gbit"]: pays(by_arch[k], singles) for k in doc["links"] if k in by_arch}
        out[name] = stops_paying(name, doc["prompt_p50"][name], paid)
    return out


def rereport(out: Path) -> str:
    """Recompute the verdicts and report.md of a finished run's directory from its summary.json."""
    doc = json.loads((out / "summary.json").read_text())
    if "prompt_p50" not in doc:  # runs before it was recorded: from the single-host run's rows
        doc["prompt_p50"] = {}
        for name in doc["results"]:
            rows = (out / "single_host" / name / "colocated" / "requests.jsonl").read_text().splitlines()
            prompts = sorted(json.loads(x)["prompt_tokens"] for x in rows)
            doc["prompt_p50"][name] = prompts[len(prompts) // 2]
    doc["verdicts"] = verdicts(doc)
    rates = {k: v["measured_gbit"] for k, v in doc["links"].items()}
    for name, p in doc["planner"].items():  # each prediction of the requests its run admitted
        e = doc["setup"]["engine"]
        kv = p["kv_bytes_per_token"]
        doc["planner"][name] = planner_check(run_rows(out, name, ["colocated", *rates]), doc["results"][name], rates,
                                             kv, e["kv_cache_bytes"] // kv, e["max_model_len"],
                                             SLO(**doc["setup"]["slo"]), Calibration(**p["calibration"]))
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    text = report(doc)
    (out / "report.md").write_text(text)
    return text


# -- the comparison ----------------------------------------------------------------------------------------------
def shifted(trace: TokenTrace, by: int, vocab: int) -> TokenTrace:
    """``trace`` with every prompt token id moved by ``by`` (mod ``vocab``): the same arrivals and lengths, but
    nothing the daemons still hold from the run at the previous link rate (no cached hand-offs)."""
    if by == 0:
        return trace
    reqs = tuple(dataclasses.replace(r, prompt_ids=tuple((x + by) % vocab for x in r.prompt_ids))
                 for r in trace.requests)
    return dataclasses.replace(trace, requests=reqs)


def probe_traces(vocab: int, max_model_len: int, repeats: int = 2) -> list[TokenTrace]:
    """Calibration probes: ``repeats`` prompts of a short and a long length, 16 output tokens each, alone."""
    from benchmarks.pd.trace import TokenRequest, TraceScaling

    out = []
    for i, n in enumerate([128] * repeats + [min(1024, max_model_len - 32)] * repeats):
        ids = tuple(5 + (97 * i + 31 * j) % (vocab - 5) for j in range(n))
        out.append(TokenTrace(f"probe-{i}", "probe", (TokenRequest(f"probe-{i}", 0.0, ids, 16, n, 16),),
                         TraceScaling(), 0))
    return out


def compare_link(cfg: HttpCompareConfig, rates: tuple[float, ...]) -> dict:
    from kvstore.testing import hosts as H

    reason = H.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"--link needs namespace hosts: {reason}")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    single_archs = tuple(a for a in cfg.archs if a is not Arch.DISAGGREGATED) or (Arch.COLOCATED,)
    if Arch.COLOCATED not in single_archs:
        single_archs = (Arch.COLOCATED, *single_archs)  # the verdicts and the planner check compare with it
    single = compare_http(dataclasses.replace(cfg, archs=single_archs, out_dir=str(out / "single_host")))
    hf = read_shape(cfg.engine.model)
    traces = [fit_trace(s.build(cfg.num_requests, cfg.seed, hf["vocab_size"], cfg.rate_scale),
                        cfg.engine.max_model_len)[0] for s in cfg.sources]
    names = _unique_names(traces)
    doc = {"machine": single["machine"], "setup": {**single["setup"], "link_rates_gbit": list(rates),
                                                   "disaggregated_on": "two namespace hosts (kvstore.testing.hosts)"},
           "results": {n: dict(single["results"][n]) for n in names}, "links": {}}
    H.remove_stale()
    with H.Hosts(("a", "b"), rate_gbit=rates[0], shm_size="3g") as hosts:
        workdir = out / "_instances" / "link"
        workdir.mkdir(parents=True, exist_ok=True)
        fleet = LinkFleet(hosts, cfg, workdir)
        fleet.start()
        fleet.replay(traces[0], warm_up=True)
        probe_rows = fleet.replay(None, probes=probe_traces(hf["vocab_size"], cfg.engine.max_model_len))["rows"]
        cal = Calibration.from_rows(probe_rows)
        doc["calibration_probes"] = [{k: r[k] for k in ("prompt_tokens", "ttft_s", "tpot_s")} for r in probe_rows]
        for index, rate in enumerate(rates):
            fleet.link.shape(rate)
            measured = H.measure_link(fleet.link, nbytes=32 << 20, repeats=3)
            label = link_label(rate)
            doc["links"][label] = {"shaped_gbit": rate, "measured_gbit": round(measured.gbit_s, 3)}
            for name, trace in zip(names, traces, strict=True):
                before = fleet.remote_counters()
                got = fleet.replay(shifted(trace, index, hf["vocab_size"]))
                after = fleet.remote_counters()
                run_dir = out / name / label
                run_dir.mkdir(parents=True, exist_ok=True)
                with open(run_dir / "requests.jsonl", "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in got["rows"])
                doc["results"][name][label] = results(got["rows"], cfg.slo, got["wall_s"], got["counters"], None)
                # what host b's daemon fetched from a's over the link during the run (node to node)
                doc["results"][name][label]["node_b_cluster"] = {k: after[k] - before.get(k, 0) for k in after
                                                                 if after[k] - before.get(k, 0)}
    kv_bytes = kv_bytes_per_token(hf, cfg.engine.dtype)
    rates_by_label = {k: v["measured_gbit"] for k, v in doc["links"].items()}
    doc["planner"], doc["verdicts"] = {}, {}
    for name, trace in zip(names, traces, strict=True):
        doc["planner"][name] = planner_check(run_rows(out, name, ["colocated", *rates_by_label]),
                                             doc["results"][name], rates_by_label, kv_bytes,
                                             cfg.engine.kv_cache_bytes // kv_bytes, cfg.engine.max_model_len,
                                             cfg.slo, cal)
        prompts = sorted(r.prompt_tokens for r in trace.requests)
        doc["prompt_p50"] = {**doc.get("prompt_p50", {}), name: prompts[len(prompts) // 2]}
    doc["verdicts"] = verdicts(doc)
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "report.md").write_text(report(doc))
    return doc


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def report(doc: dict, tolerance: float = 0.25) -> str:
    from benchmarks.pd.http_run import HEAD, table_rows

    s = doc["setup"]
    lines = ["# P/D comparison across a shaped link (vLLM OpenAI servers, `kvstore router`)", "",
             f"Machine: {doc['machine'].get('cpu')} (shared). Colocated and chunked on one host; disaggregated "
             "with prefill on host a and decode + router + client on host b (network namespaces, veth shaped "
             "with tc tbf). Same arrivals for every run. Timed at the client.", "",
             "| link | shaped Gbit/s | measured raw socket Gbit/s |", "|---|---|---|"]
    lines += [f"| {k} | {v['shaped_gbit']:g} | {v['measured_gbit']:.2f} |" for k, v in doc["links"].items()]
    lines += [""] + md_table(HEAD, table_rows(doc))
    lines += ["", "## Where disaggregation stops paying", ""]
    lines += [f"- {v}" for v in doc["verdicts"].values()]
    lines += ["", f"## Planner vs measured (p50; within {tolerance:.0%} is the target)", "",
              "| trace | arch | TTFT ms pred/meas | err | TPOT ms pred/meas | err | within |",
              "|---|---|---|---|---|---|---|"]
    for name, p in doc["planner"].items():
        for c in p["checks"]:
            pr, me, er = c["predicted"], c["measured"], c["error"]
            lines.append(f"| {name} | {c['arch']} | {_ms(pr['ttft_p50_s'])}/{_ms(me['ttft_p50_s'])} | "
                         f"{_pct(er['ttft_p50_s'])} | {_ms(pr['tpot_p50_s'])}/{_ms(me['tpot_p50_s'])} | "
                         f"{_pct(er['tpot_p50_s'])} | {'yes' if within(c, tolerance) else 'NO'} |")
        cal = p["calibration"]
        lines.append(f"\n{name}: cost model fitted to probes served alone (decode step {cal['decode_step_s'] * 1e3:.1f}"
                     f" ms, {cal['prefill_token_s'] * 1e6:.0f} us per prompt token); "
                     f"KV {p['kv_bytes_per_token']} B/token; hand-off latency assumed {p['handoff_latency_s'] * 1e3:g}"
                     " ms + bytes / the measured rate.\n")
    traces = ", ".join(f"{n}: {t['requests']} requests" for n, t in s["traces"].items())
    lines.append(f"Traces: {traces}.")
    return "\n".join(lines) + "\n"


def main_link(cfg: HttpCompareConfig, rates: tuple[float, ...]) -> int:
    doc = compare_link(cfg, rates)
    print(report(doc))
    print(f"-> {Path(cfg.out_dir) / 'summary.json'}, {Path(cfg.out_dir) / 'report.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pd.link", description="the client inside host b")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("replay")
    r.add_argument("job")
    r.add_argument("out")
    rep = sub.add_parser("report", help="recompute the verdicts and report.md of a run directory")
    rep.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "report":
        print(rereport(args.dir))
        return 0
    return _replay_main(args.job, args.out)


if __name__ == "__main__":
    sys.exit(main())
