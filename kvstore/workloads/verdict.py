"""The verdict's shared parts: why an architecture missed the SLO, and the interference-vs-transfer reasons,
worded from the aggregate blocks of :mod:`kvstore.workloads.metrics`."""

from __future__ import annotations

from typing import Any

from kvstore.workloads.slo import SLO

MiB = 1 << 20
Card = dict[str, Any]


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def miss(card: Card, slo: SLO) -> str:
    """Why a run missed: the percentiles past the limits, or lost requests."""
    if card["requests"]["lost"]:
        return f"lost {card['requests']['lost']} requests"
    parts = []
    for name, limit in (("ttft_s", slo.ttft_s), ("tpot_s", slo.tpot_s)):
        d = card[name]
        if d and d["p90"] > limit:
            parts.append(f"{name[:4].upper()} p90 {ms(d['p90'])} > {ms(limit)}")
    attain = card["slo"]["attainment_interactive"]
    return (", ".join(parts) or "attainment short") + f" (interactive attainment {pct(attain)})"


def interference_reason(arch: str, card: Card) -> str:
    i = card["interference"]
    if not i["gaps_with_prefill"]:
        return f"{arch}: no decode step ever waited on a prefill ({i['gaps']} inter-token gaps)"
    return (f"{arch}: {pct(i['share_with_prefill'])} of inter-token gaps had a prefill on the same worker, "
            f"p50 {ms(i['gap_p50_with_prefill_s'])} vs {ms(i['gap_p50_decode_only_s'])} without "
            f"(+{pct(i['tpot_inflation'])})")


def transfer_reason(arch: str, card: Card) -> str:
    t = card["transfer"]
    if not t["kv_bytes_transferred"]:
        return f"{arch}: no KV moved"
    dq = card["decode_queue_s"]
    return (f"{arch}: moved {t['kv_bytes_transferred'] / MiB:.1f} MiB of KV in {t['handoffs']} hand-offs, transfer "
            f"p50 {ms(t['transfer_s']['p50'])} = {pct(t['share_of_ttft']['p50'])} of TTFT (p50; "
            f"{pct(t['share_of_ttft']['aggregate'])} of all TTFT), decode queue p50 {ms(dq['p50'] if dq else None)}")


def burst_reason(arch: str, card: Card) -> str | None:
    b = card["burst"]
    if b is None or b["interactive_gap_p90_inside_s"] is None:
        return None
    bg = (card["by_class"].get("background") or {}).get("ttft_s")
    change = "-" if b["p90_inflation"] is None else f"{b['p90_inflation']:+.0%}"
    return (f"{arch}: interactive inter-token gap p90 {ms(b['interactive_gap_p90_inside_s'])} while background "
            f"requests arrive and prefill vs {ms(b['interactive_gap_p90_outside_s'])} otherwise ({change}), "
            f"background TTFT p90 {ms(bg['p90'] if bg else None)}")
