"""Host helpers every process kind needs: the cores it may use, a free loopback port, whether a pid lives.

Low in the layers (runtime/), so that the scheduler, the launchers and the deployments share one copy.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

from gpuforge.errors import GpuforgeError


def usable_cores() -> int:
    """The cores this process may run on (its affinity, e.g. a container's share), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def free_port(within: range | None = None) -> int:
    """A loopback port nothing listens on: any, or the first free one of `within` from a random place (so
    that two launches at once seldom try the same one); GpuforgeError when all of `within` are taken."""
    if within is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    start = random.randrange(len(within))
    for port in (*within[start:], *within[:start]):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise GpuforgeError(f"no free port in {within.start}-{within.stop - 1} (GPUFORGE_REPLICA_PORTS)")


def port_range(text: str | None) -> range | None:
    """GPUFORGE_REPLICA_PORTS' FIRST-LAST as a range (None: any port); GpuforgeError naming what is wrong."""
    if not text:
        return None
    first, last = (int(p) for p in text.split("-"))
    if not 1024 <= first <= last <= 65535:
        raise GpuforgeError(
            f"GPUFORGE_REPLICA_PORTS: {text!r}: FIRST-LAST with 1024 <= FIRST <= LAST <= 65535"
        )
    return range(first, last + 1)


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
