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
    "store_down",  # the kvstore daemon failed its health check: colocated serving
    "colocated",  # no prefill/decode pools, or they are all down: the colocated pool
)
_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvstore_router_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.routes = Counter("kvstore_router_routes", "How requests were served (see docs/router.md)",
                              ["route"], registry=r)
        self.prefill_retries = Counter("kvstore_router_prefill_retries",
                                       "Prefill hops sent again to another instance", registry=r)
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
        self.store_up.set(-1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
