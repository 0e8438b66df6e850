"""The routes the dashboard reads, on a real server that ran real jobs: who a key is, the jobs page with
owners and totals, a job's spec, series (downsampled) and report, compare, devices, costs; the pages open
without a key and carry their Content-Security-Policy, while the API stays shut."""

import json
import re
import time
from datetime import date, timedelta
from pathlib import Path

import httpx
import pytest
import yaml

from gpuforge.server.local import LocalServer
from gpuforge.store.models import JobState
from tests.helpers.cli import run_cli
from tests.helpers.paths import TEST_MODELS
from tests.helpers.processes import kill_processes_under
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
    assert set(who["states"]["jobs_ended"]) == {"finished", "failed", "cancelled", "pruned"}
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


# --- issue 36: busy time from the ledger, and "no price set" where nobody priced a device ---
@pytest.fixture(scope="module")
def unpriced(tmp_path_factory):
    """A server with two CPU slots and no prices.yaml, where a key that is not an admin's ran a job and
    serves its model with one replica: neither has a price."""
    tmp = tmp_path_factory.mktemp("unpriced")
    env = {"GPUFORGE_DATA_ROOTS": str(TEST_MODELS.parent), "GPUFORGE_ALLOW_USER_CODE": "true"}
    with LocalServer(tmp / "home", log=tmp / "server.log", GPUFORGE_CPU_SLOTS="2", **env) as server:
        admin = _as(server, server.key)
        carol = admin.post("/api/v1/keys", json={"name": "carol"}).json()["key"]
        http = _as(server, carol)
        spec = image_spec(tmp, max_steps=8) | {"name": "carol-digits"}
        job_id = http.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)}).json()["id"]
        assert _wait_ended(http, job_id)["state"] == "finished"
        made = http.post("/api/v1/deployments", json={"job_id": job_id, "name": "carols"})
        assert made.status_code == 201, made.text
        deadline = time.monotonic() + 180
        while http.get("/api/v1/deployments/carols").json()["state"] != "ready":
            assert time.monotonic() < deadline, http.get("/api/v1/deployments/carols").text
            time.sleep(0.5)
        try:
            yield server, admin, http, carol, job_id
        finally:
            admin.delete("/api/v1/deployments/carols")
            kill_processes_under(tmp)


def _replica_device(devices: list[dict]) -> dict:
    (held,) = [d for d in devices if d["held_by"] == "replica"]
    return held


def test_busy_time_counts_replicas_from_the_ledger_and_never_exceeds_the_wall_time(unpriced):
    server, admin, http, _, _ = unpriced
    started = time.monotonic()
    before = admin.get("/api/v1/costs").json()["total_device_hours"] * 3600
    devices = admin.get("/api/v1/devices").json()
    after = admin.get("/api/v1/costs").json()["total_device_hours"] * 3600
    # the slots say what they are: a share of the cores, not a usage
    assert [d["id"] for d in devices] == ["cpu:0", "cpu:1"]
    assert all(re.fullmatch(r"CPU slot [12] of 2: \d+ cores? of the \d+", d["name"]) for d in devices)
    # one source: the devices' busy time in all is the ledger's device time, shared out
    assert before - 1e-6 <= sum(d["busy_seconds"] for d in devices) <= after + 1e-6
    for d in devices:
        assert 0 <= d["busy_s_last_hour"] <= min(3600, d["busy_seconds"] + 1e-6), d
    # the replica holds its device, and the device is busy while it does
    replica = _replica_device(devices)
    assert replica["deployment"] == {"name": "carols", "replica": 0} and replica["busy_s_last_hour"] > 0
    time.sleep(3)
    again = _replica_device(admin.get("/api/v1/devices").json())
    grew = again["busy_s_last_hour"] - replica["busy_s_last_hour"]
    assert again["id"] == replica["id"] and 0 < grew <= time.monotonic() - started + 2  # a tick's lag


def test_what_nobody_priced_says_so_with_the_command_never_zero(unpriced):
    server, admin, http, carol, job_id = unpriced
    for device in http.get("/api/v1/devices").json():
        assert device["usd_per_hour"] is None and device["price_source"] is None
        assert device["set_price"].startswith("gpuforge prices set cpu --usd-per-hour")
    costs = http.get("/api/v1/costs").json()
    deployment_id = http.get("/api/v1/deployments/carols").json()["id"]
    assert {u["subject"] for u in costs["unpriced"]} == {f"job:{job_id}", f"deployment:{deployment_id}"}
    assert all(u["device_type"] == "cpu" and u["device_hours"] > 0 for u in costs["unpriced"])
    assert costs["set_price"] == [costs["unpriced"][0]["set_price"]]
    (day,) = costs["groups"]
    assert (day["jobs"], day["deployments"], day["unpriced"]) == (1, 1, 2)

    env = {"GPUFORGE_URL": server.url, "GPUFORGE_API_KEY": carol}
    shown = run_cli("costs", env=env)
    assert shown.returncode == 0, shown.stderr
    assert "no price set" in shown.stdout and "$0" not in shown.stdout and " 0.0000" not in shown.stdout
    assert f"job {job_id} carol-digits" in shown.stdout and "deployment" in shown.stdout
    assert "set a price with: gpuforge prices set cpu --usd-per-hour N" in shown.stdout


def test_prices_list_reads_the_servers_prices_and_locally_the_local_file(unpriced, tmp_path):
    server, admin, http, carol, _ = unpriced
    against = {"GPUFORGE_URL": server.url, "GPUFORGE_API_KEY": server.key, "GPUFORGE_HOME": str(tmp_path)}
    listed = run_cli("prices", "list", env=against)
    assert listed.returncode == 0, listed.stderr
    assert "cpu:0" in listed.stdout and "cpu:1" in listed.stdout and "no price set" in listed.stdout
    assert "gpuforge prices set cpu --usd-per-hour N" in listed.stdout
    assert "No prices in" not in listed.stdout and str(tmp_path) not in listed.stdout  # not the client's

    # the admin prices the server's CPUs on its machine; the server reads its file at each look
    priced = run_cli("prices", "set", "cpu", "--usd-per-hour", "0.5", env={"GPUFORGE_HOME": str(server.home)})
    assert priced.returncode == 0, priced.stderr
    listed = run_cli("prices", "list", "--json", "--url", server.url, env={"GPUFORGE_API_KEY": carol})
    answer = json.loads(listed.stdout)
    assert [(d["usd_per_hour"], d["source"]) for d in answer["devices"]] == [(0.5, "cpu (prices.yaml)")] * 2
    assert answer["entries"] is None  # what the admin's file holds (an owned device's cost) is the admin's
    as_admin = json.loads(run_cli("prices", "list", "--json", env=against).stdout)
    assert as_admin["entries"]["cpu"]["usd_per_hour"] == 0.5
    assert all(d["usd_per_hour"] == 0.5 for d in admin.get("/api/v1/devices").json())

    # without a server URL (or with --local): this machine's file, as before
    local = run_cli("prices", "list", env={"GPUFORGE_URL": "", "GPUFORGE_HOME": str(tmp_path)})
    assert local.returncode == 0 and f"no prices in {tmp_path / 'prices.yaml'}" in local.stdout
    here = run_cli("prices", "list", "--local", env=against)
    assert f"no prices in {tmp_path / 'prices.yaml'}" in here.stdout
