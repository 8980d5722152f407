"""Prometheus metrics of the verification service, in a registry of their own.

Contract: `ServiceMetrics()` holds the counters and histograms below in its own CollectorRegistry (several
services in one process, as in tests, do not collide); `serve_metrics(metrics, host, port)` exposes them over
HTTP for a scraper, at GET /metrics only (any other path is 404: the port serves metrics and nothing else), on
threads that drop a connection idle for CONNECTION_TIMEOUT_S. Names are prefixed `tether_`.
`metrics.http` is the OpenAI-compatible API's observer (tether.shared.http_observe.HttpObserver): requests by
route and status, time to first token, and prompt and completion tokens.

    metrics = ServiceMetrics(); metrics.rounds.round(drafted=5, accepted=3, seconds=0.004)
    serve_metrics(metrics, "127.0.0.1", 9100)   # curl 127.0.0.1:9100/metrics
"""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from tether.server.round_tally import RoundTally
from tether.shared.http_observe import RequestRecord, path_label

CONNECTION_TIMEOUT_S = 10.0  # a scraper's connection that sends nothing this long is closed


class HttpMetrics:
    """The HTTP API's series in `registry`; `observe(record)` once per request (an HttpObserver)."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.requests = Counter(
            "tether_http_requests", "HTTP API requests answered, by route and status", ["path", "status"], registry=r
        )
        self.ttft = Histogram(
            "tether_http_ttft_seconds",
            "HTTP API generations: time from the request's arrival to its first token",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.tokens = Counter(
            "tether_http_tokens", "HTTP API tokens, by kind: prompt or completion", ["kind"], registry=r
        )
        self.duration = Histogram(
            "tether_http_request_seconds",
            "HTTP API requests: arrival to the last byte",
            registry=r,
            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60),
        )

    def observe(self, record: RequestRecord) -> None:
        self.requests.labels(path=path_label(record.path), status=str(record.status)).inc()
        self.duration.observe(record.duration_s)
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s)
        if record.prompt_tokens:
            self.tokens.labels(kind="prompt").inc(record.prompt_tokens)
        if record.completion_tokens:
            self.tokens.labels(kind="completion").inc(record.completion_tokens)


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # rounds, drafted / accepted tokens, tau and verify_seconds: counted once a round, on the event loop
        self.rounds = RoundTally()
        r.register(self.rounds)
        self.bytes_out = Counter("tether_bytes_out", "payload bytes sent, by kind", ["kind"], registry=r)
        self.kv_delta_bytes = self.bytes_out.labels(kind="kv_delta")  # every reply's: no label lookup per round
        self.sessions = Gauge("tether_sessions", "sessions held", registry=r)
        self.evictions = Counter(
            "tether_evictions",
            "sessions evicted (least recently used), by reason: the session limit or KV memory",
            ["reason"],
            registry=r,
        )
        self.kv_blocks = Gauge("tether_kv_blocks", "blocks in the paged KV pool", registry=r)
        self.kv_blocks_used = Gauge("tether_kv_blocks_used", "KV blocks held by sessions", registry=r)
        self.opened = Counter("tether_sessions_opened", "sessions opened (and rebuilt by resync)", registry=r)
        self.resyncs = Counter("tether_resyncs", "resyncs answered, by outcome", ["outcome"], registry=r)
        self.errors = Counter("tether_errors", "requests refused, by gRPC status", ["code"], registry=r)
        # Not errors: each one a pipelined client's missed guess (its overlapping round is refused, nothing lost).
        self.stale_rounds = Counter("tether_stale_rounds", "overlapping rounds refused as stale", registry=r)
        self.batch_size = Histogram(
            "tether_batch_size",
            "rounds verified in one target forward",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.batch_seconds = Histogram(
            "tether_batch_seconds",
            "one batched verify on the batcher's thread: staging, the GPU step, verdicts and the deltas' gather",
            registry=r,
            buckets=(5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5),
        )

        self.http = HttpMetrics(r)
        self.gc_pause = Histogram(
            "tether_gc_pause_seconds",
            "pauses of Python's cyclic garbage collector (every thread stops), by generation",
            ["generation"],
            registry=r,
            buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5),
        )

    def observe_batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)


def serve_metrics(metrics: ServiceMetrics, host: str, port: int):
    """Start the exposition server (GET /metrics only) in a daemon thread; returns (server, thread). OSError when
    it cannot listen on host:port."""
    exposition = make_wsgi_app(metrics.registry)

    def metrics_only(environ, start_response):
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: this port serves GET /metrics only\n"]
        return exposition(environ, start_response)

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = make_server(host, port, metrics_only, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="tether-metrics", daemon=True)
    thread.start()
    return server, thread


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr; a connection idle past CONNECTION_TIMEOUT_S is dropped (a thread each)."""

    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format: str, *args) -> None:
        pass
