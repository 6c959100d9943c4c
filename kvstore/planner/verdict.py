"""The planner's answer: which architecture meets the SLO with the fewest GPUs, and why, in the
simulated terms of the issue: interference (decode stalls while prefills run) against transfer cost
(share of TTFT, bytes moved).

The choice is the shared verdict core's (:func:`kvstore.workloads.verdict.choose`, the measured comparison's
too) with the planner's ranking: fewest GPUs, then :func:`~kvstore.planner.plan.rank`, then the simpler
architecture; the closest when none meets is the evaluation's best by that rank. The interference sentence is
the planner's own: a simulation has per-request decode stalls, not the measured per-step timeline the shared
interference block is built from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvstore.planner.deployment import Arch
from kvstore.planner.metrics import Metrics
from kvstore.planner.plan import Evaluation, Planner, rank
from kvstore.workloads.report import seconds as _ms
from kvstore.workloads.verdict import Standing, choose

# On equal GPUs and equal rank, the architecture that moves no state wins.
_SIMPLICITY = {Arch.CHUNKED: 2, Arch.COLOCATED: 1, Arch.DISAGGREGATED: 0}


@dataclass(frozen=True, slots=True)
class Verdict:
    winner: Arch | None  # None: nothing meets the SLO with the GPUs given
    fewest_gpus: dict  # Arch -> GPUs needed to meet the SLO (None: not within the GPUs given)
    headline: str
    reasons: tuple[str, ...]
    misses: dict = field(default_factory=dict)  # Arch -> why it does not meet the SLO with the GPUs given

    def to_dict(self) -> dict:
        return {"winner": self.winner.value if self.winner else None,
                "fewest_gpus": {a.value: g for a, g in self.fewest_gpus.items()},
                "headline": self.headline, "reasons": list(self.reasons),
                "misses": {a.value: m for a, m in self.misses.items()}}


def _interference(m: Metrics) -> str:
    return (f"{m.label}: prefill work on the same worker takes {m.interference_share_of_tpot:.0%} of a "
            f"request's decode time on average; TPOT p90 {_ms(m.tpot_p90)} against {_ms(m.tpot_p90_without_stalls)} "
            f"without those stalls, inter-token p99 {_ms(m.itl_p99)}")


def _transfer(m: Metrics, link: str) -> str:
    per_req = m.kv_bytes_transferred / max(1, m.completed)
    return (f"{m.label}: no interference (TPOT p90 {_ms(m.tpot_p90)}, inter-token p99 {_ms(m.itl_p99)}) but "
            f"the KV transfer is {m.transfer_share_of_ttft:.0%} of TTFT over {link} ({per_req / 1e6:.0f} MB per "
            f"request, transfer p99 {_ms(m.transfer_p99)}); prefill pool {m.prefill_utilization:.0%} busy, "
            f"decode queue p99 {m.decode_queue_p99:.2f} s")


def _standing(m: Metrics, meets: bool) -> Standing:
    def p90(x: float) -> float | None:
        return None if math.isnan(x) else x

    return Standing(meets=meets, attainment_interactive=m.slo_attainment, goodput_rps=m.goodput_rps,
                    ttft_p90=p90(m.ttft_p90), tpot_p90=p90(m.tpot_p90))


def _cost(fewest: int, m: Metrics, arch: Arch) -> tuple:
    """Smaller wins: fewer GPUs, then the better rank, then the simpler architecture."""
    return (fewest, *(-x for x in rank(m)), -_SIMPLICITY[arch])


def decide(planner: Planner, ev: Evaluation) -> Verdict:
    fewest: dict = {}
    for arch in ev.metrics:
        found = planner.fewest_gpus(arch)
        fewest[arch] = found[0] if found else None
    slo = planner.config.slo
    limits = slo.describe()
    choice = choose({a: _standing(m, fewest[a] is not None) for a, m in ev.metrics.items()}, slo,
                    cost=lambda a: _cost(fewest[a], ev.metrics[a], a), closeness=lambda a: rank(ev.metrics[a]))
    winner = choice.winner
    if winner is not None:
        others = ", ".join(f"{a.value} needs {fewest[a]}" if fewest[a] else f"{a.value} cannot with "
                           f"{planner.config.gpus}" for a in ev.metrics if a is not winner)
        headline = (f"{winner.value} meets the SLO ({limits}) with {fewest[winner]} GPU(s), the fewest; "
                    f"{others}.")
    else:
        m = ev.metrics[choice.closest]
        headline = (f"no architecture meets the SLO ({limits}) with {planner.config.gpus} GPU(s); closest is "
                    f"{m.label} with {m.slo_attainment:.0%} of requests within both limits.")
    reasons = [f"{ev.metrics[a].label} misses the SLO with {planner.config.gpus} GPU(s): {why}"
               for a, why in choice.misses.items()]
    reasons += [_interference(ev.metrics[a]) for a in (Arch.COLOCATED, Arch.CHUNKED)]
    if Arch.DISAGGREGATED in ev.metrics:
        reasons.append(_transfer(ev.metrics[Arch.DISAGGREGATED], planner.transfer.name))
    reasons.extend(ev.notes)
    any_m = next(iter(ev.metrics.values()))
    reasons.append(f"weights: {any_m.weight_bytes_resident / 1e9:.1f} GB resident across {any_m.workers} "
                   f"worker(s) of tp={ev.tp} (x{any_m.weight_duplication:g} one copy) in every architecture")
    return Verdict(winner, fewest, headline, tuple(reasons), choice.misses)

