"""Where a served input's time goes, over a window of seconds: `POST /admin/profile?seconds=5`.

A classifier (ServeProfile): each batch the model thread runs in the window is split into tokenize (text
to token ids, or images stacked, and the copy to the device), forward (the model, up to its scores on the
host) and scores (softmax and labels); each input's wait for its batch is its queue time; each request's
answer encoded as JSON is its respond time, which every input of the request waits out. Each request's
own latency, from its handler's start to its answer, is measured too: what the parts leave of it is
`other` (the request read and checked, the hand-over to the model thread and back). The report is the
mean input's latency split into those parts, in seconds and as shares, beside the batches' figures.

Outside a window a batch costs the Predictor's four clock reads and a request two; nothing is recorded.

A causal LM (GenerateProfile, fed by serve/generate.py's engine): each request submitted and answered in
the window is split into tokenize (its prompt encoded, with any wait for the tokenizer's lock), queue
(until its prefill starts), prefill (the prefill it was part of: the prompts' forward and their first
tokens), joins (the prefills of requests that joined the running batch while it was in it: continuous
batching's cost to those already running), decode (the model's forward in each step it was in), sample
(the tokens chosen) and host (the step's host work after: the new tokens' text and the events sent, the
batch's bookkeeping, and trimming the cache where a sequence left); its time from submit to its last
event sent, less those, is `other`.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

MAX_SECONDS = 60.0
PARTS = ("queue", "tokenize", "forward", "scores", "respond", "other")
GENERATE_PARTS = ("queue", "tokenize", "prefill", "joins", "decode", "sample", "host", "other")


@dataclass
class _Window:
    until: float
    batches: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[int, float, float]] = field(default_factory=list)  # (inputs, respond s, latency s)
    split: tuple[float, float, float] | None = None  # the model thread's split of the batch just run
    steps: list[int] = field(default_factory=list)  # a causal LM's decode steps: each one's batch
    answers: list[dict[str, Any]] = field(default_factory=list)  # a causal LM's requests, each one's parts

    def open(self) -> bool:
        return time.monotonic() < self.until


class _Windows:
    """At most one window at a time; the model thread and the event loop both write into it, each reading
    `_window` once (it is set to None at the window's end, from the event loop)."""

    def __init__(self):
        self._window: _Window | None = None
        self._lock = threading.Lock()

    async def record(self, seconds: float) -> dict[str, Any]:
        """Open a window of `seconds`, wait it out, and report it. RuntimeError while one is open."""
        with self._lock:
            if self._window is not None:
                raise RuntimeError("a profile window is open already: wait for its report")
            self._window = window = _Window(time.monotonic() + seconds)
        try:
            await asyncio.sleep(seconds)
        finally:
            with self._lock:
                self._window = None
        return self.report(window, seconds)

    def recording(self) -> bool:
        return self.open_window() is not None

    def open_window(self) -> _Window | None:
        window = self._window
        return window if window is not None and window.open() else None

    def report(self, window: _Window, seconds: float) -> dict[str, Any]:
        raise NotImplementedError


class GenerateProfile(_Windows):
    """A causal LM's requests over a window (GENERATE_PARTS); the engine's model thread feeds it."""

    def step(self, batch: int) -> None:
        window = self._window
        if window is not None and window.open():
            window.steps.append(batch)

    def answered(self, window: _Window, spent: dict[str, float], latency_s: float, tokens: int) -> None:
        """A request submitted in `window` has had its last event: its parts, and its whole time. It
        counts where that window is still the one open (not in a later window)."""
        if window is self._window and window.open():
            window.answers.append({"spent": spent, "latency_s": latency_s, "tokens": tokens})

    def report(self, window: _Window, seconds: float) -> dict[str, Any]:
        """The mean request's time split into GENERATE_PARTS, beside the decode steps' figures."""
        done, steps = list(window.answers), list(window.steps)  # one reading: a late append changes nothing
        out: dict[str, Any] = {
            "seconds": seconds,
            "requests": len(done),
            "tokens": sum(r["tokens"] for r in done),
            "decode_steps": len(steps),
            "mean_batch": statistics.fmean(steps) if steps else None,
        }
        if not done:
            note = "no request was submitted and answered in the window: send requests during it"
            out.update(mean_request_s=None, breakdown=None, note=note)
            return out
        parts = {name: sum(r["spent"].get(name, 0.0) for r in done) / len(done) for name in GENERATE_PARTS}
        latency = statistics.fmean(r["latency_s"] for r in done)
        parts["other"] = max(0.0, latency - sum(parts.values()))
        return {**out, **_shares(parts, "mean_request_s")}


class ServeProfile(_Windows):
    """A classifier's batches and requests over a window (PARTS)."""

    def report(self, window: _Window, seconds: float) -> dict[str, Any]:
        return report(window, seconds)

    def batch_split(self, tokenize_s: float, forward_s: float, scores_s: float) -> None:
        """The model thread's split of the batch it just ran (kept until the batch's stats come)."""
        window = self._window
        if window is not None and window.open():
            window.split = (tokenize_s, forward_s, scores_s)

    def batch_done(self, size: int, queue_seconds: list[float], run_s: float) -> None:
        """A batch ended (the batcher's stats, on the event loop, after its split)."""
        window = self._window
        if window is None or window.split is None:
            return
        tokenize_s, forward_s, scores_s = window.split
        window.split = None
        window.batches.append({
            "size": size, "queue_s": list(queue_seconds), "run_s": run_s,
            "tokenize_s": tokenize_s, "forward_s": forward_s, "scores_s": scores_s,
        })  # fmt: skip

    def answered(self, inputs: int, respond_s: float, latency_s: float) -> None:
        """A request of `inputs` inputs answered: its JSON encoding, and its whole time in the handler."""
        window = self._window
        if window is not None and window.open():
            window.requests.append((inputs, respond_s, latency_s))


def report(window: _Window, seconds: float) -> dict[str, Any]:
    """The mean input's latency split into PARTS: a batch's parts are each of its inputs' to wait out, a
    request's encoding each of its inputs'."""
    batches, requests = window.batches, window.requests
    inputs = sum(b["size"] for b in batches)
    out: dict[str, Any] = {
        "seconds": seconds,
        "batches": len(batches),
        "inputs": inputs,
        "requests": len(requests),
        "mean_batch": inputs / len(batches) if batches else None,
        "batch_run_s": statistics.fmean(b["run_s"] for b in batches) if batches else None,
    }
    answered = sum(n for n, _, _ in requests)
    if not inputs or not answered:
        note = "no request was answered in the window: send requests during it"
        out.update(mean_input_s=None, breakdown=None, note=note)
        return out
    parts = {
        "queue": sum(sum(b["queue_s"]) for b in batches) / inputs,
        **{name: sum(b[f"{name}_s"] * b["size"] for b in batches) / inputs
           for name in ("tokenize", "forward", "scores")},
        "respond": sum(n * s for n, s, _ in requests) / answered,
    }  # fmt: skip
    latency = sum(n * s for n, _, s in requests) / answered
    parts["other"] = max(0.0, latency - sum(parts.values()))
    return {**out, **_shares(parts, "mean_input_s")}


def _shares(parts: dict[str, float], total_name: str) -> dict[str, Any]:
    total = sum(parts.values())  # the latency, unless the parts outgrew it (then: theirs)
    breakdown = {name: {"seconds": s, "share": s / total if total else 0.0} for name, s in parts.items()}
    return {total_name: total, "breakdown": breakdown}
