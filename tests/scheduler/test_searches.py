"""Hyperparameter searches on the server, with real trials (jobs of the tiny image model): pruning that
prunes, a budget reached mid-search, a stop, bad tune sections refused with nothing stored."""

import time

import pytest
import yaml
from fastapi.testclient import TestClient

from gpuforge.server.app import create_app
from gpuforge.server.settings import Settings
from tests.helpers.jobs import wait_for
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow
ENDED = ("finished", "budget_spent", "stopped", "failed")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    home = tmp_path_factory.mktemp("server") / "home"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("GPUFORGE_CPU_SLOTS", "1")
        settings = Settings(home=home, data_roots=str(TEST_MODELS.parent), allow_user_code=True)
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = f"Bearer {(home / 'admin.key').read_text().strip()}"
            yield client


def _search(api, tune: dict, **train) -> int:
    spec = {**image_spec(None, **train), "tune": tune}
    response = api.post("/api/v1/searches", json={"spec": yaml.safe_dump(spec)})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _ended(api, search_id: int, timeout: float = 180.0) -> dict:
    wait_for(api, f"/api/v1/searches/{search_id}", lambda d: d["state"] in ENDED, timeout=timeout)
    return api.get(f"/api/v1/searches/{search_id}").json()


def test_a_search_queues_its_trials_as_jobs_and_prunes_the_hopeless_ones(api):
    # the grid's order under seed 4 starts with the good rate; ASHA stops the three hopeless ones at step 10
    tune = {
        "objective": {"metric": "eval_accuracy"},
        "parameters": {"train.lr": {"choice": [0.02, 1.0e-7, 2.0e-7, 3.0e-7]}},
        "sampler": "grid", "seed": 4, "pruner": {"asha": {"min_steps": 10, "reduction_factor": 3}},
    }  # fmt: skip
    search_id = _search(api, tune, max_steps=200, eval_every=10, batch_size=64, options={"sleep_s": 0.01})
    doc = _ended(api, search_id)
    assert doc["state"] == "finished" and doc["counts"] == {"finished": 1, "pruned": 3}
    trials = {t["number"]: t for t in doc["trials"]}
    assert trials[0]["params"] == {"train.lr": 0.02}, "the grid's order under seed 4 changed"
    assert doc["best"]["trial"] == 0 and doc["best"]["job"] == trials[0]["job"]
    for number in (1, 2, 3):
        job = api.get(f"/api/v1/jobs/{trials[number]['job']}").json()
        assert job["state"] == "pruned" and job["reason"].startswith("pruned at step 10: eval_accuracy")
        assert job["step"] < 200  # stopped, not trained to its end
        assert trials[number]["reason"] == job["reason"]
    jobs = api.get("/api/v1/jobs", params={"search": search_id}).json()  # the job list, by search
    assert sorted(j["id"] for j in jobs) == sorted(t["job"] for t in doc["trials"])
    assert {(j["name"], j["search_id"], j["trial"]) for j in jobs} == {
        (f"tiny-digits-trial-{n:04d}", search_id, n) for n in range(4)
    }
    assert api.get("/api/v1/searches").json()[0]["id"] == search_id


def test_a_budget_reached_mid_search_stops_its_trial_at_a_checkpoint(api):
    tune = {
        "objective": {"metric": "eval_loss"},
        "parameters": {"train.lr": {"loguniform": [1.0e-3, 1.0e-2]}},
        "sampler": "random", "seed": 0, "max_trials": 20, "budget": {"usd": 3.0},
    }  # fmt: skip
    spec_train = {"max_steps": 400, "eval_every": 20, "checkpoint_every": 20, "options": {"sleep_s": 0.02}}
    spec = {**image_spec(None, **spec_train), "tune": tune, "cost": {"usd_per_hour": 3600.0}}  # $1 a second
    search_id = api.post("/api/v1/searches", json={"spec": yaml.safe_dump(spec)}).json()["id"]
    doc = _ended(api, search_id)
    assert doc["state"] == "budget_spent" and doc["reason"].startswith("spent $")
    assert len(doc["trials"]) < 20 and doc["spent_usd"] >= 3.0
    assert doc["trials"][-1]["state"] in ("paused", "cancelled")  # stopped at a checkpoint, or never started


def test_stop_ends_a_running_search(api):
    tune = {"objective": {"metric": "eval_loss"}, "parameters": {"train.lr": {"uniform": [1.0e-3, 1.0e-2]}}}
    search_id = _search(api, tune, max_steps=2000, eval_every=20, options={"sleep_s": 0.02})
    running = lambda d: any(t["state"] == "running" for t in d["trials"])  # noqa: E731
    wait_for(api, f"/api/v1/searches/{search_id}", running)
    stopped = api.post(f"/api/v1/searches/{search_id}/stop")
    assert stopped.status_code == 200, stopped.text
    doc = _ended(api, search_id)
    assert doc["state"] == "stopped" and all(t["state"] in ("paused", "cancelled") for t in doc["trials"])
    assert api.post(f"/api/v1/searches/{search_id}/stop").status_code == 409


