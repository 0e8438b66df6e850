"""What every executor shares: the job's runner is a child of the server on this machine (whatever runs its
ranks), stopped by SIGTERM; its devices are read once; its life is its run, charged whole."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from gpuforge.errors import GpuforgeError
from gpuforge.scheduler.allocator import DeviceInfo, parse_labels, with_labels
from gpuforge.scheduler.executor import Launched, RunningRow, launch

if TYPE_CHECKING:  # annotations only: a job's runner builds its executor without loading the store
    from gpuforge.store.ledger import Span
    from gpuforge.store.models import Job


class RunnerHere:
    """The part of the Executor protocol (scheduler/executor.py) the executors do alike. `labels` is
    GPUFORGE_DEVICE_LABELS as given, put on the devices the subclass's `_inventory` finds; `misplaced`,
    when given, says which options of another executor were set (refused by `check`)."""

    rereads_devices = False
    launches_ranks = False

    def __init__(self, labels: str = "", misplaced: str | None = None):
        self.labels, self.misplaced = labels, misplaced

    def check(self) -> None:
        if self.misplaced:
            raise GpuforgeError(self.misplaced)

    def devices(self) -> list[DeviceInfo]:
        try:
            labels = parse_labels(self.labels)
        except ValueError as err:
            raise GpuforgeError(str(err)) from None
        return with_labels(self._inventory(), labels)

    def _inventory(self) -> list[DeviceInfo]:
        raise NotImplementedError

    def start_runner(self, spec_path: Path, run_dir: Path, env: dict[str, str]) -> Launched:
        return launch(spec_path, run_dir, env)

    def stop_runner(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def watch(self, stop: threading.Event) -> None:
        return None

    def take_stock(self, running: Sequence[Job]) -> None:
        return None

    def runs_to_charge(self, job_id: int) -> list[Span] | None:
        return None

    def holds_devices_since(self, job: RunningRow) -> datetime | None:
        return job.run_started_at
