"""When the server itself saw each Slurm job hold its nodes: runs that no file in a run directory can take
back.

The runner's marks (logs/slurm-running) say when a job ran, but they lie in its run directory, which the
job's own ranks can write: a job that rewrote them would pay for less than it ran. So a thread asks Slurm
(squeue) every READ_S which of the server's jobs hold their nodes, and the ledger charges the union of
what the runner wrote and what was seen here. A run seen here starts within a real run; a forged file can
hide at most the READ_S after a run starts, the time the server was away, and the time squeue does not
answer. Only code of an admin's choosing runs in a job (docs/security.md), and it could do worse: this
keeps a job's own files from deciding its cost, not a boundary against an admin.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from datetime import datetime

from gpuforge.runs import first_and_latest
from gpuforge.store.ledger import Span
from gpuforge.store.models import utcnow

log = logging.getLogger("gpuforge.scheduler")

READ_S = 1.0  # squeue is asked this often (one call for all the jobs), as each runner asks for its own
STALE_S = 5 * READ_S  # no answer from squeue for this long: its open runs end where they were last seen
UNANSWERED_WARN = 30  # reads in a row without an answer before the log says the check is off


class SeenHolding:
    """Jobs are known by their logs folder (the folder of the batch script each Slurm job was submitted
    with, which Slurm lets nobody change); `source` gives those of the jobs holding their nodes now, or None
    where Slurm did not answer (no run is ended by that).

    A run seen here stays open until a read no longer shows it, so a job is charged up to one read (READ_S
    and squeue's own time) past the end of each of its runs; while squeue does not answer, for no more than
    STALE_S: then the runner's file alone decides, as it does while the server is away."""

    def __init__(self, source: Callable[[], set[str] | None], clock: Callable[[], datetime] = utcnow):
        self.source, self.clock = source, clock
        self._lock = threading.Lock()
        self._runs: dict[str, list[list]] = {}  # logs folder -> [[first seen, last seen, still holding]]
        self._answered_at: datetime | None = None
        self._unanswered = 0
        self._idle = False  # no job runs (keep_only): squeue is not asked, the controller is spared

    def read(self) -> None:
        if self._idle:
            return
        asked = self.clock()
        holding = self.source()
        answered = self.clock()
        self._note_answer(holding is not None)
        if holding is None:
            return
        with self._lock:
            self._answered_at = answered
            for folder, runs in self._runs.items():
                if runs[-1][2] and folder not in holding:
                    runs[-1][2] = False  # ended since the last read: counted to when it was last seen
            for folder in holding:
                runs = self._runs.setdefault(folder, [])
                if runs and runs[-1][2]:
                    runs[-1][1] = asked  # it held until the question at least
                else:
                    runs.append([answered, answered, True])  # it held from the answer on at least

    def spans(self, folder: str, since: datetime | None = None, now: datetime | None = None) -> list[Span]:
        """The runs seen for this logs folder that began at `since` or later (an earlier attempt's are not
        this one's), the last one open while it holds its nodes and squeue answers."""
        now = now or self.clock()
        with self._lock:
            fresh = self._answered_at is not None and (now - self._answered_at).total_seconds() <= STALE_S
            return [
                (first, None if holding and fresh else last)
                for first, last, holding in self._runs.get(folder, [])
                if since is None or first >= since
            ]

    def keep_only(self, folders: Iterable[str]) -> None:
        """Forget the folders of jobs no longer running; of a job's runs, keep the first and the latest
        (runs.first_and_latest)."""
        keep = set(folders)
        with self._lock:
            self._idle = not keep
            self._runs = {f: first_and_latest(runs) for f, runs in self._runs.items() if f in keep}

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.read()
            except Exception as err:  # noqa: BLE001 (one failed read: the next one retries)
                log.warning("Slurm's running jobs not read: %s", err)
            stop.wait(READ_S)

    def _note_answer(self, answered: bool) -> None:
        if answered:
            if self._unanswered >= UNANSWERED_WARN:
                log.info("squeue answers again: Slurm jobs are charged as it shows them")
            self._unanswered = 0
            return
        self._unanswered += 1
        if self._unanswered == UNANSWERED_WARN:
            log.warning(
                "squeue has not answered %d times in a row: Slurm jobs are charged by their runners' marks "
                "alone until it does", UNANSWERED_WARN,
            )  # fmt: skip


def union(*span_lists: Iterable[Span]) -> list[Span]:
    """The spans as one ordered list without overlaps (an end None: open, past every other end)."""
    merged: list[Span] = []
    for start, end in sorted((s for spans in span_lists for s in spans), key=lambda s: s[0]):
        if merged and (merged[-1][1] is None or start <= merged[-1][1]):
            last_start, last_end = merged[-1]
            merged[-1] = (last_start, None if last_end is None or end is None else max(last_end, end))
        else:
            merged.append((start, end))
    return merged
