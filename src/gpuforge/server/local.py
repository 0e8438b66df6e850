"""A gpuforge server as a child process on loopback: what the demo, the benchmarks and the tests start.

with LocalServer(home) as server:          # a free port, GPUFORGE_HOME=home
    client = server.client()
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gpuforge.errors import GpuforgeError
from gpuforge.runtime.host import free_port


def wait_until_ready(url: str, process: subprocess.Popen, timeout: float) -> bool:
    """Whether the gpuforge process at `url` answers /readyz with 200 within `timeout` (False as soon as
    the process has ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            return False
        time.sleep(0.1)
    return False


def stop_process(process: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM, and SIGKILL if it has not ended within `grace_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class LocalServer:
    def __init__(self, home: Path, port: int | None = None, log: Path | None = None, **env: str):
        self.home, self.port = Path(home), port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env, self.log_path = env, log
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> LocalServer:
        self.home.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpuforge", "server", "--port", str(self.port)],
                env={**os.environ, "GPUFORGE_HOME": str(self.home), **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the caller only; it stops the server itself
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # the child has its own copy
        if wait_until_ready(self.url, self.process, timeout):
            return self
        self.stop()
        where = f"; see {self.log_path}" if self.log_path else ""
        raise GpuforgeError(f"the local server on port {self.port} did not start{where}")

    @property
    def key(self) -> str:
        return (self.home / "admin.key").read_text().strip()

    def client(self):
        from gpuforge.client import Client

        return Client(self.url, self.key)

    def kill(self) -> None:
        """SIGKILL: a crash, for tests of recovery."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
