"""A running server job profiled on demand (`gpuforge profile JOB --steps N`): the request reaches the
runner through its run directory, the report and the trace come back through the API and the CLI, and
what cannot be profiled is refused with its reason."""

import gzip
import json

import httpx
import pytest

from gpuforge.server.local import LocalServer
from gpuforge.spec import load_spec
from tests.helpers.cli import run_cli
from tests.helpers.jobs import wait_for, wait_for_job
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.slow  # every test here is slow (docs/testing.md)


def test_a_running_job_profiles_its_next_steps_when_asked_and_the_report_comes_back(tmp_path, monkeypatch):
    long = image_spec(tmp_path, max_steps=2000, options={"sleep_s": 0.02})  # cancelled once profiled
    spec = write_spec(tmp_path / "job.yaml", long)
    with LocalServer(tmp_path / "home", log=tmp_path / "server.log") as server:
        monkeypatch.setenv("GPUFORGE_URL", server.url)
        monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
        http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"})
        job_id = server.client().submit(load_spec(spec))["id"]
        missing = http.get(f"/api/v1/jobs/{job_id}/profile")
        assert missing.status_code == 404 and "has no profile" in missing.json()["detail"]
        before = wait_for_job(http, job_id, lambda j: j["state"] == "running" and (j["step"] or 0) >= 3)

        asked = run_cli("profile", str(job_id), "--steps", "3")
        assert asked.returncode == 0 and f"job {job_id}: its runner profiles the 3 steps" in asked.stdout
        events = f"/api/v1/jobs/{job_id}/events"
        profiled = wait_for(http, events, lambda es: any(e["kind"] == "profiled" for e in es), timeout=60)
        event = next(e for e in profiled if e["kind"] == "profiled")["data"]
        assert event["steps"] == 3 and event["start_step"] > before["step"]  # the steps after the request
        assert not (tmp_path / "home" / "runs" / f"job-{job_id}" / "profile.request").exists()  # taken once

        report = http.get(f"/api/v1/jobs/{job_id}/profile").json()
        assert [s["step"] for s in report["steps"]] == [event["start_step"] + i for i in range(3)]
        assert report["breakdown"]["forward"]["share"] > 0.3  # the model's sleep is in its forward
        shown = run_cli("profile", str(job_id), "--trace", str(tmp_path / "trace.json.gz"))
        assert shown.returncode == 0 and "mean step" in shown.stdout and "forward" in shown.stdout
        trace = json.loads(gzip.decompress((tmp_path / "trace.json.gz").read_bytes()))
        assert any(e.get("name") == "gpuforge.forward" for e in trace["traceEvents"])
        http.post(f"/api/v1/jobs/{job_id}/cancel")

        # what cannot be asked: out of bounds, a job that has ended, another's job, no such trace
        assert http.post(f"/api/v1/jobs/{job_id}/profile", json={"steps": 0}).status_code == 422
        assert http.post(f"/api/v1/jobs/{job_id}/profile", json={"steps": 51}).status_code == 422
        wait_for_job(http, job_id, lambda j: j["state"] == "cancelled")
        ended = http.post(f"/api/v1/jobs/{job_id}/profile", json={"steps": 2})
        assert ended.status_code == 409 and "not running" in ended.json()["detail"]
        assert http.get(f"/api/v1/jobs/{job_id}/profile/trace", params={"rank": 1}).status_code == 404
        alice = json.loads(run_cli("keys", "create", "alice", "--json").stdout)["key"]
        theirs = http.get(f"/api/v1/jobs/{job_id}/profile", headers={"Authorization": f"Bearer {alice}"})
        assert theirs.status_code == 404  # others' jobs do not exist for a key without a project in common
        script = write_spec(
            tmp_path / "s.yaml",
            {"name": "s", "kind": "script", "script": {"command": "python s.py", "files": ["s.py"]}},
        )
        (tmp_path / "s.py").write_text("print('hello')\n")
        script_id = server.client().submit(load_spec(script))["id"]
        refused = http.post(f"/api/v1/jobs/{script_id}/profile", json={"steps": 2})
        assert refused.status_code == 422 and "runs its own loop" in refused.json()["detail"]
        gone = run_cli("profile", "999", "--steps", "2")
        assert gone.returncode == 2 and "no job 999" in gone.stderr
