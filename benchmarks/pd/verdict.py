"""The verdict per workload: which architecture meets the SLOs with the least resources, and why, in numbers.

"Meets the SLOs": every request completed and at least ``slo.attainment`` of the interactive requests met both
limits (metrics.py). Among those, the least resources: compute and weight copies are equal by construction
(same workers, each holding the model), so the order is weight copies, then KV bytes moved between workers,
then KV memory held (worker caches at peak plus what the store still holds), then CPU seconds (workers, router,
daemon). "Why" weighs the two costs the question is about, both measured in the same runs: interference (how
much longer a running decode's inter-token gap is when a prefill shares its worker) against transfer (KV bytes
moved, the hand-off's share of TTFT, the decode queue).
"""

from __future__ import annotations

from kvstore.workloads.slo import SLO

MiB = 1 << 20


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _cpu(card: dict) -> float:
    cpu = card["compute"]["cpu_s"]
    return sum(cpu["workers"].values()) + cpu.get("router", 0.0) + cpu.get("store_daemon", 0.0)


def resources(card: dict) -> tuple:
    m = card["memory"]
    held = m["peak_kv_bytes"] + (m["store_kv_bytes_at_end"] or 0)
    return m["model_memory_duplication"], card["transfer"]["kv_bytes_transferred"], held, round(_cpu(card), 1)


def _miss(card: dict, slo: SLO) -> str:
    """Why a run missed: the percentiles past the limits, or lost requests."""
    if card["requests"]["lost"]:
        return f"lost {card['requests']['lost']} requests"
    parts = []
    for name, limit in (("ttft_s", slo.ttft_s), ("tpot_s", slo.tpot_s)):
        d = card[name]
        if d and d["p90"] > limit:
            parts.append(f"{name[:4].upper()} p90 {_ms(d['p90'])} > {_ms(limit)}")
    attain = card["slo"]["attainment_interactive"]
    return (", ".join(parts) or "attainment short") + f" (interactive attainment {_pct(attain)})"


def _interference(arch: str, card: dict) -> str:
    i = card["interference"]
    if not i["gaps_with_prefill"]:
        return f"{arch}: no decode step ever waited on a prefill ({i['gaps']} inter-token gaps)"
    return (f"{arch}: {_pct(i['share_with_prefill'])} of inter-token gaps had a prefill on the same worker, "
            f"p50 {_ms(i['gap_p50_with_prefill_s'])} vs {_ms(i['gap_p50_decode_only_s'])} without "
            f"(+{_pct(i['tpot_inflation'])})")


def _transfer(arch: str, card: dict) -> str:
    t = card["transfer"]
    if not t["kv_bytes_transferred"]:
        return f"{arch}: no KV moved"
    dq = card["decode_queue_s"]
    return (f"{arch}: moved {t['kv_bytes_transferred'] / MiB:.1f} MiB of KV in {t['handoffs']} hand-offs, transfer "
            f"p50 {_ms(t['transfer_s']['p50'])} = {_pct(t['share_of_ttft']['p50'])} of TTFT (p50; "
            f"{_pct(t['share_of_ttft']['aggregate'])} of all TTFT), decode queue p50 {_ms(dq['p50'] if dq else None)}")


def _burst(arch: str, card: dict) -> str | None:
    b = card["burst"]
    if b is None or b["interactive_gap_p90_inside_s"] is None:
        return None
    bg = (card["by_class"].get("background") or {}).get("ttft_s")
    change = "-" if b["p90_inflation"] is None else f"{b['p90_inflation']:+.0%}"
    return (f"{arch}: interactive inter-token gap p90 {_ms(b['interactive_gap_p90_inside_s'])} while background "
            f"requests arrive and prefill vs {_ms(b['interactive_gap_p90_outside_s'])} otherwise ({change}), "
            f"background TTFT p90 {_ms(bg['p90'] if bg else None)}")


def _starved(card: dict, below: float = 0.5) -> bool:
    shares = card["compute"].get("cpu_share_while_busy") or {}
    return min(shares.values(), default=1.0) < below


def verdict(by_arch: dict[str, dict], slo: SLO) -> dict:
    meets = [a for a, card in by_arch.items() if card["slo"]["met"]]
    winner = min(meets, key=lambda a: resources(by_arch[a])) if meets else None
    best = max(by_arch, key=lambda a: (by_arch[a]["slo"]["attainment_interactive"], by_arch[a]["slo"]["goodput_rps"]))
    if winner is not None:
        card = by_arch[winner]
        dup, moved, held, cpu = resources(card)
        head = (f"{winner} meets the SLOs (interactive attainment {_pct(card['slo']['attainment_interactive'])}, "
                f"goodput {card['slo']['goodput_rps']:.2f} req/s) with the least resources among "
                f"{', '.join(meets)}: {dup:g} weight copies, {moved / MiB:.1f} MiB KV moved, "
                f"{held / MiB:.1f} MiB KV held, {cpu:.0f} CPU s")
    else:
        card = by_arch[best]
        head = (f"no architecture meets the SLOs at this load; closest: {best} (interactive attainment "
                f"{_pct(card['slo']['attainment_interactive'])}, goodput {card['slo']['goodput_rps']:.2f} req/s)")
    misses = {a: _miss(c, slo) for a, c in by_arch.items() if not c["slo"]["met"]}
    why = [_interference(a, c) for a, c in by_arch.items()] + [_transfer(a, c) for a, c in by_arch.items()
                                                                 if c["transfer"]["kv_bytes_transferred"]]
    bursts = [s for a, c in by_arch.items() if (s := _burst(a, c))]
    text = head + ". " + ("Misses: " + "; ".join(f"{a}: {m}" for a, m in misses.items()) + ". " if misses else "")
    text += "Interference vs transfer: " + "; ".join(why) + "."
    if bursts:
        text += " Background requests: " + "; ".join(bursts) + "."
    starved = [f"{a} (a worker got {min(c['compute']['cpu_share_while_busy'].values()):.0%} of a core while busy)"
               for a, c in by_arch.items() if _starved(c)]
    if starved:
        text += (" Caution, CPU taken by other processes on this machine: " + ", ".join(starved) +
                 "; those latencies overstate the architecture's own.")
    return {"winner": winner, "meets_slo": meets, "closest": best, "misses": misses, "why": why,
            "burst": bursts, "text": text}


def verdicts(results: dict[str, dict[str, dict]], slo: SLO) -> dict[str, dict]:
    return {workload: verdict(by_arch, slo) for workload, by_arch in results.items()}
