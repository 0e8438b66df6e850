"""A project's month budget on a real server: its key's job, at a rate that spends what is left of the
budget in seconds, is paused at a checkpoint with a reason naming the project's budget; the project's next
job waits in the queue saying so; the admin raises the budget and both run again. The costs route shows
the project's spend to its members and the admin, and nothing of it to a key outside it."""

import time

import httpx
import pytest
import yaml
from sqlalchemy import update

from gpuforge.server.local import LocalServer
from gpuforge.store.db import connect, session
from gpuforge.store.models import ApiKey, Project
from tests.helpers.jobs import wait_for_job
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow
MARGIN = 0.03  # dollars: 3 s at a cent a second


def _set_budget(engine, usd: float) -> None:
    """What `gpuforge projects set vision --budget-usd-month X` does, straight in the store."""
    with session(engine) as s:
        s.execute(update(Project).where(Project.name == "vision").values(budget_usd_month=usd))


def _spec(tmp_path, name: str, steps: int) -> str:
    spec = image_spec(tmp_path, max_steps=steps, checkpoint_every=5, options={"sleep_s": 0.05})
    spec["name"] = name  # its price: the server's (prices.yaml), whatever an ordinary key's spec says
    return yaml.safe_dump(spec)


def test_a_project_over_its_month_budget_is_paused_held_and_freed_by_a_raise(tmp_path):
    env = {
        "GPUFORGE_CPU_SLOTS": "2",  # room for both jobs: only the budget holds the second
        "GPUFORGE_DATA_ROOTS": str(TEST_MODELS.parent),
        "GPUFORGE_ALLOW_USER_CODE": "true",  # the key's jobs use the tests' python: model
    }
    with LocalServer(tmp_path / "home", log=tmp_path / "server.log", **env) as server:
        (server.home / "prices.yaml").write_text("cpu: {usd_per_hour: 36.0}\n")  # a cent a second
        engine = connect(f"sqlite:///{server.home / 'gpuforge.db'}")
        admin = httpx.Client(
            base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.key}"}
        )
        keys = {
            name: admin.post("/api/v1/keys", json={"name": name}).json()["key"] for name in ("ada", "bob")
        }
        with session(engine) as s:  # before the key's first request: the server caches keys it has seen
            vision = Project(name="vision")  # its budget comes once the job trains (a runner starts slowly)
            s.add(vision)
            s.flush()
            s.execute(update(ApiKey).where(ApiKey.name == "ada").values(project_id=vision.id))
        ada, bob = (
            httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {keys[n]}"})
            for n in ("ada", "bob")
        )

        first = ada.post("/api/v1/jobs", json={"spec": _spec(tmp_path, "long", 1000)}).json()["id"]
        wait_for_job(ada, first, lambda j: (j["step"] or 0) >= 3, timeout=90.0)
        budget = ada.get("/api/v1/costs").json()["total_usd"] + MARGIN  # 3 s more of it
        _set_budget(engine, budget)
        paused = wait_for_job(ada, first, lambda j: j["state"] not in ("queued", "running"), timeout=90.0)
        assert paused["state"] == "paused", paused
        assert "project vision's budget" in paused["reason"] and "projects set vision" in paused["reason"]
        assert 0 < paused["step"] < 1000

        second = ada.post("/api/v1/jobs", json={"spec": _spec(tmp_path, "short", 10)}).json()["id"]
        time.sleep(3.0)  # several ticks: it would have started by now
        held = ada.get(f"/api/v1/jobs/{second}").json()
        assert held["state"] == "queued" and "project vision's budget" in held["reason"], held

        spent = ada.get("/api/v1/costs", params={"by": "project"}).json()
        (group,) = spent["groups"]
        assert group["project"] == "vision" and group["usd"] >= budget and group["jobs"] == 1
        assert admin.get("/api/v1/costs", params={"project": "vision"}).json()["total_usd"] == group["usd"]
        assert bob.get("/api/v1/costs").json()["total_usd"] == 0  # outside the project: none of it
        assert bob.get("/api/v1/costs", params={"project": "vision"}).status_code == 404
        bad = admin.get("/api/v1/costs", params={"since": "2026-02-30"})
        assert bad.status_code == 422 and "YYYY-MM-DD" in bad.json()["detail"]

        _set_budget(engine, 100.0)  # the admin raises it
        assert wait_for_job(ada, second, lambda j: j["state"] != "queued", timeout=90.0)["state"] in (
            "running",
            "finished",
        )
        assert ada.post(f"/api/v1/jobs/{first}/resume", json={"budget_usd": None}).status_code == 200
        resumed = wait_for_job(
            ada, first, lambda j: j["state"] == "running" and (j["step"] or 0) > paused["step"], timeout=90.0
        )
        assert ada.post(f"/api/v1/jobs/{first}/cancel").status_code == 200
        assert (
            wait_for_job(ada, second, lambda j: j["state"] not in ("queued", "running"), timeout=90.0)[
                "state"
            ]
            == "finished"
        )
        assert (
            wait_for_job(ada, first, lambda j: j["state"] != "running", timeout=90.0)["state"] == "cancelled"
        ), resumed
        engine.dispose()
