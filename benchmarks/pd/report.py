"""``report.md`` and ``report.html`` of a comparison: setup, the metric table, the verdicts, the figures.

Both are rendered from the same cells, so they never disagree; the HTML embeds the PNGs (base64) and the
Markdown links the same files next to it.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from benchmarks.pd.figures import cdf_figure, timeline_figure
from kvstore.workloads.report import html_table, md_table, ms_cell

MiB = 1 << 20


def _ms3(d: dict | None) -> str:
    return ms_cell(d)


def _ms2(d: dict | None) -> str:
    return ms_cell(d, ("p50", "p99"))


def _energy(e: dict) -> str:
    return e["joules"] if isinstance(e["joules"], str) else f"{e['joules']:.0f} J"


def _kv(memory: dict) -> str:
    """Peak KV in the workers' caches (sum of per-worker peaks), plus what the hand-off store still held."""
    store = memory["store_kv_bytes_at_end"]
    peak = f"{memory['peak_kv_bytes'] / MiB:.1f}"
    return peak if store is None else f"{peak} (+{store / MiB:.1f})"


def _share(card: dict) -> str:
    shares = card["compute"].get("cpu_share_while_busy") or {}
    runs = len(card.get("attempts", [])) or 1
    return f"{min(shares.values(), default=1.0):.2f} ({runs})"


def table(doc: dict) -> tuple[list[str], list[list[str]]]:
    """The metric table: one row per workload x architecture."""
    fault = doc["setup"]["fault"] is not None
    head = ["workload", "arch", "prompt tok/s", "output tok/s", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms",
            "prefill-queue p50/p99 ms", "decode-queue p50/p99 ms", "KV moved MiB", "transfer p50/p99 ms",
            "transfer share of TTFT p50", "weight copies", "peak KV MiB (+ in store at end)", "energy", "goodput req/s",
            "SLO attainment (interactive)", "meets SLO", "min CPU share busy (runs)"]
    if fault:
        head += ["lost", "recomputed", "refetched", "recovery s"]
    rows = []
    for workload, by_arch in doc["results"].items():
        for arch, c in by_arch.items():
            t, m, s = c["transfer"], c["memory"], c["slo"]
            row = [workload, arch, f"{c['throughput']['prompt_tokens_per_s']:.0f}",
                   f"{c['throughput']['output_tokens_per_s']:.1f}", _ms3(c["ttft_s"]), _ms3(c["tpot_s"]),
                   _ms2(c["prefill_queue_s"]), _ms2(c["decode_queue_s"]), f"{t['kv_bytes_transferred'] / MiB:.1f}",
                   _ms2(t["transfer_s"]), f"{t['share_of_ttft']['p50'] * 100:.0f}%",
                   f"{m['model_memory_duplication']:g}", _kv(m), _energy(c["energy"]),
                   f"{s['goodput_rps']:.2f}",
                   f"{s['attainment'] * 100:.0f}% ({s['attainment_interactive'] * 100:.0f}%)",
                   "yes" if s["met"] else "no", _share(c)]
            if fault:
                f = c["fault"] or {}
                rec = f.get("recovery_s")
                row += [str(f.get("requests_lost", "-")), str(f.get("requests_recomputed", "-")),
                        str(f.get("requests_refetched", "-")), "-" if rec is None else f"{rec:.2f}"]
            rows.append(row)
    return head, rows


def _setup_lines(doc: dict) -> list[str]:
    m, s = doc["machine"], doc["setup"]
    e = s["engine"]["model"]
    slo = s["slo"]
    energy = next(iter(next(iter(doc["results"].values())).values()))["energy"]
    lines = [
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['platform']}, Python {m['python']}, torch "
        f"{m['torch']}; load average {m['load_average_at_start']} at the start, {m.get('load_average_at_end')} "
        f"at the end (a shared machine: other work ran alongside).",
        f"Model: {e['num_layers']} layers, hidden {e['hidden_size']}, {e['num_heads']} heads / {e['num_kv_heads']} KV "
        f"heads x {e['head_dim']}, {e['dtype']}, {s['engine']['kv_bytes_per_token']} KV bytes per token; "
        f"{s['engine']['num_blocks_per_worker']} KV blocks of {s['engine']['block_size']} tokens per worker.",
        f"Compute (equal in every architecture): {s['compute']['engine_workers']} engine worker processes x "
        f"{s['compute']['threads_per_worker']} torch thread. colocated: {s['compute']['colocated']}. chunked: "
        f"{s['compute']['chunked']}. disaggregated: {s['compute']['disaggregated']} (hand-off transport "
        f"{s['transport']}, {s['handoff_keys']}-keyed chunks). {s['compute']['shared']}.",
        f"SLO: TTFT <= {slo['ttft_s'] * 1000:.0f} ms and TPOT <= {slo['tpot_s'] * 1000:.0f} ms per request; an "
        f"architecture meets it when no request is lost and >= {slo['attainment'] * 100:.0f}% of interactive "
        f"requests meet both. Goodput: requests meeting both per second.",
        f"Admission control: {_admission_line(s['admission'])}.",
        f"Fault injected: {s['fault'] or 'none'}.",
        f"Energy: {_energy(energy)}" + (f" ({energy['reason']})" if "reason" in energy else "") + ".",
        f"Seed {s['seed']}; built-in workload rates x{s['rate_scale']}; wall time of the whole comparison "
        f"{doc.get('wall_s', '-')} s.",
        f"Min CPU share busy: the smallest share of a core any worker of the run got while it had work (CPU s / "
        f"step wall s; 1.0 = a core to itself); a run under {s['reruns']['when_cpu_share_below']} was repeated "
        f"(up to {s['reruns']['max']} times; attempts in parentheses) because other processes took its CPU.",
    ]
    return lines


