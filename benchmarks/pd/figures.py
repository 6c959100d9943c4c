"""The report's figures (matplotlib, Agg backend, PNG): TTFT and TPOT CDFs per architecture, and a timeline.

Each function takes the raw rows (requests.jsonl) and timeline steps (timeline.jsonl) of the runs and
writes one PNG; nothing here computes a metric the summary does not already hold.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

COLORS = {"colocated": "#1f77b4", "chunked": "#2ca02c", "disaggregated": "#d62728"}
STEP_COLORS = {"prefill": "#ff7f0e", "mixed": "#9467bd", "decode": "#1f77b4", "fetch": "#17becf"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values: list[float], label: str, color: str | None) -> None:
    if not values:
        return
    x = np.sort(np.asarray(values)) * 1000
    ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label, color=color)


def cdf_figure(rows_by_arch: dict[str, list[dict]], title: str, slo_ttft_s: float, slo_tpot_s: float,
               path: Path) -> Path:
    """TTFT and TPOT CDFs, one line per architecture, the SLO limits as dashed lines."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for metric, ax, limit in (("ttft_s", axes[0], slo_ttft_s), ("tpot_s", axes[1], slo_tpot_s)):
        for arch, rows in rows_by_arch.items():
            _cdf(ax, [r[metric] for r in rows if r[metric] is not None and not r["lost"]], arch, COLORS.get(arch))
        ax.axvline(limit * 1000, color="grey", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel(f"{metric[:4].upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_xscale("log")
    axes[1].legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _step_kind(step: dict) -> str:
    if step["prefill_tokens"] and step["decode_tokens"]:
        return "mixed"
    if step["prefill_tokens"]:
        return "prefill"
    return "fetch" if step["transfer_s"] > 0 else "decode"


def _lanes(ax, timeline: list[dict]) -> list[int]:
    workers = sorted({s["worker"] for s in timeline})
    for lane, worker in enumerate(workers):
        for kind in STEP_COLORS:
            spans = [(s["start_s"], max(s["end_s"] - s["start_s"], 1e-4)) for s in timeline
                     if s["worker"] == worker and _step_kind(s) == kind]
            if spans:
                ax.broken_barh(spans, (lane - 0.4, 0.8), facecolors=STEP_COLORS[kind])
    return workers


def timeline_figure(timelines: dict[str, list[dict]], rows_by_arch: dict[str, list[dict]], title: str,
                    path: Path, fault_at_s: dict[str, float | None] | None = None) -> Path:
    """One panel per architecture: a lane per worker with its steps coloured by kind (prefill, mixed
    prefill+decode, decode, decode with a KV fetch), the background requests' arrival window shaded, and
    the fault's kill time marked."""
    plt = _plt()
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.3 + 1.1 * len(timelines)), sharex=True,
                             squeeze=False)
    for ax, (arch, timeline) in zip(axes[:, 0], timelines.items(), strict=False):
        roles = {s["worker"]: s["role"] for s in timeline}
        workers = _lanes(ax, timeline)
        ax.set_yticks(range(len(workers)), [f"w{w} {roles[w]}" for w in workers], fontsize=7)
        bg = [r["arrival_s"] for r in rows_by_arch.get(arch, []) if r["class"] == "background"]
        if bg:
            ax.axvspan(min(bg), max(bg) + 0.05, color="grey", alpha=0.15)
        if fault_at_s and fault_at_s.get(arch) is not None:
            ax.axvline(fault_at_s[arch], color="black", linestyle=":", linewidth=1.5)
        ax.set_ylabel(arch, fontsize=8)
        ax.set_ylim(-0.6, max(len(workers), 1) - 0.4)
    axes[-1, 0].set_xlabel("seconds since the run started")
    handles = [Patch(color=c, label=k) for k, c in STEP_COLORS.items()]
    handles.append(Patch(color="grey", alpha=0.3, label="background arrivals"))
    fig.legend(handles=handles, loc="upper right", ncol=5, fontsize=7)
    fig.suptitle(title, x=0.02, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
