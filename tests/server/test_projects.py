"""Projects on a real app and store (SQLite and PostgreSQL): made, listed and changed by the admin, keys put
in them, members reading each other's jobs and deployments but changing only their own; and the same
verbs through the real CLI against a real server."""

import json
from datetime import timedelta

import pytest
import yaml
from sqlalchemy import select

from gpuforge.server.local import LocalServer
from gpuforge.store.db import session
from gpuforge.store.ledger import month_start
from gpuforge.store.models import Deployment, Device, Job, JobState, LedgerEntry, Project, utcnow
from tests.helpers.cli import run_cli
from tests.helpers.jobs import finished_job


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _project(client, admin, name: str, **settings) -> dict:
    made = client.post("/api/v1/projects", json={"name": name, **settings}, headers=_auth(admin))
    assert made.status_code == 201, made.text
    return made.json()


def _key(client, admin, name: str, project: str | None = None) -> str:
    body = {"name": name, **({"project": project} if project else {})}
    made = client.post("/api/v1/keys", json=body, headers=_auth(admin))
    assert made.status_code == 201, made.text
    assert made.json()["project"] == project
    return made.json()["key"]


def _submit(client, key: str) -> dict:
    spec = {  # no code of the user's and no server files: any key may submit it
        "name": "tiny",
        "model": {"source": "bundled:minilm", "task": "sequence-classification"},
        "data": {"train": "stdlib:docstrings"},
        "train": {"max_steps": 3},
    }
    made = client.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)}, headers=_auth(key))
    assert made.status_code == 201, made.text
    return made.json()


def test_the_admin_makes_lists_and_changes_projects_and_others_may_not(server):
    client, admin = server
    vision = _project(client, admin, "vision", budget_usd_month=100, max_devices=2, share=2)
    assert {k: vision[k] for k in ("name", "budget_usd_month", "max_devices", "share", "keys")} == {
        "name": "vision", "budget_usd_month": 100.0, "max_devices": 2, "share": 2.0, "keys": [],
    }  # fmt: skip
    plain = _project(client, admin, "nlp")
    assert (plain["budget_usd_month"], plain["max_devices"], plain["share"]) == (None, None, 1.0)
    assert [p["name"] for p in client.get("/api/v1/projects", headers=_auth(admin)).json()] == [
        "nlp",
        "vision",
    ]

    changed = client.patch(
        "/api/v1/projects/vision", json={"budget_usd_month": None, "share": 0.5}, headers=_auth(admin)
    )
    assert changed.status_code == 200, changed.text
    assert (changed.json()["budget_usd_month"], changed.json()["max_devices"], changed.json()["share"]) == (
        None, 2, 0.5,
    )  # fmt: skip
    with session(client.app.state.services.engine) as s:  # stored as the admin said: NULL is no budget
        stored = s.scalar(select(Project).where(Project.name == "vision"))
        assert (stored.budget_usd_month, stored.max_devices, stored.share) == (None, 2, 0.5)

    refusals = [  # each names its field
        ("post", "", {"name": "bad name"}, 422, "name"),
        ("post", "", {"name": "x", "share": 0}, 422, "share"),
        ("post", "", {"name": "x", "max_devices": -1}, 422, "max_devices"),
        ("post", "", {"name": "x", "budget_usd_month": -5}, 422, "budget_usd_month"),
        ("post", "", {"name": "vision"}, 409, "a project named 'vision' exists already"),
        ("patch", "/vision", {"share": -1}, 422, "share"),
        ("patch", "/vision", {"share": None}, 422, "share"),
        ("patch", "/vision", {}, 422, "nothing to change"),
        ("patch", "/vision", {"max_gpus": 3}, 422, "max_gpus"),
        ("patch", "/nobody", {"share": 2}, 404, "no project named 'nobody'"),
    ]
    for method, path, body, code, message in refusals:
        refused = getattr(client, method)(f"/api/v1/projects{path}", json=body, headers=_auth(admin))
        assert refused.status_code == code and message in refused.text, (body, refused.text)

    alice = _key(client, admin, "alice", "vision")
    for method, path, body in [("post", "", {"name": "mine"}), ("patch", "/vision", {"share": 100})]:
        refused = getattr(client, method)(f"/api/v1/projects{path}", json=body, headers=_auth(alice))
        assert refused.status_code == 403 and "not an admin key" in refused.text
    with session(client.app.state.services.engine) as s:
        assert s.scalar(select(Project.share).where(Project.name == "vision")) == 0.5
        assert s.scalar(select(Project.id).where(Project.name == "mine")) is None


