"""``python -m benchmarks.pd validate-planner``: the planner's validation against the small engine.

Serves the same short trace on the three deployments (or reads existing run directories with ``--runs``),
calibrates the cost model on the measured steps, replays each run through the simulator and reports measured
against simulated TTFT and TPOT p50. A measurement, not a test: on a loaded machine step costs move with what
else competes for the cores, so its result is reported (exit status 1 outside ``--tolerance``) instead of
asserted in the test suite, which checks the calibration arithmetic on synthetic runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kvstore.planner import presets
from kvstore.planner.calibrate import RunComparison, calibrate, compare_run
from kvstore.workloads.runlog import read_run

ARCHS = ("colocated", "chunked", "disaggregated")


def add_validate_parser(sub) -> None:
    v = sub.add_parser("validate-planner", help="calibrate the planner on the small engine and compare p50s",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("--runs", nargs="+", type=Path, metavar="DIR",
                   help="existing run directories (python -m benchmarks.pd run --out DIR); default: run the three "
                        "deployments now")
    v.add_argument("--num-requests", type=int, default=32)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--workload", default="short")
    v.add_argument("--tolerance", type=float, default=0.25, help="relative error allowed on each p50")
    v.add_argument("--json", type=Path, help="also write the comparison here")


def _measure(args: argparse.Namespace, root: Path) -> list[Path]:
    dirs = []
    for arch in ARCHS:
        out = root / arch
        subprocess.run([sys.executable, "-m", "benchmarks.pd", "run", "--arch", arch, "--workload", args.workload,
                        "--num-requests", str(args.num_requests), "--seed", str(args.seed), "--out", str(out)],
                       check=True)
        dirs.append(out)
    return dirs


def validate(dirs: list[Path]) -> list[RunComparison]:
    """Calibrate on all runs, then replay each under step costs fitted to its own steps (see compare_run)."""
    runs = [read_run(d) for d in dirs]
    fit = calibrate(runs, presets.CALIBRATED[("pd-tiny", "cpu-2core")])
    return [compare_run(run, fit.cost, fit.transfer, per_run=True) for run in runs]


def table(results: list[RunComparison], tolerance: float) -> str:
    lines = [f"{'arch':<14} {'requests':>8} {'TTFT p50 ms meas/sim':>22} {'err':>7} {'TPOT p50 ms meas/sim':>22} "
             f"{'err':>7}  within {tolerance:.0%}"]
    for r in results:
        ok = abs(r.ttft_error) < tolerance and abs(r.tpot_error) < tolerance
        ttft = f"{1e3 * r.measured_ttft_p50:>10.1f}/{1e3 * r.simulated_ttft_p50:<11.1f}"
        tpot = f"{1e3 * r.measured_tpot_p50:>10.2f}/{1e3 * r.simulated_tpot_p50:<11.2f}"
        lines.append(f"{r.arch:<14} {r.requests:>8} {ttft} {r.ttft_error:>+7.1%} {tpot} {r.tpot_error:>+7.1%}  "
                     f"{'yes' if ok else 'NO'}")
    return "\n".join(lines)


def main_validate(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="pd-validate-") as tmp:
        dirs = args.runs or _measure(args, Path(tmp))
        results = validate(dirs)
    print(table(results, args.tolerance))
    if args.json:
        args.json.write_text(json.dumps([{**dataclasses.asdict(r), "ttft_error": r.ttft_error,
                                          "tpot_error": r.tpot_error} for r in results], indent=2))
    within = all(abs(r.ttft_error) < args.tolerance and abs(r.tpot_error) < args.tolerance for r in results)
    return 0 if within else 1
