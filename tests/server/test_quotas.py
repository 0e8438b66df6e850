"""Quotas per key on a real app and store (SQLite and PostgreSQL): set by the admin, shown, changed, and
each one refused with its status and its name, leaving the store as it was."""

import hashlib
import os
import threading
from pathlib import Path

import yaml
from sqlalchemy import func, select

from gpuforge.executors.local import LocalExecutor
from gpuforge.scheduler.allocator import DeviceInfo
from gpuforge.scheduler.executor import Launched
from gpuforge.scheduler.loop import Scheduler, SchedulerOptions
from gpuforge.store.db import session
from gpuforge.store.models import ApiKey, Deployment, Job, Upload
from gpuforge.store.quotas import QUOTAS
from tests.helpers.jobs import finished_job

DEFAULTS = {q.name: q.default for q in QUOTAS}
NONE = dict.fromkeys(DEFAULTS)


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _make_key(client, admin, name: str, **quotas) -> str:
    made = client.post("/api/v1/keys", json={"name": name, **quotas}, headers=_auth(admin))
    assert made.status_code == 201, made.text
    return made.json()["key"]


def _spec(**changes) -> str:
    spec = {  # no code of the user's and no server files: any key may submit it
        "name": "tiny",
        "model": {"source": "bundled:minilm", "task": "sequence-classification"},
        "data": {"train": "stdlib:docstrings"},
        "train": {"max_steps": 3},
        **changes,
    }
    return yaml.safe_dump(spec)


def _quotas(key: dict) -> dict:
    return {name: key[name] for name in DEFAULTS}


def _count(client, model) -> int:
    with session(client.app.state.services.engine) as s:
        return s.scalar(select(func.count()).select_from(model))


def test_a_new_key_has_the_defaults_those_given_and_an_admin_key_none(server):
    client, admin = server
    alice = client.post("/api/v1/keys", json={"name": "alice"}, headers=_auth(admin)).json()
    assert _quotas(alice) == DEFAULTS
    bob = client.post(
        "/api/v1/keys", json={"name": "bob", "max_running": 1, "max_upload_bytes": 1000}, headers=_auth(admin)
    ).json()
    assert _quotas(bob) == {**DEFAULTS, "max_running": 1, "max_upload_bytes": 1000}
    listed = {k["name"]: _quotas(k) for k in client.get("/api/v1/keys", headers=_auth(admin)).json()}
    assert listed == {
        "admin": NONE,
        "alice": DEFAULTS,
        "bob": {**DEFAULTS, "max_running": 1, "max_upload_bytes": 1000},
    }
    with session(client.app.state.services.engine) as s:  # stored: what the admin gave, NULL for the defaults
        stored = s.scalar(select(ApiKey).where(ApiKey.name == "bob"))
        assert (stored.max_running, stored.max_upload_bytes, stored.max_queued) == (1, 1000, None)

    refusals = [
        ({"name": "root", "admin": True, "max_queued": 5}, 422, "admin keys have no quotas"),
        ({"name": "carol", "max_priority": 5000}, 422, "max_priority"),
        ({"name": "carol", "max_queued": -1}, 422, "max_queued"),
        ({"name": "carol", "max_gpus": 1}, 422, "max_gpus"),
    ]
    for body, code, message in refusals:
        refused = client.post("/api/v1/keys", json=body, headers=_auth(admin))
        assert refused.status_code == code and message in refused.text, (body, refused.text)
    alice_key = _make_key(client, admin, "dave")
    assert client.post("/api/v1/keys", json={"name": "eve"}, headers=_auth(alice_key)).status_code == 403
    assert {k["name"] for k in client.get("/api/v1/keys", headers=_auth(admin)).json()} == {
        "admin", "alice", "bob", "dave"
    }  # fmt: skip


def test_keys_set_changes_quotas_and_null_puts_the_default_back(server):
    client, admin = server
    alice = _make_key(client, admin, "alice")
    changed = client.patch(
        "/api/v1/keys/alice", json={"max_queued": 3, "max_priority": -5}, headers=_auth(admin)
    )
    assert changed.status_code == 200 and _quotas(changed.json()) == {
        **DEFAULTS,
        "max_queued": 3,
        "max_priority": -5,
    }
    back = client.patch("/api/v1/keys/alice", json={"max_queued": None}, headers=_auth(admin))
    assert _quotas(back.json()) == {**DEFAULTS, "max_priority": -5}

    refusals = [
        ("admin", {"max_queued": 3}, _auth(admin), 422, "admin keys have no quotas"),
        ("nobody", {"max_queued": 3}, _auth(admin), 404, "no API key named 'nobody'"),
        ("alice", {"max_queued": 300}, _auth(alice), 403, "not an admin key"),
        ("alice", {}, _auth(admin), 422, "nothing to change"),
        ("alice", {"max_gpus": 3}, _auth(admin), 422, "max_gpus"),
        ("alice", {"max_running": 2**40}, _auth(admin), 422, "max_running"),
    ]
    for name, body, headers, code, message in refusals:
        refused = client.patch(f"/api/v1/keys/{name}", json=body, headers=headers)
        assert refused.status_code == code and message in refused.text, (name, body, refused.text)
    listed = {k["name"]: _quotas(k) for k in client.get("/api/v1/keys", headers=_auth(admin)).json()}
    assert listed == {
        "admin": NONE,
        "alice": {**DEFAULTS, "max_priority": -5},
    }  # the refusals changed nothing


