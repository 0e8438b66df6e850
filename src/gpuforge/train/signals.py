"""How a signal stops a training process: at the end of a step, after a checkpoint, never mid-write."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RunDropped(BaseException):
    """Raised by the loop between steps after SIGUSR1: the run ends at once, with no checkpoint, summary
    or event (a search's pruned trial, which nothing will resume). A BaseException, so that no
    `except Exception` on the way takes it for the run's own error."""


_held: list[int] = []  # SIGTERMs that came before the loop's StopFlag was installed (hold_until_the_loop)


def hold_until_the_loop() -> None:
    """From a rank's first line: a SIGTERM that comes while it is still setting up (its launcher died,
    PR_SET_PDEATHSIG) is kept for the loop's StopFlag, which then stops at the first step with the other
    ranks, rather than killing this one while another waits for it in a collective (that one then fails
    with no word: its launcher, which would have written it, is gone)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: _held.append(signum))


class StopFlag:
    """SIGTERM/SIGINT set a flag the loop checks after each step; a second SIGINT interrupts at once.
    SIGUSR1 asks the loop to drop the run (RunDropped) at the end of the step."""

    def __init__(self):
        self.signal_number: int | None = None
        self.dropped = False

    def _drop(self, signum, frame):
        self.dropped = True

    def check_dropped(self) -> None:
        if self.dropped:
            raise RunDropped

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self.signal_number).name if self.signal_number else None

    def _handle(self, signum, frame):
        if self.signal_number == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_number = signum

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread; a thread-run job is stopped by its owner
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._drop)
        if _held and self.signal_number is None:  # one came during set-up: stop at the first step
            self.signal_number = _held[-1]
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
