"""Kill -9 the server while jobs run, start it again: a job whose process still runs is re-attached, one
whose process died with the server is re-queued and resumes from its checkpoint, and nothing stored
before the crash is lost or stored twice."""

import json
import os
import signal
import time

import httpx
import pytest
import yaml

from gpuforge.server.local import LocalServer
from tests.helpers.jobs import runner_pid, wait_for_job
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow


def test_a_server_killed_mid_run_re_attaches_and_re_queues_its_jobs(tmp_path):
    home = tmp_path / "home"
    env = {"GPUFORGE_CPU_SLOTS": "2", "GPUFORGE_DATA_ROOTS": str(TEST_MODELS.parent)}
    server = LocalServer(home, log=tmp_path / "server.log", **env).start()
    http = httpx.Client(base_url=server.url, timeout=10)
    http.headers["Authorization"] = f"Bearer {server.key}"
    try:
        ids = []
        for _ in range(2):
            spec = image_spec(tmp_path, max_steps=60, checkpoint_every=5, options={"sleep_s": 0.1})
            ids.append(http.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)}).json()["id"])
        survivor, victim = (
            wait_for_job(http, i, lambda j: (j["step"] or 0) >= 12, timeout=180.0) for i in ids
        )
        before = {i: http.get(f"/api/v1/jobs/{i}/events").json() for i in ids}

        server.kill()  # SIGKILL: the server dies between two ticks, or in one
        os.kill(runner_pid(victim["run_dir"]), signal.SIGKILL)  # and this job's runner with it
        time.sleep(1.0)  # the survivor goes on writing while no server watches

        server.start()  # the same home and port
        kept = wait_for_job(
            http, survivor["id"], lambda j: j["state"] != "running" or (j["step"] or 0) >= 30, timeout=180.0
        )
        # re-attached, not restarted: on a busy machine the restarted server may first look after the
        # survivor's last step, when it is already finished; either way by its own first process
        assert kept["state"] in ("running", "finished") and kept["restarts"] == 0
        done = [
            wait_for_job(http, i, lambda j: j["state"] not in ("queued", "running"), timeout=180.0)
            for i in ids
        ]
        assert [j["state"] for j in done] == ["finished", "finished"]
        assert done[0]["restarts"] == 0 and done[1]["restarts"] == 1
        for job_id in ids:
            events = http.get(f"/api/v1/jobs/{job_id}/events").json()
            assert [e["seq"] for e in events] == list(range(len(events)))  # none lost, none twice
            assert events[: len(before[job_id])] == before[job_id]  # what was stored stays as it was
            run_dir = done[ids.index(job_id)]["run_dir"]
            on_disk = [json.loads(line)["event"] for line in open(f"{run_dir}/events.jsonl")]
            assert [e["kind"] for e in events] == on_disk
            steps = [m["step"] for m in http.get(f"/api/v1/jobs/{job_id}/metrics").json()]
            assert steps == list(range(1, 61))
        starts = [e for e in http.get(f"/api/v1/jobs/{ids[1]}/events").json() if e["kind"] == "started"]
        assert len(starts) == 2 and starts[1]["data"]["resumed_from"] >= 10
        kept_starts = [e for e in http.get(f"/api/v1/jobs/{ids[0]}/events").json() if e["kind"] == "started"]
        assert len(kept_starts) == 1  # the survivor's one process ran it from its first step to its last
    finally:
        server.stop()
        for job_id in ids:
            pid = runner_pid(str(home / "runs" / f"job-{job_id}"))
            if pid:
                os.kill(pid, signal.SIGKILL)
