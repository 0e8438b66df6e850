"""Waiting on a real server's job, and finding its runner process: for the integration tests."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def wait_for(http, path: str, until, timeout: float = 120.0):
    """GET `path`'s answer once `until(answer)` holds; AssertionError with its last answer past `timeout`."""
    deadline = time.monotonic() + timeout
    found = None
    while time.monotonic() < deadline:
        found = http.get(path).json()
        if until(found):
            return found
        time.sleep(0.2)
    raise AssertionError(f"{path} never got there: {found}")


def wait_for_job(http, job_id: int, until, timeout: float = 120.0) -> dict:
    """The job's answer once `until(job)` holds; AssertionError with its last answer past `timeout`."""
    return wait_for(http, f"/api/v1/jobs/{job_id}", until, timeout)


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


def finished_job(client, owner: str, run_dir: Path, manifest: dict | None = None) -> int:
    """A job of key `owner`'s stored as finished with a classifier's model/ (nothing is run: its manifest
    is all a deploy reads), in the store of the app behind `client` (a TestClient)."""
    from sqlalchemy import select

    from gpuforge.store.db import session
    from gpuforge.store.models import ApiKey, Job

    (run_dir / "model").mkdir(parents=True)
    manifest = manifest or {"format": "state_dict", "kind": "full", "source": "bundled:tiny",
                            "task": "sequence-classification"}  # fmt: skip
    (run_dir / "model" / "gpuforge.json").write_text(json.dumps(manifest))
    with session(client.app.state.services.engine) as s:
        key = s.scalar(select(ApiKey).where(ApiKey.name == owner))
        job = Job(name="done", owner_id=key.id, project_id=key.project_id, state="finished", spec_yaml="",
                  run_dir=str(run_dir))  # fmt: skip
        s.add(job)
        s.flush()
        return job.id
