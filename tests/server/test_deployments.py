"""Deployments through the server, with real processes: a finished job's model served by two replicas
behind the server's address, a dead replica restarted, undeploy, and the refusals."""

import os
import signal

import pytest
import yaml
from fastapi.testclient import TestClient
from sklearn.datasets import load_digits

from gpuforge.server.app import create_app
from gpuforge.server.settings import Settings
from tests.helpers.jobs import wait_for
from tests.helpers.paths import TEST_MODELS
from tests.helpers.processes import kill_processes_under
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow


@pytest.fixture
def api(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFORGE_CPU_SLOTS", "2")
    settings = Settings(home=tmp_path / "home", data_roots=str(TEST_MODELS.parent))
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = "Bearer " + (tmp_path / "home" / "admin.key").read_text().strip()
        yield client
    kill_processes_under(tmp_path)


def test_a_finished_job_served_by_two_replicas_behind_the_server(api, tmp_path):
    spec = image_spec(tmp_path, max_steps=4)
    job_id = api.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)}).json()["id"]
    early = api.post("/api/v1/deployments", json={"job_id": job_id, "name": "digits"})
    assert early.status_code == 409 and "no trained model" in early.json()["detail"]
    wait_for(api, f"/api/v1/jobs/{job_id}", lambda j: j["state"] == "finished")

    too_many = api.post("/api/v1/deployments", json={"job_id": job_id, "name": "digits", "replicas": 3})
    assert too_many.status_code == 422 and "this server has 2 cpu device(s)" in too_many.json()["detail"]
    made = api.post("/api/v1/deployments", json={"job_id": job_id, "name": "digits", "replicas": 2,
                                                 "options": {"max_batch": 8}})  # fmt: skip
    assert made.status_code == 201 and made.json()["state"] == "starting", made.text
    # the same name again is the deployment's next version, which keeps its replicas and options
    again = api.post("/api/v1/deployments", json={"job_id": job_id, "name": "digits", "replicas": 1})
    assert again.status_code == 422 and "keeps its replicas and options" in again.json()["detail"]
    ready = wait_for(api, "/api/v1/deployments/digits", lambda d: d["state"] == "ready")
    assert [w["ready"] for w in ready["workers"]] == [True, True]

    images = (load_digits().images[:2] / 16.0).tolist()
    replicas = set()
    for _ in range(6):
        answer = api.post("/api/v1/deployments/digits/predict", json={"inputs": images})
        assert answer.status_code == 200 and len(answer.json()["outputs"]) == 2, answer.text
        replicas.add(answer.headers["x-gpuforge-replica"])
    assert replicas == {"0", "1"}  # spread over both
    bad = api.post("/api/v1/deployments/digits/predict", json={"inputs": []})
    assert bad.status_code == 422  # the replica's own answer, passed through

    # the dashboard's figures, from each replica's own metrics: over its life at the first look, then
    # over the time since the last look
    stats = api.get("/api/v1/deployments/digits/stats").json()["replicas"]
    assert [(r["index"], r["ready"]) for r in stats] == [(0, True), (1, True)]
    assert all(r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] and r["requests_per_s"] is None for r in stats)
    assert api.post("/api/v1/deployments/digits/predict", json={"inputs": images}).status_code == 200
    stats = api.get("/api/v1/deployments/digits/stats").json()["replicas"]
    assert sum(r["requests_per_s"] for r in stats) > 0 and all(r["in_flight"] == 0 for r in stats)

    pid = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _serves(int(p), ready["model_dir"]))
    os.kill(pid, signal.SIGKILL)

    def restarts(d):
        return sum(w["restarts"] for w in d["workers"])

    back = wait_for(api, "/api/v1/deployments/digits", lambda d: d["state"] == "ready" and restarts(d) == 1)
    assert back["state"] == "ready"

    stopping = api.delete("/api/v1/deployments/digits")
    assert stopping.status_code == 200 and stopping.json()["state"] == "stopping"
    wait_for(api, "/api/v1/deployments/digits", lambda d: d["state"] == "stopped")
    assert not any(_serves(int(p), ready["model_dir"]) for p in os.listdir("/proc") if p.isdigit())
    assert api.post("/api/v1/deployments/digits/predict", json={"inputs": images}).status_code == 404
    assert api.delete("/api/v1/deployments/digits").status_code == 409
    assert api.post("/api/v1/deployments", json={"job_id": 999, "name": "x"}).status_code == 404


def _serves(pid: int, model_dir: str) -> bool:
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    return b"serve" in argv and model_dir.encode() in argv


