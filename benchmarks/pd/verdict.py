"""The verdict per workload: which architecture meets the SLOs with the least resources, and why, in numbers.

"Meets the SLOs": every request completed and at least ``slo.attainment`` of the interactive requests met both
limits (metrics.py). Among those, the least resources: compute and weight copies are equal by construction
(same workers, each holding the model), so the order is weight copies, then KV bytes moved between workers,
then KV memory held (worker caches at peak plus what the store still holds), then CPU seconds (workers, router,
daemon). "Why" weighs the two costs the question is about, both measured in the same runs: interference (how
much longer a running decode's inter-token gap is when a prefill shares its worker) against transfer (KV bytes
moved, the hand-off's share of TTFT, the decode queue).

The choice (who meets, the winner, the closest: interactive attainment then goodput, the misses) and the
wording of the misses and reasons are the shared verdict core's (:mod:`kvstore.workloads.verdict`, the
planner's too); this module gives it the ranking (:func:`resources`) and the run's own cautions (starved CPU).
"""

from __future__ import annotations

from kvstore.workloads.slo import SLO
from kvstore.workloads.verdict import MiB, Standing, burst_reason, choose, interference_reason, pct, transfer_reason


def _cpu(card: dict) -> float:
    cpu = card["compute"]["cpu_s"]
    return sum(cpu["workers"].values()) + cpu.get("router", 0.0) + cpu.get("store_daemon", 0.0)


def resources(card: dict) -> tuple:
    m = card["memory"]
    held = m["peak_kv_bytes"] + (m["store_kv_bytes_at_end"] or 0)
    return m["model_memory_duplication"], card["transfer"]["kv_bytes_transferred"], held, round(_cpu(card), 1)


def _starved(card: dict, below: float = 0.5) -> bool:
    shares = card["compute"].get("cpu_share_while_busy") or {}
    return min(shares.values(), default=1.0) < below


def verdict(by_arch: dict[str, dict], slo: SLO) -> dict:
    """The shared choice (:func:`kvstore.workloads.verdict.choose`) ranked by :func:`resources`, in words."""
    choice = choose({a: Standing.of_card(c) for a, c in by_arch.items()}, slo, cost=lambda a: resources(by_arch[a]))
    meets, winner, best, misses = list(choice.meeting), choice.winner, choice.closest, choice.misses
    if winner is not None:
        card = by_arch[winner]
        dup, moved, held, cpu = resources(card)
        head = (f"{winner} meets the SLOs (interactive attainment {pct(card['slo']['attainment_interactive'])}, "
                f"goodput {card['slo']['goodput_rps']:.2f} req/s) with the least resources among "
                f"{', '.join(meets)}: {dup:g} weight copies, {moved / MiB:.1f} MiB KV moved, "
                f"{held / MiB:.1f} MiB KV held, {cpu:.0f} CPU s")
    else:
        card = by_arch[best]
        head = (f"no architecture meets the SLOs at this load; closest: {best} (interactive attainment "
                f"{pct(card['slo']['attainment_interactive'])}, goodput {card['slo']['goodput_rps']:.2f} req/s)")
    why = [interference_reason(a, c) for a, c in by_arch.items()] + [transfer_reason(a, c) for a, c in by_arch.items()
                                                                 if c["transfer"]["kv_bytes_transferred"]]
    bursts = [s for a, c in by_arch.items() if (s := burst_reason(a, c))]
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
