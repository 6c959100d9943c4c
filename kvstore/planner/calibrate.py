"""Fitting the cost model to measured runs, and checking the simulator against them.

Step samples come from :mod:`kvstore.planner.samples`; transfers are the (kv_bytes, transfer_s) pairs of
disaggregated runs. The step formula is linear in its coefficients once it is known whether compute or
memory is the smaller part of each step, so the fit alternates: assign regimes, solve non-negative least
squares on relative error, re-assign, for each overlap in a small grid, keeping the best.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from kvstore.planner.costmodel import CostModel, TransferModel
from kvstore.planner.deployment import Arch, deployment_of
from kvstore.planner.samples import StepSample, decode_samples, prefill_samples
from kvstore.workloads.runlog import RunLog
from kvstore.workloads.stats import median

OVERLAPS = (0.0, 0.25, 0.5, 0.75, 1.0)
_COEFS = ("base_s", "weight_s", "token_s", "seq_s", "pair_s", "ctx_s")


@dataclass(frozen=True, slots=True)
class Fit:
    """A fitted cost model and how well it explains the samples (relative RMS error per kind)."""

    cost: CostModel
    transfer: TransferModel | None
    prefill_samples: int
    decode_samples: int
    transfer_samples: int
    prefill_error: float
    decode_error: float
    transfer_error: float
    notes: tuple[str, ...] = ()


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 by dropping the most negative coefficient until none is left."""
    free = [j for j in range(a.shape[1]) if np.any(a[:, j])]
    x = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            x[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return x


def _design(samples: list[StepSample], overlap: float, compute_smaller: np.ndarray) -> np.ndarray:
    rows = []
    for s, small_c in zip(samples, compute_smaller, strict=True):
        fc, fm = (1 - overlap, 1.0) if small_c else (1.0, 1 - overlap)
        rows.append([1.0, fm, fc * s.prefill_tokens, fc * s.decode_seqs, fc * s.pairs, fm * s.decode_ctx])
    return np.array(rows)


def _regimes(samples: list[StepSample], x: np.ndarray) -> np.ndarray:
    _, weight, token, seq, pair, ctx = x
    return np.array([token * s.prefill_tokens + seq * s.decode_seqs + pair * s.pairs
                     <= weight + ctx * s.decode_ctx for s in samples])


def _fit_overlap(samples: list[StepSample], overlap: float) -> tuple[np.ndarray, float]:
    y = np.array([s.seconds for s in samples])
    # Absolute errors within a kind (so a fitted decode step matches the *mean* gap, which is what TPOT
    # averages, noise spikes included), each kind scaled by its median so long prefills do not drown
    # the many short decode steps.
    kinds = np.array([s.kind for s in samples])
    scale = np.ones(len(y))
    for kind in set(kinds):
        scale[kinds == kind] = median(y[kinds == kind])
    regime = np.array([s.kind == "decode" for s in samples])  # decode steps start memory-bound
    x = np.zeros(len(_COEFS))
    for _ in range(20):
        x = _nnls(_design(samples, overlap, regime) / scale[:, None], y / scale)
        new = _regimes(samples, x)
        if (new == regime).all():
            break
        regime = new
    predicted = np.array([_predict(s, x, overlap) for s in samples])
    return x, float(np.sqrt(np.mean(((predicted - y) / scale) ** 2)))  # the objective minimised above


def _predict(s: StepSample, x: np.ndarray, overlap: float) -> float:
    base, weight, token, seq, pair, ctx = x
    c = token * s.prefill_tokens + seq * s.decode_seqs + pair * s.pairs
    m = weight + ctx * s.decode_ctx
    return base + c + m - overlap * min(c, m)


def _rel_rms(samples: list[StepSample], x: np.ndarray, overlap: float) -> float:
    if not samples:
        return math.nan
    err = [(_predict(s, x, overlap) - s.seconds) / s.seconds for s in samples]
    return float(np.sqrt(np.mean(np.square(err))))


def fit_transfer(runs: list[RunLog]) -> tuple[TransferModel | None, int, float]:
    """Least squares of latency + bytes / bandwidth on (kv_bytes, transfer_s) of the handed-off requests,
    in relative terms; ``publish_share`` from the runs' publish times when they record them."""
    moved = [r for run in runs for r in run.requests if r.kv_bytes > 0 and r.transfer_s > 0]
    if len(moved) < 2:
        return None, len(moved), math.nan
    b = np.array([r.kv_bytes for r in moved], dtype=float)
    t = np.array([r.transfer_s for r in moved], dtype=float)
    scale = median(t)
    lat, inv_bw = _nnls(np.column_stack([np.ones(len(b)), b]) / scale, t / scale)
    if inv_bw <= 0:  # sizes too alike or fixed costs dominate: latency only, bandwidth unbounded
        inv_bw = 1e-15
    share = float(sum(r.publish_s for r in moved) / t.sum())
    model = TransferModel("calibrated", latency_s=float(lat), bytes_per_s=float(1 / inv_bw),
                          publish_share=min(1.0, share))
    err = float(np.sqrt(np.mean(((lat + inv_bw * b) - t) ** 2 / t**2)))
    return model, len(moved), err


def calibrate(runs: list[RunLog], template: CostModel) -> Fit:
    """Fit ``template``'s step coefficients (memory and geometry fields are kept, except KV bytes per
    token, taken from the runs when they record it) to the measured ``runs``."""
    if not runs:
        raise ValueError("calibration needs at least one run directory")
    steps = [s for run in runs for s in prefill_samples(run) + decode_samples(run)]
    pre = [s for s in steps if s.kind != "decode"]
    dec = [s for s in steps if s.kind == "decode"]
    notes = []
    if len(dec) < 3:
        raise ValueError(f"only {len(dec)} clean decode steps in {[r.path for r in runs]}; need >= 3 "
                         f"(longer outputs or lighter load help)")
    if not pre:
        notes.append("no steps with prompt work (chunked runs without timeline.jsonl): prefill "
                     "coefficients kept from the template")
    best = min((_fit_overlap(steps, o) + (o,) for o in OVERLAPS), key=lambda t: (t[1], t[2]))
    x, _, overlap = best
    coefs = dict(zip(_COEFS, map(float, x), strict=True))
    if overlap == 0:  # base and weight reads are then indistinguishable: report them as one fixed cost
        coefs.update(base_s=coefs["base_s"] + coefs["weight_s"], weight_s=0.0)
    if not pre:
        coefs.update(token_s=template.token_s, pair_s=template.pair_s)
    recorded = {run.find("kv_bytes_per_token") for run in runs} - {None}
    kv = [r.kv_bytes / r.prompt_tokens for run in runs for r in run.requests if r.kv_bytes > 0]
    kv_per_token = int(min(recorded)) if recorded else \
        int(round(median(kv))) if kv else template.kv_bytes_per_token
    capacities = {run.kv_capacity_tokens for run in runs} - {None}
    capacity = min(capacities) if capacities else template.kv_capacity_tokens
    cost = replace(template, name=f"{template.name.split(' ')[0]} (calibrated on {len(runs)} run(s))",
                   overlap=overlap, kv_bytes_per_token=kv_per_token, kv_capacity_tokens=capacity, **coefs)
    transfer, n_transfer, transfer_err = fit_transfer(runs)
    return Fit(cost=cost, transfer=transfer, prefill_samples=len(pre), decode_samples=len(dec),
               transfer_samples=n_transfer, prefill_error=_rel_rms(pre, x, overlap),
               decode_error=_rel_rms(dec, x, overlap), transfer_error=transfer_err, notes=tuple(notes))


@dataclass(frozen=True, slots=True)
class RunComparison:
    """Measured against simulated p50s for one run (relative errors: simulated / measured - 1)."""

    path: str
    arch: str
    requests: int
    per_run: bool
    measured_ttft_p50: float
    simulated_ttft_p50: float
    measured_tpot_p50: float
    simulated_tpot_p50: float

    @property
    def ttft_error(self) -> float:
        return self.simulated_ttft_p50 / self.measured_ttft_p50 - 1

    @property
    def tpot_error(self) -> float:
        return self.simulated_tpot_p50 / self.measured_tpot_p50 - 1


def compare_run(run: RunLog, cost: CostModel, transfer: TransferModel | None,
                per_run: bool = False) -> RunComparison:
    """Replay ``run``'s arrivals and lengths through its own deployment under ``cost`` and compare.

    ``per_run`` first refits the step coefficients to this run's own steps (keeping ``cost``'s where the
    run has no samples for them). On a shared CPU the cost of a step depends on what else competes for the
    cores in that run, so this isolates what the comparison is meant to check: the simulator's queueing,
    batching and interference given the step costs."""
    from kvstore.planner.simulator import Simulator  # the simulator is only needed for validation

    if per_run:
        fit = calibrate([run], cost)
        cost, transfer = fit.cost, fit.transfer or transfer
    dep = deployment_of(run)
    if dep.arch is Arch.DISAGGREGATED and transfer is None:
        raise ValueError(f"{run.path}: a disaggregated run needs a transfer model (none could be fitted)")
    if run.kv_capacity_tokens:
        cost = replace(cost, kv_capacity_tokens=run.kv_capacity_tokens)
    sim = Simulator(replace(cost, tp=dep.tp), dep, transfer).run(run.trace())
    tpots = [r.tpot_s for r in run.requests if r.tpot_s is not None]
    sim_tpots = [r.tpot_s for r in sim.requests if r.tpot_s is not None]
    if not tpots or not sim_tpots:
        raise ValueError(f"{run.path}: no request has two or more output tokens; TPOT cannot be compared")
    return RunComparison(
        path=run.path, arch=dep.arch.value, requests=len(run.requests), per_run=per_run,
        measured_ttft_p50=median([r.ttft_s for r in run.requests]),
        simulated_ttft_p50=median([r.ttft_s for r in sim.requests if not r.rejected]),
        measured_tpot_p50=median(tpots), simulated_tpot_p50=median(sim_tpots))
