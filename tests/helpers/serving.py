"""`gpuforge serve` as a real process on loopback, for tests that talk to it over HTTP or a raw socket."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpuforge.runtime.host import free_port
from gpuforge.server.local import wait_until_ready


def start_serve(model_dir: Path, *options: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """The serving process, ready, and its URL; the caller stops it. Fails if it is not ready in 90 s."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuforge", "serve", str(model_dir), "--port", str(port), *options],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    if wait_until_ready(url, process, 90):
        return process, url
    process.kill()
    raise AssertionError(f"serve did not get ready: {process.stdout.read()}")
