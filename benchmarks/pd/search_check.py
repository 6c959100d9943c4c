"""``python -m benchmarks.pd check-search``: the planner's fleet search against the small engine.

Serves one trace on this machine's two cores as 2 colocated workers, 2 chunked workers and 1 prefill + 1
decode worker (or reads existing run directories with ``--runs``), fits the cost model to those runs
(``kvstore plan --calibrate``), runs ``kvstore plan --search`` on the measured trace with at most 2 workers,
and prints, per architecture, the SLO attainment measured against the one the search's simulator predicts
for the same deployment, and whether the search's answer (meets with at most 2 workers, or not) agrees
with the measurement. A measurement, not a test:
on a shared machine step costs move with what else competes for the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from kvstore.planner import presets
from kvstore.planner.calibrate import calibrate
from kvstore.planner.deployment import deployment_of
from kvstore.planner.plan import PlanConfig
from kvstore.planner.probe import Prober
from kvstore.planner.search import FleetSearch
from kvstore.workloads.runlog import RunLog, read_run
from kvstore.workloads.slo import SLO, judge

ARCHS = ("colocated", "chunked", "disaggregated")


def add_check_search_parser(sub) -> None:
    p = sub.add_parser("check-search", help="plan --search on the small engine, against measured runs",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", type=Path, metavar="DIR", help="existing run directories (default: run "
                   "the three deployments now)")
    p.add_argument("--out", type=Path, help="keep the measured runs here (for --runs later, e.g. other SLOs)")
    p.add_argument("--workload", default="mixed")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--json", type=Path, help="also write the comparison here")


def _measure(args: argparse.Namespace, root: Path) -> list[Path]:
    dirs = []
    for arch in ARCHS:
        out = root / arch
        subprocess.run([sys.executable, "-m", "benchmarks.pd", "run", "--arch", arch, "--workload", args.workload,
                        "--num-requests", str(args.num_requests), "--seed", str(args.seed), "--out", str(out),
                        "--no-progress"], check=True)
        dirs.append(out)
    return dirs


def measured_attainment(run: RunLog, slo: SLO) -> float:
    """Share of the run's requests that met both limits (unfinished ones count as misses), by the SLO's one
    accounting (every request held to it, as the planner's simulation does)."""
    outcomes = [(r.ttft_s, r.tpot_s, "interactive") for r in run.requests]
    return judge(slo, outcomes + [(None, None, "interactive")] * run.unfinished, duration_s=0.0).attainment


def check(runs: list[RunLog], slo: SLO) -> dict:
    fit = calibrate(runs, presets.CALIBRATED[("pd-tiny", "cpu-2core")])
    first = deployment_of(runs[0])
    cost = fit.cost
    if runs[0].kv_capacity_tokens:
        cost = replace(cost, kv_capacity_tokens=runs[0].kv_capacity_tokens)
    chunk = next((deployment_of(r).chunk_tokens for r in runs if r.arch and r.arch.value == "chunked"), 512)
    config = PlanConfig(model=presets.get_model("pd-tiny"), gpu=presets.get_gpu("cpu-2core"),
                        link=presets.get_link("shm"), gpus=2, slo=slo, cost=cost, transfer=fit.transfer,
                        chunk_tokens=chunk, max_batch=first.max_batch, max_prefill_tokens=first.max_prefill_tokens)
    prober = Prober(config, runs[0].trace())
    result = FleetSearch(config, prober, max_gpus=2, chunk_choices=(chunk,)).run()
    rows = []
    for run in runs:
        dep = deployment_of(run)
        simulated = prober.probe(dep, prober.base_rate, full=True).metrics.slo_attainment
        measured = measured_attainment(run, slo)
        gpus = result.plans[dep.arch].gpus
        # the search's answer for this architecture (it meets with <= 2 workers or not) against the run's
        rows.append({"arch": dep.arch.value, "deployment": dep.label, "measured": measured,
                     "simulated": simulated, "search_gpus": gpus,
                     "agrees": (gpus is not None) == (measured >= slo.attainment)})
    return {"slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
            "rows": rows, "search_winner": result.winner.value if result.winner else None,
            "measured_meeting": [r["arch"] for r in rows if r["measured"] >= slo.attainment],
            "fit_error": {"prefill": fit.prefill_error, "decode": fit.decode_error},
            "load_average": os.getloadavg()}


def main_check_search(args: argparse.Namespace) -> int:
    slo = SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot)
    with tempfile.TemporaryDirectory(prefix="pd-check-search-") as tmp:
        dirs = args.runs or _measure(args, args.out or Path(tmp))
        doc = check([read_run(d) for d in dirs], slo)
    print(f"SLO TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s * 1e3:g} ms; load average "
          f"{' '.join(f'{x:.1f}' for x in doc['load_average'])}; fit error prefill "
          f"{doc['fit_error']['prefill']:.0%}, decode {doc['fit_error']['decode']:.0%}")
    print(f"{'deployment':<34} {'measured':>9} {'simulated':>10} {'search: fewest workers':>23}  agrees")
    for r in doc["rows"]:
        print(f"{r['deployment']:<34} {r['measured']:>9.1%} {r['simulated']:>10.1%} "
              f"{r['search_gpus'] if r['search_gpus'] else 'none <= 2':>23}  {'yes' if r['agrees'] else 'NO'}")
    print(f"search winner: {doc['search_winner']}; meeting the SLO as measured: "
          f"{', '.join(doc['measured_meeting']) or 'none'}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    return 0