def test_keys_join_a_project_and_a_member_sees_its_own_project_alone(server):
    client, admin = server
    _project(client, admin, "vision")
    _project(client, admin, "nlp")
    alice = _key(client, admin, "alice", "vision")
    loner = _key(client, admin, "loner")

    refusals = [
        ({"name": "root", "admin": True, "project": "vision"}, "admin keys belong to no project"),
        ({"name": "bob", "project": "nope"}, "project: no project named 'nope'"),
    ]
    for body, message in refusals:
        refused = client.post("/api/v1/keys", json=body, headers=_auth(admin))
        assert refused.status_code == 422 and message in refused.text, refused.text
    admin_moved = client.patch("/api/v1/keys/admin", json={"project": "vision"}, headers=_auth(admin))
    assert admin_moved.status_code == 422 and "admin keys belong to no project" in admin_moved.text
    assert (
        client.patch("/api/v1/keys/nobody", json={"project": "nlp"}, headers=_auth(admin)).status_code == 404
    )
    assert client.patch("/api/v1/keys/loner", json={"project": "x"}, headers=_auth(admin)).status_code == 422

    listed = {k["name"]: k["project"] for k in client.get("/api/v1/keys", headers=_auth(admin)).json()}
    assert listed == {"admin": None, "alice": "vision", "loner": None}
    mine = client.get("/api/v1/projects", headers=_auth(alice)).json()
    assert [(p["name"], p["keys"]) for p in mine] == [("vision", ["alice"])]
    assert client.get("/api/v1/projects/vision", headers=_auth(alice)).status_code == 200
    assert client.get("/api/v1/projects/nlp", headers=_auth(alice)).status_code == 404  # not its team's
    assert client.get("/api/v1/projects", headers=_auth(loner)).json() == []

    moved = client.patch("/api/v1/keys/alice", json={"project": "nlp", "max_queued": 3}, headers=_auth(admin))
    assert moved.status_code == 200 and (moved.json()["project"], moved.json()["max_queued"]) == ("nlp", 3)
    assert [p["name"] for p in client.get("/api/v1/projects", headers=_auth(alice)).json()] == ["nlp"]
    out = client.patch("/api/v1/keys/alice", json={"project": None}, headers=_auth(admin))
    assert out.status_code == 200 and out.json()["project"] is None and out.json()["max_queued"] == 3
    assert client.get("/api/v1/projects", headers=_auth(alice)).json() == []


def test_members_read_each_others_jobs_and_change_only_their_own(server):
    client, admin = server
    _project(client, admin, "vision")
    _project(client, admin, "nlp")
    alice, bob = _key(client, admin, "alice", "vision"), _key(client, admin, "bob", "vision")
    carol, dave = _key(client, admin, "carol", "nlp"), _key(client, admin, "dave")
    job = _submit(client, alice)
    assert job["project"] == "vision"
    own = _submit(client, bob)
    theirs = _submit(client, carol)
    loose = _submit(client, dave)

    def listed(key: str) -> list[int]:
        answer = client.get("/api/v1/jobs", headers=_auth(key))
        assert answer.headers["X-Total-Count"] == str(len(answer.json()))
        return [j["id"] for j in answer.json()]

    assert listed(bob) == [own["id"], job["id"]]  # its own and its teammate's, not another team's
    assert listed(carol) == [theirs["id"]]
    assert listed(dave) == [loose["id"]]  # a key in no project: its own alone
    assert listed(admin) == [loose["id"], theirs["id"], own["id"], job["id"]]
    assert [j["id"] for j in client.get("/api/v1/jobs?owner=alice", headers=_auth(bob)).json()] == [job["id"]]

    path = f"/api/v1/jobs/{job['id']}"
    for read in ("", "/events", "/metrics", "/logs", "/spec", "/series"):
        assert client.get(path + read, headers=_auth(bob)).status_code == 200, read
        for stranger in (carol, dave):
            assert client.get(path + read, headers=_auth(stranger)).status_code == 404, read
    assert client.get(f"/api/v1/compare?ids={job['id']},{own['id']}", headers=_auth(bob)).status_code == 200
    assert (
        client.get(f"/api/v1/compare?ids={job['id']},{theirs['id']}", headers=_auth(bob)).status_code == 404
    )

    refused = client.post(f"{path}/cancel", headers=_auth(bob))
    assert refused.status_code == 403
    assert refused.json()["detail"] == (
        f"job {job['id']} belongs to key 'alice': jobs.cancel on a teammate's needs its owner, an admin, "
        "or a maintainer of its project (key 'bob' is a member)"
    )
    assert client.post(f"{path}/resume", json={}, headers=_auth(bob)).status_code == 403
    assert client.post(f"{path}/cancel", headers=_auth(carol)).status_code == 404  # another team's: none
    assert client.get(path, headers=_auth(bob)).json()["state"] == "queued"
    assert client.post(f"/api/v1/jobs/{own['id']}/cancel", headers=_auth(bob)).json()["state"] == "cancelled"
    assert client.post(f"{path}/cancel", headers=_auth(alice)).json()["state"] == "cancelled"


