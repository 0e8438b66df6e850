"""Where a served input's time goes, over a window of seconds: `POST /admin/profile?seconds=5`.

Each batch the model thread runs in the window is split into tokenize (text to token ids, or images
stacked), forward (the model, on its device) and the scores made from its logits; each input's wait for
its batch is its queue time, and each request's answer encoded as JSON is its respond time. The report is
the mean input's latency split into those parts, in seconds and as shares, beside the batches' figures.

Off (no window open), a batch costs three clock reads (Predictor keeps its last split) and one
comparison here: nothing is recorded.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

MAX_SECONDS = 60.0
PARTS = ("queue", "tokenize", "forward", "scores", "respond")


@dataclass
class _Window:
    until: float
    batches: list[dict[str, Any]] = field(default_factory=list)
    responds: list[float] = field(default_factory=list)
    split: tuple[float, float, float] | None = None  # the model thread's split of the batch just run


class ServeProfile:
    """At most one window at a time; the model thread and the event loop both write into it."""

    def __init__(self):
        self._window: _Window | None = None
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        window = self._window
        return window is not None and time.monotonic() < window.until

    async def record(self, seconds: float) -> dict[str, Any]:
        """Open a window of `seconds`, wait it out, and report it. RuntimeError while one is open."""
        with self._lock:
            if self.open:
                raise RuntimeError("a profile window is open already: wait for its report")
            self._window = window = _Window(time.monotonic() + seconds)
        await asyncio.sleep(seconds)
        with self._lock:
            self._window = None
        return report(window, seconds)

    def batch_split(self, tokenize_s: float, forward_s: float, scores_s: float) -> None:
        """The model thread's split of the batch it just ran (kept until the batch's stats come)."""
        if self.open:
            self._window.split = (tokenize_s, forward_s, scores_s)

    def batch_done(self, size: int, queue_seconds: list[float], run_s: float) -> None:
        """A batch ended (the batcher's stats, on the event loop, after its split)."""
        window = self._window
        if window is None or not self.open or window.split is None:
            return
        tokenize_s, forward_s, scores_s = window.split
        window.split = None
        window.batches.append({
            "size": size, "queue_s": list(queue_seconds), "run_s": run_s,
            "tokenize_s": tokenize_s, "forward_s": forward_s, "scores_s": scores_s,
        })  # fmt: skip

    def responded(self, seconds: float) -> None:
        if self.open:
            self._window.responds.append(seconds)


def report(window: _Window, seconds: float) -> dict[str, Any]:
    """The mean input's latency split into PARTS (a batch's parts are each of its inputs' to wait out)."""
    batches = window.batches
    inputs = sum(b["size"] for b in batches)
    out: dict[str, Any] = {
        "seconds": seconds,
        "batches": len(batches),
        "inputs": inputs,
        "requests": len(window.responds),
        "mean_batch": inputs / len(batches) if batches else None,
        "batch_run_s": statistics.fmean(b["run_s"] for b in batches) if batches else None,
    }
    if not inputs:
        out.update(
            mean_input_s=None, breakdown=None, note="no batch ran in the window: send requests during it"
        )
        return out
    parts = {
        "queue": sum(sum(b["queue_s"]) for b in batches) / inputs,
        **{name: sum(b[f"{name}_s"] * b["size"] for b in batches) / inputs
           for name in ("tokenize", "forward", "scores")},
        "respond": statistics.fmean(window.responds) if window.responds else 0.0,
    }  # fmt: skip
    total = sum(parts.values())
    out["mean_input_s"] = total
    out["breakdown"] = {
        name: {"seconds": s, "share": s / total if total else 0.0} for name, s in parts.items()
    }
    return out