def test_submit_past_max_queued_is_429_and_queues_nothing(server):
    client, admin = server
    alice = _make_key(client, admin, "alice", max_queued=2)
    ids = []
    for _ in range(2):
        made = client.post("/api/v1/jobs", json={"spec": _spec()}, headers=_auth(alice))
        assert made.status_code == 201, made.text
        ids.append(made.json()["id"])
    refused = client.post("/api/v1/jobs", json={"spec": _spec()}, headers=_auth(alice))
    assert refused.status_code == 429
    assert refused.json()["detail"] == (
        "quota max_queued: key 'alice' has 2 jobs not ended (queued, running or paused), its limit; "
        "the admin can raise it: gpuforge keys set alice --max-queued N"
    )
    assert _count(client, Job) == 2
    for _ in range(3):  # the admin has no quota; others' jobs do not count against alice's
        assert client.post("/api/v1/jobs", json={"spec": _spec()}, headers=_auth(admin)).status_code == 201

    with session(client.app.state.services.engine) as s:  # running and paused jobs are not ended: they count
        s.get(Job, ids[0]).state, s.get(Job, ids[1]).state = "running", "paused"
    assert client.post("/api/v1/jobs", json={"spec": _spec()}, headers=_auth(alice)).status_code == 429
    with session(client.app.state.services.engine) as s:  # an ended job frees its place
        s.get(Job, ids[0]).state = "finished"
    assert client.post("/api/v1/jobs", json={"spec": _spec()}, headers=_auth(alice)).status_code == 201
    assert client.post("/api/v1/jobs", json={"spec": _spec()}, headers=_auth(alice)).status_code == 429
    assert client.patch("/api/v1/keys/alice", json={"max_queued": 3}, headers=_auth(admin)).status_code == 200
    assert (
        client.post("/api/v1/jobs", json={"spec": _spec()}, headers=_auth(alice)).status_code == 201
    )  # at once


def test_submits_at_the_same_moment_take_no_more_than_max_queued(server):
    client, admin = server
    alice = _make_key(client, admin, "alice", max_queued=3)
    codes, lock = [], threading.Lock()

    def submit():
        code = client.post("/api/v1/jobs", json={"spec": _spec()}, headers=_auth(alice)).status_code
        with lock:
            codes.append(code)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [201] * 3 + [429] * 5
    assert _count(client, Job) == 3


def test_a_priority_past_max_priority_is_422_from_the_body_or_the_spec(server):
    client, admin = server
    alice = _make_key(client, admin, "alice", max_priority=5)
    for body in ({"spec": _spec(), "priority": 6}, {"spec": _spec(priority=6)}):
        refused = client.post("/api/v1/jobs", json=body, headers=_auth(alice))
        assert refused.status_code == 422, refused.text
        assert refused.json()["detail"] == (
            "quota max_priority: key 'alice' may ask for priority 5 at most, not 6; "
            "the admin can raise it: gpuforge keys set alice --max-priority N"
        )
    assert _count(client, Job) == 0
    # the body's priority is the one asked for, when given
    assert (
        client.post(
            "/api/v1/jobs", json={"spec": _spec(priority=6), "priority": 5}, headers=_auth(alice)
        ).status_code
        == 201
    )
    assert (
        client.post(
            "/api/v1/jobs", json={"spec": _spec(), "priority": 1000}, headers=_auth(admin)
        ).status_code
        == 201
    )


def _put(client, key: str, content: bytes, name: str = "data.jsonl", chunked: bool = False):
    sha = hashlib.sha256(content).hexdigest()
    body = (part for part in [content]) if chunked else content  # a generator: no Content-Length
    return client.put(f"/api/v1/uploads/{sha}", params={"name": name}, content=body, headers=_auth(key))


def _charged(client) -> dict[str, int]:
    with session(client.app.state.services.engine) as s:
        rows = s.execute(select(ApiKey.name, func.sum(Upload.size)).join(ApiKey).group_by(ApiKey.name))
        return dict(rows.all())