def test_projects_list_shows_spend_devices_and_jobs_of_each(server):
    client, admin = server
    _project(client, admin, "vision", budget_usd_month=50, max_devices=4)
    _project(client, admin, "nlp")
    alice, carol = _key(client, admin, "alice", "vision"), _key(client, admin, "carol", "nlp")
    running, _queued, preempted = (_submit(client, alice)["id"] for _ in range(3))
    _submit(client, carol)
    now = utcnow()
    # as the scheduler leaves them: one running on two devices
    with session(client.app.state.services.engine) as s:
        vision = s.scalar(select(Project.id).where(Project.name == "vision"))
        s.get(Job, running).state, s.get(Job, running).devices = JobState.RUNNING, "cpu:0,cpu:1"
        s.get(Job, preempted).state = JobState.PREEMPTED
        last_month = month_start(now) - timedelta(minutes=1)
        for minute, usd in (
            (month_start(now), 1.25),
            (now.replace(second=0, microsecond=0), 0.5),
            (last_month, 9),
        ):
            s.add(LedgerEntry(subject=f"job:{running}", minute=minute, project_id=vision, usd=usd))
    rows = {p["name"]: p for p in client.get("/api/v1/projects", headers=_auth(admin)).json()}
    figures = (
        "spend_usd_month",
        "budget_usd_month",
        "devices_held",
        "max_devices",
        "jobs_queued",
        "jobs_running",
    )
    assert {n: tuple(p[f] for f in figures) for n, p in rows.items()} == {
        "vision": (pytest.approx(1.75), 50.0, 2, 4, 2, 1),  # last month's spend is not this month's
        "nlp": (0.0, None, 0, None, 1, 0),
    }
    assert [p["name"] for p in client.get("/api/v1/projects", headers=_auth(carol)).json()] == ["nlp"]


