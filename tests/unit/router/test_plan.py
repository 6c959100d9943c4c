"""``kvstore router --plan PATH``: the router configuration that ``kvstore plan --search --router-config`` writes,
read back by the router (budgets, the skip-the-prefill-pool rule), reported on /health and /metrics; a bad file
is a clear error of the CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from paths import ROOT

pytest.importorskip("aiohttp")

import aiohttp  # noqa: E402

from kvstore.cli.main import build_parser  # noqa: E402
from kvstore.cli.main import main as kvstore_main  # noqa: E402
from kvstore.cli.router import config_from  # noqa: E402
from kvstore.planner.cli import main as plan_main  # noqa: E402
from kvstore.planner.thresholds import HandoffThresholds  # noqa: E402
from kvstore.router.plan import PlanFileError, load_plan  # noqa: E402
from kvstore.router.request import ClientRequest  # noqa: E402
from kvstore.router.router import Router  # noqa: E402
from kvstore.router.server import serve  # noqa: E402

pytestmark = pytest.mark.timeout(60)
# nothing listens there: the pools' health checks fail fast, the router's own logic is what is tested
POOLS = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9"]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> str:
    """A router configuration written by the planner itself (a small search: well under a second)."""
    path = tmp_path_factory.mktemp("plan") / "router.json"
    rc = plan_main(["--search", "--workload", "short", "--rate", "4", "--num-requests", "60", "--max-gpus", "4",
                    "--slo-ttft", "1.5", "--slo-tpot", "0.05", "--router-config", str(path)])
    assert rc == 0
    return str(path)


def _router(*argv: str) -> Router:
    return Router(config_from(build_parser().parse_args(["router", *POOLS, *argv])))


def _route(router: Router, prompt_tokens: int) -> str:
    req = ClientRequest("/v1/completions", {"prompt": "x"}, "r", True, token_ids=[1] * prompt_tokens)
    return router.plan(req)[0]


def test_the_plan_sets_the_budgets_and_the_skip_rule(plan_file):
    router = _router("--plan", plan_file)
    rule = HandoffThresholds.from_dict(json.load(open(plan_file))["thresholds"])
    low = rule.min_prefill_tokens
    assert low is not None and low > 1  # llama-3-8b on h100 over rdma-100g: a few hundred tokens
    assert (router.config.slo_ttft_s, router.config.slo_tpot_s) == (1.5, 0.05)
    assert router.threshold() == low and router.threshold_source()["source"] == "planner"
    for n in (1, low - 1, low, low + 1, 4 * low):
        assert _route(router, n) == ("skip_short" if n < low else "handoff")
        assert (_route(router, n) == "skip_short") == rule.skip_prefill(n, 0)  # the planner's exact rule


def test_command_line_options_win_over_the_plan(plan_file):
    router = _router("--plan", plan_file, "--skip-prefill-below", "50", "--slo-ttft", "3")
    assert (router.config.slo_ttft_s, router.config.slo_tpot_s) == (3.0, 0.05)
    source = router.threshold_source()
    assert source["source"] == "option" and source["below_tokens"] == 50 and source["plan"]["path"] == plan_file
    assert [_route(router, n) for n in (49, 50)] == ["skip_short", "handoff"]


def test_without_a_plan_the_live_estimate_is_in_force():
    router = _router()
    assert router.threshold_source() == {"below_tokens": router.threshold(), "source": "estimate"}
    assert (router.config.slo_ttft_s, router.config.slo_tpot_s) == (2.0, 0.2)


def test_a_plan_where_the_transfer_never_wins_skips_every_prompt(plan_file, tmp_path):
    doc = json.load(open(plan_file))
    doc["skip_prefill_below_tokens"] = doc["thresholds"]["min_prefill_tokens"] = None
    path = tmp_path / "never.json"
    path.write_text(json.dumps(doc))
    router = _router("--plan", str(path))
    assert router.threshold() is None and _route(router, 100_000) == "skip_short"


def test_health_and_metrics_say_which_threshold_and_from_where(plan_file):
    config = config_from(build_parser().parse_args(["router", *POOLS, "--plan", plan_file, "--listen",
                                                     "127.0.0.1:0"]))
    low = load_plan(plan_file).threshold()

    async def go():
        ready = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(config, ready=ready.set_result))
        port = await asyncio.wait_for(ready, 30)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/health") as r:
                    health = await r.json()
                async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                    metrics = await r.text()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return health, metrics

    health, metrics = asyncio.run(go())
    assert health["skip_prefill_below"] == low
    assert health["skip_prefill"]["source"] == "planner" and health["skip_prefill"]["plan"]["path"] == plan_file
    assert f"kvstore_router_skip_prefill_below_tokens {float(low)}" in metrics
    assert 'kvstore_router_skip_prefill_source{source="planner"} 1.0' in metrics
    assert 'kvstore_router_skip_prefill_source{source="estimate"} 0.0' in metrics


def test_the_held_share_rule_follows_the_plan_the_option_or_the_missing_tokens(plan_file):
    """A prompt the store mostly holds skips the prefill pool: by the planner's exact rule with --plan, by
    --skip-prefill-hit when given, else when the tokens the store lacks would be a short prompt."""
    rule = HandoffThresholds.from_dict(json.load(open(plan_file))["thresholds"])
    planned = _router("--plan", plan_file)
    n = rule.reference_prompt_tokens
    assert planned.hit_fraction() == rule.skip_hit_fraction
    for held in (0, n // 4, n // 2, 3 * n // 4, n):
        assert planned.skips_held(n, held) == (held > 0 and rule.skip_prefill(n, held))
    assert not planned.skips_held(n, 0) and planned.skips_held(n, n)
    option = _router("--plan", plan_file, "--skip-prefill-hit", "0.5")
    assert option.hit_fraction() == 0.5
    assert [option.skips_held(1000, h) for h in (0, 499, 500, 1000)] == [False, False, True, True]
    below = _router("--skip-prefill-below", "100")
    assert below.hit_fraction() is None
    assert [below.skips_held(1000, h) for h in (0, 900, 901, 2000)] == [False, False, True, True]


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_skip_prefill_hit_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="skip_prefill_hit"):
        _router("--skip-prefill-hit", value)


def _broken(plan_file: str, tmp_path, change) -> str:
    doc = json.load(open(plan_file))
    change(doc)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("change, problem", [
    (lambda d: d.pop("thresholds"), "no 'thresholds'"),
    (lambda d: d["thresholds"].pop("cost"), "handoff-thresholds"),
    (lambda d: d.update(slo_ttft=0), "'slo_ttft' must be a number of seconds > 0"),
    (lambda d: d.update(skip_prefill_below_tokens=7), "differs from thresholds.min_prefill_tokens"),
    (lambda d: d.update(decode="two"), "'decode' must be a worker count"),
])
def test_a_malformed_plan_names_the_file_and_the_problem(plan_file, tmp_path, capsys, change, problem):
    path = _broken(plan_file, tmp_path, change)
    with pytest.raises(PlanFileError, match=problem):
        load_plan(path)
    assert kvstore_main(["router", *POOLS, "--plan", path]) == 2
    err = capsys.readouterr().err
    assert path in err and problem in err


def test_cli_refuses_a_file_that_is_not_json_or_not_there(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    for path, problem in ((bad, "not JSON"), (tmp_path / "missing.json", "cannot read it")):
        run = subprocess.run([sys.executable, "-m", "kvstore.cli", "router", *POOLS, "--plan", str(path)],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert run.returncode != 0 and str(path) in run.stderr and problem in run.stderr, run.stderr
        assert "Traceback" not in run.stderr
