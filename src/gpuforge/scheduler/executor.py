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


def is_alive(pid: int | None, run_dir: str | None = None) -> bool:
    """Whether `pid` is a live process (the runner of `run_dir`, when given: after a server restart the
    pid may have been reused by another program). A finished child not yet reaped (a zombie) counts as
    dead, and is left for its Popen to reap, so that its exit code is not lost."""
    if not pid:
        return False
    if run_dir is not None and not _runs(pid, run_dir):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _runs(pid: int, run_dir: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return not Path("/proc").is_dir()  # no /proc (not Linux): trust the pid
    return os.fsencode(run_dir) in argv


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


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
