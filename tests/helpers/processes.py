"""Processes a test started under its own folder, ended at teardown: a deployment's replicas outlive the
server that started them (as they must across a server restart), so a test that fails before undeploying
would leave them running."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def kill_processes_under(folder: Path) -> list[int]:
    """SIGKILL every process whose command line names a path inside `folder`; their pids."""
    mark = str(folder).encode()
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(arg.startswith(mark) for arg in argv):
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except ProcessLookupError:
                pass
    return killed
