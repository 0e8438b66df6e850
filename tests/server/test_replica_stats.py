"""A replica's figures from its own Prometheus text (a real ServeMetrics registry): rates and quantiles
over the time since the last look, and over its life at the first."""

import pytest
from prometheus_client import generate_latest

from gpuforge.serve.metrics import ServeMetrics
from gpuforge.server.replica_stats import quantile, read_metrics, replica_figures


def test_quantiles_rates_and_refusals_since_the_last_look():
    metrics = ServeMetrics()
    for _ in range(90):
        metrics.latency.observe(0.004)  # the 0.0025..0.005 bucket
    for _ in range(10):
        metrics.latency.observe(0.2)  # the 0.1..0.25 bucket
    metrics.rejected.labels("queue full").inc(3)
    first = read_metrics(generate_latest(metrics.registry).decode(), at=100.0)
    assert first.count == 100 and first.rejected == 3
    life = replica_figures(first, None)
    assert life["requests_per_s"] is None and life["refused"] == 3
    assert 2.5 < life["p50_ms"] <= 5 and 100 < life["p99_ms"] <= 250

    for _ in range(20):
        metrics.latency.observe(0.02)
    later = read_metrics(generate_latest(metrics.registry).decode(), at=110.0)
    window = replica_figures(later, first)
    assert window["requests_per_s"] == pytest.approx(2.0) and window["refused"] == 0
    assert 10 < window["p50_ms"] <= 25 and 10 < window["p99_ms"] <= 25  # only the last 20 requests


def test_a_quantile_of_nothing_is_unknown():
    assert quantile(0.5, {}) is None and quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None
    assert quantile(0.99, {0.1: 0.0, float("inf"): 4.0}) == 0.1  # past the last bound: that bound
