"""`gpuforge dashboard RUNS_DIR`'s API over real `gpuforge train` run directories: the runs listed by start,
their series, events, logs, summary and a comparison, read-only and without a key."""

import pytest
from fastapi.testclient import TestClient

from gpuforge.dashboard.local import create_local_app
from tests.helpers.cli import run_cli
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local-runs")
    for lr in (0.01, 0.03):
        spec = write_spec(tmp / f"lr-{lr}.yaml", {**image_spec(tmp, lr=lr, max_steps=8), "name": f"lr-{lr}"})
        profiled = ["--profile", "3:2"] if lr == 0.03 else []
        done = run_cli("train", str(spec), "--out", str(tmp / "runs" / f"lr-{lr}"), *profiled)
        assert done.returncode == 0, done.stderr
    (tmp / "runs" / "not-a-run").mkdir()
    return tmp / "runs"


def test_runs_are_listed_by_start_with_their_figures(runs):
    client = TestClient(create_local_app(runs), base_url="http://127.0.0.1")
    who = client.get("/api/v1/whoami").json()
    assert (who["name"], who["admin"], who["read_only"]) == ("local", True, True)
    assert "stopped" in who["states"]["jobs_ended"]  # a run that ended without a word
    listed = client.get("/api/v1/jobs")
    assert listed.headers["X-Total-Count"] == "2"
    newest, oldest = listed.json()
    assert (oldest["id"], oldest["name"], newest["id"], newest["name"]) == (1, "lr-0.01", 2, "lr-0.03")
    assert oldest["state"] == "finished" and oldest["step"] == oldest["total_steps"] == 8
    assert oldest["loss"] > 0 and oldest["started_at"] and oldest["finished_at"]
    assert client.get("/api/v1/jobs", params={"state": "failed"}).json() == []
    # the same run directory served alone
    alone = (
        TestClient(create_local_app(runs / "lr-0.03"), base_url="http://localhost").get("/api/v1/jobs").json()
    )
    assert [j["name"] for j in alone] == ["lr-0.03"]


def test_a_runs_pages_data_and_a_comparison(runs):
    client = TestClient(create_local_app(runs), base_url="http://127.0.0.1")
    assert client.get("/api/v1/jobs/1/series").json()["metrics"]["loss"]["step"] == list(range(1, 9))
    kinds = [e["kind"] for e in client.get("/api/v1/jobs/1/events").json()]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert client.get("/api/v1/jobs/1/summary").json()["status"] == "finished"
    assert client.get("/api/v1/jobs/1/spec").json()["spec"]["train"]["lr"] == 0.01
    assert client.get("/api/v1/jobs/1/report").status_code == 404
    compared = client.get("/api/v1/compare", params={"ids": "1,2"}).json()
    assert {"key": "train.lr", "values": [0.01, 0.03]} in compared["spec_diff"]
    assert all(f["samples_per_s"] > 0 for f in compared["finals"])
    assert client.get("/api/v1/jobs/3").status_code == 404
    assert client.get("/api/v1/compare", params={"ids": "1,9"}).status_code == 404
    assert client.get("/").status_code == 200 and client.get("/jobs/1").status_code == 200


def test_a_runs_profile_and_its_trace_but_nothing_linked_outside(runs, tmp_path):
    import gzip
    import json

    client = TestClient(create_local_app(runs), base_url="http://127.0.0.1")
    assert [s["step"] for s in client.get("/api/v1/jobs/2/profile").json()["steps"]] == [3, 4]
    trace = client.get("/api/v1/jobs/2/profile/trace")
    assert trace.headers["content-type"] == "application/gzip"
    assert "traceEvents" in json.loads(gzip.decompress(trace.content))
    assert client.get("/api/v1/jobs/1/profile").status_code == 404
    assert client.get("/api/v1/jobs/2/profile/trace", params={"rank": 1}).status_code == 404
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "profile.json").write_text("{}")
    (runs / "lr-0.01" / "profile").symlink_to(tmp_path / "profile")
    try:
        assert client.get("/api/v1/jobs/1/profile").status_code == 404  # not read through the link
    finally:
        (runs / "lr-0.01" / "profile").unlink()


def test_its_api_wants_the_key_it_was_given_and_a_loopback_host(runs):
    client = TestClient(create_local_app(runs, key="gfd_k"), base_url="http://127.0.0.1:8700")
    assert client.get("/api/v1/jobs").status_code == 401
    assert client.get("/api/v1/jobs", headers={"Authorization": "Bearer gfd_wrong"}).status_code == 401
    assert client.get("/api/v1/jobs", headers={"Authorization": "Bearer gfd_k"}).status_code == 200
    assert client.get("/").status_code == 200  # the page, which asks for the key
    rebound = TestClient(create_local_app(runs, key="gfd_k"), base_url="http://attacker.example")
    assert rebound.get("/api/v1/jobs", headers={"Authorization": "Bearer gfd_k"}).status_code == 400


def test_a_run_with_a_file_linked_outside_is_left_out(runs, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    linked = runs.parent / "linked"
    (linked / "runs" / "ok").mkdir(parents=True)
    (linked / "runs" / "ok" / "spec.yaml").write_text("name: ok\n")
    (linked / "runs" / "bad").mkdir()
    (linked / "runs" / "bad" / "spec.yaml").symlink_to(secret)
    jobs = TestClient(create_local_app(linked), base_url="http://127.0.0.1").get("/api/v1/jobs").json()
    assert [j["name"] for j in jobs] == ["ok"]


def test_it_changes_nothing(runs):
    client = TestClient(create_local_app(runs), base_url="http://127.0.0.1")
    assert client.post("/api/v1/jobs", json={"spec": "name: x"}).status_code == 405
    assert client.post("/api/v1/jobs/1/cancel").status_code == 404
    assert client.get("/api/v1/devices").status_code == 404


def test_it_listens_on_loopback_only(tmp_path):
    for host in ("0.0.0.0", "127.evil.example"):  # not a name that merely starts like loopback
        refused = run_cli("dashboard", str(tmp_path), "--host", host)
        assert refused.returncode == 2 and "a loopback address" in refused.stderr
    missing = run_cli("dashboard", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr


def test_a_runs_range_test_curve_and_a_file_that_is_not_one(tmp_path):
    raw = {**image_spec(tmp_path, lr="auto", max_steps=4), "name": "auto"}
    spec = write_spec(tmp_path / "auto.yaml", raw)
    done = run_cli("train", str(spec), "--out", str(tmp_path / "runs" / "auto"))
    assert done.returncode == 0, done.stderr
    client = TestClient(create_local_app(tmp_path / "runs"), base_url="http://127.0.0.1")
    found = client.get("/api/v1/jobs/1/lr_find").json()
    written = (tmp_path / "runs" / "auto" / "lr_find.json").read_text()
    assert found["lr"] > 0 and found["reason"] in written and len(found["points"]) > 3
    (tmp_path / "runs" / "auto" / "lr_find.json").write_text('{"lr": "rm -rf /", "lrs": [], "losses": []}')
    assert client.get("/api/v1/jobs/1/lr_find").status_code == 404
