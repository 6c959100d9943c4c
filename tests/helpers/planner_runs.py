"""Runs in the small engine's run-log format, made by the planner's simulator under known coefficients: the
planner's calibration tests and the engine's validate-planner test share them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvstore.planner import presets
from kvstore.planner.costmodel import TransferModel
from kvstore.planner.deployment import Arch, Deployment
from kvstore.planner.simulator import Simulator
from kvstore.workloads.runlog import write_run
from kvstore.workloads.trace import get_workload, poisson

TRUE_COST = replace(presets.CALIBRATED[("pd-tiny", "cpu-2core")], base_s=2e-3, weight_s=5e-3, token_s=3e-4,
                    seq_s=8e-4, pair_s=5e-8, ctx_s=3e-7, overlap=0.0)
TRUE_LINK = TransferModel("shm", 3e-4, 2e9)


def write_synthetic_runs(root: Path) -> list[Path]:
    """One run directory under ``root`` per architecture (colocated, chunked, disaggregated), in that order."""
    trace = poisson(get_workload("mixed"), 1.0, 50, seed=3).scaled(output=0.5)
    dirs = []
    for dep in (Deployment(Arch.COLOCATED, 1), Deployment(Arch.CHUNKED, 1),
                Deployment(Arch.DISAGGREGATED, 2, prefill_workers=1)):
        res = Simulator(TRUE_COST, dep, TRUE_LINK, record_tokens=True).run(trace)
        write_run(root / dep.arch.value, res)
        dirs.append(root / dep.arch.value)
    return dirs
