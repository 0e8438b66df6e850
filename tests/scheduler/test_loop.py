"""The scheduling loop with real job processes, driven through the API: run, queue, cancel, restart."""

import os
import signal
import time

import pytest
import yaml
from fastapi.testclient import TestClient

from gpuforge.server.app import create_app
from gpuforge.server.settings import Settings
from tests.conftest import TEST_MODELS, image_spec


@pytest.fixture
def api(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFORGE_CPU_SLOTS", "1")  # one CPU job at a time: the second one queues
    settings = Settings(home=tmp_path / "home", data_roots=str(TEST_MODELS.parent))
    with TestClient(create_app(settings)) as client:
        key = (tmp_path / "home" / "admin.key").read_text().strip()
        client.headers["Authorization"] = f"Bearer {key}"
        yield client


def _submit(api, tmp_path, **train) -> int:
    spec = image_spec(tmp_path, **train)
    response = api.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _wait(api, job_id, until, timeout=120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = api.get(f"/api/v1/jobs/{job_id}").json()
        if until(job):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} never got there: {job}")


def test_jobs_run_one_slot_at_a_time_and_their_runs_are_ingested(api, tmp_path):
    first = _submit(api, tmp_path, max_steps=6)
    second = _submit(api, tmp_path, max_steps=4)
    a = _wait(api, first, lambda j: j["state"] == "finished")
    b = _wait(api, second, lambda j: j["state"] == "finished")
    assert (a["step"], a["total_steps"], a["devices"]) == (6, 6, "cpu:0")
    assert b["started_at"] >= a["finished_at"]  # one CPU slot: the second waited for the first
    kinds = [e["kind"] for e in api.get(f"/api/v1/jobs/{first}/events").json()]
    assert kinds[0] == "started" and kinds[-1] == "finished"


def test_cancel_stops_a_running_job_with_a_checkpoint(api, tmp_path):
    job_id = _submit(api, tmp_path, max_steps=500, options={"sleep_s": 0.05})
    _wait(api, job_id, lambda j: j["state"] == "running" and (j["step"] or 0) >= 2)
    assert api.post(f"/api/v1/jobs/{job_id}/cancel").json()["state"] == "running"  # stopping
    job = _wait(api, job_id, lambda j: j["state"] == "cancelled")
    kinds = [e["kind"] for e in api.get(f"/api/v1/jobs/{job_id}/events").json()]
    assert kinds[-2:] == ["checkpoint", "cancelled"] and job["reason"] == "cancelled by admin"


def test_a_killed_training_process_is_restarted_from_its_checkpoint(api, tmp_path):
    job_id = _submit(api, tmp_path, max_steps=60, checkpoint_every=5, options={"sleep_s": 0.05})
    running = _wait(api, job_id, lambda j: j["state"] == "running" and (j["step"] or 0) >= 12)
    pid = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_runner(int(p), running["run_dir"]))
    os.kill(pid, signal.SIGKILL)
    job = _wait(api, job_id, lambda j: j["state"] == "finished")
    assert job["step"] == 60 and "restart 1 of 2" in (job["reason"] or "")
    events = api.get(f"/api/v1/jobs/{job_id}/events").json()
    starts = [e for e in events if e["kind"] == "started"]
    assert len(starts) == 2 and starts[1]["data"]["resumed_from"] >= 10


def _is_runner(pid: int, run_dir: str) -> bool:
    try:
        return run_dir in open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return False
