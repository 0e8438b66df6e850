"""A deployment's replicas as the dashboard shows them, from each replica's own Prometheus text: requests
per second, p50/p99 latency and refusals over a window from a kept reading to now (the route keeps a
reading until it is STATS_WINDOW_S old; the replica's whole life on a first look), and requests in flight.

The latency histogram's buckets give the quantiles, interpolated within a bucket as Prometheus'
histogram_quantile does; a quantile past the last finite bucket is that bucket's bound.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

LATENCY = "gpuforge_serve_request_seconds"
REJECTED = "gpuforge_serve_rejected"
IN_FLIGHT = "gpuforge_serve_requests_in_flight"


@dataclass
class Reading:
    """One look at a replica's counters."""

    at: float
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative count
    count: float = 0.0
    rejected: float = 0.0
    in_flight: float = 0.0


def read_metrics(text: str, at: float | None = None) -> Reading:
    reading = Reading(at=time.monotonic() if at is None else at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == LATENCY + "_bucket":
                reading.buckets[float(sample.labels["le"])] = sample.value
            elif sample.name == LATENCY + "_count":
                reading.count = sample.value
            elif sample.name == REJECTED + "_total":
                reading.rejected += sample.value
            elif sample.name == IN_FLIGHT:
                reading.in_flight = sample.value
    return reading


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram ({upper bound: count}), in its unit; None when empty."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # past the last finite bucket: its bound is all we know
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def restarted(now: Reading, before: Reading) -> bool:
    """Whether the replica's counters began again since `before` (any of them went down)."""
    return (
        now.count < before.count
        or now.rejected < before.rejected
        or any(now.buckets.get(b, 0.0) < count for b, count in before.buckets.items())
    )


def replica_figures(now: Reading, before: Reading | None) -> dict[str, float | None]:
    """Requests/s, p50/p99 in ms and refusals over the time since `before` (or over the replica's life)."""
    if before is not None and now.at > before.at and not restarted(now, before):
        window = {b: now.buckets.get(b, 0.0) - before.buckets.get(b, 0.0) for b in now.buckets}
        count, seconds = now.count - before.count, now.at - before.at
        refused = now.rejected - before.rejected
    else:  # the first look, or a replica restarted since (its counters began again)
        window, count, seconds, refused = now.buckets, now.count, None, now.rejected
    p50, p99 = quantile(0.5, window), quantile(0.99, window)
    return {
        "requests_per_s": count / seconds if seconds else None,
        "p50_ms": p50 * 1000 if p50 is not None else None,
        "p99_ms": p99 * 1000 if p99 is not None else None,
        "refused": refused,
        "in_flight": now.in_flight,
    }
