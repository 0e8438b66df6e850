"""The named phases of a training step (data wait, forward, backward, optimizer, evaluation, logging,
checkpoint), timed only while a profile is recorded (train.profile, train/profile.py).

    with phase("forward"):
        logits = model(batch)

Off, `phase()` returns one shared no-op context: a global read a call, no profiler object, no clock.
On, each phase is a `torch.profiler.record_function` range named `gpuforge.<phase>` (so the trace shows
it) and its seconds add up in the clock; on a GPU the device is synchronised at each edge, so that a
phase's kernels are counted in it and not in the next one.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

# sync: the step's figures (loss, counts, stop and budget decisions) shared between ranks
PHASES = ("data_wait", "forward", "backward", "sync", "optimizer", "evaluation", "logging", "checkpoint")

_OFF = contextlib.nullcontext()
_clock: PhaseClock | None = None


def phase(name: str):
    """Time the block as phase `name` while a profile is recorded; nothing otherwise."""
    clock = _clock
    return _OFF if clock is None else clock.timed(name)


class PhaseClock:
    """Seconds per phase over one step."""

    def __init__(self, device: torch.device):
        self.seconds: dict[str, float] = defaultdict(float)
        self.cuda = device.type == "cuda"

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(f"gpuforge.{name}"):
            self.synchronize()
            start = time.perf_counter()
            try:
                yield
            finally:
                self.synchronize()
                self.seconds[name] += time.perf_counter() - start

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@contextlib.contextmanager
def timing(clock: PhaseClock) -> Iterator[PhaseClock]:
    """Phases are timed into `clock` within the block (one step of a profile window)."""
    global _clock
    _clock = clock
    try:
        yield clock
    finally:
        _clock = None
