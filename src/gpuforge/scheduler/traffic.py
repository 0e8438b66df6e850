"""What the server's forwarder (routes/deployments.py) tells the scheduling loop about each deployment's
requests: how many it has forwarded and not yet had answered, per replica (least loaded first) and in all
(the autoscaler's load), how many wait for a replica to start (scaled to zero, or starting), and when a
request last came or went (idle time). In memory: a restarted server starts counting afresh."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class Flow:
    by_replica: dict[int, int] = field(default_factory=dict)  # replica index -> requests in flight
    held: int = 0  # requests waiting for a ready replica
    last_active: float = field(default_factory=time.monotonic)

    @property
    def in_flight(self) -> int:
        return sum(self.by_replica.values()) + self.held


class Traffic:
    """Counters shared by the forwarder (event loop) and the scheduling loop (its thread)."""

    def __init__(self) -> None:
        self._flows: dict[str, Flow] = {}
        self._lock = threading.Lock()

    def of(self, name: str) -> Flow:
        with self._lock:
            return self._flows.setdefault(name, Flow())

    def load(self, name: str, replica: int) -> int:
        return self.of(name).by_replica.get(replica, 0)

    def begin(self, name: str, replica: int) -> None:
        self._add(name, replica, 1)

    def end(self, name: str, replica: int) -> None:
        self._add(name, replica, -1)

    def hold(self, name: str, n: int = 1) -> None:
        """A request waits for a replica (n=-1: it stopped waiting)."""
        with self._lock:
            flow = self._flows.setdefault(name, Flow())
            flow.held += n
            flow.last_active = time.monotonic()

    def _add(self, name: str, replica: int, n: int) -> None:
        with self._lock:
            flow = self._flows.setdefault(name, Flow())
            flow.by_replica[replica] = flow.by_replica.get(replica, 0) + n
            flow.last_active = time.monotonic()
