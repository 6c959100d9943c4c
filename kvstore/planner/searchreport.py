"""Rendering ``kvstore plan --search``: the table of cheapest fleets and per-GPU goodput, the frontier,
why the winner wins, as text, JSON, a plot (matplotlib, from the ``bench`` extra) and a router config."""

from __future__ import annotations

import json
from pathlib import Path

from kvstore.planner.deployment import Arch
from kvstore.planner.metrics import Metrics
from kvstore.planner.search import ArchPlan, SearchResult
from kvstore.planner.thresholds import HandoffThresholds
from kvstore.workloads.report import seconds as _ms
from kvstore.workloads.report import text_table
from kvstore.workloads.slo import SLO


def _slo_text(slo: SLO) -> str:
    return slo.describe()


def table(result: SearchResult) -> list[str]:
    rows = [("architecture", "cheapest fleet", "GPUs", "attainment", "max rate", "per-GPU goodput")]
    for arch, p in result.plans.items():
        if p.best is None:
            rows.append((arch.value, "none within the search", "-", "-", "-", "-"))
            continue
        bound = ">=" if p.rate_capped else ""
        rows.append((arch.value, p.best.metrics.label, str(p.gpus), f"{p.best.metrics.slo_attainment:.1%}",
                     f"{bound}{p.max_rate:.3g} req/s", f"{bound}{p.goodput_per_gpu:.3g} req/s/GPU"))
    return text_table(rows)


def frontier_lines(result: SearchResult) -> list[str]:
    lines = ["frontier (GPUs: SLO attainment at the search's rate, placement of the cheapest fleet; * meets)"]
    for arch, p in result.plans.items():
        cells = "  ".join(f"{f.gpus:>3}: {f.attainment:6.1%}{'*' if f.meets else ' '}" for f in p.frontier)
        lines.append(f"  {arch.value:14s} {cells or '-'}")
    return lines


def _interference(m: Metrics) -> str:
    return (f"{m.label} loses {m.interference_share_of_tpot:.0%} of decode time to prefill work on the same "
            f"worker (TPOT p90 {_ms(m.tpot_p90)}, {_ms(m.tpot_p90_without_stalls)} without those stalls; TTFT p90 "
            f"{_ms(m.ttft_p90)})")


def _transfer(m: Metrics, link: str) -> str:
    per_req = m.kv_bytes_transferred / max(1, m.completed)
    return (f"{m.label} has no interference (TPOT p90 {_ms(m.tpot_p90)}; TTFT p90 {_ms(m.ttft_p90)}) but adds "
            f"the KV transfer: "
            f"{m.transfer_share_of_ttft:.0%} of TTFT over {link} ({per_req / 1e6:.0f} MB per request, p99 "
            f"{_ms(m.transfer_p99)}); prefill pool {m.prefill_utilization:.0%} busy, decode pool "
            f"{m.decode_utilization:.0%}")


def why(result: SearchResult, link: str) -> list[str]:
    """The winner against the others in the issue's terms: interference removed vs transfer and
    weight duplication added (each architecture at its own cheapest fleet)."""
    if result.winner is None:
        return ["no architecture meets the SLO within the search; see the notes for what was pruned"]
    win = result.plans[result.winner]
    lines = []
    for arch, p in result.plans.items():
        if p.best is None:
            continue
        m = p.best.metrics
        lines.append(_transfer(m, link) if arch is Arch.DISAGGREGATED else _interference(m))
    copies = ", ".join(f"{a.value} x{p.best.metrics.weight_duplication:g}" for a, p in result.plans.items() if p.best)
    lines.append(f"weight copies resident: {copies} (one per worker; tp={win.best.deployment.tp} for the winner)")
    for arch, p in result.plans.items():
        if arch is result.winner:
            continue
        same = next((f for f in p.frontier if f.gpus == win.gpus), None)
        if same is not None and not same.meets:
            lines.append(f"at the winner's {win.gpus} GPUs {arch.value} ({same.label}) meets only "
                         f"{same.attainment:.1%} of requests ({same.ttft_misses} miss TTFT, {same.tpot_misses} "
                         f"miss TPOT)")
    return lines


def headline(result: SearchResult) -> str:
    if result.winner is None:
        return "no architecture meets the SLO within the search"
    win = result.plans[result.winner]
    others = ", ".join(f"{a.value} needs {p.gpus}" if p.gpus else f"{a.value} none within {result.max_gpus}"
                       for a, p in result.plans.items() if a is not result.winner)
    return f"winner: {win.best.metrics.label}, {win.gpus} GPU(s), the fewest; {others}"


