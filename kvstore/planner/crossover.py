"""Where disaggregation stops paying: sweeps of link bandwidth and of prompt length.

"Pays" means the disaggregated deployment ranks above the better of colocated and chunked on the same
GPUs (:func:`kvstore.planner.plan.rank`: meets the SLO, then goodput, then latency headroom).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

from kvstore.planner.costmodel import TransferModel
from kvstore.planner.deployment import Arch
from kvstore.planner.plan import Planner, rank

# One direction's rate, 1 Gb/s .. 3.6 Tb/s (NVLink 4's 450 GB/s), in bytes/s.
BANDWIDTH_GRID = tuple(g * 1e9 / 8 for g in (1, 2.5, 10, 25, 50, 100, 200, 400, 800, 1600, 3600))
PROMPT_SCALES = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    x: float  # bytes/s for a bandwidth sweep, prompt scale factor for a prompt sweep
    pays: bool
    disagg_goodput_rps: float
    best_colocated_goodput_rps: float
    disagg_slo_ratio: float
    best_colocated_slo_ratio: float
    transfer_share_of_ttft: float
    mean_prompt_tokens: float = math.nan


@dataclass(frozen=True, slots=True)
class Crossover:
    """A sweep and its answer. ``threshold`` is the swept value at which the answer flips (None if it
    never does in the range); ``pays_above`` says on which side of it disaggregation pays."""

    kind: str  # "link bandwidth" or "prompt scale"
    points: tuple[SweepPoint, ...]
    threshold: float | None
    pays_above: bool | None
    summary: str


def _point(planner: Planner, x: float, transfer: TransferModel | None, trace, prefill_workers: int) -> SweepPoint:
    gpus = planner.config.gpus
    _, disagg = planner.simulate(Arch.DISAGGREGATED, gpus, prefill_workers, transfer, trace)
    coloc = max((planner.simulate(a, gpus, trace=trace)[1] for a in (Arch.COLOCATED, Arch.CHUNKED)), key=rank)
    return SweepPoint(x=x, pays=rank(disagg) > rank(coloc), disagg_goodput_rps=disagg.goodput_rps,
                      best_colocated_goodput_rps=coloc.goodput_rps, disagg_slo_ratio=disagg.slo_ratio,
                      best_colocated_slo_ratio=coloc.slo_ratio,
                      transfer_share_of_ttft=disagg.transfer_share_of_ttft,
                      mean_prompt_tokens=(trace or planner.trace).mean_prompt)


def _gbps(bytes_per_s: float) -> str:
    gbps = bytes_per_s * 8 / 1e9
    return f"{gbps / 1000:.3g} Tb/s" if gbps >= 1000 else f"{gbps:.3g} Gb/s"


def bandwidth_crossover(planner: Planner, prefill_workers: int, refine: int = 5) -> Crossover:
    """Sweep the link's bandwidth (latency kept) and bisect (log scale) the lowest bandwidth above which
    disaggregation keeps paying."""
    base = planner.transfer

    def at(bw: float) -> SweepPoint:
        link = TransferModel(name=f"{_gbps(bw)}", latency_s=base.latency_s, bytes_per_s=bw)
        return _point(planner, bw, link, None, prefill_workers)

    points = [at(bw) for bw in BANDWIDTH_GRID]
    if not any(p.pays for p in points):
        return Crossover("link bandwidth", tuple(points), None, None,
                         f"disaggregation does not pay at any link bandwidth from {_gbps(BANDWIDTH_GRID[0])} "
                         f"to {_gbps(BANDWIDTH_GRID[-1])}: what it removes (prefill interference) costs less "
                         f"here than what it adds (fewer GPUs per phase, KV transfer)")
    if points[0].pays:
        return Crossover("link bandwidth", tuple(points), None, True,
                         f"disaggregation pays even at {_gbps(BANDWIDTH_GRID[0])}")
    # lowest grid point from which every faster link pays
    i = len(points) - 1
    while i > 0 and points[i - 1].pays:
        i -= 1
    lo, hi = BANDWIDTH_GRID[i - 1], BANDWIDTH_GRID[i]
    for _ in range(refine):
        mid = math.sqrt(lo * hi)
        p = at(mid)
        points.append(p)
        lo, hi = (lo, mid) if p.pays else (mid, hi)
    points.sort(key=lambda p: p.x)
    return Crossover("link bandwidth", tuple(points), hi, True,
                     f"disaggregation stops paying below ~{_gbps(hi)} per worker link")


def prompt_crossover(planner: Planner, prefill_workers: int, scales=PROMPT_SCALES) -> Crossover:
    """Scale every prompt by each factor (arrivals unchanged) and see where disaggregation pays."""
    points = [_point(planner, s, None, planner.trace.scaled(prompt=s), prefill_workers) for s in scales]
    flips = [(a, b) for a, b in pairwise(points) if a.pays != b.pays]
    link = planner.transfer.name
    if not flips:
        verb = "pays at every" if points[0].pays else "does not pay at any"
        return Crossover("prompt scale", tuple(points), None, points[0].pays if points[0].pays else None,
                         f"over {link}, disaggregation {verb} prompt scale x{scales[0]:g}..x{scales[-1]:g}")
    a, b = flips[0]
    more = "" if len(flips) == 1 else f" (and flips {len(flips) - 1} more time(s), see the sweep)"
    side = "above" if b.pays else "below"
    if b.pays:
        text = (f"over {link}, disaggregation starts paying at prompt scale x{b.x:g} (mean prompt "
                f"{b.mean_prompt_tokens:.0f} tokens){more}")
    else:
        text = (f"over {link}, disaggregation stops paying above prompt scale x{a.x:g} (mean prompt "
                f"{a.mean_prompt_tokens:.0f} tokens){more}")
    return Crossover("prompt scale", tuple(points), b.x if b.pays else a.x, side == "above", text)