def test_an_onnx_export_its_compress_section_made_is_deployed_by_name(api, tmp_path):
    pytest.importorskip("onnxruntime", reason="the export extra (onnx, onnxruntime) is not installed")
    spec = {**image_spec(tmp_path, max_steps=4), "compress": {"onnx": True}}
    job_id = api.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)}).json()["id"]
    wait_for(api, f"/api/v1/jobs/{job_id}", lambda j: j["state"] == "finished", timeout=240)
    missing = api.post(
        "/api/v1/deployments", json={"job_id": job_id, "name": "d", "model": "compressed/int4"}
    )
    assert missing.status_code == 409 and "has no compressed/int4" in missing.json()["detail"]
    outside = api.post("/api/v1/deployments", json={"job_id": job_id, "name": "d", "model": "../model"})
    assert outside.status_code == 422  # a variant is a name under compressed/, never a path
    body = {"job_id": job_id, "name": "d", "model": "compressed/onnx-fp32", "options": {"quantize": "int8"}}
    requantized = api.post("/api/v1/deployments", json=body)
    assert requantized.status_code == 422 and "an ONNX export" in requantized.json()["detail"]

    made = api.post(
        "/api/v1/deployments", json={"job_id": job_id, "name": "onnx", "model": "compressed/onnx-int8"}
    )
    assert made.status_code == 201 and made.json()["model_dir"].endswith("compressed/onnx-int8"), made.text
    wait_for(api, "/api/v1/deployments/onnx", lambda d: d["state"] == "ready", timeout=240)
    images = (load_digits().images[:3] / 16.0).tolist()
    answer = api.post("/api/v1/deployments/onnx/predict", json={"inputs": images})
    assert answer.status_code == 200 and len(answer.json()["outputs"]) == 3, answer.text


@pytest.fixture
def one_slot_api(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFORGE_CPU_SLOTS", "1")  # one slot: what fractions share
    settings = Settings(home=tmp_path / "home", data_roots=str(TEST_MODELS.parent))
    try:
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = (
                "Bearer " + (tmp_path / "home" / "admin.key").read_text().strip()
            )
            yield client
    finally:  # replicas outlive the server: none is left running, whatever failed
        kill_processes_under(tmp_path)


def test_replicas_on_half_a_slot_each_share_it_with_a_half_slot_job(one_slot_api, tmp_path):
    api = one_slot_api
    spec = image_spec(tmp_path, max_steps=4)
    job_id = api.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)}).json()["id"]
    wait_for(api, f"/api/v1/jobs/{job_id}", lambda j: j["state"] == "finished")
    odd = api.post("/api/v1/deployments", json={"job_id": job_id, "name": "digits", "devices": 0.33})
    assert odd.status_code == 422 and "devices: 0.33: a fraction of a device is a multiple of" in odd.text
    too_many = api.post(
        "/api/v1/deployments", json={"job_id": job_id, "name": "digits", "devices": 0.5, "replicas": 3}
    )
    assert too_many.status_code == 422 and "room for 2 at 0.5 on its 1 cpu device(s)" in too_many.text
    made = api.post("/api/v1/deployments", json={"job_id": job_id, "name": "digits", "devices": 0.5})
    assert made.status_code == 201 and made.json()["device_share"] == 0.5, made.text
    ready = wait_for(api, "/api/v1/deployments/digits", lambda d: d["state"] == "ready")
    replica = ready["workers"][0]
    assert replica["device"] == "cpu:0" and replica["isolation"].startswith("cores "), replica
    # the other half of the slot runs a job beside it, on cores of its own; a whole-slot job waits
    long = image_spec(tmp_path, max_steps=400, options={"sleep_s": 0.02})
    half = api.post("/api/v1/jobs", json={"spec": yaml.safe_dump({**long, "resources": {"devices": 0.5}})})
    whole = api.post("/api/v1/jobs", json={"spec": yaml.safe_dump(long)})
    running = wait_for(api, f"/api/v1/jobs/{half.json()['id']}", lambda j: j["state"] == "running")
    assert running["devices"] == "cpu:0" and running["isolation"].startswith("cores "), running
    if len(os.sched_getaffinity(0)) >= 2:
        assert running["isolation"].split()[1] != replica["isolation"].split()[1]
    waiting = wait_for(api, f"/api/v1/jobs/{whole.json()['id']}", lambda j: j["reason"] is not None)
    assert waiting["state"] == "queued" and "replica 0" in waiting["reason"], waiting
    answer = api.post(
        "/api/v1/deployments/digits/predict", json={"inputs": load_digits().images[:1].tolist()}
    )
    assert answer.status_code == 200, answer.text
    api.delete("/api/v1/deployments/digits")
    api.post(f"/api/v1/jobs/{half.json()['id']}/cancel")
    api.post(f"/api/v1/jobs/{whole.json()['id']}/cancel")
