"""``python -m benchmarks.pd compare``: every workload and trace through the three deployments, one report.

Each source (a built-in workload, or a trace file with its scaling) becomes one :class:`TokenTrace`; the same trace
(same arrivals, same prompts) is served by every architecture in turn, with the same engine settings and the
same compute (``workers`` processes x ``threads_per_worker`` torch threads). Runs go source by source,
architectures interleaved, so slow drift of a shared machine's load hits them alike. Outputs in ``out_dir``:
``<source>/<arch>/`` (each run's requests.jsonl, timeline.jsonl, summary.json), ``summary.json`` (every
metric of metrics.py per architecture x source, the setup, the verdicts), ``report.md``, ``report.html`` and
the figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common.machine import machine as common_machine
from benchmarks.pd.admission import AdmissionKind, Budgeted, Budgets, Immediate
from benchmarks.pd.deployment import Arch, DeploymentConfig, run
from benchmarks.pd.fault import FaultSpec
from benchmarks.pd.metrics import scorecard
from benchmarks.pd.stepmodel import StepModel, fit_step_model
from benchmarks.pd.trace import BUILTIN_WORKLOADS, BuiltinWorkload, TokenTrace, TraceScaling, generate, load_token_trace
from kvstore.workloads.slo import SLO

_TRACE_KEYS = {"prompt": "prompt_scale", "output": "output_scale", "time": "time_scale",
               "max-prompt": "max_prompt_tokens", "max-output": "max_output_tokens"}


@dataclass(frozen=True, slots=True)
class Source:
    """A built-in workload (``workload``) or a trace file (``path``, scaled by ``scaling``)."""

    workload: BuiltinWorkload | None = None
    path: Path | None = None
    scaling: TraceScaling = TraceScaling()
    num_requests: int | None = None  # None: the comparison's --num-requests

    def __post_init__(self) -> None:
        if (self.workload is None) == (self.path is None):
            raise ValueError("a Source is either a workload or a trace file")

    @classmethod
    def parse_trace(cls, text: str, default: TraceScaling) -> Source:
        """``FILE[,prompt=X][,output=Y][,length=X][,time=Z][,max-prompt=N][,max-output=N][,n=N]``."""
        path, *opts = text.split(",")
        values: dict = {}
        num = None
        for opt in opts:
            key, sep, value = opt.partition("=")
            try:
                if key == "n":
                    num = int(value)
                elif key == "length":
                    values.update(prompt_scale=float(value), output_scale=float(value))
                elif key.startswith("max-"):
                    values[_TRACE_KEYS[key]] = int(value)
                else:
                    values[_TRACE_KEYS[key]] = float(value)
            except (KeyError, ValueError):
                raise ValueError(f"bad trace option {opt!r} in {text!r}; expected KEY=VALUE with KEY one of "
                                 f"{['n', 'length', *_TRACE_KEYS]}") from None
        if not Path(path).is_file():
            raise ValueError(f"trace file not found: {path}")
        return cls(path=Path(path), scaling=dataclasses.replace(default, **values), num_requests=num)

    def build(self, num_requests: int, seed: int, vocab_size: int, rate_scale: float = 1.0) -> TokenTrace:
        n = self.num_requests or num_requests
        if self.workload is not None:
            rate = BUILTIN_WORKLOADS[self.workload].rate_rps * rate_scale
            return generate(self.workload, n, seed=seed, vocab_size=vocab_size, rate_rps=rate)
        return load_token_trace(self.path, num_requests=n, seed=seed, vocab_size=vocab_size, scaling=self.scaling)


@dataclass(frozen=True, slots=True)
class CompareConfig:
    sources: tuple[Source, ...]
    out_dir: Path
    engine: DeploymentConfig = field(default_factory=lambda: DeploymentConfig(Arch.COLOCATED))  # arch replaced
    archs: tuple[Arch, ...] = tuple(Arch)
    num_requests: int = 24
    seed: int = 0
    rate_scale: float = 1.0
    slo: SLO = SLO(ttft_s=1.5, tpot_s=0.1)
    admission: AdmissionKind = AdmissionKind.BUDGET
    fault: FaultSpec | None = None
    progress: bool = False
    reruns: int = 1  # extra attempts of a run whose worker was starved of CPU by other processes
    starved_share: float = 0.5  # ... i.e. got less than this share of a core while busy

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("nothing to compare: give --workloads and/or --trace")
        if not self.archs:
            raise ValueError("no architecture to compare")
        if not (isinstance(self.reruns, int) and self.reruns >= 0):
            raise ValueError(f"reruns must be an int >= 0, got {self.reruns!r}")
        if not 0 < self.starved_share <= 1:
            raise ValueError(f"starved_share must be in (0, 1], got {self.starved_share!r}")


@dataclass(slots=True)
class RunData:
    """One architecture x source: its scorecard and the raw rows the figures need."""

    card: dict
    rows: list[dict]
    timeline: list[dict]


def machine() -> dict:
    import torch  # noqa: F401 -- the description names torch's version when it is imported

    return {**common_machine(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compute_note(engine: DeploymentConfig) -> dict:
    """What each architecture got, in words and numbers."""
    n, t = engine.num_workers, engine.threads_per_worker
    p = engine.prefill_workers
    return {
        "engine_workers": n, "threads_per_worker": t, "engine_threads_total": n * t,
        "colocated": f"{n} prefill-first replicas, the router splitting requests between them",
        "chunked": f"{n} chunked-prefill replicas ({engine.chunk_budget} tokens per step)",
        "disaggregated": f"{p} prefill-only + {n - p} decode-only, plus a kvstore serve daemon for the hand-off "
                         f"(its CPU seconds reported, not counted as engine compute)",
        "shared": "every architecture also has the router process; workers are not pinned to cores",
    }


def _admission(cfg: CompareConfig, step: StepModel | None):
    if cfg.admission is AdmissionKind.NONE:
        return Immediate()
    return Budgeted(Budgets(cfg.slo.ttft_s, cfg.slo.tpot_s), step, cfg.engine.chunk_budget)


def _unique_names(traces: list[TokenTrace]) -> list[str]:
    seen: dict[str, int] = {}
    names = []
    for trace in traces:
        seen[trace.name] = seen.get(trace.name, 0) + 1
        names.append(trace.name if seen[trace.name] == 1 else f"{trace.name}-{seen[trace.name]}")
    return names


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="compare", unit="run", disable=not enabled, position=0)


def compare(cfg: CompareConfig) -> dict:
    """Run everything, write summary.json and the report; returns the summary document."""
    from benchmarks.pd.report import write_report
    from benchmarks.pd.verdict import verdicts

    started = time.monotonic()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    host = machine()
    vocab = cfg.engine.model.vocab_size
    traces = [s.build(cfg.num_requests, cfg.seed, vocab, cfg.rate_scale) for s in cfg.sources]
    for trace in traces:  # fail before the first run, not after an hour
        trace.check_fits(cfg.engine.max_request_tokens)
    step = fit_step_model(cfg.engine.model, cfg.engine.block_size) if cfg.admission is AdmissionKind.BUDGET else None
    names = _unique_names(traces)
    data: dict[str, dict[str, RunData]] = {}
    with _bar(len(traces) * len(cfg.archs), cfg.progress) as bar:
        for name, trace in zip(names, traces, strict=True):
            data[name] = {}
            for arch in cfg.archs:
                bar.set_postfix_str(f"{name} / {arch.value}")
                data[name][arch.value] = _run_one(cfg, arch, trace, out / name / arch.value, step)
                bar.update(1)
    host["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc = {
        "machine": host,
        "setup": _setup(cfg, step, {name: trace.describe() for name, trace in zip(names, traces, strict=True)}),
        "results": {name: {arch: run.card for arch, run in by_arch.items()} for name, by_arch in data.items()},
    }
    doc["verdicts"] = verdicts(doc["results"], cfg.slo)
    doc["wall_s"] = round(time.monotonic() - started, 1)
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    write_report(doc, data, out)
    return doc


def _run_one(cfg: CompareConfig, arch: Arch, trace: TokenTrace, run_dir: Path, step: StepModel | None) -> RunData:
    """One run; repeated (up to ``cfg.reruns`` times) while a worker got less than ``cfg.starved_share`` of a
    core while busy. Every attempt's CPU shares stay in the card, and the report names re-run cells."""
    engine = dataclasses.replace(cfg.engine, arch=arch)
    attempts = []
    for _ in range(1 + cfg.reruns):
        summary = run(engine, trace, run_dir, progress=cfg.progress, admission=_admission(cfg, step),
                      fault=cfg.fault)
        rows = _read_jsonl(run_dir / "requests.jsonl")
        timeline = _read_jsonl(run_dir / "timeline.jsonl")
        card = scorecard(summary, rows, timeline, cfg.slo)
        shares = card["compute"]["cpu_share_while_busy"]
        attempts.append(shares)
        if min(shares.values(), default=1.0) >= cfg.starved_share:
            break
    card["attempts"] = attempts
    card["run_dir"] = str(run_dir.relative_to(cfg.out_dir))
    return RunData(card, rows, timeline)


def _setup(cfg: CompareConfig, step: StepModel | None, traces: dict[str, dict]) -> dict:
    engine = cfg.engine.describe()
    for key in ("arch", "workers", "transport", "store", "handoff_keys"):
        engine.pop(key, None)
    return {
        "archs": [a.value for a in cfg.archs], "compute": compute_note(cfg.engine), "engine": engine,
        "transport": cfg.engine.transport.value, "handoff_keys": "prefix" if cfg.engine.handoff_prefix_keys
        else "request",
        "slo": dataclasses.asdict(cfg.slo),
        "admission": _admission(cfg, step).describe(),
        "fault": str(cfg.fault) if cfg.fault else None,
        "seed": cfg.seed, "num_requests": cfg.num_requests, "rate_scale": cfg.rate_scale,
        "reruns": {"max": cfg.reruns, "when_cpu_share_below": cfg.starved_share},
        "traces": traces,
    }