def render(result: SearchResult, slo: SLO, link: str, extra: list[str] | None = None) -> str:
    source = "the trace's own" if abs(result.rate - result.trace_rate) < 1e-9 * result.trace_rate else "--rate"
    lines = [f"search  {result.rate:.3g} req/s ({source}); SLO {_slo_text(slo)}; fleets up to {result.max_gpus} "
             f"GPUs; {result.simulations} simulations ({result.stopped_early} stopped early) in "
             f"{result.elapsed_s:.1f} s", ""]
    lines += table(result) + [""] + frontier_lines(result) + ["", headline(result)]
    lines += [f"  - {r}" for r in why(result, link)]
    notes = [n for p in result.plans.values() for n in p.notes]
    if any(p.rate_capped for p in result.plans.values()):
        notes.append("'>=': the trace, time-scaled that fast, lasts under 20 TTFT budgets (one burst): the knee "
                     "is past what it can measure; use a longer trace")
    lines += [f"note: {n}" for n in notes] + (extra or [])
    return "\n".join(lines)


def _plan_dict(p: ArchPlan) -> dict:
    return {"gpus": p.gpus, "deployment": None if p.best is None else {
                "label": p.best.metrics.label, "tp": p.best.deployment.tp, "workers": p.best.deployment.workers,
                "prefill_workers": p.best.deployment.prefill_workers,
                "decode_workers": p.best.deployment.decode_workers,
                "chunk_tokens": p.best.deployment.chunk_tokens if p.arch is Arch.CHUNKED else None},
            "metrics": p.best.metrics.to_dict() if p.best else None,
            "max_rate_rps": p.max_rate, "goodput_per_gpu_rps": p.goodput_per_gpu, "rate_capped": p.rate_capped,
            "rate_tries": p.rate_tries, "notes": list(p.notes),
            "frontier": [{"gpus": f.gpus, "label": f.label, "attainment": f.attainment, "meets": f.meets,
                          "ttft_misses": f.ttft_misses, "tpot_misses": f.tpot_misses} for f in p.frontier]}


def to_json(result: SearchResult, slo: SLO, link: str, thresholds: HandoffThresholds | None = None) -> dict:
    return {"rate_rps": result.rate, "trace_rate_rps": result.trace_rate, "max_gpus": result.max_gpus,
            "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment}, "link": link,
            "winner": result.winner.value if result.winner else None, "headline": headline(result),
            "why": why(result, link), "simulations": result.simulations, "stopped_early": result.stopped_early,
            "elapsed_s": result.elapsed_s, "plans": {a.value: _plan_dict(p) for a, p in result.plans.items()},
            "thresholds": thresholds.to_dict() if thresholds else None}


def router_config(result: SearchResult, slo: SLO, thresholds: HandoffThresholds) -> dict:
    """The plan as a router configuration: pool sizes of the disaggregated fleet (the cheapest one found,
    whether or not it won: the router serves that architecture), the budgets and the skip thresholds."""
    plan = result.plans.get(Arch.DISAGGREGATED)
    if plan is None or plan.best is None:
        raise ValueError("no disaggregated fleet meets the SLO within the search: nothing to configure "
                         "the router with (raise --max-gpus or relax the SLO)")
    dep = plan.best.deployment
    return {"prefill": dep.prefill_workers, "decode": dep.decode_workers, "tp": dep.tp,
            "slo_ttft": slo.ttft_s, "slo_tpot": slo.tpot_s, "slo_attainment": slo.attainment,
            "skip_prefill_below_tokens": thresholds.min_prefill_tokens,
            "skip_prefill_hit_fraction": thresholds.skip_hit_fraction,
            "thresholds": thresholds.to_dict(), "rate_rps": result.rate,
            "winner": result.winner.value if result.winner else None,
            "note": "written by kvstore plan --search --router-config; see docs/planner.md"}


def write_json(path: str | Path, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=1, default=lambda v: None))


def plot(result: SearchResult, slo: SLO, path: str | Path, title: str) -> None:
    """GPUs vs SLO attainment per architecture (the frontier), the target as a line, PNG or SVG by suffix."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvstore[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for arch, p in result.plans.items():
        if p.frontier:
            ax.plot([f.gpus for f in p.frontier], [f.attainment for f in p.frontier], marker="o",
                    label=f"{arch.value} ({p.goodput_per_gpu:.3g} req/s/GPU)" if p.best else arch.value)
    ax.axhline(slo.attainment, color="grey", linestyle="--", linewidth=1, label="SLO attainment target")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("GPUs")
    ax.set_ylabel("SLO attainment")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

