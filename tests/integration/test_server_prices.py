"""Issue 35: the server owns prices. An ordinary key's job costs what prices.yaml says, whatever its spec
says: `gpuforge submit` of a spec with no `cost:` (the CLI sends only what the user wrote, so the server's
default applies) and of one declaring $0 an hour are both charged the admin's rate, and the project's
budget pauses both. An admin's own rate is kept (docs/decisions.md)."""

import json

import httpx
import pytest
from sqlalchemy import func, select, update

from gpuforge.server.local import LocalServer
from gpuforge.store.db import connect, session
from gpuforge.store.models import ApiKey, LedgerEntry, Project
from tests.helpers.cli import run_cli
from tests.helpers.jobs import wait_for_job
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.slow
RATE = 36.0  # $ an hour: a cent a second


def _charged(engine, job_id: int) -> tuple[float, float]:
    with session(engine) as s:
        usd, seconds = s.execute(
            select(func.sum(LedgerEntry.usd), func.sum(LedgerEntry.device_seconds)).where(
                LedgerEntry.subject == f"job:{job_id}"
            )
        ).one()
    return float(usd or 0.0), float(seconds or 0.0)


def test_an_ordinary_keys_jobs_cost_the_servers_price_whatever_their_spec_says(tmp_path):
    env = {
        "GPUFORGE_CPU_SLOTS": "2",  # both jobs at once
        "GPUFORGE_DATA_ROOTS": str(TEST_MODELS.parent),
        "GPUFORGE_ALLOW_USER_CODE": "true",  # the tests' python: model, from an ordinary key
    }
    with LocalServer(tmp_path / "home", log=tmp_path / "server.log", **env) as server:
        priced = run_cli(
            "prices", "set", "cpu", "--usd-per-hour", str(RATE), env={"GPUFORGE_HOME": str(server.home)}
        )
        assert priced.returncode == 0, priced.stderr
        engine = connect(f"sqlite:///{server.home / 'gpuforge.db'}")
        admin = httpx.Client(
            base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.key}"}
        )
        ada = admin.post("/api/v1/keys", json={"name": "ada"}).json()["key"]
        with session(engine) as s:  # its budget comes once both jobs train (a runner starts slowly)
            vision = Project(name="vision")
            s.add(vision)
            s.flush()
            s.execute(update(ApiKey).where(ApiKey.name == "ada").values(project_id=vision.id))
        as_ada = {"GPUFORGE_URL": server.url, "GPUFORGE_API_KEY": ada}
        ids = {}
        for name, cost in (("unset", None), ("free", {"usd_per_hour": 0})):
            spec = image_spec(tmp_path, max_steps=2000, checkpoint_every=10, options={"sleep_s": 0.05})
            spec["name"] = name
            if cost is not None:
                spec["cost"] = cost
            path = write_spec(tmp_path / f"{name}.yaml", spec)
            submitted = run_cli("submit", str(path), "--json", env=as_ada)
            assert submitted.returncode == 0, submitted.stderr
            ids[name] = json.loads(submitted.stdout)["id"]
        for job_id in ids.values():
            wait_for_job(admin, job_id, lambda j: (j["step"] or 0) >= 3, timeout=120.0)
        spent = admin.get("/api/v1/costs", params={"project": "vision"}).json()["total_usd"]
        assert spent > 0  # both are charged: neither spec's rate (none, or $0) was taken
        with session(engine) as s:  # what `gpuforge projects set vision --budget-usd-month X` does
            s.execute(update(Project).where(Project.name == "vision").values(budget_usd_month=spent + 0.03))
        for name, job_id in ids.items():
            job = wait_for_job(
                admin, job_id, lambda j: j["state"] not in ("queued", "running"), timeout=120.0
            )
            assert job["state"] == "paused" and "project vision's budget" in job["reason"], (name, job)
            assert job["usd_per_hour"] == RATE, (name, job)
            usd, seconds = _charged(engine, job_id)
            assert seconds > 0 and usd == pytest.approx(seconds * RATE / 3600), name
        own = {**image_spec(tmp_path), "cost": {"usd_per_hour": 1.5}}
        mine = admin.post("/api/v1/jobs", json={"spec": write_spec(tmp_path / "own.yaml", own).read_text()})
        assert mine.json()["usd_per_hour"] == 1.5  # an admin's own rate stands
        engine.dispose()
