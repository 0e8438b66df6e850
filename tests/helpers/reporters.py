"""Reporters a test hands to `gpuforge.train.engine.train` to act at a given step."""

from __future__ import annotations

import os
import signal

from gpuforge.train.progress import Reporter


class SignalAt(Reporter):
    """Sends this process a signal once a given step is logged, as `kill` would."""

    def __init__(self, step: int, signum: int = signal.SIGTERM) -> None:
        self.at, self.signum = step, signum

    def step(self, record: dict) -> None:
        if record["step"] == self.at:
            os.kill(os.getpid(), self.signum)
