"""Fair share on a real server with one CPU slot: a key (or a project) that queued one job waits one turn,
not three. Key A queues three jobs, then key B one: B's job starts second, not fourth (A's first was
already running, so in the next turn B has used less lately). The same between projects, whose keys
share their turns: project A's two keys queue three jobs, then project B's key one: B's starts second
(turns by key alone would start A's second key's job first)."""

import time

import httpx
import pytest
import yaml
from sqlalchemy import select

from gpuforge.server.local import LocalServer
from gpuforge.store.db import connect, session
from gpuforge.store.models import ApiKey, Project
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("fair-share")
    env = {
        "GPUFORGE_DATA_ROOTS": str(TEST_MODELS.parent),
        "GPUFORGE_ALLOW_USER_CODE": "true",  # the keys' jobs use the tests' python: model
        "GPUFORGE_CPU_SLOTS": "1",
    }
    with LocalServer(home / "home", log=home / "server.log", **env) as started:
        yield started


def _keys(server: LocalServer, *names: str) -> dict[str, httpx.Client]:
    admin = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.key}"})
    keys = {}
    for name in names:
        made = admin.post("/api/v1/keys", json={"name": name})
        assert made.status_code == 201, made.text
        keys[name] = httpx.Client(
            base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {made.json()['key']}"}
        )
    return keys


def _run_in_turns(server: LocalServer, tmp_path, keys: dict[str, httpx.Client], who: list[str]) -> dict:
    """Each of `who` (key names) queues one short job, in that order; the jobs once all have finished."""
    order = []
    for name in who:
        # 1.5 s of steps, in 10 of them: a step costs CPU (~40 ms), its sleep none
        spec = image_spec(tmp_path, max_steps=10, options={"sleep_s": 0.15})
        spec["name"] = f"{name}-{len(order)}"
        answer = keys[name].post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)})
        assert answer.status_code == 201, answer.text
        order.append(answer.json()["id"])
    admin = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.key}"})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        jobs = {j["id"]: j for j in admin.get("/api/v1/jobs").json()}
        if all(jobs[i]["state"] == "finished" for i in order):
            return {i: jobs[i] for i in order}
        assert not any(jobs[i]["state"] == "failed" for i in order), jobs
        time.sleep(0.5)
    pytest.fail(f"jobs {order} did not all finish: {jobs}")


def _started(jobs: dict) -> list[int]:
    return sorted(jobs, key=lambda i: jobs[i]["started_at"])


def test_a_key_that_queued_one_job_waits_one_turn_not_three(server, tmp_path):
    keys = _keys(server, "a", "b")
    jobs = _run_in_turns(server, tmp_path, keys, ["a", "a", "a", "b"])
    a1, a2, a3, b1 = jobs
    assert _started(jobs) == [a1, b1, a2, a3], {i: jobs[i]["started_at"] for i in jobs}


def test_a_project_that_queued_one_job_waits_one_turn_not_three(server, tmp_path):
    keys = _keys(server, "vision-1", "vision-2", "speech-1")
    # the projects API is not there yet: the store is written as it would write it
    engine = connect(f"sqlite:///{server.home / 'gpuforge.db'}")
    try:
        with session(engine) as s:
            vision, speech = Project(name="vision"), Project(name="speech")
            s.add_all([vision, speech])
            s.flush()
            for key in s.scalars(select(ApiKey).where(ApiKey.name.in_(keys))):
                key.project_id = vision.id if key.name.startswith("vision") else speech.id
    finally:
        engine.dispose()
    jobs = _run_in_turns(server, tmp_path, keys, ["vision-1", "vision-2", "vision-1", "speech-1"])
    v1, v2, v3, s1 = jobs
    assert [jobs[i]["project"] for i in jobs] == ["vision", "vision", "vision", "speech"]
    assert _started(jobs) == [v1, s1, v2, v3], {i: jobs[i]["started_at"] for i in jobs}
