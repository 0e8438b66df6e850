"""The autoscaler's decisions on a clock the test moves, from the forwarder's real counters."""

from types import SimpleNamespace

from gpuforge.scheduler.autoscale import SCALE_UP_WINDOW_S, Autoscaler
from gpuforge.scheduler.traffic import Traffic


def _deployment(**fields):
    values = {"id": 1, "name": "d", "replicas": 1, "min_replicas": 0, "max_replicas": 2, "target_queue": 2.0,
              "scale_down_after_s": 10.0} | fields  # fmt: skip
    return SimpleNamespace(**values)


def test_one_more_replica_once_the_load_stays_above_the_target_for_the_window():
    traffic, d = Traffic(), _deployment()
    scaler = Autoscaler(traffic)
    for _ in range(5):
        traffic.begin("d", 0)  # 5 in flight on one ready replica: above 2
    assert scaler.decide(d, ready=1, now=100.0) is None  # one sample is no window
    assert scaler.decide(d, ready=1, now=100.0 + SCALE_UP_WINDOW_S / 2) is None
    up = scaler.decide(d, ready=1, now=100.0 + SCALE_UP_WINDOW_S)
    assert up is not None and up.replicas == 2 and "above the target 2" in up.why
    d.replicas = 2
    assert scaler.decide(d, ready=1, now=103.0) is None  # the new one is not ready: no third yet
    assert scaler.decide(_deployment(replicas=2), ready=2, now=110.0) is None  # at max_replicas


def test_idle_replicas_go_one_at_a_time_and_a_request_wakes_it_from_zero():
    traffic, d = Traffic(), _deployment(replicas=2, scale_down_after_s=5.0)
    scaler = Autoscaler(traffic)
    traffic.begin("d", 0)
    traffic.end("d", 0)
    now = traffic.of("d").last_active
    assert scaler.decide(d, ready=2, now=now + 1) is None
    down = scaler.decide(d, ready=2, now=now + 6)
    assert down is not None and down.replicas == 1 and "no request for" in down.why
    d.replicas = 1
    assert scaler.decide(d, ready=1, now=now + 8) is None  # counted again from the change
    assert scaler.decide(d, ready=1, now=now + 11.5).replicas == 0
    d.replicas = 0
    assert scaler.decide(d, ready=0, now=now + 20) is None  # nothing waits
    traffic.hold("d")  # a request waits for a replica
    woke = scaler.decide(d, ready=0, now=now + 21)
    assert woke is not None and woke.replicas == 1 and "scaled to zero" in woke.why
    assert scaler.cold_start(d, ready=0, now=now + 22) is None
    assert scaler.cold_start(d, ready=1, now=now + 24.5) == 3.5
    assert scaler.cold_start(d, ready=1, now=now + 25) is None  # once


def test_a_replica_still_loading_holds_the_idle_clock_and_one_waiting_for_a_device_does_not():
    traffic, d = Traffic(), _deployment(replicas=2, min_replicas=1, scale_down_after_s=5.0)
    scaler = Autoscaler(traffic)
    start = traffic.of("d").last_active
    assert scaler.decide(d, ready=1, starting=1, now=start + 6) is None  # loading its model: wait
    assert scaler.decide(d, ready=1, starting=0, now=start + 8) is None  # 2 s since it loaded
    assert scaler.decide(d, ready=1, starting=0, now=start + 11.5).replicas == 1  # no device came


def test_min_equal_to_max_never_moves():
    traffic, d = Traffic(), _deployment(min_replicas=1, max_replicas=1)
    for _ in range(50):
        traffic.begin("d", 0)
    scaler = Autoscaler(traffic)
    assert all(scaler.decide(d, ready=1, now=t) is None for t in (0.0, 5.0, 100.0))
