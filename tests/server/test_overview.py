"""The routes the dashboard reads, on a real server that ran real jobs: who a key is, the jobs page with
owners and totals, a job's spec, series (downsampled) and report, compare, devices, costs; the pages open
without a key and carry their Content-Security-Policy, while the API stays shut."""

import json
import time
from datetime import date, timedelta
from pathlib import Path

import httpx
import pytest
import yaml

from gpuforge.server.local import LocalServer
from gpuforge.store.models import JobState
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow
STEPS = 40


def _wait_ended(http, job_id, timeout=240.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = http.get(f"/api/v1/jobs/{job_id}").json()
        if job["state"] in ("finished", "failed", "cancelled"):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} never ended: {job}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server that ran two real jobs (lr 0.01 and 0.02, the second compressed), and a second key."""
    tmp = tmp_path_factory.mktemp("overview")
    roots = {"GPUFORGE_DATA_ROOTS": str(TEST_MODELS.parent)}  # the code of the python: model
    with LocalServer(tmp / "home", log=tmp / "server.log", **roots) as server:
        http = httpx.Client(
            base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.key}"}
        )
        ids = []
        for lr, extra in ((0.01, {}), (0.02, {"compress": {"quantize": "int8"}})):
            spec = image_spec(tmp, lr=lr, max_steps=STEPS, eval_every=10)
            spec.update(name=f"digits-{lr}", cost={"usd_per_hour": 3.6}, **extra)
            answer = http.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)})
            assert answer.status_code == 201, answer.text
            ids.append(answer.json()["id"])
        for job_id in ids:
            assert _wait_ended(http, job_id)["state"] == "finished"
        user = http.post("/api/v1/keys", json={"name": "bob"}).json()["key"]
        yield server, http, ids, user


def _as(server, key):
    return httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {key}"})


def test_whoami_names_the_key_and_the_states_the_dashboard_shows(served):
    server, http, _, user = served
    who = http.get("/api/v1/whoami").json()
    assert (who["name"], who["admin"], who["read_only"]) == ("admin", True, False)
    assert who["states"]["jobs"] == [s.value for s in JobState]  # one list: the store's
    assert set(who["states"]["jobs_ended"]) == {"finished", "failed", "cancelled"}
    assert set(who["states"]["deployments_ended"]) == {"stopped", "failed"}
    assert _as(server, user).get("/api/v1/whoami").json()["name"] == "bob"
    assert httpx.get(f"{server.url}/api/v1/whoami").status_code == 401


def test_the_jobs_list_has_owners_figures_totals_and_an_owner_filter(served):
    server, http, ids, user = served
    listed = http.get("/api/v1/jobs", params={"limit": 1})
    assert listed.headers["X-Total-Count"] == "2"
    (newest,) = listed.json()
    assert newest["id"] == ids[1] and newest["owner"] == "admin"
    assert newest["mfu"] is not None and newest["step"] == STEPS and newest["eta_s"] is not None
    assert http.get("/api/v1/jobs", params={"owner": "admin"}).headers["X-Total-Count"] == "2"
    assert http.get("/api/v1/jobs", params={"owner": "bob"}).json() == []
    bob = _as(server, user)
    assert bob.get("/api/v1/jobs").json() == [] and bob.get("/api/v1/jobs").headers["X-Total-Count"] == "0"


def test_a_jobs_spec_series_and_report(served):
    server, http, ids, user = served
    spec = http.get(f"/api/v1/jobs/{ids[0]}/spec").json()
    assert spec["spec"]["train"]["lr"] == 0.01 and "digits-0.01" in spec["yaml"]

    whole = http.get(f"/api/v1/jobs/{ids[0]}/series", params={"max_points": 1000}).json()
    records = [
        json.loads(line)
        for line in Path(_run_dir(http, ids[0]), "metrics.jsonl").read_text().split("\n")[:-1]
    ]
    assert whole["records"] == len(records) == STEPS
    assert whole["metrics"]["loss"]["value"] == [r["loss"] for r in records]
    assert whole["metrics"]["eval_accuracy"]["step"] == [10, 20, 30, 40]

    small = http.get(f"/api/v1/jobs/{ids[0]}/series", params={"max_points": 10}).json()
    loss = small["metrics"]["loss"]
    assert len(loss["step"]) <= 10 and loss["step"] == sorted(loss["step"])
    assert loss["step"][0] == 1 and loss["step"][-1] == STEPS  # the whole run's span
    values = [r["loss"] for r in records]
    assert max(values) in loss["value"] and min(values) in loss["value"]  # extremes are never averaged away

    again = http.get(f"/api/v1/jobs/{ids[0]}/series", headers={"If-None-Match": small_tag(http, ids[0])})
    assert again.status_code == 304 and again.content == b""  # a poll of a run with nothing new
    big = httpx.get(
        f"{server.url}/api/v1/jobs/{ids[0]}/series",
        headers={**http.headers, "Accept-Encoding": "gzip"},
    )
    assert big.headers["content-encoding"] == "gzip" and big.json() == whole

    assert http.get(f"/api/v1/jobs/{ids[0]}/report").status_code == 404
    report = http.get(f"/api/v1/jobs/{ids[1]}/report").json()
    assert [v["name"] for v in report["variants"]][0] == "original" and len(report["variants"]) == 2
    for path in ("spec", "series", "report"):  # another key's job does not exist for bob
        assert _as(server, user).get(f"/api/v1/jobs/{ids[1]}/{path}").status_code == 404


def small_tag(http, job_id) -> str:
    return http.get(f"/api/v1/jobs/{job_id}/series", params={"max_points": 1000}).headers["ETag"]


def _run_dir(http, job_id) -> str:
    return http.get(f"/api/v1/jobs/{job_id}").json()["run_dir"]


def test_compare_lists_only_the_keys_that_differ_and_the_final_figures(served):
    server, http, ids, user = served
    compared = http.get("/api/v1/compare", params={"ids": f"{ids[0]},{ids[1]}"}).json()
    assert [j["id"] for j in compared["jobs"]] == ids
    differing = {row["key"]: row["values"] for row in compared["spec_diff"]}
    assert differing["train.lr"] == [0.01, 0.02] and differing["name"] == ["digits-0.01", "digits-0.02"]
    assert "train.max_steps" not in differing and "data.train" not in differing
    for final in compared["finals"]:
        assert final["status"] == "finished" and final["samples_per_s"] > 0 and final["wall_s"] > 0
        assert 0 <= final["eval"]["accuracy"] <= 1
    bad = http.get("/api/v1/compare", params={"ids": "1"})
    assert bad.status_code == 422 and "compare takes 2 to 8" in bad.json()["detail"]
    assert http.get("/api/v1/compare", params={"ids": "1,x"}).status_code == 422
    assert _as(server, user).get("/api/v1/compare", params={"ids": f"{ids[0]},{ids[1]}"}).status_code == 404


def test_devices_show_the_last_hours_busy_time(served):
    _, http, _, _ = served
    (cpu,) = http.get("/api/v1/devices").json()
    assert cpu["id"] == "cpu:0" and cpu["held_by"] is None and cpu["job"] is None
    assert 0 < cpu["busy_s_last_hour"] <= 3600 and cpu["busy_seconds"] > 0


def test_costs_per_key_per_day(served):
    server, http, ids, user = served
    spent = sum(http.get(f"/api/v1/jobs/{i}").json()["cost_usd"] for i in ids)
    costs = http.get("/api/v1/costs").json()  # from the ledger: each process's whole life, its start-up too
    # the same ledger rows summed in another order: equal up to the last bit of a float
    assert costs["total_usd"] >= spent * (1 - 1e-12) and spent > 0 and costs["keys"] == ["admin"]
    assert costs["total_usd"] == pytest.approx(costs["total_device_hours"] * 3.6)
    by_key = http.get("/api/v1/costs", params={"by": "key"}).json()["groups"]
    assert [(g["key"], g["jobs"]) for g in by_key] == [("admin", 2)]
    assert by_key[0]["usd"] == pytest.approx(costs["total_usd"])
    assert http.get("/api/v1/costs", params={"by": "week"}).status_code == 422
    assert len(costs["days"]) == 30 and {row["day"] for row in costs["rows"]} <= set(costs["days"])
    assert sum(row["jobs"] for row in costs["rows"]) >= 2
    assert _as(server, user).get("/api/v1/costs").json()["total_usd"] == 0
    long_ago = (date.today() - timedelta(days=400)).isoformat()
    assert http.get("/api/v1/costs", params={"since": long_ago}).status_code == 422
    backwards = {"since": "2026-02-02", "until": "2026-02-01"}
    assert http.get("/api/v1/costs", params=backwards).status_code == 422


def test_pages_open_without_a_key_with_their_policy_and_the_api_does_not(served):
    server, _, ids, _ = served
    for path in ("/", f"/jobs/{ids[0]}", "/compare", "/devices", "/deployments", "/costs"):
        page = httpx.get(server.url + path)
        assert page.status_code == 200 and "<html" in page.text.lower(), path
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["x-frame-options"] == "DENY"
    assert httpx.get(f"{server.url}/static/app.js").status_code == 200
    for path in ("/api/v1/jobs", "/api/v1/devices", "/api/v1/costs", "/jobs/abc", "/static-not"):
        assert httpx.get(server.url + path).status_code == 401, path
