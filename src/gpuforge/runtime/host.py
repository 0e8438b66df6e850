"""Host helpers every process kind needs: the cores it may use, a free loopback port, whether a pid lives.

Low in the layers (runtime/), so that the scheduler, the launchers and the deployments share one copy.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def usable_cores() -> int:
    """The cores this process may run on (its affinity, e.g. a container's share), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
