"""``kvstore router`` / ``kvstore pd up`` options into a RouterConfig (no processes)."""

from __future__ import annotations

import pytest

from kvstore.cli.main import build_parser
from kvstore.cli.router import config_from
from kvstore.router.config import AdmissionKind


def test_router_options_become_the_config():
    args = build_parser().parse_args([
        "router", "--prefill", "http://p:1/", "--decode", "http://d:2", "--decode", "http://d:3",
        "--store", "unix:///tmp/s.sock", "--listen", "0.0.0.0:9000", "--admission", "budget", "--slo-ttft", "0.5",
        "--slo-tpot", "0.05", "--skip-prefill-below", "300", "--eject-after", "3", "--prefill-attempts", "1",
        "--background-max-wait", "7", "--max-queue", "10"])
    c = config_from(args)
    assert c.prefill == ("http://p:1",) and c.decode == ("http://d:2", "http://d:3") and c.colocated == ()
    assert (c.host, c.port, c.store) == ("0.0.0.0", 9000, "unix:///tmp/s.sock")
    assert c.admission is AdmissionKind.BUDGET and (c.slo_ttft_s, c.slo_tpot_s) == (0.5, 0.05)
    assert (c.skip_prefill_below, c.eject_after, c.prefill_attempts, c.max_wait_s, c.max_queue) == (300, 3, 1, 7, 10)


def test_pd_up_builds_its_pools_itself():
    args = build_parser().parse_args(["pd", "up", "--model", "/m", "--prefill", "2", "--decode", "1"])
    c = config_from(args, prefill=("http://127.0.0.1:8100", "http://127.0.0.1:8101"),
                    decode=("http://127.0.0.1:8102",), colocated=(), store="unix:///x.sock")
    assert len(c.prefill) == 2 and c.store == "unix:///x.sock" and c.admission is AdmissionKind.NONE


@pytest.mark.parametrize("argv", [
    ["router", "--prefill", "http://p:1"],  # a prefill pool without a decode pool
    ["router", "--colocated", "p:1"],  # not a URL
    ["router", "--colocated", "http://p:1", "--listen", "nowhere"],
    ["router", "--colocated", "http://p:1", "--eject-after", "0"],
])
def test_bad_router_options_are_refused(argv):
    with pytest.raises(ValueError):
        config_from(build_parser().parse_args(argv))