@pytest.mark.parametrize(
    "tune, told",
    [
        ({"objective": {"metric": "eval_accuracy"}, "parameters": {"train.lrr": {"uniform": [0.1, 0.2]}}},
         "did you mean train.lr?"),
        ({"objective": {"metric": "eval_accuracy"}, "parameters": {"adapt.lora.r": {"choice": [4, 8]}}},
         "this job has no adapt.lora section"),
        ({"objective": {"metric": "eval_accuracy"}, "parameters": {"train.lr": {"uniform": [-1.0, 1.0]}}},
         "-1.0 is not a value this job takes"),
        ({"objective": {"metric": "eval_perplexity"}, "parameters": {"train.lr": {"uniform": [0.1, 0.2]}}},
         "eval_perplexity is not a figure"),
        ({"objective": {"metric": "eval_accuracy"}, "parameters": {"resources.devices": {"choice": [1, 2]}},
          "pruner": "none"}, "resources.devices is the job's"),
        ({"objective": {"metric": "eval_accuracy"}, "parameters": {"train.lr": {"uniform": [0.1, 0.2]}},
          "pruner": {"asha": {"pause": True}}}, "tune.pruner.asha.pause: a server's trials are not paused"),
    ],
)  # fmt: skip
def test_a_bad_tune_section_is_refused_naming_the_key_and_nothing_is_stored(api, tune, told):
    before = api.get("/api/v1/searches").json()
    spec = {**image_spec(None, max_steps=10, eval_every=5), "tune": tune}
    response = api.post("/api/v1/searches", json={"spec": yaml.safe_dump(spec)})
    assert response.status_code == 422 and told in response.json()["detail"], response.text
    assert api.get("/api/v1/searches").json() == before


def test_two_projects_searches_share_one_device_by_fair_share(tmp_path, monkeypatch):
    """Project a's two trials are queued before project b's; with one CPU slot, first in first out would
    run both of a's before b's first. Fair share (the ledger's recent device-time of each project, read
    every 10 s) starts b's first trial once a has run a while."""
    monkeypatch.setenv("GPUFORGE_CPU_SLOTS", "1")
    settings = Settings(home=tmp_path / "home", data_roots=str(TEST_MODELS.parent), allow_user_code=True)
    with TestClient(create_app(settings)) as client:
        admin = {"Authorization": f"Bearer {(tmp_path / 'home' / 'admin.key').read_text().strip()}"}
        client.headers.update(admin)  # sees every job
        keys = {}
        for name in ("a", "b"):
            assert client.post("/api/v1/projects", json={"name": name}, headers=admin).status_code == 201
            made = client.post("/api/v1/keys", json={"name": f"{name}-key", "project": name}, headers=admin)
            keys[name] = {"Authorization": f"Bearer {made.json()['key']}"}
        tune = {
            "objective": {"metric": "eval_loss"}, "parameters": {"train.lr": {"uniform": [1.0e-3, 1.0e-2]}},
            "sampler": "random", "max_trials": 2, "parallel": 2,
        }  # fmt: skip
        ids = {}
        for name in ("a", "b"):
            spec = {**image_spec(None, max_steps=30, eval_every=15, options={"sleep_s": 0.05}), "tune": tune}
            made = client.post("/api/v1/searches", json={"spec": yaml.safe_dump(spec)}, headers=keys[name])
            assert made.status_code == 201, made.text
            ids[name] = made.json()["id"]
            # every trial of a's is queued before b's search is even made
            wait_for(client, f"/api/v1/jobs?search={ids[name]}", lambda jobs: len(jobs) == 2)
        for name in ("a", "b"):
            _ended(client, ids[name], timeout=240)
        jobs = client.get("/api/v1/jobs", params={"limit": 100}).json()
        started = sorted((j["started_at"], j["project"]) for j in jobs if j["search_id"] is not None)
        order = [project for _, project in started]
        assert sorted(order) == ["a", "a", "b", "b"]
        assert order[:2] == ["a", "b"], order  # b's first before a's second: not first in, first out


def test_a_trial_whose_values_break_a_rule_between_keys_fails_alone_and_the_search_goes_on(api):
    # each value passes alone; global batch 48 is no multiple of a batch of 32
    batches = {"train.batch_size": {"choice": [16, 32]}, "train.global_batch_size": {"choice": [32, 48]}}
    tune = {"objective": {"metric": "eval_loss"}, "sampler": "grid", "pruner": "none", "parameters": batches}
    search_id = _search(api, tune, max_steps=3, eval_every=3, batch_size=16, global_batch_size=32)
    doc = _ended(api, search_id)
    assert doc["state"] == "finished" and doc["counts"] == {"finished": 3, "failed": 1}, doc
    (failed,) = [t for t in doc["trials"] if t["state"] == "failed"]
    assert (
        failed["params"] == {"train.batch_size": 32, "train.global_batch_size": 48} and failed["job"] is None
    )
    assert failed["reason"].startswith("its spec: ") and "multiple of" in failed["reason"]


def test_a_search_queues_no_more_trials_than_its_keys_quota_allows(api):
    made = api.post("/api/v1/keys", json={"name": "quota-searcher", "max_queued": 1})
    key = {"Authorization": f"Bearer {made.json()['key']}"}
    tune = {"objective": {"metric": "eval_loss"}, "parameters": {"train.lr": {"uniform": [1.0e-3, 1.0e-2]}},
            "sampler": "random", "max_trials": 3, "parallel": 3}  # fmt: skip
    spec = {**image_spec(None, max_steps=20, eval_every=10, options={"sleep_s": 0.05}), "tune": tune}
    made = api.post("/api/v1/searches", json={"spec": yaml.safe_dump(spec)}, headers=key)
    assert made.status_code == 201, made.text
    search_id = made.json()["id"]
    most = 0
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        doc = api.get(f"/api/v1/searches/{search_id}").json()
        jobs = api.get("/api/v1/jobs", params={"search": search_id}).json()
        most = max(most, sum(j["state"] in ("queued", "running", "preempted", "paused") for j in jobs))
        if doc["state"] in ENDED:
            break
        time.sleep(0.2)
    assert doc["state"] == "finished" and len(doc["trials"]) == 3
    assert most == 1  # max_queued 1: one trial at a time, though parallel asks 3