def test_deployments_carry_their_project_and_price_and_members_read_them(server, tmp_path):
    client, admin = server
    (tmp_path / "home" / "prices.yaml").write_text("cpu: {usd_per_hour: 0.75}\n")
    _project(client, admin, "vision")
    _project(client, admin, "nlp")
    alice, bob = _key(client, admin, "alice", "vision"), _key(client, admin, "bob", "vision")
    carol = _key(client, admin, "carol", "nlp")
    job_id = finished_job(client, "alice", tmp_path / "runs" / "done")
    made = client.post("/api/v1/deployments", json={"job_id": job_id, "name": "cats"}, headers=_auth(alice))
    assert made.status_code == 201, made.text
    (tmp_path / "home" / "prices.yaml").unlink()  # none priced: a replica then costs $0
    teammates = client.post(
        "/api/v1/deployments", json={"job_id": job_id, "name": "dogs"}, headers=_auth(bob)
    )
    assert teammates.status_code == 403 and "maintainer" in teammates.text  # a member deploys its own models
    role = client.patch("/api/v1/keys/bob", json={"role": "maintainer"}, headers=_auth(admin))
    assert role.status_code == 200 and role.json()["role"] == "maintainer", role.text
    free = client.post("/api/v1/deployments", json={"job_id": job_id, "name": "dogs"}, headers=_auth(bob))
    assert free.status_code == 201, free.text  # a teammate's model, served as bob's own by a maintainer
    client.patch("/api/v1/keys/bob", json={"role": "member"}, headers=_auth(admin))  # a member again
    with session(client.app.state.services.engine) as s:
        vision = s.scalar(select(Project.id).where(Project.name == "vision"))
        rows = {d.name: (d.project_id, d.usd_per_hour) for d in s.scalars(select(Deployment))}
    assert rows == {"cats": (vision, 0.75), "dogs": (vision, 0.0)}

    assert [d["name"] for d in client.get("/api/v1/deployments", headers=_auth(bob)).json()] == [
        "dogs",
        "cats",
    ]
    assert client.get("/api/v1/deployments", headers=_auth(carol)).json() == []
    assert client.get("/api/v1/deployments/cats", headers=_auth(bob)).status_code == 200
    assert client.get("/api/v1/deployments/cats", headers=_auth(carol)).status_code == 404
    assert (
        client.post(
            "/api/v1/deployments", json={"job_id": job_id, "name": "x"}, headers=_auth(carol)
        ).status_code
        == 404
    )
    # a teammate reads its versions and events, and changes nothing; another team sees nothing
    for path in ("versions", "events"):
        assert client.get(f"/api/v1/deployments/cats/{path}", headers=_auth(bob)).status_code == 200
        assert client.get(f"/api/v1/deployments/cats/{path}", headers=_auth(carol)).status_code == 404
    changes = [
        ("post", "/api/v1/deployments", {"job_id": job_id, "name": "cats"}),  # a new version
        ("post", "/api/v1/deployments/cats/rollback", {}),
        ("post", "/api/v1/deployments/cats/adapters", {"job_id": job_id, "name": "a"}),
        ("delete", "/api/v1/deployments/cats/adapters/a", None),
    ]
    for method, path, body in changes:
        for who, expected in ((bob, 403), (carol, 404)):
            answer = client.request(method, path, json=body, headers=_auth(who))
            assert answer.status_code == expected, (method, path, answer.text)
    refused = client.delete("/api/v1/deployments/cats", headers=_auth(bob))
    assert refused.status_code == 403 and "belongs to key 'alice'" in refused.text
    assert client.delete("/api/v1/deployments/cats", headers=_auth(carol)).status_code == 404
    assert client.delete("/api/v1/deployments/cats", headers=_auth(alice)).json()["state"] == "stopping"


def test_the_devices_page_names_a_teammates_job_and_hides_another_teams(server):
    client, admin = server
    _project(client, admin, "vision")
    _project(client, admin, "nlp")
    alice, bob = _key(client, admin, "alice", "vision"), _key(client, admin, "bob", "vision")
    carol = _key(client, admin, "carol", "nlp")
    job_id = _submit(client, alice)["id"]
    with session(client.app.state.services.engine) as s:
        job = s.get(Job, job_id)
        job.state, job.devices, job.started_at = JobState.RUNNING, "cpu:0", utcnow()
        s.add(Device(id="cpu:0", kind="cpu", name="cpu", job_id=job_id))
    shown = client.get("/api/v1/devices", headers=_auth(bob)).json()[0]
    assert (shown["held_by"], shown["job"]) == ("job", {"id": job_id, "name": "tiny", "owner": "alice"})
    hidden = client.get("/api/v1/devices", headers=_auth(carol)).json()[0]
    assert (hidden["held_by"], hidden["job"]) == ("job", None)


