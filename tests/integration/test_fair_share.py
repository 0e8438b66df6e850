"""Fair share on a real server with one CPU slot: key A queues three jobs, then key B one; B's job starts
second, not fourth (A's first was already running, so in the next turn B has used less lately)."""

import os
import time

import httpx
import pytest
import yaml

from gpuforge.server.local import LocalServer
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow


def test_a_key_that_queued_one_job_waits_one_turn_not_three(tmp_path):
    env = {
        "GPUFORGE_DATA_ROOTS": os.pathsep.join([str(TEST_MODELS.parent)]),
        "GPUFORGE_ALLOW_USER_CODE": "true",  # the keys' jobs use the tests' python: model
        "GPUFORGE_CPU_SLOTS": "1",
    }
    with LocalServer(tmp_path / "home", log=tmp_path / "server.log", **env) as server:
        admin = httpx.Client(
            base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.key}"}
        )
        keys = {}
        for name in ("a", "b"):
            made = admin.post("/api/v1/keys", json={"name": name})
            keys[name] = httpx.Client(
                base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {made.json()['key']}"}
            )
        order = []
        for name in ("a", "a", "a", "b"):
            spec = image_spec(tmp_path, max_steps=30, options={"sleep_s": 0.05})
            spec["name"] = f"{name}-{len(order)}"
            answer = keys[name].post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)})
            assert answer.status_code == 201, answer.text
            order.append(answer.json()["id"])
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            jobs = {j["id"]: j for j in admin.get("/api/v1/jobs").json()}
            if all(jobs[i]["state"] == "finished" for i in order):
                break
            assert not any(jobs[i]["state"] == "failed" for i in order), jobs
            time.sleep(0.5)
        started = sorted(order, key=lambda i: jobs[i]["started_at"])
        a1, a2, a3, b1 = order
        assert started == [a1, b1, a2, a3], {i: jobs[i]["started_at"] for i in order}
