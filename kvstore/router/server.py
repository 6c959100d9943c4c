"""The router's HTTP server (aiohttp): the OpenAI endpoints, /health, /metrics, and the health checks of the
instances and of the kvstore daemon."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

import aiohttp
from aiohttp import web

from kvstore.router.admission import Refused
from kvstore.router.config import RouterConfig
from kvstore.router.hops import HopError, InstanceAnswer
from kvstore.router.plan import SOURCES
from kvstore.router.pool import Instance, Pool
from kvstore.router.request import CHAT, COMPLETIONS, RequestError, parse
from kvstore.router.router import Router

log = logging.getLogger("kvstore.router")


def _error(status: int, message: str, kind: str, retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class RouterApp:
    def __init__(self, router: Router):
        self.router = router
        self.tasks: list[asyncio.Task] = []
        self.app = web.Application(client_max_size=64 << 20)
        self.app.add_routes([web.post(COMPLETIONS, self.completion), web.post(CHAT, self.completion),
                             web.get("/v1/models", self.models), web.get("/health", self.health),
                             web.get("/metrics", self.metrics)])
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    # -- endpoints -----------------------------------------------------------------------------------------
    async def completion(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        r, endpoint = self.router, request.path
        try:
            req = parse(endpoint, await request.read(), request.headers)
            self._check_model(req.body)
            resp = await r.serve(req, request, arrived)
        except RequestError as exc:
            resp = web.json_response(exc.body(), status=exc.status)
        except InstanceAnswer as exc:
            resp = web.Response(status=exc.status, body=exc.body, content_type="application/json")
        except Refused as exc:
            kind = "RateLimitError" if exc.status == 429 else "ServiceUnavailableError"
            resp = _error(exc.status, str(exc), kind, exc.retry_after_s)
        except HopError as exc:
            resp = _error(503, str(exc), "ServiceUnavailableError", 1)
        except (asyncio.CancelledError, ConnectionResetError):
            r.metrics.disconnects.inc()  # leaving the hop's `async with` closed its connection: aborted there
            r.metrics.requests.labels(endpoint, "499").inc()
            raise
        r.metrics.requests.labels(endpoint, str(resp.status)).inc()
        return resp

    def _check_model(self, body: dict) -> None:
        known = self.router.models()
        model = body.get("model")
        if model is not None and known and model not in known:
            raise RequestError(f"The model `{model}` does not exist; served: {sorted(known)}", 404,
                               "NotFoundError", "model")

    async def models(self, request: web.Request) -> web.Response:
        cards, seen = [], set()
        for pool in self.router.pools:
            for inst in pool.instances:
                for card in inst.cards:
                    if card.get("id") not in seen:
                        seen.add(card.get("id"))
                        cards.append(card)
        if not cards:
            return _error(503, "no instance has answered /v1/models yet", "ServiceUnavailableError", 1)
        return web.json_response({"object": "list", "data": cards})

    async def health(self, request: web.Request) -> web.Response:
        r = self.router
        pools = {p.role.value: {"live": len(p.live()), "instances": len(p.instances)} for p in r.pools}
        ok = bool(r.decode.live() or r.colocated.live())
        body = {"status": "ok" if ok else "unavailable", "pools": pools, "store_up": r.store_up,
                "skip_prefill_below": r.threshold(), "skip_prefill": r.threshold_source(),
                "skip_prefill_hit": r.hit_fraction(),
                "estimates": r.est.describe()}
        return web.json_response(body, status=200 if ok else 503, headers={} if ok else {"Retry-After": "1"})

    async def metrics(self, request: web.Request) -> web.Response:
        r = self.router
        for pool in r.pools:
            for inst in pool.instances:
                r.metrics.instance_up.labels(pool.role.value, inst.url).set(1 if inst.healthy else 0)
                r.metrics.outstanding.labels(pool.role.value, inst.url).set(inst.outstanding_tokens())
        r.metrics.store_up.set(-1 if r.store_up is None else int(r.store_up))
        below, source = r.threshold(), r.threshold_source()["source"]
        r.metrics.threshold.set(float("inf") if below is None else below)
        hit = r.hit_fraction()
        r.metrics.hit_threshold.set(-1 if hit is None else hit)
        for name in SOURCES:
            r.metrics.threshold_source.labels(name).set(1 if name == source else 0)
        return web.Response(body=r.metrics.render(), content_type="text/plain", charset="utf-8")

    # -- health checks -------------------------------------------------------------------------------------
    async def _start(self, app: web.Application) -> None:
        await self.router.hops.start()
        await self.check_all()  # know the models and who is up before the first request
        self.tasks.append(asyncio.create_task(self._checks()))

    async def _stop(self, app: web.Application) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.router.hops.close()
        if self.router.index is not None:
            await asyncio.to_thread(self.router.index.close)

    async def _checks(self) -> None:
        while True:
            await asyncio.sleep(self.router.config.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop the checks for good
                log.exception("health checks failed")

    async def check_all(self) -> None:
        checks = [self._check(p, i) for p in self.router.pools for i in p.instances]
        if self.router.config.store:
            checks.append(self._check_store())
        await asyncio.gather(*checks)
        r = self.router
        if r.index is not None and r.store_up:  # the layouts the model's blocks are stored under
            await r.index.refresh({c["root"] for p in r.pools for i in p.instances for c in i.cards
                                   if isinstance(c.get("root"), str)})
        await self.router.admission.release()

    async def _check(self, pool: Pool, inst: Instance) -> None:
        limit = min(self.router.config.health_interval_s, self.router.config.connect_timeout_s)
        hops = self.router.hops
        try:
            await hops.get_json(inst.url + "/health", limit)
            if not inst.cards:
                answer = await hops.get_json(inst.url + "/v1/models", limit)
                inst.cards = [c for c in answer.get("data", []) if isinstance(c, dict)]
                inst.models = tuple(str(c.get("id")) for c in inst.cards)
                lens = [c["max_model_len"] for c in inst.cards if isinstance(c.get("max_model_len"), int)]
                inst.max_model_len = min(lens) if lens else None
            ok = True
        except (HopError, asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            log.debug("health check of %s failed: %s", inst.url, exc)
            ok = False
        was = inst.healthy
        pool.checked(inst, ok)
        if was and not inst.healthy:
            self.router.metrics.ejections.labels(pool.role.value).inc()
            log.warning("%s instance %s ejected (health check)", pool.role.value, inst.url)
        elif inst.healthy and not was:
            log.warning("%s instance %s readmitted", pool.role.value, inst.url)

    async def _check_store(self) -> None:
        up = await asyncio.to_thread(_store_answers, self.router.config.store,
                                     min(self.router.config.health_interval_s, 2.0))
        if up != self.router.store_up:
            level = logging.INFO if up and self.router.store_up is None else logging.WARNING
            log.log(level, "kvstore daemon at %s is %s", self.router.config.store, "up" if up else "DOWN")
        self.router.store_up = up


def _store_answers(url: str, timeout: float) -> bool:
    from kvstore.api import connect
    from kvstore.errors import KVStoreError

    try:
        with connect(url, timeout=timeout, transport="tcp", client_name="kvstore-router") as store:
            store.stats()
        return True
    except (KVStoreError, OSError, ValueError):
        return False


async def serve(config: RouterConfig, router: Router | None = None, ready=None) -> None:
    """Run until cancelled (or SIGINT/SIGTERM when run by :func:`run`). ``ready(port)`` is called once listening."""
    router = router or Router(config)
    runner = web.AppRunner(RouterApp(router).app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else config.port
    log.info("kvstore router on http://%s:%d (%s)", config.host, port, json.dumps(_summary(router)))
    if ready is not None:
        ready(port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def _summary(router: Router) -> dict:
    c = router.config
    return {"prefill": list(c.prefill), "decode": list(c.decode), "colocated": list(c.colocated),
            "store": c.store, "admission": c.admission.value, "slo_ttft_s": c.slo_ttft_s, "slo_tpot_s": c.slo_tpot_s,
            "skip_prefill": router.threshold_source()}


def run(config: RouterConfig, router: Router | None = None) -> int:
    """Serve in this thread until SIGINT or SIGTERM."""

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await serve(config, router)
        except asyncio.CancelledError:
            pass

    try:  # the `fast` extra: uvloop's loop costs the router less CPU per request than asyncio's
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
    return 0
