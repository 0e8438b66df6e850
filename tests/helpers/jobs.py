"""Waiting on a real server's job, and finding its runner process: for the integration tests."""

from __future__ import annotations

import os
import time


def wait_for_job(http, job_id: int, until, timeout: float = 120.0) -> dict:
    """The job's answer once `until(job)` holds; AssertionError with its last answer past `timeout`."""
    deadline = time.monotonic() + timeout
    job = None
    while time.monotonic() < deadline:
        job = http.get(f"/api/v1/jobs/{job_id}").json()
        if until(job):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} never got there: {job}")


def runner_pid(run_dir: str) -> int | None:
    """The pid of the process whose command line names `run_dir` (a job's runner), or None."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if run_dir.encode() in argv:
                return int(entry)
    return None
