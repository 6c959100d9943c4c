"""Metrics: Prometheus counters and histograms of the daemon (served only with ``--metrics-port``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class Metrics:
    """Ops by kind and result, bytes in and out, latency per op, and store gauges read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]] | None = None):
        self.enabled = stats is not None
        if stats is None:
            return
        read_stats = stats
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import GaugeMetricFamily

        self.registry = CollectorRegistry()
        self._ops = Counter("kvstore_ops", "Requests served", ["op", "result"], registry=self.registry)
        self._in = Counter("kvstore_bytes_in", "Payload bytes stored", registry=self.registry)
        self._out = Counter("kvstore_bytes_out", "Payload bytes streamed out", registry=self.registry)
        self._latency = Histogram("kvstore_op_seconds", "Request latency", ["op"], registry=self.registry,
                                  buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3))

        class _StoreCollector:
            def collect(self_inner) -> Iterator[GaugeMetricFamily]:
                s = read_stats()
                for name in ("capacity_bytes", "used_bytes", "objects", "leases", "pending", "evictions",
                             "expirations", "clients", "pinned_objects", "pinned_bytes", "unpins"):
                    g = GaugeMetricFamily(f"kvstore_{name}", f"Store {name.replace('_', ' ')}")
                    g.add_metric([], s.get(name, 0))
                    yield g
                refused = s.get("cluster", {}).get("refused")
                if refused is not None:  # a cluster member: peers that failed the handshake
                    g = GaugeMetricFamily("kvstore_cluster_refused_peers", "Cluster members refused in the "
                                          "handshake (another token, or another daemon at their address)",
                                          labels=["node"])
                    for node in refused:
                        g.add_metric([node], 1)
                    yield g

        self.registry.register(_StoreCollector())

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=addr, registry=self.registry)

    def op(self, op: str, result: str, seconds: float) -> None:
        if self.enabled:
            self._ops.labels(op, result).inc()
            self._latency.labels(op).observe(seconds)

    def bytes_in(self, n: int) -> None:
        if self.enabled:
            self._in.inc(n)

    def bytes_out(self, n: int) -> None:
        if self.enabled:
            self._out.inc(n)