def _admission_line(a: dict) -> str:
    if a["policy"] == "none":
        return "none (every request sent at once to the least-loaded worker)"
    fit = a.get("step_model") or a["cost_model"]  # "cost_model" in summaries written before the rename
    return (f"two queues with two budgets, prefill queue against TTFT {a['ttft_budget_s'] * 1000:.0f} ms, decode "
            f"queue against TPOT {a['tpot_budget_s'] * 1000:.0f} ms; interactive before background, background "
            f"only into slack, or after waiting {a['background_max_wait_s']:g} s; step times predicted by a step "
            f"model fitted here (median fit error {fit['fit_error_median'] * 100:.0f}%)")


def trace_table(doc: dict) -> tuple[list[str], list[list[str]]]:
    head = ["source", "requests", "prompt scale", "output scale", "time scale", "caps (prompt/output)",
            "capped", "arrival span s"]
    rows = [[f"{name} ({t['source']})", str(t["requests"]), f"{t['prompt_scale']:g}", f"{t['output_scale']:g}",
             f"{t['time_scale']:g}", f"{t['max_prompt_tokens'] or '-'}/{t['max_output_tokens'] or '-'}",
             str(t["capped_requests"]), f"{t['duration_s']:.1f}"] for name, t in doc["setup"]["traces"].items()]
    return head, rows


def _figures(doc: dict, data: dict, out: Path) -> list[tuple[str, Path]]:
    slo = doc["setup"]["slo"]
    figs = []
    for workload, by_arch in data.items():
        rows = {arch: run.rows for arch, run in by_arch.items()}
        path = cdf_figure(rows, f"{workload}: TTFT and TPOT CDFs", slo["ttft_s"], slo["tpot_s"],
                          out / f"cdf_{workload}.png")
        figs.append((f"{workload}: TTFT and TPOT CDFs per architecture", path))
    name = next((w for w in ("burst", "mixed") if w in data), next(iter(data)))
    by_arch = data[name]
    faults = {arch: (run.card["fault"] or {}).get("killed_at_s") for arch, run in by_arch.items()}
    path = timeline_figure({a: r.timeline for a, r in by_arch.items()}, {a: r.rows for a, r in by_arch.items()},
                           f"timeline of the {name} runs: engine steps per worker", out / f"timeline_{name}.png",
                           faults)
    figs.append((f"Timeline of the {name} runs (one lane per worker; dotted line: fault)", path))
    return figs


def write_report(doc: dict, data: dict, out: Path) -> tuple[Path, Path]:
    """Write the figures, report.md and report.html into ``out``; returns the two report paths."""
    figs = _figures(doc, data, out)
    metric_head, metric_rows = table(doc)
    trace_head, trace_rows = trace_table(doc)
    setup = _setup_lines(doc)
    verdicts = doc["verdicts"]
    md = ["# Collocated vs chunked prefill vs disaggregated: measured comparison", ""]
    md += [f"- {line}" for line in setup] + ["", "## Traces", ""] + md_table(trace_head, trace_rows)
    md += ["", "## Metrics", ""] + md_table(metric_head, metric_rows)
    md += ["", "## Verdicts", ""]
    for workload, v in verdicts.items():
        md += [f"### {workload}", "", v["text"], ""]
    md += ["## Figures", ""] + [f"![{caption}]({path.name})\n" for caption, path in figs]
    md_path = out / "report.md"
    md_path.write_text("\n".join(md) + "\n")

    style = ("body{font-family:sans-serif;max-width:1400px;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px}"
             "th{background:#f3f3f3}img{max-width:100%}")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>pd compare</title><style>{style}</style>"
             "</head><body><h1>Collocated vs chunked prefill vs disaggregated: measured comparison</h1><ul>"]
    parts += [f"<li>{html.escape(line)}</li>" for line in setup]
    parts += ["</ul><h2>Traces</h2>", html_table(trace_head, trace_rows), "<h2>Metrics</h2>",
              html_table(metric_head, metric_rows), "<h2>Verdicts</h2>"]
    for workload, v in verdicts.items():
        parts.append(f"<h3>{html.escape(workload)}</h3><p>{html.escape(v['text'])}</p>")
    parts.append("<h2>Figures</h2>")
    for caption, path in figs:
        data_uri = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{data_uri}'>"
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    html_path = out / "report.html"
    html_path.write_text("\n".join(parts) + "\n")
    return md_path, html_path
