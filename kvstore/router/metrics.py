"""The router's Prometheus metrics (``GET /metrics``): one registry per router, so that two routers in one
process (tests) never share a counter."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: How a request was served; the values of ``kvstore_router_routes_total{route=...}``.
ROUTES = (
    "handoff",  # prefill pool, verified kv_transfer_params (saved_blocks > 0), then decode pool
    "fallback_unverified",  # the prefill answered without a saved block (or without params): full request on decode
    "fallback_prefill_failed",  # every prefill attempt failed: full request on decode
    "skip_short",  # prompt below the hand-off threshold: straight to decode
    "skip_cached",  # the store already holds most of the prompt's blocks: straight to decode (it loads them)
    "store_down",  # the kvstore daemon failed its health check: colocated serving
    "colocated",  # no prefill/decode pools, or they are all down: the colocated pool
)
#: Results of the router's store lookups (``kvstore_router_store_lookups_total{result=...}``).
LOOKUP_RESULTS = ("hit", "miss", "unknown")  # unknown: no layout of the model in the store yet, or no answer
_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvstore_router_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.routes = Counter("kvstore_router_routes", "How requests were served (see docs/router.md)",
                              ["route"], registry=r)
        self.prefill_retries = Counter("kvstore_router_prefill_retries",
                                       "Prefill hops sent again to another instance, by why the previous one "
                                       "did not hand off (failed: no answer or an error; unverified: it answered "
                                       "without saving a block)", ["reason"], registry=r)
        self.lookups = Counter("kvstore_router_store_lookups", "Store lookups of a prompt's blocks before a "
                               "hand-off, by result (hit: at least one leading block held)", ["result"],
                               registry=r)
        self.held_fraction = Histogram("kvstore_router_store_held_fraction", "Share of a prompt's tokens whose "
                                       "blocks the store held at lookup", buckets=(0, 0.1, 0.25, 0.5, 0.75, 0.9,
                                                                                   0.99, 1), registry=r)
        self.hit_threshold = Gauge("kvstore_router_skip_prefill_hit_fraction", "Prompts of which the store holds "
                                   "this share skip the prefill pool (--skip-prefill-hit, or the plan's "
                                   "skip_hit_fraction at its reference prompt; -1: the rule is the tokens the "
                                   "store lacks against kvstore_router_skip_prefill_below_tokens)", registry=r)
        self.hop_errors = Counter("kvstore_router_hop_errors", "Failed hops, by pool and reason",
                                  ["pool", "reason"], registry=r)
        self.shed = Counter("kvstore_router_shed", "Requests refused with 429 by admission control",
                            ["klass", "queue"], registry=r)
        self.disconnects = Counter("kvstore_router_client_disconnects",
                                   "Clients gone before the answer; both hops aborted", registry=r)
        self.ejections = Counter("kvstore_router_ejections", "Instances ejected", ["pool"], registry=r)
        self.ttft = Histogram("kvstore_router_ttft_seconds", "Arrival at the router to the first byte of the "
                              "answer sent", ["klass"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_s = Histogram("kvstore_router_prefill_hop_seconds", "Duration of prefill hops",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_s = Histogram("kvstore_router_queue_seconds", "Time spent in an admission queue",
                                 ["queue"], buckets=_LATENCY_BUCKETS, registry=r)
        self.instance_up = Gauge("kvstore_router_instance_up", "1 while an instance is admitted",
                                 ["pool", "url"], registry=r)
        self.outstanding = Gauge("kvstore_router_outstanding_tokens", "Tokens sent to an instance and not "
                                 "finished", ["pool", "url"], registry=r)
        self.store_up = Gauge("kvstore_router_store_up", "1 while the kvstore daemon answers (-1: not "
                              "checked)", registry=r)
        self.queued = Gauge("kvstore_router_queued", "Requests waiting in an admission queue", ["queue"],
                            registry=r)
        self.threshold = Gauge("kvstore_router_skip_prefill_below_tokens", "Prompts shorter than this go "
                               "straight to decode (+Inf: every prompt, by the planner's rule)", registry=r)
        self.threshold_source = Gauge("kvstore_router_skip_prefill_source", "1 for where the threshold in force "
                                      "came from: option (--skip-prefill-below), planner (--plan), estimate (live)",
                                      ["source"], registry=r)
        for route in ROUTES:
            self.routes.labels(route)
        for reason in ("failed", "unverified"):
            self.prefill_retries.labels(reason)
        for result in LOOKUP_RESULTS:
            self.lookups.labels(result)
        self.store_up.set(-1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
