"""A data-parallel job through a real server: two CPU slots, two ranks, one run directory."""

import json

import pytest

from gpuforge.runs import RunDir
from gpuforge.server.local import LocalServer
from tests.helpers.cli import run_cli
from tests.helpers.ddp_specs import write_ddp_spec as write_spec

pytestmark = pytest.mark.slow  # every test here is slow (docs/testing.md)


def test_a_ddp_job_submitted_to_the_server_runs_on_two_slots(tmp_path, monkeypatch):
    spec = write_spec(tmp_path, "served", train={"max_steps": 8})
    server = LocalServer(
        tmp_path / "home",
        log=tmp_path / "server.log",
        GPUFORGE_DATA_ROOTS=str(tmp_path),
        GPUFORGE_CPU_SLOTS="2",
    )
    with server:
        monkeypatch.setenv("GPUFORGE_URL", server.url)
        monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
        submitted = run_cli("submit", str(spec), "--json")
        assert submitted.returncode == 0, submitted.stderr
        job = json.loads(submitted.stdout)
        waited = run_cli("wait", str(job["id"]), timeout=240)
        assert waited.returncode == 0, (
            waited.stdout + waited.stderr + (tmp_path / "server.log").read_text()[-3000:]
        )
        done = json.loads(run_cli("job", str(job["id"]), "--json").stdout)
    assert done["state"] == "finished" and done["devices_wanted"] == 2
    assert done["devices"] == "cpu:0,cpu:1"
    run = RunDir(done["run_dir"])
    assert run.summary()["processes"] == 2
    assert [m["step"] for m in run.metrics()] == list(range(1, 9))
