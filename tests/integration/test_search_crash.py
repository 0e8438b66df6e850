"""Kill -9 the server during a search, start it again: the search goes on, no trial is lost or asked
twice, and its study agrees with its jobs; on SQLite and on PostgreSQL (the study in Optuna's tables
beside the store's)."""

import json
import os
import signal

import httpx
import pytest
import yaml

from gpuforge.server.local import LocalServer
from tests.helpers.jobs import runner_pid, wait_for
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow


def test_a_search_goes_on_after_its_server_is_killed_with_every_trial_once(tmp_path, store_url):
    home = tmp_path / "home"
    env = {"GPUFORGE_CPU_SLOTS": "1", "GPUFORGE_DATA_ROOTS": str(TEST_MODELS.parent)}
    env["GPUFORGE_DB"] = store_url
    server = LocalServer(home, log=tmp_path / "server.log", **env).start()
    http = httpx.Client(base_url=server.url, timeout=10)
    http.headers["Authorization"] = f"Bearer {server.key}"
    tune = {
        "objective": {"metric": "eval_accuracy"},
        "parameters": {"train.lr": {"loguniform": [1.0e-3, 3.0e-2]}},
        "sampler": "random", "seed": 0, "max_trials": 2, "parallel": 1,
    }  # fmt: skip
    train = {"max_steps": 60, "eval_every": 10, "checkpoint_every": 5, "options": {"sleep_s": 0.05}}
    spec = {**image_spec(None, **train), "tune": tune}
    try:
        search_id = http.post("/api/v1/searches", json={"spec": yaml.safe_dump(spec)}).json()["id"]
        path = f"/api/v1/searches/{search_id}"
        second = lambda d: any(t["number"] == 1 and t["state"] == "running" and t["job"] for t in d["trials"])  # noqa: E501, E731
        running = wait_for(http, path, second, timeout=180.0)
        job = next(t["job"] for t in running["trials"] if t["number"] == 1)
        wait_for(http, f"/api/v1/jobs/{job}", lambda j: (j["step"] or 0) >= 12, timeout=120.0)
        server.kill()  # SIGKILL, mid-search
        pid = runner_pid(str(home / "runs" / f"job-{job}"))
        if pid:
            os.kill(pid, signal.SIGKILL)  # and the trial's runner with it: it resumes from its checkpoint
        server.start()
        doc = wait_for(http, path, lambda d: d["state"] != "running", timeout=240.0)
        assert doc["state"] == "finished", doc
        assert [t["number"] for t in doc["trials"]] == [0, 1]  # none lost, none asked twice
        jobs = [http.get(f"/api/v1/jobs/{t['job']}").json() for t in doc["trials"]]
        assert len({j["id"] for j in jobs}) == 2
        searched = http.get("/api/v1/jobs", params={"search": search_id}).json()
        assert sorted(j["id"] for j in searched) == sorted(j["id"] for j in jobs)  # none the study lacks
        for trial, j in zip(doc["trials"], jobs, strict=True):
            assert j["state"] == trial["state"] and trial["state"] in ("finished", "pruned")
            evaluated = [s for s, _ in trial["curve"]]
            assert evaluated == sorted(set(evaluated))  # each evaluation told once
        resumed = jobs[1]
        assert resumed["restarts"] == 1 and resumed["state"] in ("finished", "pruned")
        events = http.get(f"/api/v1/jobs/{resumed['id']}/events").json()
        starts = [e for e in events if e["kind"] == "started"]
        assert len(starts) == 2 and starts[1]["data"]["resumed_from"] is not None
        steps = [json.loads(line)["step"] for line in open(f"{resumed['run_dir']}/metrics.jsonl")]
        assert steps == sorted(set(steps))
    finally:
        server.stop()
