"""How many replicas a deployment wants, between its min_replicas and max_replicas, from its traffic
(scheduler/traffic.py), decided at each scheduling tick:

- up by one when the requests in flight per ready replica, averaged over the last SCALE_UP_WINDOW_S, stay
  above `target_queue` while every replica it wants is ready (a replica still starting counts for nothing
  yet, so a burst adds one at a time);
- down by one when no request has come or gone for `scale_down_after_s` (counted again after each change,
  and from when the replicas it started are ready; one waiting for a device does not hold it up);
- from zero to one as soon as a request waits: the forwarder holds it until a replica is ready, and the
  time that took (the cold start) is an event.
A deployment with min = max never moves. The decisions are the deployment's events (store/versions.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from gpuforge.scheduler.traffic import Traffic
from gpuforge.store.models import Deployment

SCALE_UP_WINDOW_S = 2.0


@dataclass
class _Seen:
    samples: deque = field(default_factory=deque)  # (monotonic time, in flight per ready replica)
    last_change: float = 0.0
    woken_at: float | None = None  # when a request found it at zero: the cold start runs from there


@dataclass(frozen=True)
class Decision:
    replicas: int
    why: str


class Autoscaler:
    def __init__(self, traffic: Traffic):
        self.traffic = traffic
        self._seen: dict[int, _Seen] = {}

    def decide(
        self, d: Deployment, ready: int, starting: int = 0, now: float | None = None
    ) -> Decision | None:
        """The new count of replicas `d` wants, or None to stay; `ready`: its replicas that serve now,
        `starting`: those whose process loads its model (one waiting for a device is neither)."""
        now = time.monotonic() if now is None else now
        seen = self._seen.setdefault(d.id, _Seen(last_change=now))
        flow = self.traffic.of(d.name)
        if d.min_replicas == d.max_replicas:
            return None
        if d.replicas == 0:
            if flow.in_flight == 0:
                return None
            seen.woken_at, seen.last_change = now, now
            return Decision(1, f"{flow.in_flight} request(s) came while it was scaled to zero")
        seen.samples.append((now, flow.in_flight / max(ready, 1)))
        while seen.samples and now - seen.samples[0][0] > SCALE_UP_WINDOW_S:
            seen.samples.popleft()
        covered = now - seen.samples[0][0] >= SCALE_UP_WINDOW_S * 0.75
        mean = sum(x for _, x in seen.samples) / len(seen.samples)
        if covered and mean > d.target_queue and ready >= d.replicas and d.replicas < d.max_replicas:
            seen.samples.clear()
            seen.last_change = now
            return Decision(
                d.replicas + 1,
                f"{mean:.1f} requests in flight per ready replica over {SCALE_UP_WINDOW_S:.0f} s, "
                f"above the target {d.target_queue:g}",
            )
        if starting:
            seen.last_change = now  # idle time counts once what it started serves
        idle_for = now - max(flow.last_active, seen.last_change)
        if flow.in_flight == 0 and d.replicas > d.min_replicas and idle_for >= d.scale_down_after_s:
            seen.last_change = now
            seen.samples.clear()
            return Decision(d.replicas - 1, f"no request for {idle_for:.0f} s")
        return None

    def cold_start(self, d: Deployment, ready: int, now: float | None = None) -> float | None:
        """Seconds from the request that woke `d` from zero to its first ready replica, once, when it is."""
        seen = self._seen.get(d.id)
        if seen is None or seen.woken_at is None or ready == 0:
            return None
        took, seen.woken_at = (time.monotonic() if now is None else now) - seen.woken_at, None
        return took
