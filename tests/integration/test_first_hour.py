"""What a newcomer meets through a server: a job's log without third-party noise, a deployment answering
`predict --json`, and `deployments` listing the live ones (`--all`: the stopped too)."""

import json
import time

import pytest

from gpuforge.server.local import LocalServer
from tests.helpers.cli import run_cli
from tests.helpers.output import OWN_LINE
from tests.helpers.specs import write_spec

pytestmark = pytest.mark.slow


def _wait_for(check, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.5)
    raise AssertionError("never happened")


def _json(*args):
    result = run_cli(*args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_job_log_a_deployment_and_the_deployments_list(tmp_path, monkeypatch, small_topics):
    spec = {
        "name": "topics",
        "model": {"source": "bundled:minilm", "task": "sequence-classification"},
        "data": {"train": str(small_topics), "max_length": 32, "eval_fraction": 0.25},
        "train": {"max_steps": 2, "batch_size": 8, "precision": "fp32"},
    }
    with LocalServer(tmp_path / "home", log=tmp_path / "server.log") as server:  # scheduling on
        monkeypatch.setenv("GPUFORGE_URL", server.url)
        monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
        job_id = _json("submit", str(write_spec(tmp_path / "job.yaml", spec)))["id"]
        assert run_cli("wait", str(job_id), timeout=300).returncode == 0

        log = run_cli("logs", str(job_id), "--tail", "500")
        assert log.returncode == 0 and "finished at step 2/2" in log.stdout, log.stderr
        # the runner's process.log: gpuforge's own lines, none of torchao's, torch's or transformers'
        assert [line for line in log.stdout.splitlines() if not OWN_LINE.fullmatch(line.rstrip())] == []

        made = run_cli("deploy", str(job_id), "--name", "topics", "--wait", timeout=300)
        assert made.returncode == 0, made.stderr
        answer = _json("predict", "topics", "the match went to extra time", "bake it for an hour")
        assert len(answer["outputs"]) == 2 and all({"label", "score"} <= set(o) for o in answer["outputs"])
        assert {o["label"] for o in answer["outputs"]} <= {"cooking", "sports", "technology", "weather"}
        assert [d["name"] for d in _json("deployments")] == ["topics"]

        assert run_cli("undeploy", "topics").returncode == 0
        _wait_for(lambda: [d["state"] for d in _json("deployments", "--all")] == ["stopped"])
        assert _json("deployments") == []  # stopped: history, shown with --all only
        assert "topics" not in run_cli("deployments").stdout
        assert "stopped" in run_cli("deployments", "--all").stdout
