"""`gpuforge server` as a real process on loopback, for tests that drive it from outside."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(home: Path, port: int, **env: str) -> subprocess.Popen:
    """Start a server on 127.0.0.1:`port` with GPUFORGE_HOME=`home` (and `env`); return once it is ready."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuforge", "server", "--port", str(port)],
        env={**os.environ, "GPUFORGE_HOME": str(home), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            if process.poll() is not None:
                break
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"server did not start: {process.stdout.read()}")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