@pytest.mark.slow
def test_projects_and_keys_through_the_cli(tmp_path, monkeypatch):
    with LocalServer(tmp_path / "home", log=tmp_path / "server.log", GPUFORGE_SCHEDULE="false") as live:
        monkeypatch.setenv("GPUFORGE_URL", live.url)
        monkeypatch.setenv("GPUFORGE_API_KEY", live.key)
        made = run_cli("projects", "create", "vision", "--budget-usd-month", "100", "--max-devices", "2")
        assert made.returncode == 0, made.stderr
        assert made.stdout.strip() == "project vision: budget $100/month, max_devices 2, share 1"
        assert run_cli("projects", "create", "nlp", "--share", "2").returncode == 0
        zero = run_cli("projects", "create", "x", "--share", "0")
        assert zero.returncode == 2 and "--share: must be > 0" in zero.stderr
        changed = run_cli("projects", "set", "vision", "--no-budget", "--share", "3")
        assert changed.stdout.strip() == "project vision: budget none, max_devices 2, share 3", changed.stderr
        assert "nothing to change" in run_cli("projects", "set", "vision").stderr

        alice = json.loads(run_cli("keys", "create", "alice", "--project", "vision", "--json").stdout)
        assert alice["project"] == "vision"
        both = run_cli("keys", "create", "root", "--admin", "--project", "vision")
        assert both.returncode == 2 and "an admin key belongs to no project" in both.stderr
        unknown = run_cli("keys", "create", "bob", "--project", "nope")
        assert unknown.returncode == 2 and "project: no project named 'nope'" in unknown.stderr
        assert run_cli("keys", "create", "bob").returncode == 0
        moved = run_cli("keys", "set", "bob", "--project", "nlp")
        assert moved.stdout.startswith("key bob: project nlp, max_queued 100"), moved.stderr
        assert "nlp" in run_cli("keys", "list").stdout

        listed = json.loads(run_cli("projects", "list", "--json").stdout)
        assert [(p["name"], p["keys"], p["share"]) for p in listed] == [
            ("nlp", ["bob"], 2.0),
            ("vision", ["alice"], 3.0),
        ]
        table = run_cli("projects", "list").stdout
        assert "vision" in table and "spent this month" in table

        monkeypatch.setenv("GPUFORGE_API_KEY", alice["key"])
        assert [p["name"] for p in json.loads(run_cli("projects", "list", "--json").stdout)] == ["vision"]
        refused = run_cli("projects", "set", "vision", "--share", "100")
        assert refused.returncode == 2 and "403" in refused.stderr


@pytest.mark.slow
def test_roles_members_and_the_audit_log_through_the_cli(tmp_path, monkeypatch):
    with LocalServer(tmp_path / "home", log=tmp_path / "server.log", GPUFORGE_SCHEDULE="false") as live:
        monkeypatch.setenv("GPUFORGE_URL", live.url)
        monkeypatch.setenv("GPUFORGE_API_KEY", live.key)
        assert run_cli("projects", "create", "vision").returncode == 0
        lead = json.loads(run_cli("keys", "create", "lead", "--project", "vision", "--role", "maintainer",
                                  "--json").stdout)  # fmt: skip
        assert lead["role"] == "maintainer"
        assert run_cli("keys", "create", "new").returncode == 0
        bad = run_cli("keys", "create", "x", "--role", "owner")
        assert (
            bad.returncode == 2 and "--role: 'owner' is not one of viewer, member, maintainer" in bad.stderr
        )
        demoted = run_cli("keys", "set", "lead", "--role", "member")
        assert demoted.stdout.startswith("key lead: role member, "), demoted.stderr
        assert run_cli("keys", "set", "lead", "--role", "maintainer").returncode == 0

        monkeypatch.setenv("GPUFORGE_API_KEY", lead["key"])  # the maintainer takes a new key in as a viewer
        joined = run_cli("projects", "member", "vision", "new", "--role", "viewer")
        assert joined.stdout.strip() == "project vision: lead (maintainer), new (viewer)", joined.stderr
        neither = run_cli("projects", "member", "vision", "new")
        assert neither.returncode == 2 and "give --role ROLE, or --remove" in neither.stderr
        assert run_cli("projects", "member", "vision", "new", "--remove").stdout.strip() == (
            "project vision: lead (maintainer)"
        )
        own = json.loads(run_cli("audit", "--json").stdout)  # its project's rows, newest first
        assert [(r["action"], r["target"], r["actor"]) for r in own[:2]] == [
            ("projects.members", "key new", "lead"), ("projects.members", "key new", "lead"),
        ]  # fmt: skip
        assert own[0]["before"] == {"project": "vision", "role": "viewer"}
        assert own[0]["after"] == {"project": None, "role": "member"}
        assert all(r["project"] == "vision" for r in own)
        assert run_cli("keys", "list").returncode == 2  # the admin's

        monkeypatch.setenv("GPUFORGE_API_KEY", live.key)
        table = run_cli("audit", "--action", "keys.change", "--actor", "admin").stdout
        assert "key lead" in table and "role maintainer -> member" in table, table
        every = json.loads(run_cli("audit", "--json").stdout)
        assert {r["action"] for r in every} >= {
            "projects.create",
            "keys.create",
            "keys.change",
            "projects.members",
        }
        assert json.loads(run_cli("audit", "--since", "2999-01-01", "--json").stdout) == []
