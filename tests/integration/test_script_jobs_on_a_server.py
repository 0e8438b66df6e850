"""A script job on a real server shows what its script reported, as a spec job does: the total it declared
(track.total_steps), the last loss it logged (also when its eval comes on a line of its own), the cost the
ledger charged, and charts of its figures only (not of the time each line was written). A job paused by
its budget says how to go on there: `gpuforge resume`, not a rerun."""

import json
from datetime import datetime

import httpx
import pytest

from gpuforge.server.local import LocalServer
from tests.helpers.cli import run_cli
from tests.helpers.jobs import wait_for_job
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.slow  # every test here is slow (docs/testing.md)

# a loop of a team's own: the loss and the accuracy on lines of their own, the loss first
COUNT = """
import sys, time
from gpuforge import track

steps = int(sys.argv[1])
if "declare" in sys.argv:
    track.total_steps(steps)
for step in range(steps):
    time.sleep(0.1)
    track.log(step, loss=1.0 / (step + 1))
    track.log(step, accuracy=step / steps)
"""

USD_PER_HOUR = 36.0


@pytest.fixture
def server(tmp_path, monkeypatch):
    with LocalServer(tmp_path / "home", log=tmp_path / "server.log") as server:
        monkeypatch.setenv("GPUFORGE_URL", server.url)
        monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
        yield server


def _api(server: LocalServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"})


def _script_job(tmp_path, name: str, command: str, cost: dict | None = None):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "count.py").write_text(COUNT)
    spec = {"name": name, "kind": "script", "script": {"command": command, "files": ["count.py"]}}
    return write_spec(folder / "job.yaml", {**spec, "cost": cost or {"usd_per_hour": USD_PER_HOUR}})


def _submit(spec) -> int:
    submitted = run_cli("submit", str(spec), "--json")
    assert submitted.returncode == 0, submitted.stderr
    return json.loads(submitted.stdout)["id"]


def _seconds(job: dict) -> float:
    started, ended = (datetime.fromisoformat(job[k]) for k in ("started_at", "finished_at"))
    return (ended - started).total_seconds()


def test_a_script_job_shows_its_declared_total_its_last_loss_its_cost_and_no_chart_of_time(tmp_path, server):
    http = _api(server)
    declared = _submit(_script_job(tmp_path, "declared", "python count.py 12 declare"))
    silent = _submit(_script_job(tmp_path, "silent", "python count.py 5"))
    done = lambda j: j["state"] not in ("queued", "running")  # noqa: E731
    job = wait_for_job(http, declared, done)
    assert job["state"] == "finished", job
    assert (job["step"], job["total_steps"]) == (11, 12)
    assert job["loss"] == pytest.approx(1 / 12)  # step 11's, though an accuracy line came after it
    summary = http.get(f"/api/v1/jobs/{declared}/summary").json()
    assert (summary["total_steps"], summary["final_loss"]) == (12, job["loss"])
    # the ledger charged it, at its rate, for no longer than it held its device (a tick's margin)
    assert 0 < job["cost_usd"] <= USD_PER_HOUR * (_seconds(job) + 1.0) / 3600
    charts = http.get(f"/api/v1/jobs/{declared}/series").json()["metrics"]
    assert sorted(charts) == ["accuracy", "loss"]  # not `ts`, the time each line was written
    assert charts["loss"]["step"] == list(range(12))

    other = wait_for_job(http, silent, done)
    assert other["state"] == "finished" and other["total_steps"] is None and other["step"] == 4
    table = run_cli("jobs")
    assert table.returncode == 0, table.stderr
    cells = [[c.strip() for c in line.split("│")] for line in table.stdout.splitlines() if "│" in line]
    rows = {row[2]: row for row in cells}  # | id | name | project | state | devices | step | loss | ...
    assert rows["declared"][6:8] == ["11/12", "0.0833"]
    assert rows["silent"][6] == "4"  # no total said: the step alone, not 4/None


def test_a_job_paused_by_its_budget_on_a_server_says_gpuforge_resume(tmp_path, server):
    http = _api(server)
    spec = image_spec(tmp_path, max_steps=200, options={"sleep_s": 0.05})
    spec["cost"] = {"usd_per_hour": 3600.0, "budget_usd": 0.3}  # a dollar a second: paused within a second
    spec_job = _submit(write_spec(tmp_path / "spec.yaml", spec))
    script_cost = {"usd_per_hour": 3600.0, "budget_usd": 0.3}
    script_job = _submit(_script_job(tmp_path, "script", "python count.py 200", script_cost))
    for job_id in (spec_job, script_job):
        job = wait_for_job(http, job_id, lambda j: j["state"] not in ("queued", "running"))
        assert job["state"] == "paused" and "cost.budget_usd 0.3 spent" in job["reason"], job
        logs = run_cli("logs", str(job_id), "--tail", "20")
        assert logs.returncode == 0, logs.stderr
        assert f"`gpuforge resume {job_id} --budget USD`" in logs.stdout, logs.stdout
        assert "rerun" not in logs.stdout  # the local wording (tests/test_cli.py) stays local
