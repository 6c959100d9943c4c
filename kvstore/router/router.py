"""The router: one client request through tokenization, admission, the prefill hop and its verification,
and the decode hop (docs/router.md)."""

from __future__ import annotations

import json
import logging
import time

from aiohttp import web

from kvstore.router.admission import Admission, Refused, Stage
from kvstore.router.cached import StoreIndex
from kvstore.router.config import BACKGROUND, INTERACTIVE, RouterConfig
from kvstore.router.estimates import Estimates, handoff_threshold
from kvstore.router.hops import HopError, Hops, InstanceAnswer
from kvstore.router.metrics import RouterMetrics
from kvstore.router.plan import SOURCE_ESTIMATE, SOURCE_OPTION, SOURCE_PLAN
from kvstore.router.pool import Instance, Load, Pool, Role
from kvstore.router.request import ClientRequest, RequestError, verified

log = logging.getLogger("kvstore.router")
#: Block size assumed for the hand-off threshold when none is given (vLLM's default on GPUs).
DEFAULT_BLOCK_TOKENS = 16


class Router:
    def __init__(self, config: RouterConfig, estimates: Estimates | None = None,
                 block_tokens: int = DEFAULT_BLOCK_TOKENS):
        self.config = config
        self.est = estimates or Estimates()
        self.block_tokens = block_tokens
        self.prefill = Pool(Role.PREFILL, config.prefill, config.eject_after)
        self.decode = Pool(Role.DECODE, config.decode, config.eject_after)
        self.colocated = Pool(Role.COLOCATED, config.colocated, config.eject_after)
        self.pools = [p for p in (self.prefill, self.decode, self.colocated) if p]
        self.metrics = RouterMetrics()
        self.admission = Admission(config, self.est)
        self.hops = Hops(config)
        self.store_up: bool | None = None  # None: not checked (no --store)
        #: What the store holds of a prompt (``--store``): a hand-off of a mostly held prompt is skipped.
        self.index = StoreIndex(config.store, min(config.connect_timeout_s, 5.0)) if config.store else None

    # -- what is served, and where -------------------------------------------------------------------------
    def threshold(self) -> int | None:
        """Prompts shorter than this skip the prefill pool (None: every prompt does, by the planner's rule).
        ``--skip-prefill-below`` first, then ``--plan``'s rule, then the live estimate."""
        if self.config.skip_prefill_below is not None:
            return self.config.skip_prefill_below
        if self.config.plan is not None:
            return self.config.plan.threshold()
        return handoff_threshold(self.est, self.block_tokens)

    def threshold_source(self) -> dict:
        """Which short-prompt threshold is in force and where it came from (``/health``)."""
        c = self.config
        source = SOURCE_OPTION if c.skip_prefill_below is not None else SOURCE_PLAN if c.plan else SOURCE_ESTIMATE
        doc = {"below_tokens": self.threshold(), "source": source}
        if c.plan is not None:
            doc["plan"] = c.plan.describe()
        return doc

    def skips_prefill(self, prompt_tokens: int) -> bool:
        limit = self.threshold()
        return limit is None or prompt_tokens < limit

    def hit_fraction(self) -> float | None:
        """The held share of a prompt at which it skips the prefill pool, when the rule is a share
        (``--skip-prefill-hit``, or the plan's ``skip_hit_fraction`` at its reference prompt); None when the rule is
        "the tokens the store lacks are below :meth:`threshold`"."""
        c = self.config
        if c.skip_prefill_hit is not None:
            return c.skip_prefill_hit
        if c.skip_prefill_below is None and c.plan is not None:
            return c.plan.thresholds.skip_hit_fraction
        return None

    def skips_held(self, prompt_tokens: int, held_tokens: int) -> bool:
        """Skip the prefill pool for a prompt of which the store holds ``held_tokens`` (leading blocks): the
        decode instance loads them and computes the rest itself."""
        c, held = self.config, min(held_tokens, prompt_tokens)
        if held <= 0:
            return False
        if c.skip_prefill_hit is not None:
            return held >= c.skip_prefill_hit * prompt_tokens
        if c.skip_prefill_below is None and c.plan is not None:  # the planner's exact rule
            return c.plan.thresholds.skip_prefill(prompt_tokens, held)
        return self.skips_prefill(prompt_tokens - held)  # what is left to compute is a short prompt

    def model_root(self, req: ClientRequest) -> str | None:
        """The model path the instances serve the request's model from (their /v1/models ``root``), which
        names the model in the store's layout index; None for an adapter or an unknown model."""
        want = req.body.get("model")
        roots = set()
        for pool in self.pools:
            for inst in pool.instances:
                for card in inst.cards:
                    if (want is None or card.get("id") == want) and card.get("parent") is None \
                            and isinstance(card.get("root"), str):
                        roots.add(card["root"])
        return roots.pop() if len(roots) == 1 else None

    async def held_tokens(self, req: ClientRequest) -> int | None:
        """Tokens of the prompt's leading blocks the store holds, counted in /metrics; None: not known."""
        if self.index is None or not self.store_up:
            return None
        salt = req.body.get("cache_salt")
        held = await self.index.held_tokens(self.model_root(req), req.token_ids, salt if isinstance(salt, str) else "")
        if held is None:
            self.metrics.lookups.labels("unknown").inc()
            return None
        self.metrics.lookups.labels("hit" if held else "miss").inc()
        self.metrics.held_fraction.observe(min(held / len(req.token_ids), 1.0))
        return held

    def models(self) -> set[str]:
        return {m for p in self.pools for i in p.instances for m in i.models}

    def max_model_len(self) -> int | None:
        lens = [i.max_model_len for p in self.pools for i in p.instances if i.max_model_len]
        return min(lens) if lens else None

    def plan(self, req: ClientRequest) -> tuple[str, Pool]:
        """(route, the pool of the request's last hop); Refused (503) when nothing can serve it."""
        disagg = bool(self.decode.live())
        if disagg and self.store_up is False:
            return "store_down", (self.colocated if self.colocated.live() else self.decode)
        if disagg and self.skips_prefill(len(req.token_ids)):
            return "skip_short", self.decode
        if disagg and self.prefill.live():
            return "handoff", self.decode
        if disagg:
            return "fallback_prefill_failed", self.decode
        if self.colocated.live():
            return "colocated", self.colocated
        raise Refused("every decode and colocated instance is down", 503, self.config.health_interval_s)

    # -- one request ---------------------------------------------------------------------------------------
    async def serve(self, req: ClientRequest, request: web.Request, arrived: float) -> web.StreamResponse:
        await self.tokenize(req)
        route, last = self.plan(req)
        load = Load(len(req.token_ids), req.max_tokens, req.interactive)
        deadline = arrived + self.config.slo_ttft_s
        params = None
        if route == "handoff":
            held = await self.held_tokens(req)
            if held is not None and self.skips_held(len(req.token_ids), held):
                route = "skip_cached"
        if route == "handoff":
            route, params = await self.prefill_hop(req, load, deadline)
        self.metrics.routes.labels(route).inc()
        stage = Stage.DECODE if route == "handoff" else Stage.DIRECT
        return await self.decode_hop(req, request, last, stage, load, deadline, params, arrived)

    async def tokenize(self, req: ClientRequest) -> None:
        body = req.tokenize_body()
        if body is not None:
            if "model" in req.body:
                body["model"] = req.body["model"]
            req.token_ids = await self._tokenize(body)
        limit = self.max_model_len()
        if not req.token_ids:
            raise RequestError("the prompt is empty after tokenization", param="prompt")
        if limit is not None and len(req.token_ids) + req.max_tokens > limit:
            raise RequestError(f"this model's context is {limit} tokens; the prompt has {len(req.token_ids)} and "
                               f"max_tokens asks for {req.max_tokens} more", param="prompt")

    async def _tokenize(self, body: dict) -> list[int]:
        """Token ids from the first live instance that answers /tokenize (decode, colocated, then prefill)."""
        error = "every instance is down"
        for pool in (self.decode, self.colocated, self.prefill):
            for inst in sorted(pool.live(), key=lambda i: i.outstanding_tokens()):
                try:
                    answer = await self.hops.post_json(inst, "/tokenize", body, {},
                                                       self.config.connect_timeout_s + self.config.idle_timeout_s)
                except InstanceAnswer as exc:
                    raise RequestError(_message(exc.body), exc.status) from None
                except HopError as exc:
                    self._failed(pool, inst, exc.reason)
                    error = f"tokenization failed: {exc}"
                    continue
                return [int(t) for t in answer.get("tokens", [])]
        raise Refused(error, 503, self.config.health_interval_s)

    async def prefill_hop(self, req: ClientRequest, load: Load, deadline: float) -> tuple[str, dict | None]:
        """Prefill on up to ``prefill_attempts`` instances, each tried once: a hop that fails, or that answers
        without having saved a block, is retried on another (``kvstore_router_prefill_retries_total{reason}``).
        (route, the kv_transfer_params for decode); the route is a fallback when no attempt handed off."""
        tried: list[Instance] = []
        route = "fallback_prefill_failed"
        for attempt in range(self.config.prefill_attempts):
            pool = _Without(self.prefill, tried)
            if not pool.live():
                break
            if attempt:
                self.metrics.prefill_retries.labels("unverified" if route == "fallback_unverified" else "failed").inc()
            inst = await self._admit(pool, Stage.PREFILL, load, deadline, queue="prefill")
            tried.append(inst)
            queued = bool(inst.prefilling)
            inst.prefilling[req.key] = load
            start = time.monotonic()
            try:
                answer = await self.hops.post_json(inst, req.endpoint, req.prefill_body(),
                                                   self._headers(req), self.config.prefill_timeout_s)
            except HopError as exc:
                self._failed(self.prefill, inst, exc.reason)
                route = "fallback_prefill_failed"
                continue
            finally:
                inst.prefilling.pop(req.key, None)
                await self.admission.release()
            self.prefill.succeeded(inst)
            seconds = time.monotonic() - start
            self.metrics.prefill_s.observe(seconds)
            self.est.observe_prefill(load.prompt_tokens, seconds, queued)
            params = answer.get("kv_transfer_params")
            if verified(params):
                return "handoff", params
            log.debug("request %s: prefill on %s saved nothing (%r)", req.request_id, inst.url, params)
            route = "fallback_unverified"
        return route, None

    async def decode_hop(self, req: ClientRequest, request: web.Request, pool: Pool, stage: Stage, load: Load,
                         deadline: float, params: dict | None, arrived: float) -> web.StreamResponse:
        tried: list[Instance] = []
        klass = INTERACTIVE if req.interactive else BACKGROUND
        while True:
            candidates = _Without(pool, tried)
            if tried and not candidates.live():
                raise Refused(f"every {pool.role.value} instance failed this request", 503,
                              self.config.health_interval_s)
            inst = await self._admit(candidates, stage, load, deadline, queue="decode")
            tried.append(inst)
            table = inst.decoding if stage is Stage.DECODE else inst.prefilling
            alone = not inst.prefilling  # then its first token measures its prefill alone
            table[req.key] = load
            last, sent = [0.0], time.monotonic()

            def on_token(t: float, inst=inst, table=table, last=last, alone=alone, sent=sent) -> None:
                if not last[0]:
                    self.metrics.ttft.labels(klass).observe(t - arrived)
                    if table is inst.prefilling:  # the prompt is done: from now on it only decodes
                        inst.prefilling.pop(req.key, None)
                        inst.decoding[req.key] = load
                        if req.stream:
                            self.est.observe_prefill(load.prompt_tokens, t - sent, queued=not alone)
                elif req.stream:
                    self.est.observe_step(len(inst.decoding), t - last[0])
                last[0] = t

            try:
                resp = await self.hops.relay(inst, req.endpoint, req.decode_body(params), self._headers(req),
                                             request, {"X-Request-Id": req.request_id}, on_token)
            except HopError as exc:
                self._failed(pool, inst, exc.reason)
                continue
            finally:
                inst.prefilling.pop(req.key, None)
                inst.decoding.pop(req.key, None)
                await self.admission.release()
            pool.succeeded(inst)
            return resp

    # -- helpers -------------------------------------------------------------------------------------------
    async def _admit(self, pool: Pool, stage: Stage, load: Load, deadline: float, queue: str) -> Instance:
        start = time.monotonic()
        self.metrics.queued.labels(queue).inc()
        try:
            return await self.admission.admit(pool, stage, load, deadline)
        except Refused as exc:
            if exc.status == 429:
                self.metrics.shed.labels(INTERACTIVE if load.interactive else BACKGROUND, queue).inc()
            raise
        finally:
            self.metrics.queued.labels(queue).dec()
            self.metrics.queue_s.labels(queue).observe(time.monotonic() - start)

    def _failed(self, pool: Pool, inst: Instance, reason: str) -> None:
        self.metrics.hop_errors.labels(pool.role.value, reason).inc()
        if pool.failed(inst):
            self.metrics.ejections.labels(pool.role.value).inc()
            log.warning("%s instance %s ejected after %d failures (%s)", pool.role.value, inst.url,
                        inst.failures, reason)

    @staticmethod
    def _headers(req: ClientRequest) -> dict:
        return {**req.headers, "X-Request-Id": req.request_id}


class _Without(Pool):
    """A view of ``pool`` without the instances a request already tried (failures still count on ``pool``)."""

    def __init__(self, pool: Pool, tried: list[Instance]):  # noqa: D107 - shares the instances, not copies
        self.role, self.eject_after, self.base = pool.role, pool.eject_after, pool
        self.instances = [i for i in pool.instances if i not in tried]

    def failed(self, inst: Instance) -> bool:
        return self.base.failed(inst)


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:500]

