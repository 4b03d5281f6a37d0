"""Prometheus metrics of the router (GET /metrics), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("unweight_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("unweight_time_to_first_token_seconds", "From request admission to its first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("unweight_inter_token_latency_seconds", "Between consecutive tokens of one request", buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("unweight_generated_tokens", "Tokens generated", registry=r)
        self.kv_bytes = Counter("unweight_kv_transferred_bytes", "KV cache bytes sent from prefill to decode workers", ["prefill", "decode"], registry=r)
        labels = ["worker", "role", "pid"]
        self.running = Gauge("unweight_worker_running", "Sequences in a worker's running batch", labels, registry=r)
        self.queued = Gauge("unweight_worker_queue_depth", "Requests waiting in a worker", labels, registry=r)
        self.kv_used = Gauge("unweight_kv_cache_used_blocks", "KV cache blocks in use", labels, registry=r)
        self.kv_total = Gauge("unweight_kv_cache_max_blocks", "KV cache blocks a worker may use", labels, registry=r)
        self.served = Gauge("unweight_worker_requests", "Requests a worker took part in (prefill or decode)", labels, registry=r)
        self.up = Gauge("unweight_worker_up", "1 if the worker is ready", labels, registry=r)

    def worker(self, w) -> None:
        key = (w.name, w.role, str(w.pid))
        self.running.labels(*key).set(w.running)
        self.queued.labels(*key).set(w.queued)
        self.kv_used.labels(*key).set(w.kv_blocks_used)
        self.kv_total.labels(*key).set(w.kv_blocks_total)
        self.served.labels(*key).set(w.served)
        self.up.labels(*key).set(1 if w.state == "ready" else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
