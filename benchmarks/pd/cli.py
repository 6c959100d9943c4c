"""``python -m benchmarks.pd run ...`` serves one trace on one deployment; ``compare`` runs every workload and
trace through the three deployments and writes the comparison's summary and report; ``validate-planner``
compares the planner's simulator with the small engine (benchmarks/pd/validate.py)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from benchmarks.pd.admission import AdmissionKind
from benchmarks.pd.compare import CompareConfig, Source, compare
from benchmarks.pd.deployment import Arch, DeploymentConfig, run
from benchmarks.pd.fault import FaultSpec
from benchmarks.pd.make_model import add_parser as add_make_model_parser
from benchmarks.pd.make_model import main_make_model
from benchmarks.pd.model import MODEL_PRESETS
from benchmarks.pd.search_check import add_check_search_parser, main_check_search
from benchmarks.pd.trace import BuiltinWorkload, TokenTrace, TraceFormat, TraceScaling, generate, load_token_trace
from benchmarks.pd.transfer import Transport
from benchmarks.pd.validate import add_validate_parser, main_validate
from benchmarks.pd.vllm_cli import add_vllm_args, vllm_compare_config
from kvstore.workloads.slo import SLO


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", choices=[t.value for t in Transport], default="auto")
    p.add_argument("--handoff-keys", choices=["prefix", "request"], default="prefix",
                   help="disaggregated: chunk keys chained over the prompt's tokens, or scoped to the request")
    e = p.add_argument_group("engine")
    e.add_argument("--model", default=None,
                   help=f"--engine tiny: a preset {sorted(MODEL_PRESETS)} (default 'default'); --engine vllm: a "
                        f"model directory (default: `make-model` defaults, built into OUT/model)")
    e.add_argument("--workers", type=_positive_int, default=2, help="engine workers (equal in every arch)")
    e.add_argument("--prefill-workers", type=_positive_int, default=1, help="disaggregated: prefill-only workers")
    e.add_argument("--threads-per-worker", type=_positive_int, default=1)
    e.add_argument("--chunk-budget", type=_positive_int, default=256, help="chunked: tokens per step")
    e.add_argument("--prefill-batch-tokens", type=_positive_int, default=1024)
    e.add_argument("--num-blocks", type=_positive_int, default=4096, help="KV blocks per worker")
    e.add_argument("--block-size", type=_positive_int, help="tokens per KV block (default: tiny 16, vllm 128)")
    e.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty())


def _add_scaling_args(p: argparse.ArgumentParser, what: str) -> None:
    g = p.add_argument_group(f"trace scaling ({what}; all reported)")
    g.add_argument("--length-scale", type=_positive_float, help="sets both --prompt-scale and --output-scale")
    g.add_argument("--prompt-scale", type=_positive_float)
    g.add_argument("--output-scale", type=_positive_float)
    g.add_argument("--time-scale", type=_positive_float, default=1.0, help="multiplies arrival offsets")
    g.add_argument("--max-prompt-tokens", type=_positive_int, help="explicit cap; capped requests are counted")
    g.add_argument("--max-output-tokens", type=_positive_int, help="explicit cap; capped requests are counted")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="serve one trace on one deployment")
    p.add_argument("--arch", required=True, choices=[a.value for a in Arch])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", choices=[w.value for w in BuiltinWorkload])
    source.add_argument("--trace", type=Path, help="Mooncake .jsonl or Azure 2023 .csv trace file")
    p.add_argument("--trace-format", choices=[f.value for f in TraceFormat], help="default: from the suffix")
    p.add_argument("--num-requests", type=_positive_int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rate", type=_positive_float, help="Poisson workloads: requests/s (default per workload)")
    _add_scaling_args(p, "workloads and trace files")
    _add_engine_args(p)
    p.add_argument("--inline", action="store_true", help="all workers in this process, embedded store")
    add_compare_parser(sub)
    add_make_model_parser(sub)
    add_validate_parser(sub)
    add_check_search_parser(sub)
    return parser


def add_compare_parser(sub) -> None:
    c = sub.add_parser("compare", help="every workload and trace through the three deployments, with a report",
                       description="Serve each workload / trace with every architecture (same arrivals, same "
                                   "compute) and write summary.json, report.md, report.html and figures.")
    c.add_argument("--workloads", default="short,long,mixed",
                   help=f"comma-separated built-in workloads from {[w.value for w in BuiltinWorkload]}; '' for none")
    c.add_argument("--trace", action="append", default=[], metavar="FILE[,KEY=VALUE...]",
                   help="a Mooncake .jsonl or Azure .csv trace (repeatable); per-trace overrides of the scaling "
                        "options: prompt=, output=, length=, time=, max-prompt=, max-output=, n= (requests)")
    c.add_argument("--archs", default=",".join(a.value for a in Arch), help="comma-separated architectures")
    c.add_argument("--num-requests", type=_positive_int, default=24, help="per workload / trace")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--rate-scale", type=_positive_float, default=1.0, help="multiplies built-in workload rates")
    c.add_argument("--slo-ttft", type=_positive_float, default=1.5, help="seconds")
    c.add_argument("--slo-tpot", type=_positive_float, default=0.1, help="seconds")
    c.add_argument("--slo-attainment", type=_positive_float, default=0.9,
                   help="share of interactive requests that must meet both limits")
    c.add_argument("--admission", choices=[k.value for k in AdmissionKind], default="budget",
                   help="budget: two queues against the TTFT/TPOT budgets (= the SLOs), two request classes")
    c.add_argument("--inject-fault", metavar="decode-crash@T", help="SIGKILL a decode worker T s into each run")
    c.add_argument("--reruns", type=int, default=1, choices=range(0, 4),
                   help="repeat a run whose worker got < --starved-share of a core while busy (shared machines)")
    c.add_argument("--starved-share", type=_positive_float, default=0.5)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--engine", choices=["tiny", "vllm"], default="tiny",
                   help="tiny: this package's small engine; vllm: real vLLM instances (CPU) and KVStoreConnector")
    _add_scaling_args(c, "trace files only; built-in workloads are sized for this engine")
    _add_engine_args(c)
    add_vllm_args(c)


def _scaling(args: argparse.Namespace) -> TraceScaling:
    prompt_scale = args.prompt_scale or args.length_scale or 1.0
    output_scale = args.output_scale or args.length_scale or 1.0
    return TraceScaling(prompt_scale, output_scale, args.time_scale, args.max_prompt_tokens, args.max_output_tokens)


def _trace(args: argparse.Namespace, vocab_size: int) -> TokenTrace:
    common = {"seed": args.seed, "vocab_size": vocab_size, "scaling": _scaling(args)}
    if args.workload:
        return generate(BuiltinWorkload(args.workload), args.num_requests, rate_rps=args.rate, **common)
    if args.rate is not None:
        raise ValueError("--rate applies to --workload only; use --time-scale for trace files")
    fmt = TraceFormat(args.trace_format) if args.trace_format else None
    return load_token_trace(args.trace, fmt=fmt, num_requests=args.num_requests, **common)


def _sources_archs(args: argparse.Namespace) -> tuple[tuple[Source, ...], tuple[Arch, ...]]:
    workloads = [w for w in args.workloads.split(",") if w.strip()]
    try:
        sources = [Source(workload=BuiltinWorkload(w.strip())) for w in workloads]
        archs = tuple(Arch(a.strip()) for a in args.archs.split(",") if a.strip())
    except ValueError as exc:
        raise ValueError(f"{exc}; workloads: {[w.value for w in BuiltinWorkload]}, "
                         f"archs: {[a.value for a in Arch]}") from None
    sources += [Source.parse_trace(t, _scaling(args)) for t in args.trace]
    return tuple(sources), archs


def _compare_config(args: argparse.Namespace) -> CompareConfig:
    sources, archs = _sources_archs(args)
    return CompareConfig(
        sources=sources, out_dir=args.out, engine=_config(args, Arch.COLOCATED), archs=archs,
        num_requests=args.num_requests, seed=args.seed, rate_scale=args.rate_scale,
        slo=SLO(args.slo_ttft, args.slo_tpot, args.slo_attainment), admission=AdmissionKind(args.admission),
        fault=FaultSpec.parse(args.inject_fault) if args.inject_fault else None, progress=args.progress,
        reruns=args.reruns, starved_share=args.starved_share)


def _config(args: argparse.Namespace, arch: Arch) -> DeploymentConfig:
    preset = args.model or "default"
    if preset not in MODEL_PRESETS:
        raise ValueError(f"--model {preset!r}: the tiny engine's presets are {sorted(MODEL_PRESETS)}")
    model = dataclasses.replace(MODEL_PRESETS[preset], seed=args.seed)
    return DeploymentConfig(
        arch=arch, model=model, num_workers=args.workers, prefill_workers=args.prefill_workers,
        threads_per_worker=args.threads_per_worker, num_blocks=args.num_blocks, block_size=args.block_size or 16,
        chunk_budget=args.chunk_budget, prefill_batch_tokens=args.prefill_batch_tokens,
        transport=Transport(args.transport), inline=getattr(args, "inline", False),
        handoff_prefix_keys=args.handoff_keys == "prefix",
    )


def _report(summary: dict, out: Path) -> str:
    def ms(d: dict | None, key: str) -> str:
        return "-" if d is None else f"{d[key] * 1000:.1f}"

    t, req = summary["throughput"], summary["requests"]
    lines = [
        f"{summary['deployment']['arch']}: {req['completed']}/{req['total']} requests "
        f"({req['lost']} lost, {req['recomputed']} recomputed) in {t['duration_s']:.2f} s -> {out}",
        f"  throughput     {t.get('prompt_tokens_per_s', 0):.0f} prompt tok/s, {t.get('output_tokens_per_s', 0):.1f} "
        f"output tok/s",
    ]
    for name in ("ttft_s", "tpot_s", "prefill_queue_s", "decode_queue_s"):
        d = summary[name]
        lines.append(f"  {name[:-2]:<15}p50 {ms(d, 'p50')} ms  p90 {ms(d, 'p90')} ms  p99 {ms(d, 'p99')} ms")
    tr = summary["trace"]
    lines.append(f"  trace          {tr['source']}: scale prompt x{tr['prompt_scale']}, output x{tr['output_scale']}, "
                 f"time x{tr['time_scale']}; {tr['capped_requests']} requests capped")
    x = summary["transfer"]
    lines.append(f"  kv moved       {x['kv_bytes_transferred'] / 2**20:.1f} MiB in {x['handoffs']} hand-offs, "
                 f"transfer p50 {ms(x['transfer_s'], 'p50')} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "make-model":
        return main_make_model(args)
    if args.command == "compare":
        return _main_compare(parser, args)
    if args.command == "validate-planner":
        return main_validate(args)
    if args.command == "check-search":
        return main_check_search(args)
    try:
        config = _config(args, Arch(args.arch))
        trace = _trace(args, config.model.vocab_size)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    summary = run(config, trace, args.out, progress=args.progress)
    print(_report(summary, args.out))
    return 0


def _main_compare(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from benchmarks.pd.report import table

    if getattr(args, "link", None) and not (args.engine == "vllm" and args.via == "router"):
        parser.error("--link needs --engine vllm --via router (the vLLM OpenAI servers behind kvstore router)")
    try:
        if args.engine == "vllm" and args.via == "router":
            from benchmarks.pd.http_run import http_compare_config

            http_cfg = http_compare_config(args, *_sources_archs(args))
        elif args.engine == "vllm":
            sources, archs = _sources_archs(args)
            cfg = vllm_compare_config(args, sources, archs)
        else:
            cfg = _compare_config(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    if args.engine == "vllm" and args.via == "router" and getattr(args, "link", None):
        from benchmarks.pd.link import main_link, parse_rates

        try:
            rates = parse_rates(args.link)
        except ValueError as exc:
            parser.error(str(exc))
        return main_link(http_cfg, rates)
    if args.engine == "vllm" and args.via == "router":
        from benchmarks.pd.http_run import main_http

        return main_http(http_cfg)
    if args.engine == "vllm":
        from benchmarks.pd.vllm_compare import compare_vllm

        doc = compare_vllm(cfg)
    else:
        doc = compare(cfg)
    head, rows = table(doc)
    keep = [head.index(h) for h in ("workload", "arch", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms",
                                    "KV moved MiB", "goodput req/s", "meets SLO")]
    print("  ".join(f"{head[i]:<22}" for i in keep))
    for row in rows:
        print("  ".join(f"{row[i]:<22}" for i in keep))
    for workload, v in doc["verdicts"].items():
        print(f"\n[{workload}] {v['text']}")
    for workload, o in doc.get("outputs", {}).items():
        print(f"[{workload}] greedy outputs identical across architectures: {o['identical']}")
    print(f"\n-> {args.out / 'summary.json'}, {args.out / 'report.md'}, {args.out / 'report.html'}")
    return 0
