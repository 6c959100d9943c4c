"""Admission control and the router's estimates, as pure logic (no instances, no sockets)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("aiohttp")

from kvstore.router.admission import Admission, Refused, Stage  # noqa: E402
from kvstore.router.config import AdmissionKind, RouterConfig  # noqa: E402
from kvstore.router.estimates import Estimates, handoff_threshold  # noqa: E402
from kvstore.router.pool import Load, Pool, Role  # noqa: E402

pytestmark = pytest.mark.timeout(30)
URLS = ("http://a:1", "http://b:2")


def config(kind=AdmissionKind.BUDGET, **kw) -> RouterConfig:
    return RouterConfig(prefill=URLS, decode=URLS, admission=kind, health_interval_s=0.05, **kw)


def run(coro):
    return asyncio.run(coro)


def test_none_sends_at_once_to_the_least_loaded_instance():
    async def go():
        adm, pool = Admission(config(AdmissionKind.NONE), Estimates()), Pool(Role.PREFILL, URLS)
        pool.instances[0].prefilling["x"] = Load(1000, 10)
        return await adm.admit(pool, Stage.PREFILL, Load(5000, 10), deadline=0)

    assert run(go()).url == URLS[1]


def test_budget_refuses_with_429_when_the_ttft_budget_cannot_be_met():
    async def go():
        est = Estimates(prefill_s_per_token=1e-3)
        adm, pool = Admission(config(slo_ttft_s=0.2), est), Pool(Role.PREFILL, URLS)
        for inst in pool.instances:  # 1 s of prefill queued on each
            inst.prefilling["busy"] = Load(1000, 1)
        loop = asyncio.get_running_loop()
        with pytest.raises(Refused) as err:
            await adm.admit(pool, Stage.PREFILL, Load(100, 1), deadline=loop.time() + 0.2)
        return err.value

    refused = run(go())
    assert refused.status == 429 and refused.retry_after_s >= 1


def test_a_waiting_request_is_bound_to_the_instance_that_frees_up():
    async def go():
        adm, pool = Admission(config(slo_ttft_s=10), Estimates(prefill_s_per_token=1.0)), Pool(Role.PREFILL, URLS)
        for inst in pool.instances:
            inst.prefilling["busy"] = Load(1000, 1)
        loop = asyncio.get_running_loop()
        waiter = asyncio.create_task(adm.admit(pool, Stage.PREFILL, Load(100, 1), deadline=loop.time() + 10))
        await asyncio.sleep(0.1)
        assert not waiter.done() and adm.queued(Stage.PREFILL) == 1
        del pool.instances[1].prefilling["busy"]
        await adm.release()
        return await asyncio.wait_for(waiter, 5)

    assert run(go()).url == URLS[1]


def test_background_only_fills_slack_and_is_shed_first():
    async def go():
        adm = Admission(config(slo_ttft_s=0.1, background_max_wait_s=0.3), Estimates(prefill_s_per_token=1.0))
        pool = Pool(Role.PREFILL, URLS[:1])
        idle = await adm.admit(pool, Stage.PREFILL, Load(10, 1, interactive=False), deadline=0)
        pool.instances[0].prefilling["busy"] = Load(10, 1)
        loop = asyncio.get_running_loop()
        with pytest.raises(Refused) as err:  # the instance has work queued: no slack for background
            await adm.admit(pool, Stage.PREFILL, Load(10, 1, interactive=False), deadline=loop.time() + 100)
        return idle, err.value

    idle, refused = run(go())
    assert idle.url == URLS[0] and refused.status == 429


def test_decode_queue_holds_the_tpot_budget():
    async def go():
        est = Estimates(step_base_s=0.01, step_per_seq_s=0.01)  # step(n) = 10 ms + 10 ms a sequence
        adm, pool = Admission(config(slo_tpot_s=0.05), est), Pool(Role.DECODE, URLS[:1])
        inst = pool.instances[0]
        for i in range(3):  # 3 running: adding one predicts 50 ms, within budget
            inst.decoding[str(i)] = Load(10, 10)
        got = await adm.admit(pool, Stage.DECODE, Load(10, 10), deadline=asyncio.get_running_loop().time() + 1)
        inst.decoding["3"] = Load(10, 10)  # a fifth would predict 60 ms
        with pytest.raises(Refused) as err:
            await adm.admit(pool, Stage.DECODE, Load(10, 10), deadline=asyncio.get_running_loop().time() + 0.1)
        return got, err.value

    got, refused = run(go())
    assert got.url == URLS[0] and refused.status == 429


def test_no_live_instance_is_503():
    async def go():
        adm, pool = Admission(config(), Estimates()), Pool(Role.DECODE, URLS)
        for inst in pool.instances:
            inst.healthy = False
        with pytest.raises(Refused) as err:
            await adm.admit(pool, Stage.DIRECT, Load(10, 10), deadline=0)
        return err.value

    assert run(go()).status == 503


def test_estimates_fit_the_step_time_line():
    est = Estimates(step_base_s=0.5)
    for _ in range(5):
        for batch in (1, 2, 4, 8):
            est.observe_step(batch, 0.02 + 0.005 * batch)
    assert est.step_base_s == pytest.approx(0.02, rel=1e-3)
    assert est.step_per_seq_s == pytest.approx(0.005, rel=1e-3)


def test_handoff_threshold_is_at_least_one_block_and_grows_with_the_hop_cost():
    cheap = Estimates(prefill_s_per_token=1e-3, hop_overhead_s=1e-3)
    dear = Estimates(prefill_s_per_token=1e-3, hop_overhead_s=1.0)
    assert handoff_threshold(cheap, block_tokens=16) == 17
    assert handoff_threshold(dear, block_tokens=16) == 1000


@pytest.mark.parametrize("kw", [{"prefill": URLS}, {}, {"colocated": ("ftp://x",)}, {"colocated": URLS,
                                                                                       "slo_ttft_s": 0}])
def test_config_refuses_bad_values(kw):
    with pytest.raises(ValueError):
        RouterConfig(**kw)
