"""Where jobs' processes run, as the scheduler sees it: the `Executor` protocol, and the one thing every
executor shares, the job's runner process.

Each job is its own process running `gpuforge train` on its run directory (the same runner a user
calls by hand), started in a session of its own so that a server killed with SIGKILL leaves it running
to be re-attached. Cancel is SIGTERM (the runner checkpoints and exits 143), then SIGKILL after a grace.
The runner then starts the job's ranks where the executor says: here, on a Ray cluster, as a Slurm job.
The implementations live in gpuforge/executors/ (one module each), chosen once from the settings by
`executors.build`; the scheduler knows this protocol alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gpuforge.runtime.host import is_alive

if TYPE_CHECKING:
    from gpuforge.scheduler.allocator import DeviceInfo
    from gpuforge.spec import JobSpec
    from gpuforge.store.ledger import Span
    from gpuforge.store.models import Job

CANCEL_GRACE_S = 30.0
BAD_INPUT_EXIT = 2  # cli.py EXIT_BAD_INPUT: the runner refused its spec or data, and would again


@dataclass
class Launched:
    pid: int
    process: subprocess.Popen | None  # None for a process re-attached after a server restart


class RunningRow(Protocol):
    """What an executor reads of a running job: its id, its runner's pid and run directory, and when its
    runner started (a Job, or a row of its columns)."""

    id: int
    run_started_at: datetime | None


class Executor(Protocol):
    """Where a job's ranks run. Built once from the settings (executors.build) and handed to the server
    and the scheduler, which ask it and never which kind it is. To add an executor, implement this in one
    module of gpuforge/executors/ and name it in `executors.build`.

    The server's side, in the order a server meets it: `check` before it listens, `devices` to hand out,
    `watch` while it serves, then each tick `take_stock` of the running jobs, before the ledger asks
    `runs_to_charge` and the queue `holds_devices_since`. The runner's side: `launches_ranks` and
    `launch_ranks`, in the `gpuforge train` process the scheduler started with `start_runner`."""

    rereads_devices: bool  # its devices change while the server serves (a Slurm partition's nodes)
    launches_ranks: bool  # every job's runner launches its ranks through it, one process or several

    def check(self) -> None:
        """Before the server listens: what the executor needs answers (a cluster, a partition), or a
        GpuforgeError saying what does not; never a hang at the first job."""

    def devices(self) -> list[DeviceInfo]:
        """The devices the scheduler hands out (read again every DEVICES_REFRESH_S if rereads_devices)."""

    def start_runner(self, spec_path: Path, run_dir: Path, env: dict[str, str]) -> Launched:
        """Start a job's runner (`gpuforge train`) with `env` as its whole environment."""

    def stop_runner(self, pid: int) -> None:
        """Ask a job's runner to stop: its ranks checkpoint and it exits."""

    def watch(self, stop: threading.Event) -> None:
        """Start what the executor watches while the server serves (in threads of its own) until `stop`."""

    def take_stock(self, running: Sequence[Job]) -> None:
        """Once a tick, before the ledger: what the executor knows of the running jobs now."""

    def runs_to_charge(self, job_id: int) -> list[Span] | None:
        """The spans a running job is charged within (as of take_stock), or None: its runner's life is
        its run, all of it charged."""

    def holds_devices_since(self, job: RunningRow) -> datetime | None:
        """When this run began to hold its devices (its max_time counts from there); None: not yet."""

    def launch_ranks(self, spec: JobSpec, out: Path) -> dict[str, Any]:
        """In the runner: run the job's ranks to their end; rank 0's summary (launch/job.py)."""


def launch(spec_path: Path, run_dir: Path, env: dict[str, str]) -> Launched:
    """Start the runner for one job with `env` as its whole environment (the scheduler's child_env: never
    the server's own); its stdout/stderr go to <run>/logs/process.log (appended: restarts)."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / "process.log").open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpuforge", "train", str(spec_path), "--out", str(run_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # outlives the server; signals to the server do not reach it
        )
    return Launched(process.pid, process)


def cancel(pid: int, grace_s: float = CANCEL_GRACE_S) -> str:
    """SIGTERM, then SIGKILL if the process is still there after `grace_s`; how it ended."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return "already gone"
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not is_alive(pid):
            return "stopped by SIGTERM"
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "stopped by SIGTERM"
    while is_alive(pid):
        time.sleep(0.05)
    return f"killed after {grace_s:g} s"
