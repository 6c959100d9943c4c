"""``kvstore plan``: the planner's command line.

    kvstore plan --model llama-3-8b --gpus 2 --link 10gbe --trace FILE [--gpu h100|h200]
                 [--slo-ttft S --slo-tpot S] [--json PATH]
    kvstore plan --search --model llama-3-8b --link rdma-100g --trace FILE [--rate R] [--max-gpus N]
                 [--json PATH] [--plot PATH.png] [--router-config PATH] [--burst RATE [--burst-window A:B]]
    kvstore plan --calibrate DIR [DIR ...] [--save FILE]
    kvstore plan --list-presets

The top-level ``kvstore`` CLI hooks :func:`add_arguments` and :func:`run`; ``python -m kvstore.planner``
runs :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from kvstore.planner import presets, searchreport
from kvstore.planner.burst import Burst, plan_burst
from kvstore.planner.calibrate import calibrate, compare_run
from kvstore.planner.costmodel import CostModel, TransferModel
from kvstore.planner.crossover import bandwidth_crossover, prompt_crossover
from kvstore.planner.deployment import Arch
from kvstore.planner.plan import PlanConfig, Planner
from kvstore.planner.report import render, to_json, write_json
from kvstore.planner.search import search
from kvstore.planner.searchreport import write_json as write_search_json
from kvstore.planner.specs import Efficiency, LinkSpec
from kvstore.planner.thresholds import handoff_thresholds
from kvstore.planner.verdict import decide
from kvstore.workloads.runlog import read_run
from kvstore.workloads.slo import SLO
from kvstore.workloads.trace import Trace, get_workload, load_trace, poisson

DEFAULT_LINK = "rdma-100g"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_argument_group("mode (default: plan)")
    mode.add_argument("--calibrate", nargs="+", metavar="DIR", help="fit the cost model to measured run dirs")
    mode.add_argument("--save", metavar="FILE", help="with --calibrate: write the fitted model (JSON)")
    mode.add_argument("--list-presets", action="store_true", help="list models, GPUs and links")
    mode.add_argument("--search", action="store_true",
                      help="the cheapest fleet per architecture (GPUs, tp, P:D split, chunk) and per-GPU goodput")
    hw = parser.add_argument_group("hardware")
    hw.add_argument("--model", help="model preset (default llama-3-8b; pd-tiny with --calibrate)")
    hw.add_argument("--gpu", help="GPU preset (default h100; cpu-2core with --calibrate)")
    hw.add_argument("--gpus", type=int, default=2, help="total GPUs (default 2)")
    hw.add_argument("--link", default=None, help=f"prefill->decode link preset (default {DEFAULT_LINK})")
    hw.add_argument("--tp", type=int, default=None, help="GPUs per worker (default: fewest that fit)")
    hw.add_argument("--cost-model", metavar="FILE", help="a cost model saved by --calibrate --save")
    hw.add_argument("--mfu", type=float, help="prefill FLOP utilisation (default 0.5)")
    hw.add_argument("--mbu", type=float, help="decode memory-bandwidth utilisation (default 0.8)")
    hw.add_argument("--overlap", type=float, help="compute/memory overlap in a step, 0..1 (default 0.8)")
    tr = parser.add_argument_group("traffic")
    tr.add_argument("--trace", metavar="FILE", help="Mooncake .jsonl or Azure 2023 .csv trace")
    tr.add_argument("--workload", help="built-in Poisson workload: short, long or mixed")
    tr.add_argument("--rate", type=float, help="Poisson requests/s (default: ~70%% of estimated capacity)")
    tr.add_argument("--num-requests", type=int, help="first N requests of the trace (workload: default 500)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--time-scale", type=float, default=1.0, help="multiply inter-arrival times")
    tr.add_argument("--prompt-scale", type=float, default=1.0, help="multiply prompt lengths")
    tr.add_argument("--output-scale", type=float, default=1.0, help="multiply output lengths")
    pol = parser.add_argument_group("policy and SLO")
    pol.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT limit, s (default 2)")
    pol.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT limit, s (default 0.1)")
    pol.add_argument("--slo-attainment", type=float, default=0.9, help="share of requests (default 0.9)")
    pol.add_argument("--prefill-workers", type=int, help="disaggregated split (default: best)")
    pol.add_argument("--chunk-tokens", type=int, default=512, help="chunked token budget per step")
    pol.add_argument("--max-batch", type=int, default=256, help="running sequences per worker")
    pol.add_argument("--prefix-cache-tokens", type=int, default=0, help="per-worker prefix cache (0: off)")
    out = parser.add_argument_group("output")
    out.add_argument("--no-crossover", action="store_true", help="skip the bandwidth and prompt sweeps")
    out.add_argument("--json", metavar="PATH", help="write everything (with per-request results) as JSON")
    srch = parser.add_argument_group("search (--search)")
    srch.add_argument("--max-gpus", type=int, default=64, help="largest fleet the search considers (default 64)")
    srch.add_argument("--plot", metavar="PATH", help="the frontier (GPUs vs SLO attainment), .png or .svg")
    srch.add_argument("--burst", type=float, metavar="RATE",
                      help="also plan for a burst of long documents at RATE/s added to the traffic")
    srch.add_argument("--burst-prompt", type=int, default=16384, help="burst documents' prompt tokens (mean)")
    srch.add_argument("--burst-output", type=int, default=256, help="burst documents' output tokens (mean)")
    srch.add_argument("--burst-window", metavar="START:END", help="seconds of the trace the burst lasts "
                      "(default: all of it; END may be empty)")
    srch.add_argument("--router-config", metavar="PATH",
                      help="write the disaggregated plan as a kvstore router configuration (JSON)")


def run(args: argparse.Namespace) -> int:
    try:
        if args.list_presets:
            print(list_presets())
        elif args.calibrate:
            print(run_calibration(args))
        elif args.search:
            print(run_search(args))
        else:
            print(run_plan(args))
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"kvstore plan: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore plan", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


# -- plan -------------------------------------------------------------------------------------------------
def _efficiency(args) -> Efficiency:
    given = {k: getattr(args, k) for k in ("mfu", "mbu", "overlap") if getattr(args, k) is not None}
    return Efficiency(**given)


def _load_cost_file(path: str) -> dict:
    doc = json.loads(Path(path).read_text())
    if "cost_model" not in doc:
        raise ValueError(f"{path}: not a saved cost model (no 'cost_model' key)")
    return doc


def _config(args) -> PlanConfig:
    cost = transfer = None
    model_name, gpu_name = args.model or "llama-3-8b", args.gpu or "h100"
    if args.cost_model:
        doc = _load_cost_file(args.cost_model)
        cost = CostModel.from_dict(doc["cost_model"])
        transfer = TransferModel(**doc["transfer_model"]) if doc.get("transfer_model") else None
        model_name, gpu_name = args.model or doc.get("model", model_name), args.gpu or doc.get("gpu", gpu_name)
    model, gpu = presets.get_model(model_name), presets.get_gpu(gpu_name)
    if args.link is not None or transfer is None:
        link = presets.get_link(args.link or DEFAULT_LINK)
        transfer = None
    else:
        link = LinkSpec(name=transfer.name, bytes_per_s=transfer.bytes_per_s, latency_s=transfer.latency_s,
                        per_gpu=False, source=args.cost_model)
    slo = SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot, attainment=args.slo_attainment)
    return PlanConfig(model=model, gpu=gpu, link=link, gpus=args.gpus, slo=slo, tp=args.tp,
                      prefill_workers=args.prefill_workers, chunk_tokens=args.chunk_tokens,
                      max_batch=args.max_batch, prefix_cache_tokens=args.prefix_cache_tokens,
                      efficiency=_efficiency(args), cost=cost, transfer=transfer)


def _auto_rate(config: PlanConfig, sample: Trace) -> float:
    """~70 % of a rough capacity: per request, its prefill plus its share of batch-32 decode steps."""
    tp = config.resolve_tp(sample)
    cost = config.cost_model(tp)
    per_request = sum(cost.prefill_s(r.prompt_tokens) + r.output_tokens * cost.decode_s(
        32, 32 * (r.prompt_tokens + r.output_tokens / 2)) / 32 for r in sample.requests) / len(sample)
    return 0.7 * (config.gpus // tp) / per_request


def _trace(args, config: PlanConfig) -> Trace:
    if bool(args.trace) == bool(args.workload):
        raise ValueError("give exactly one of --trace FILE or --workload short|long|mixed")
    if args.trace:
        trace = load_trace(args.trace)
        if args.num_requests is not None:
            trace = trace.head(args.num_requests)
    else:
        workload = get_workload(args.workload)
        n = args.num_requests if args.num_requests is not None else 500
        rate = args.rate
        if rate is None:
            rate = _auto_rate(config, poisson(workload, 1.0, n, args.seed).scaled(
                prompt=args.prompt_scale, output=args.output_scale))
        trace = poisson(workload, rate, n, args.seed)
    return trace.scaled(time=args.time_scale, prompt=args.prompt_scale, output=args.output_scale)


def run_plan(args) -> str:
    config = _config(args)
    trace = _trace(args, config)
    planner = Planner(config, trace)
    ev = planner.evaluate()
    verdict = decide(planner, ev)
    crossovers = []
    if not args.no_crossover and Arch.DISAGGREGATED in ev.metrics:
        split = ev.results[Arch.DISAGGREGATED].deployment.prefill_workers
        crossovers = [bandwidth_crossover(planner, split), prompt_crossover(planner, split)]
    text = render(planner, ev, verdict, crossovers)
    if verdict.winner is None:
        text += (f"\n\nhint: nothing meets the SLO with {config.gpus} GPU(s); `kvstore plan --search` (same options) "
                 f"finds how many GPUs, in what split, each architecture needs")
    too_long = sum(r.prompt_tokens + r.output_tokens > config.model.max_context for r in trace.requests)
    if too_long and config.cost is None:
        text += (f"\n\nnote: {too_long} request(s) exceed {config.model.name}'s {config.model.max_context}-token "
                 f"context; they are simulated at full length (nothing is truncated)")
    if args.json:
        write_json(args.json, to_json(planner, ev, verdict, crossovers))
        text += f"\n\nwrote {args.json}"
    return text


# -- search ---------------------------------------------------------------------------------------------------
def run_search(args) -> str:
    config = _config(args)
    trace = _trace(args, config)
    # with a trace, --rate time-scales its arrivals; with --workload it already set the Poisson rate
    rate = args.rate if args.trace else None
    result = search(config, trace, rate, max_gpus=args.max_gpus)
    disagg = result.plans[Arch.DISAGGREGATED].best
    tp = disagg.deployment.tp if disagg else config.resolve_tp(trace)
    link = config.transfer_model(tp).name
    thresholds = handoff_thresholds(config.model, config.link, config.gpu, tp=tp, efficiency=config.efficiency,
                                    cost=config.cost, transfer=config.transfer)
    skip = {None: "every prompt (a transfer never beats recomputing here)",
            1: "no prompt (a transfer always beats recomputing here)"}.get(
        thresholds.min_prefill_tokens, f"prompts under {thresholds.min_prefill_tokens} tokens")
    hit = "" if thresholds.min_prefill_tokens is None else (
        f"; skip the prefill pool when >= {thresholds.skip_hit_fraction:.0%} of a "
        f"{thresholds.reference_prompt_tokens}-token prompt is in the store")
    extra = [f"router thresholds ({link}, tp={tp}): recompute on the decode worker {skip}{hit}"]
    title = f"{trace.name} at {result.rate:.3g} req/s: {config.model.name} on {config.gpu.name}"
    doc = searchreport.to_json(result, config.slo, link, thresholds)
    if args.burst is not None:
        steady = {a: p.best.deployment if p.best else None for a, p in result.plans.items()}
        start, end = _window_arg(args.burst_window)
        burst = plan_burst(config, trace.scaled(time=result.trace_rate / result.rate),
                           Burst(args.burst, args.burst_prompt, args.burst_output, args.seed, start, end),
                           args.max_gpus, steady)
        extra += burst.lines()
        doc["burst"] = burst.to_dict()
    if args.json:
        write_search_json(args.json, doc)
    if args.plot:
        searchreport.plot(result, config.slo, args.plot, title)
    if args.router_config:
        write_search_json(args.router_config, searchreport.router_config(result, config.slo, thresholds))
    extra += [f"wrote {p}" for p in (args.json, args.plot, args.router_config) if p]
    head = [f"trace   {trace.describe()}",
            f"model   {config.model.name} on {config.gpu.name}; link {config.link.name}"]
    return "\n".join(head) + "\n" + searchreport.render(result, config.slo, link, extra)


def _window_arg(text: str | None) -> tuple[float, float | None]:
    if not text:
        return 0.0, None
    start, sep, end = text.partition(":")
    try:
        return float(start or 0), (float(end) if end else None)
    except ValueError:
        raise ValueError(f"--burst-window takes START:END in seconds, got {text!r}") from None


# -- calibrate ------------------------------------------------------------------------------------------------
def run_calibration(args) -> str:
    runs = [read_run(d) for d in args.calibrate]
    template = presets.cost_model_for(presets.get_model(args.model or "pd-tiny"),
                                      presets.get_gpu(args.gpu or "cpu-2core"))
    fit = calibrate(runs, template)
    comparisons = [compare_run(r, fit.cost, fit.transfer, per_run=own)
                   for r in runs if r.arch is not None for own in (False, True)]
    lines = _fit_lines(fit) + [f"  {r.path}: arch unknown, not replayed" for r in runs if r.arch is None]
    lines.append("  replay, measured -> simulated p50 ('joint': the fit above; 'own': refitted to that run's steps):")
    for c in comparisons:
        fit_kind = "own" if c.per_run else "joint"
        lines.append(f"    {c.arch:13s} {fit_kind:5s} TTFT {c.measured_ttft_p50 * 1e3:8.2f} -> "
                     f"{c.simulated_ttft_p50 * 1e3:8.2f} ms ({c.ttft_error:+4.0%})  TPOT "
                     f"{c.measured_tpot_p50 * 1e3:7.2f} -> {c.simulated_tpot_p50 * 1e3:7.2f} ms "
                     f"({c.tpot_error:+4.0%})  {c.path}")
    doc = {"model": args.model or "pd-tiny", "gpu": args.gpu or "cpu-2core", "cost_model": fit.cost.to_dict(),
           "transfer_model": fit.transfer.to_dict() if fit.transfer else None,
           "fit": {k: getattr(fit, k) for k in ("prefill_error", "decode_error", "transfer_error",
                                                "prefill_samples", "decode_samples", "transfer_samples")},
           "comparisons": [dict(asdict(c), ttft_error=c.ttft_error, tpot_error=c.tpot_error) for c in comparisons]}
    for path in filter(None, (args.save, args.json)):
        Path(path).write_text(json.dumps(doc, indent=1, default=lambda v: None))
        lines.append(f"wrote {path}")
    return "\n".join(lines)


def _fit_lines(fit) -> list[str]:
    cost = fit.cost
    lines = [f"calibrated {cost.name}: {fit.prefill_samples} steps with prompt work, "
             f"{fit.decode_samples} decode steps",
             f"  per step {cost.base_s * 1e3:.3f} ms + weight reads {cost.weight_s * 1e3:.3f} ms; prompt token "
             f"{cost.token_s * 1e6:.2f} us; decode sequence {cost.seq_s * 1e6:.2f} us; attention pair "
             f"{cost.pair_s * 1e9:.3f} ns; context token {cost.ctx_s * 1e9:.2f} ns; overlap {cost.overlap:g}",
             f"  fit error (relative RMS): steps with prompt work {fit.prefill_error:.1%}, decode steps "
             f"{fit.decode_error:.1%}"]
    if fit.transfer:
        t = fit.transfer
        rate = f"bytes / {t.bytes_per_s / 1e9:.2f} GB/s" if t.bytes_per_s < 1e14 else "no measurable bandwidth term"
        lines.append(f"  transfer: {t.latency_s * 1e6:.0f} us + {rate}, {t.publish_share:.0%} of it publishing "
                     f"(error {fit.transfer_error:.1%}, {fit.transfer_samples} transfers)")
    return lines + [f"  note: {n}" for n in fit.notes]


# -- presets ------------------------------------------------------------------------------------------------
def list_presets() -> str:
    lines = ["models:"]
    for m in presets.MODELS.values():
        kind = "MLA" if m.is_mla else f"GQA {m.heads}/{m.kv_heads}"
        moe = f", MoE {m.experts_per_token}/{m.experts}" if m.experts else ""
        lines.append(f"  {m.name:12s} {m.params / 1e9:7.2f}B params ({m.active_params / 1e9:.1f}B active{moe}), "
                     f"{m.layers} layers, {kind}, KV {m.kv_bytes_per_token:,} B/token, weights "
                     f"{m.weight_bytes / 1e9:.1f} GB  [{m.source}]")
    lines.append("gpus:")
    for g in presets.GPUS.values():
        lines.append(f"  {g.name:12s} {g.memory_bytes / 1e9:.0f} GB, {g.hbm_bytes_per_s / 1e12:.2f} TB/s, "
                     f"{g.bf16_flops / 1e12:.0f} TFLOPS BF16 dense  [{g.source}]")
    lines.append("links:")
    for link in presets.LINKS.values():
        scope = "per GPU" if link.per_gpu else "per node"
        lines.append(f"  {link.name:12s} {link.gbit_per_s:8.1f} Gb/s {scope}, {link.latency_s * 1e6:.0f} us "
                     f"(assumed)  [{link.source}]")
    lines.append("calibrated cost models: " + ", ".join(f"{m}@{g}" for m, g in presets.CALIBRATED))
    return "\n".join(lines)
