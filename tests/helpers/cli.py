"""`gpuforge` as a user runs it: a child process of this interpreter, its output captured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpuforge", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        # wide enough that rich never wraps a line a test matches
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
