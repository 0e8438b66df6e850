"""Each job is its own process running `gpuforge train` on its run directory (the same runner a user
calls by hand), started in a session of its own so that a server killed with SIGKILL leaves it running
to be re-attached. Cancel is SIGTERM (the runner checkpoints and exits 143), then SIGKILL after a grace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpuforge.runtime.host import is_alive

CANCEL_GRACE_S = 30.0
BAD_INPUT_EXIT = 2  # cli.py EXIT_BAD_INPUT: the runner refused its spec or data, and would again


@dataclass
class Launched:
    pid: int
    process: subprocess.Popen | None  # None for a process re-attached after a server restart


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
