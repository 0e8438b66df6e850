"""The Ray actor that runs one rank on a node: it starts the rank's command as a subprocess, keeps its output
lines until the driver (``ray_ranks.py``) polls them, and stops it on request.

This module travels to the nodes by value (``ray_ranks.run_ranks`` registers it with Ray's cloudpickle), so
a worker hosts the actor without importing it; what it imports by name (``gpuforge.child_env``,
``gpuforge.launch.ray_cluster``) stays light, with no torch.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

from gpuforge.child_env import child_environment
from gpuforge.launch.ray_cluster import RayLaunchError

_MAX_LINES = 2000  # lines per poll answer

# Started between the actor and the rank's command on Linux: the command gets SIGKILL when the thread of
# the actor that started it ends (an actor killed while its rank runs leaves no orphan).
_DIE_WITH_PARENT = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"  # PR_SET_PDEATHSIG
    "os.getppid() == int(sys.argv[1]) or os._exit(137)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class RankProcess:
    """Ray actor (threaded): runs one rank's command and keeps its output lines until polled."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lines: collections.deque[str] = collections.deque()
        self._cond = threading.Condition()
        self._eof = False
        self._rc: int | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None

    def where(self) -> dict[str, Any]:
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def start(self, argv: list[str], env: dict[str, str], cwd: str) -> int:
        if self._proc is not None:
            raise RuntimeError("this actor already runs a rank")
        if not os.path.isdir(cwd):
            import ray

            raise RayLaunchError(
                f"directory {cwd} does not exist on node {ray.util.get_node_ip_address()} "
                f"({socket.gethostname()}): the run directory must be on a filesystem every node sees "
                "under the same path (NFS across machines)"
            )
        argv = list(argv)
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable  # the Python this node's Ray runs, with gpuforge installed
        # the node's own environment cut to the allow-list (a Ray node may hold its operator's secrets),
        # then what the launcher sent on purpose
        full_env = child_environment(env)
        threading.Thread(target=self._run, args=(argv, full_env, cwd), daemon=True).start()
        self._started.wait()
        if self._start_error is not None:
            raise RayLaunchError(f"cannot start {argv[0]!r}: {self._start_error}")
        assert self._proc is not None
        return self._proc.pid

    def _run(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        # This thread starts the process and lives until the output ends, which is after the process ended:
        # the death signal set in the child fires when the thread that forked it ends.
        if sys.platform.startswith("linux"):
            argv = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]
        try:
            self._proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,  # its own process group: signals reach the rank's children too
            )
        except OSError as e:
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        threading.Thread(target=self._reap, daemon=True).start()
        assert self._proc.stdout is not None
        for raw in iter(self._proc.stdout.readline, b""):
            with self._cond:
                self._lines.append(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _reap(self) -> None:
        assert self._proc is not None
        rc = self._proc.wait()
        # The rank is over: children of it still holding the output pipe open would keep the rank "running".
        with contextlib.suppress(OSError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        with self._cond:
            self._rc = rc
            self._cond.notify_all()

    def poll(self, wait_s: float) -> tuple[list[str], bool, int | None]:
        """``(lines, finished, exit code)``: waits up to ``wait_s`` for a line or the end."""
        with self._cond:
            if not self._lines and not (self._eof and self._rc is not None):
                self._cond.wait(wait_s)
            n = min(len(self._lines), _MAX_LINES)
            lines = [self._lines.popleft() for _ in range(n)]
            finished = self._eof and self._rc is not None and not self._lines
            return lines, finished, self._rc if finished else None

    def terminate(self, grace_s: float) -> int | None:
        """SIGTERM to the rank's process group, SIGKILL after ``grace_s``; its exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()