def test_an_upload_past_max_upload_bytes_is_429_and_nothing_is_kept(server, tmp_path):
    client, admin = server
    alice = _make_key(client, admin, "alice", max_upload_bytes=100)
    uploads = tmp_path / "home" / "uploads"
    first, second, shared = b"a" * 60, b"b" * 60, b"c" * 60
    assert _put(client, alice, first).status_code == 200
    assert _charged(client) == {"alice": 60}

    refused = _put(client, alice, second)  # by its Content-Length, before a byte is read
    assert refused.status_code == 429
    assert refused.json()["detail"] == (
        "quota max_upload_bytes: key 'alice' has 60 bytes of uploads stored; this one of 60 bytes would pass "
        "its 100; the admin can raise it: gpuforge keys set alice --max-upload-bytes N"
    )
    chunked = _put(client, alice, second, chunked=True)  # no Content-Length: refused as it passes
    assert chunked.status_code == 429 and "this one of 60 bytes or more would pass" in chunked.text
    assert sorted(p.name for p in uploads.iterdir()) == [hashlib.sha256(first).hexdigest() + ".jsonl"]
    assert _charged(client) == {"alice": 60}

    assert _put(client, alice, first).status_code == 200  # content the server has: costs nothing more
    assert _put(client, admin, shared).status_code == 200  # the admin: no quota, but counted
    assert _put(client, alice, shared).status_code == 200  # stored already, by the admin
    assert _charged(client) == {"alice": 60, "admin": 60}

    assert (
        client.patch("/api/v1/keys/alice", json={"max_upload_bytes": 200}, headers=_auth(admin)).status_code
        == 200
    )
    assert _put(client, alice, second, chunked=True).status_code == 200
    assert _charged(client) == {"alice": 120, "admin": 60}
    assert not [p for p in uploads.iterdir() if p.name.startswith(".upload-")]  # no half files left


def test_a_deploy_past_max_deployments_is_429_and_makes_nothing(server, tmp_path):
    client, admin = server
    alice = _make_key(client, admin, "alice", max_deployments=1)
    job_id = finished_job(client, "alice", tmp_path / "runs" / "done")
    made = client.post("/api/v1/deployments", json={"job_id": job_id, "name": "one"}, headers=_auth(alice))
    assert made.status_code == 201, made.text
    refused = client.post("/api/v1/deployments", json={"job_id": job_id, "name": "two"}, headers=_auth(alice))
    assert refused.status_code == 429
    assert refused.json()["detail"] == (
        "quota max_deployments: key 'alice' has 1 live deployments (starting, ready, stopping or failing), "
        "its limit; the admin can raise it: gpuforge keys set alice --max-deployments N"
    )
    assert _count(client, Deployment) == 1
    with session(client.app.state.services.engine) as s:  # a stopping one still holds its replicas: it counts
        s.scalar(select(Deployment)).state = "stopping"
    assert (
        client.post(
            "/api/v1/deployments", json={"job_id": job_id, "name": "two"}, headers=_auth(alice)
        ).status_code
        == 429
    )
    with session(client.app.state.services.engine) as s:
        s.scalar(select(Deployment)).state = "stopped"
    again = client.post("/api/v1/deployments", json={"job_id": job_id, "name": "two"}, headers=_auth(alice))
    assert again.status_code == 201, again.text


def test_the_scheduler_keeps_a_key_to_max_running_and_starts_the_others_meanwhile(
    server, tmp_path, monkeypatch
):
    client, admin = server
    alice = _make_key(client, admin, "alice", max_running=1)
    bob = _make_key(client, admin, "bob")
    launched = []

    def fake_launch(spec_path, run_dir, env):  # no process: what started is what the store says
        launched.append(Path(run_dir).name)
        return Launched(pid=os.getpid(), process=None)

    executor = LocalExecutor()
    monkeypatch.setattr(executor, "start_runner", fake_launch)
    submitted = {}
    for who, key, priority in (("alice", alice, 10), ("alice", alice, 10), ("bob", bob, 0), ("bob", bob, 0)):
        job = client.post("/api/v1/jobs", json={"spec": _spec(), "priority": priority}, headers=_auth(key))
        submitted.setdefault(who, []).append(job.json()["id"])
    engine = client.app.state.services.engine
    slots = [DeviceInfo(f"cpu:{i}", "cpu", "cpu slot", threads=1) for i in range(4)]
    scheduler = Scheduler(engine, slots, executor, SchedulerOptions(deployments_dir=tmp_path / "deployments"))

    def states() -> dict[int, str]:
        with session(engine) as s:
            return dict(s.execute(select(Job.id, Job.state)).all())

    for _ in range(2):  # alice's second job waits, a tick later too; bob's lower-priority jobs start
        with session(engine) as s:
            scheduler._start_queued(s)
        a1, a2 = submitted["alice"]
        assert states() == {a1: "running", a2: "queued", **dict.fromkeys(submitted["bob"], "running")}
        reason = client.get(f"/api/v1/jobs/{a2}", headers=_auth(alice)).json()["reason"]
        assert reason == "waiting for quota max_running: its key runs 1 jobs, its limit"
    with session(engine) as s:
        s.get(Job, a1).state = "finished"
    with session(engine) as s:
        scheduler._start_queued(s)
    assert states()[a2] == "running" and len(launched) == 4
    assert client.get(f"/api/v1/jobs/{a2}", headers=_auth(alice)).json()["reason"] is None  # it started
