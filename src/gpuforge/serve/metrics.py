"""What a worker counts for Prometheus (GET /metrics): request latency, queue time, batch sizes, inputs,
tokens, requests in flight and refused, inputs waiting."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpuforge.serve.batcher import BatchStats

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    """One worker's metrics, in a registry of its own (two workers in one process count apart)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.latency = Histogram(
            "gpuforge_serve_request_seconds", "request latency", buckets=SECONDS, registry=r
        )
        self.queue = Histogram(
            "gpuforge_serve_queue_seconds", "an input's wait for its batch", buckets=SECONDS, registry=r
        )
        self.batch = Histogram(
            "gpuforge_serve_batch_size", "inputs per batch", buckets=BATCH_SIZES, registry=r
        )
        self.inputs = Counter("gpuforge_serve_inputs", "inputs answered", registry=r)
        self.tokens = Counter("gpuforge_serve_tokens", "tokens the model read", registry=r)
        self.in_flight = Gauge("gpuforge_serve_requests_in_flight", "requests being answered", registry=r)
        self.rejected = Counter("gpuforge_serve_rejected", "requests refused", ["reason"], registry=r)
        self.queued = Gauge("gpuforge_serve_queue_length", "inputs waiting for a batch", registry=r)

    def batch_done(self, stats: BatchStats) -> None:
        self.batch.observe(stats.size)
        for seconds in stats.queue_seconds:
            self.queue.observe(seconds)
