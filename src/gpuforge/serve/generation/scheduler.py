"""Who runs, and when: the waiting queue, its limits, and admission into the running batch.

The caller's event loop checks and queues requests (`check_prompt`, `check_room`, `enqueue`); the model
thread takes all that wait, up to the room beside the running ones (`next_batch`), to prefill them in one
forward. While requests are arriving in a burst (one came less than `linger_s / 2` ago) it waits for the
rest, at most `linger_s` (a fraction of a decode step), so that they join together rather than one by one
(every prefill is a forward of its own that the running batch waits for). A request is refused at once, never
queued beyond `max_queue`: PromptTooLong for a prompt past the context, QueueFull (serve/batcher.py) with
a Retry-After from the seconds a request has been taking.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from gpuforge.serve.batcher import QueueFull
from gpuforge.serve.generation.output import send
from gpuforge.serve.generation.request import EngineStopped, PromptTooLong, SequenceState


class GenerationScheduler:
    """The waiting requests of one engine, and the rule that admits them."""

    def __init__(self, max_batch: int, max_queue: int):
        if max_batch < 1 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1")
        self.max_batch, self.max_queue = max_batch, max_queue
        self._waiting: deque[SequenceState] = deque()
        self._cond = threading.Condition()
        self._arrived = 0.0  # when the newest request was queued (time.monotonic)
        self.stopping = False
        self.seconds_per_request = 1.0  # a running estimate, for Retry-After

    @property
    def queued(self) -> int:
        return len(self._waiting)

    # -- the caller's side (event loop) --------------------------------------------------------------

    def check_prompt(self, ids: Sequence[int], context: int, vocab: int | None) -> None:
        """ValueError for a prompt the model cannot take; PromptTooLong past the model's context."""
        if not ids:
            raise ValueError("the prompt is empty")
        if vocab and not all(0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= context:
            raise PromptTooLong(len(ids), context)

    def check_room(self, running: int) -> None:
        """QueueFull while stopping, or with max_queue waiting: retry after the waves ahead have run."""
        if self.stopping:
            raise QueueFull(1.0)
        if len(self._waiting) >= self.max_queue:
            waves = (len(self._waiting) + running) / self.max_batch
            raise QueueFull(max(1.0, waves * self.seconds_per_request))

    def enqueue(self, seq: SequenceState) -> None:
        with self._cond:
            self._waiting.append(seq)
            self._arrived = time.monotonic()
            self._cond.notify()

    def cancel(self, seq: SequenceState) -> None:
        """Mark it cancelled; a waiting one leaves the queue at once (a running one at the next step)."""
        seq.cancelled = True
        with self._cond:
            if seq in self._waiting:
                self._waiting.remove(seq)

    def start(self) -> None:
        self.stopping = False

    def stop(self, drain: bool, running: Sequence[SequenceState]) -> None:
        """Refuse new requests; without `drain`, end the waiting and running ones with EngineStopped."""
        with self._cond:
            self.stopping = True
            if not drain:
                for seq in [*self._waiting, *running]:
                    send(seq, EngineStopped("the engine stopped"))
                    seq.cancelled = True
                self._waiting.clear()
            self._cond.notify_all()

    # -- the model thread ----------------------------------------------------------------------------

    def next_batch(self, running: int, linger_s: float = 0.0) -> list[SequenceState] | None:
        """The requests to admit beside `running` ones (cancelled ones dropped), waiting while there is
        nothing to do, and up to `linger_s` more while a burst is still arriving and there is room; None
        once stopping with nothing waiting or running: the model thread ends."""
        with self._cond:
            while not self._waiting and not running and not self.stopping:
                self._cond.wait()
            if self.stopping and not self._waiting and not running:
                return None
            deadline = time.monotonic() + linger_s
            while (
                self._waiting
                and running + len(self._waiting) < self.max_batch
                and not self.stopping
                and (quiet := self._arrived + linger_s / 2 - time.monotonic()) > 0  # one came just now
                and (left := deadline - time.monotonic()) > 0
            ):
                self._cond.wait(min(left, quiet))  # until the next arrives, or none has for a while
            admitted = []
            while self._waiting and running + len(admitted) < self.max_batch:
                seq = self._waiting.popleft()
                if not seq.cancelled:
                    admitted.append(seq)
            return admitted

    def finished(self, seconds: float) -> None:
        """A request took `seconds` from submit to its last token: fold it into the estimate."""
        self.seconds_per_request = 0.8 * self.seconds_per_request + 0.2 * seconds
