"""Prometheus metrics of the verification service, in a registry of their own.

Contract: `ServiceMetrics()` holds the counters and histograms below in its own CollectorRegistry (several
services in one process, as in tests, do not collide); `serve_metrics(metrics, host, port)` exposes them over
HTTP for a scraper. Names are prefixed `tether_`.

    metrics = ServiceMetrics(); metrics.rounds.inc()
    serve_metrics(metrics, "127.0.0.1", 9100)   # curl 127.0.0.1:9100/metrics
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rounds = Counter("tether_rounds", "verification rounds answered", registry=r)
        self.accepted = Counter("tether_accepted_tokens", "draft tokens the target accepted", registry=r)
        self.drafted = Counter("tether_drafted_tokens", "draft tokens received", registry=r)
        self.tau = Histogram("tether_tau", "tokens gained per round (accepted + 1)",
                             buckets=(1, 2, 3, 4, 5, 6, 8, 10, 14, 20, 33, 65), registry=r)  # fmt: skip
        self.bytes_out = Counter("tether_bytes_out", "payload bytes sent, by kind", ["kind"], registry=r)
        self.kv_delta_bytes = self.bytes_out.labels(kind="kv_delta")  # every reply's: no label lookup per round
        self.sessions = Gauge("tether_sessions", "sessions held", registry=r)
        self.evictions = Counter("tether_evictions", "sessions evicted (least recently used), by reason: the session "
                                 "limit or KV memory", ["reason"], registry=r)  # fmt: skip
        self.kv_blocks = Gauge("tether_kv_blocks", "blocks in the paged KV pool", registry=r)
        self.kv_blocks_used = Gauge("tether_kv_blocks_used", "KV blocks held by sessions", registry=r)
        self.opened = Counter("tether_sessions_opened", "sessions opened (and rebuilt by resync)", registry=r)
        self.resyncs = Counter("tether_resyncs", "resyncs answered, by outcome", ["outcome"], registry=r)
        self.errors = Counter("tether_errors", "requests refused, by gRPC status", ["code"], registry=r)
        # Not errors: each one a pipelined client's missed guess (its overlapping round is refused, nothing lost).
        self.stale_rounds = Counter("tether_stale_rounds", "overlapping rounds refused as stale", registry=r)
        self.verify_seconds = Histogram("tether_verify_seconds", "round latency: batching wait + forward + verdict",
                                        buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
                                        registry=r)  # fmt: skip
        self.batch_size = Histogram("tether_batch_size", "rounds verified in one target forward",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)  # fmt: skip
        self.batch_seconds = Histogram("tether_batch_seconds", "one batched verify on the batcher's thread: "
                                       "staging, the GPU step, verdicts and the deltas' gather", registry=r,
                                       buckets=(5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5))  # fmt: skip

        self.gc_pause = Histogram("tether_gc_pause_seconds", "pauses of Python's cyclic garbage collector (every "
                                  "thread stops), by generation", ["generation"], registry=r,
                                  buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5))  # fmt: skip

    def observe_batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)


def serve_metrics(metrics: ServiceMetrics, host: str, port: int):
    """Start the HTTP exposition server in a daemon thread; returns (server, thread)."""
    return start_http_server(port, addr=host, registry=metrics.registry)
