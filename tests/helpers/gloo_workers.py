"""Run a few worker processes of one gloo job for a test, under a hard timeout.

A hang fails the test with the workers' last log lines instead of blocking the suite; a machine where gloo
cannot start a process group at all skips it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def run_workers(commands: list[list[str]], logs: list[Path], timeout: float, started_marker: str) -> None:
    """Start each command (its output into its log), wait for all, kill them past `timeout`. Fails the test
    if any exits non-zero; skips it if they failed in init_process_group before `started_marker` showed."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = []
    for command, path in zip(commands, logs, strict=True):
        with open(path, "w") as log:
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {len(procs)}-process job hung (over {timeout}s); last log lines:\n{tails(logs)}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        text = tails(logs)
        if "init_process_group" in text and started_marker not in text:
            pytest.skip(f"gloo could not start a process group on 127.0.0.1 here:\n{text}")
        pytest.fail(f"processes exited with {[p.returncode for p in procs]}:\n{text}")


def tails(logs: list[Path]) -> str:
    return "\n".join(
        f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-15:]) for p in logs if p.exists()
    )
