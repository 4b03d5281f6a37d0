"""Prometheus metrics of the router (GET /metrics), named and typed as vLLM names its own.

Series that mean what vLLM's mean carry vLLM's names (`vllm:` prefix, same types, buckets and
`model_name` label; vLLM's docs/design/metrics.md and vllm/v1/metrics/loggers.py), so a vLLM
dashboard, alert rule or metrics-aware router (aiperf, guidellm, llm-d, production-stack) reads
them unchanged. What vLLM has no name for (per-worker state, KV hand-offs) is `unweight:`.
HTTP responses are counted as prometheus-fastapi-instrumentator (which vLLM uses) counts them.

Request timings are what the router sees (docs/serving.md, "Metrics"): it stamps admission,
each token's arrival and the end. Queue and prefill time are split by a model of the prefill
worker (one prompt at a time, first come first served): a prompt's prefill starts when it was
admitted or when that worker's previous first token came back, whichever is later.

Gauges and per-worker series are read from the router's state at scrape time (a collector), so
a restarted worker leaves no stale series behind, and counters only ever grow.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
KV_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values


def token_buckets(max_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return out
            out.append(m * scale)
        scale *= 10


@dataclass(slots=True)
class _Live:
    """What the metrics keep about a request between its admission and its end."""

    created: float
    prompt: int
    first_at: float | None = None
    last_at: float | None = None
    started: float | None = None  # estimated start of its prefill
    tokens: int = 0


class Metrics:
    def __init__(self, model_name: str, max_model_len: int = 8192):
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        m = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_BUCKETS,
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_BUCKETS,
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.prompt_hist = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets(max_model_len)
        )
        self.generation_hist = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets(max_model_len)
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m, registry=r).labels(
            model_name
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", m, registry=r
        ).labels(model_name)
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*m, "finished_reason"], registry=r
        )
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.kv_bytes = Counter(
            "unweight:kv_transfer_bytes",
            "KV cache bytes sent from prefill to decode workers.",
            [*m, "prefill", "decode"],
            registry=r,
        )
        self.kv_wire_bytes = Counter(
            "unweight:kv_wire_bytes",
            "KV hand-off bytes on the wire (coded, sealed and framed), as the prefill workers sent them.",
            [*m, "prefill", "decode"],
            registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            "unweight:kv_transfer_seconds",
            "Wall time of a KV hand-off at each end, from its first byte to its last.",
            [*m, "side"],
            buckets=KV_BUCKETS,
            registry=r,
        )
        self.kv_codec_seconds = Histogram(
            "unweight:kv_codec_seconds",
            "Time a KV hand-off spent coding and sealing (prefill side) or opening and decoding (decode side).",
            [*m, "side"],
            buckets=KV_BUCKETS,
            registry=r,
        )
        self.http = Counter(
            "http_requests",
            "Total number of requests by method, status and handler.",
            [*m, "method", "status", "handler"],
            registry=r,
        )
        self._live: dict[str, _Live] = {}
        self._prefill_free_at: dict[str, float] = {}  # prefill worker -> when its last first token came back
        self._workers: Callable[[], Iterable] = lambda: ()
        self._requests: Callable[[], Iterable] = lambda: ()
        r.register(_StateCollector(self))

    def watch(self, workers: Callable[[], Iterable], requests: Callable[[], Iterable]) -> None:
        """Where the scrape-time gauges read from: the router's worker handles and live requests."""
        self._workers, self._requests = workers, requests

    # -- called by the router -----------------------------------------------------------------
    def admitted(self, rid: str, prompt_tokens: int, created: float) -> None:
        self._live[rid] = _Live(created, prompt_tokens)

    def token(self, rid: str, holder: str | None, now: float) -> None:
        """A token of request rid reached the router; holder: the worker that made it."""
        s = self._live.get(rid)
        if s is None:
            return
        self.generation_tokens.inc()
        s.tokens += 1
        if s.first_at is None:
            s.first_at = now
            self.ttft.observe(now - s.created)
            self.prompt_tokens.inc(s.prompt)
            s.started = started = max(s.created, self._prefill_free_at.get(holder, 0.0))
            self.queue.observe(started - s.created)
            self.prefill.observe(now - started)
            if holder is not None:
                self._prefill_free_at[holder] = now
        else:
            self.itl.observe(now - s.last_at)
        s.last_at = now

    def finished(self, rid: str, reason: str, now: float | None = None) -> None:
        """The request ended: "stop", "length", "abort" (client gone) or "error"."""
        s = self._live.pop(rid, None)
        if s is None:
            return
        now = time.monotonic() if now is None else now
        self.success[reason if reason in self.success else "error"].inc()
        self.e2e.observe(now - s.created)
        self.prompt_hist.observe(s.prompt)
        self.generation_hist.observe(s.tokens)
        if s.first_at is not None:
            self.decode.observe(s.last_at - s.first_at)
            self.inference.observe(s.last_at - s.started)
            if s.tokens > 1:
                self.tpot.observe((s.last_at - s.first_at) / (s.tokens - 1))

    def kv_sent(self, prefill: str, decode: str, nbytes: int) -> None:
        self.kv_bytes.labels(self.model_name, prefill, decode).inc(nbytes)

    def kv_transferred(self, role: str, name: str, msg: dict) -> None:
        """A hand-off done, as one end (`role`, worker `name`) saw it."""
        side = "send" if role == "prefill" else "receive"
        self.kv_transfer_seconds.labels(self.model_name, side).observe(msg["seconds"])
        self.kv_codec_seconds.labels(self.model_name, side).observe(msg["codec_seconds"])
        if role == "prefill":
            self.kv_wire_bytes.labels(self.model_name, name, msg["peer"]).inc(msg["wire_bytes"])

    # -- called by the HTTP layer -------------------------------------------------------------
    def response(self, handler: str, method: str, status: int) -> None:
        self.http.labels(self.model_name, method, str(status), handler).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Gauges and per-worker series computed from the router's state at each scrape."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        name = self.m.model_name
        workers = list(self.m._workers())
        requests = list(self.m._requests())
        running = sum(1 for r in requests if r.first_at is not None)
        g = GaugeMetricFamily(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels=["model_name"]
        )
        g.add_metric([name], running)
        yield g
        g = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=["model_name"]
        )
        g.add_metric([name], len(requests) - running)
        yield g
        caches = [w for w in workers if w.role in ("decode", "worker") and w.state != "dead" and w.kv_blocks_total]
        g = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=["model_name"]
        )
        g.add_metric([name], sum(w.kv_blocks_used for w in caches) / max(1, sum(w.kv_blocks_total for w in caches)))
        yield g
        # vLLM's prefix-cache counters, in tokens: a prompt that the one before it repeats (a request's
        # n or best_of choices) is copied from it, not prefilled again (worker_base.SharedPrompt)
        c = CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up.", labels=["model_name"])
        c.add_metric([name], sum(w.prompt_tokens for w in workers))
        yield c
        c = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found, not prefilled.", labels=["model_name"])
        c.add_metric([name], sum(w.prompt_tokens_reused for w in workers))
        yield c
        labels = ["model_name", "worker", "role"]
        per_worker = [
            (
                GaugeMetricFamily,
                "unweight:worker_up",
                "1 if the worker is ready.",
                lambda w: 1 if w.state == "ready" else 0,
            ),
            (
                GaugeMetricFamily,
                "unweight:worker_running",
                "Sequences in the worker's running batch (last heartbeat).",
                lambda w: w.running,
            ),
            (
                GaugeMetricFamily,
                "unweight:worker_queued",
                "Requests waiting in the worker (last heartbeat).",
                lambda w: w.queued,
            ),
            (
                GaugeMetricFamily,
                "unweight:worker_kv_blocks_used",
                "KV cache blocks in use (last heartbeat).",
                lambda w: w.kv_blocks_used,
            ),
            (
                GaugeMetricFamily,
                "unweight:worker_kv_blocks_total",
                "KV cache blocks the worker may use (last heartbeat).",
                lambda w: w.kv_blocks_total,
            ),
            (
                CounterMetricFamily,
                "unweight:worker_requests",
                "Requests the worker took part in (prefill or decode).",
                lambda w: w.served,
            ),
            (
                CounterMetricFamily,
                "unweight:worker_restarts",
                "Times the router restarted the worker.",
                lambda w: w.restarts,
            ),
        ]
        for family, metric, doc, value in per_worker:
            f = family(metric, doc, labels=labels)
            for w in workers:
                f.add_metric([name, w.name, w.role], value(w))
            yield f
        info = GaugeMetricFamily(
            "unweight:worker_info",
            "The worker's current process: pid, incarnation and state (always 1).",
            labels=[*labels, "pid", "incarnation", "state"],
        )
        for w in workers:
            info.add_metric([name, w.name, w.role, str(w.pid), w.incarnation or "", w.state], 1)
        yield info
