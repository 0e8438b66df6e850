"""`gpuforge server` as a real process on loopback, driven by the client verbs."""

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import ROOT, run_cli


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_server(tmp_path, monkeypatch):
    port = _free_port()
    env = {
        **os.environ,
        "GPUFORGE_HOME": str(tmp_path / "home"),
        "GPUFORGE_DATA_ROOTS": str(ROOT / "examples"),
        "GPUFORGE_SCHEDULE": "false",  # the API and client alone: jobs stay queued
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuforge", "server", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        process.kill()
        pytest.fail(f"server did not start: {process.stdout.read()}")
    key = (tmp_path / "home" / "admin.key").read_text().strip()
    monkeypatch.setenv("GPUFORGE_URL", url)
    monkeypatch.setenv("GPUFORGE_API_KEY", key)
    yield url, process
    process.terminate()
    process.wait(10)


def test_submit_list_and_cancel_through_the_cli(live_server):
    url, process = live_server
    submitted = run_cli("submit", str(ROOT / "examples" / "digits-cnn.yaml"), "--priority", "3", "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["id"]
    listed = json.loads(run_cli("jobs", "--json").stdout)
    assert [(j["id"], j["state"], j["priority"]) for j in listed] == [(job_id, "queued", 3)]
    assert "queued" in run_cli("jobs").stdout
    assert run_cli("cancel", str(job_id)).stdout.strip() == f"job {job_id}: cancelled"
    again = run_cli("cancel", str(job_id))
    assert again.returncode == 2
    assert (
        again.stderr.strip().splitlines()[-1]
        == f"gpuforge: error: server answered 409: job {job_id} is already cancelled"
    )
    assert process.poll() is None  # still up


def test_client_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUFORGE_API_KEY", raising=False)
    result = run_cli("jobs")
    assert result.returncode == 2 and "no API key" in result.stderr
    monkeypatch.setenv("GPUFORGE_API_KEY", "gf_x")
    result = run_cli("jobs", "--url", f"http://127.0.0.1:{_free_port()}")
    assert result.returncode == 2 and "server unreachable" in result.stderr
