"""Who may do what (server/permissions.py), on the real app and store: every route of the app, read from the
app itself, is walked with every role, and each answer is compared with RULES; each change that went
through wrote one audit row, in its own transaction; docs/security.md holds the table as the code has it."""

import hashlib
import re
from pathlib import Path

import pytest
import yaml
from fastapi.routing import APIRoute
from sqlalchemy import func, select, text

from gpuforge.access import DOCUMENT_PATHS, OPEN_PATHS, is_page_path
from gpuforge.server.auth import UNAUTHORIZED
from gpuforge.server.permissions import ADMIN, RULES, Permit, has, rules_table
from gpuforge.store.db import session
from gpuforge.store.models import ApiKey, AuditEntry, Job, Role
from tests.helpers.jobs import finished_job
from tests.helpers.routes import flat_routes

SECURITY_DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
MINILM_SPEC = {  # no code of the user's and no server files: any member may submit it
    "name": "tiny",
    "model": {"source": "bundled:minilm", "task": "sequence-classification"},
    "data": {"train": "stdlib:docstrings"},
    "train": {"max_steps": 3},
}
# the 404s that hide a row another project's key may not know of (as if there were none)
NOT_VISIBLE = re.compile(
    r"no notification target \d+|no job \d+|no deployment '[^']+'|no project '[^']+'|no upload \w+|"
    r"search \d+: no such search"
)
# the walk's actors, least rights first: what one allows, the ones after it see done already
ACTORS = ["outsider", "viewer", "member", "maintainer", "admin"]


def _action(route: APIRoute) -> str | None:
    named = [d.call.action for d in route.dependant.dependencies if isinstance(d.call, Permit)]
    assert len(named) <= 1, f"{route.path}: {named}"
    return named[0] if named else None


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_every_route_names_one_action_of_the_table_or_is_open(server):
    client, _ = server
    for route in flat_routes(client.app.routes):
        action = _action(route)
        concrete = re.sub(r"\{\w+:int\}", "1", route.path)  # a page's URL, as the key gate sees it
        opened = route.path in OPEN_PATHS | DOCUMENT_PATHS or is_page_path(concrete)
        assert (action is None) == opened, f"{sorted(route.methods)} {route.path}: no permit({action!r})"
        if action is not None and route.methods & {"POST", "PUT", "PATCH", "DELETE"}:
            # a change is audited; the exceptions ask for an answer (a prediction, a test message) and change
            # nothing of what the server keeps
            assert RULES[action].audited or action in ("deployments.predict", "notifications.test"), (
                route.path
            )


def test_docs_security_holds_the_table_the_code_has():
    assert rules_table() in SECURITY_DOC.read_text(), (
        "docs/security.md: paste server/permissions.rules_table()"
    )


def _team(client, admin, tmp_path) -> dict:
    """Project `team` with one key of each role, an owner whose rows the others act on, and an outsider."""
    auth = _auth(admin)
    for project in ("team", "other"):
        assert client.post("/api/v1/projects", json={"name": project}, headers=auth).status_code == 201
    keys = {"admin": admin}
    made = [("owner", "team", "member"), ("viewer", "team", "viewer"), ("member", "team", "member"),
            ("maintainer", "team", "maintainer"), ("outsider", "other", "member"), ("spare", None, "member"),
            ("joiner", None, "member"), ("leaver", "team", "member")]  # fmt: skip
    for name, project, role in made:
        body = {"name": name, "role": role, **({"project": project} if project else {})}
        answer = client.post("/api/v1/keys", json=body, headers=auth)
        assert answer.status_code == 201 and answer.json()["role"] == role, answer.text
        keys[name] = answer.json()["key"]
    return keys


def _rows(client, keys, tmp_path) -> dict:
    """The owner's rows: a finished job with a model, a LoRA job's adapter, a deployment, a search, an
    upload."""
    adapter = {"format": "state_dict", "kind": "adapter", "source": "bundled:tiny", "base": "bundled:tiny",
               "task": "sequence-classification"}  # fmt: skip
    base = {**adapter, "kind": "adapter"}
    job = finished_job(client, "owner", tmp_path / "run-model", base)
    lora = finished_job(client, "owner", tmp_path / "run-lora", adapter)
    owner = _auth(keys["owner"])
    deployed = client.post("/api/v1/deployments", json={"name": "web", "job_id": job}, headers=owner)
    assert deployed.status_code == 201, deployed.text
    gone = client.post("/api/v1/deployments", json={"name": "gone", "job_id": job}, headers=owner)
    assert (
        gone.status_code == 201
        and client.delete("/api/v1/deployments/gone", headers=owner).status_code == 200
    )
    with session(client.app.state.services.engine) as s:
        s.execute(text("UPDATE deployments SET state = 'stopped' WHERE name = 'gone'"))
    body = b"a,b\n1,2\n"
    sha = hashlib.sha256(body).hexdigest()
    assert client.put(f"/api/v1/uploads/{sha}?name=x.csv", content=body, headers=owner).status_code == 200
    search = client.post("/api/v1/searches", headers=owner, **_search_body())
    assert search.status_code == 201, search.text
    search_id = search.json()["id"]
    hook = {"url": "http://127.0.0.1:9/hook", "events": ["job.failed"]}  # nothing listens: refused at once
    made = [client.post("/api/v1/notifications/targets", json=hook, headers=owner) for _ in range(2)]
    assert [m.status_code for m in made] == [201, 201], made[0].text
    return {"job": job, "lora": lora, "search": search_id, "sha": sha, "body": body,
            "target": made[0].json()["id"], "target_gone": made[1].json()["id"]}  # fmt: skip


def _request(route: APIRoute, method: str, actor: str, rows: dict) -> tuple[str, dict]:
    """The URL and keyword arguments of one request to `route` by `actor`: on the owner's rows."""
    values = {"job_id": rows["job"], "search_id": rows["search"], "sha256": rows["sha"], "adapter": "none",
              "member": "joiner" if method == "PUT" else "leaver",
              "target_id": rows["target_gone"] if method == "DELETE" else rows["target"]}  # fmt: skip
    path = route.path
    if path.endswith("/predict"):
        values["name"] = "gone"  # stopped: answered at once (a starting one would be waited for)
    elif path.startswith("/api/v1/deployments"):
        values["name"] = "web"
    elif path.startswith("/api/v1/projects"):
        values["name"] = "team"
    elif path.startswith("/api/v1/keys"):
        values["name"] = "spare"
    elif path.startswith("/api/v1/me/keys"):
        values["name"] = "none-such"  # a plain key has no personal keys: 422 for every role
    url = path.format(**values)
    bodies = {
        ("POST", "/api/v1/jobs"): {"json": {"spec": yaml.safe_dump(MINILM_SPEC)}},
        ("POST", "/api/v1/jobs/{job_id}/resume"): {"json": {}},
        ("POST", "/api/v1/jobs/{job_id}/profile"): {"json": {"steps": 2}},
        ("POST", "/api/v1/searches"): _search_body(),
        ("POST", "/api/v1/keys"): {"json": {"name": f"made-by-{actor}"}},
        ("PATCH", "/api/v1/keys/{name}"): {"json": {"max_queued": 7}},
        ("POST", "/api/v1/projects"): {"json": {"name": f"made-by-{actor}"}},
        ("PATCH", "/api/v1/projects/{name}"): {"json": {"share": 1.5}},
        ("PUT", "/api/v1/projects/{name}/members/{member}"): {"json": {"role": "viewer"}},
        ("PUT", "/api/v1/uploads/{sha256}"): {"content": rows["body"], "params": {"name": "x.csv"}},
        ("GET", "/api/v1/uploads/{sha256}"): {"params": {"name": "x.csv"}},
        ("POST", "/api/v1/deployments"): {"json": {"name": f"by-{actor}", "job_id": rows["job"]}},
        ("POST", "/api/v1/deployments/{name}/rollback"): {"json": {}},
        ("POST", "/api/v1/deployments/{name}/adapters"): {"json": {"job_id": rows["lora"]}},
        ("POST", "/api/v1/deployments/{name}/predict"): {"json": {"inputs": ["x"]}},
        ("GET", "/api/v1/compare"): {"params": {"ids": f"{rows['job']},{rows['lora']}"}},
        ("POST", "/api/v1/notifications/targets"): {"json": {"url": f"http://127.0.0.1:9/{actor}"}},
    }
    return url, bodies.get((method, path), {})


def _search_body() -> dict:
    tune = {"objective": {"metric": "eval_loss"}, "parameters": {"train.lr": {"uniform": [1e-3, 1e-2]}}}
    return {"json": {"spec": yaml.safe_dump({**MINILM_SPEC, "tune": tune})}}


def _expected(actor: str, action: str, route: APIRoute) -> str:
    """What RULES say `actor` gets: allowed, refused (403), or hidden (404: a row of a project not its)."""
    if actor == "admin":
        return "allowed"
    role = Role.MEMBER if actor == "outsider" else Role(actor)
    rule = RULES[action]
    key = ApiKey(name=actor, admin=False, role=role)
    if not has(key, rule.least):
        return "refused"
    on_a_row = (
        any(p in route.path for p in ("{job_id}", "{search_id}", "{sha256}", "/projects/{name}"))
        or ("/deployments/{name}" in route.path or route.path == "/api/v1/compare")
        or action in ("deployments.deploy",)
    )  # its body names the owner's job
    on_a_row = on_a_row and action != "uploads.write"  # content: whoever sends the bytes holds it
    if actor == "outsider" and on_a_row and action != "deployments.predict":
        return "hidden"
    if "{target_id}" in route.path:  # a person's target: its owner's and an admin's alone
        return "hidden"
    if on_a_row and rule.others is not None and rule.others != ADMIN and not has(key, rule.others):
        return "refused"
    return "allowed"


def _got(answer) -> str:
    if answer.status_code == 403:
        return "refused"
    if answer.status_code == 404 and NOT_VISIBLE.fullmatch(answer.json().get("detail", "")):
        return "hidden"
    assert answer.status_code not in (401, 500), answer.text
    return "allowed"


def _audit_rows(client) -> list[tuple[str, str]]:
    with session(client.app.state.services.engine) as s:
        return [(r.action, r.target) for r in s.scalars(select(AuditEntry).order_by(AuditEntry.id))]


def test_every_route_answers_every_role_as_the_table_says_and_each_change_writes_one_audit_row(
    server, tmp_path
):
    client, admin = server
    keys = _team(client, admin, tmp_path)
    rows = _rows(client, keys, tmp_path)
    routes = [r for r in flat_routes(client.app.routes) if _action(r) is not None]
    audited_ok: set[str] = set()
    mismatches = []
    for actor in ACTORS:
        for route in routes:
            action = _action(route)
            for method in route.methods:
                if route.path.endswith(
                    "/stream"
                ):  # a stream that follows the job: its first answer is enough
                    continue
                url, kwargs = _request(route, method, actor, rows)
                before = len(_audit_rows(client))
                answer = client.request(method, url, headers=_auth(keys[actor]), **kwargs)
                got, want = _got(answer), _expected(actor, action, route)
                if got != want:
                    mismatches.append(
                        f"{actor} {method} {url}: {want} expected, {answer.status_code} {answer.text}"
                    )
                written = _audit_rows(client)[before:]
                held = action == "uploads.write" and actor != "outsider"  # its project has the bytes already
                if RULES[action].audited and answer.status_code < 300 and not held:
                    assert [a for a, _ in written] == [action], (actor, method, url, written)
                    audited_ok.add(action)
                else:
                    assert written == [], (actor, method, url, answer.status_code, written)
    assert mismatches == [], "\n".join(mismatches)
    for route in routes:  # the streams too: refused before they start
        if route.path.endswith("/stream"):
            url, _ = _request(route, "GET", "viewer", rows)
            assert client.get(url, headers=_auth(keys["outsider"])).status_code == 404
    missing = {a for a, r in RULES.items() if r.audited} - audited_ok
    # refused with 409 on the walk's rows (a finished job, a stopped deployment): the next test has them
    assert missing <= {
        "jobs.cancel",
        "jobs.resume",
        "jobs.profile",
        "deployments.rollback",
        "deployments.adapters",
        "me.keys.change",
    }, missing  # fmt: skip  (test_sso.py: the last)


def test_the_changes_a_finished_job_refuses_write_one_row_each_once_they_go_through(server, tmp_path):
    """Cancel, resume, profile, rollback and adapters answer 409 on the walk's ended rows: here each goes
    through once, and writes its one row."""
    client, admin = server
    keys = _team(client, admin, tmp_path)
    member = _auth(keys["member"])
    job = client.post("/api/v1/jobs", json={"spec": yaml.safe_dump(MINILM_SPEC)}, headers=member).json()["id"]
    assert client.post(f"/api/v1/jobs/{job}/cancel", headers=member).status_code == 200
    with session(client.app.state.services.engine) as s:
        s.get(Job, job).state = "paused"
    assert client.post(f"/api/v1/jobs/{job}/resume", json={}, headers=member).status_code == 200
    run_dir = tmp_path / "running"
    run_dir.mkdir()
    with session(client.app.state.services.engine) as s:
        row = s.get(Job, job)
        row.state, row.run_dir = "running", str(run_dir)
    assert client.post(f"/api/v1/jobs/{job}/profile", json={"steps": 2}, headers=member).status_code == 202
    model = {"format": "state_dict", "kind": "adapter", "source": "bundled:tiny", "base": "bundled:tiny",
             "task": "sequence-classification"}  # fmt: skip
    first, second, lora = (finished_job(client, "member", tmp_path / f"run-{n}", model) for n in (1, 2, 3))
    deploy = client.post  # the deployment `d`: a version, the next, rolled back; an adapter added, removed
    assert (
        deploy("/api/v1/deployments", json={"name": "d", "job_id": first}, headers=member).status_code == 201
    )
    assert (
        deploy("/api/v1/deployments", json={"name": "d", "job_id": second}, headers=member).status_code == 201
    )
    assert client.post("/api/v1/deployments/d/rollback", json={}, headers=member).status_code == 200
    added = client.post("/api/v1/deployments/d/adapters", json={"job_id": lora, "name": "a"}, headers=member)
    assert added.status_code == 201, added.text
    assert client.delete("/api/v1/deployments/d/adapters/a", headers=member).status_code == 200
    before = _audit_rows(client)
    actions = [a for a, _ in before if not a.startswith(("keys.", "projects."))]
    assert actions == ["jobs.submit", "jobs.cancel", "jobs.resume", "jobs.profile", "deployments.deploy",
                       "deployments.deploy", "deployments.rollback", "deployments.adapters",
                       "deployments.adapters"]  # fmt: skip
    refused = client.post(f"/api/v1/jobs/{job}/resume", json={}, headers=member)  # running: 409, no row
    assert refused.status_code == 409 and _audit_rows(client) == before


def test_audit_rows_cannot_be_changed_or_deleted_even_through_the_store(server):
    client, admin = server
    assert client.post("/api/v1/projects", json={"name": "p"}, headers=_auth(admin)).status_code == 201
    engine = client.app.state.services.engine
    for statement in ("UPDATE audit_log SET actor = 'someone else'", "DELETE FROM audit_log"):
        with pytest.raises(Exception, match="append-only"):
            with engine.begin() as conn:
                conn.execute(text(statement))
    with session(engine) as s:
        assert s.scalar(select(func.count()).select_from(AuditEntry)) == 1


def test_a_refused_key_is_one_audit_row_a_source_a_minute_counting_the_rest(server):
    client, admin = server
    unknown = _auth("gf_" + "x" * 40)
    for _ in range(3):
        assert client.get("/api/v1/jobs", headers=unknown).status_code == 401
    assert client.get("/api/v1/jobs").status_code == 401  # no key at all: no sign-in was tried
    with session(client.app.state.services.engine) as s:
        rows = list(s.scalars(select(AuditEntry).where(AuditEntry.action == "sign_in")))
    assert [(r.actor, r.source, r.outcome, r.target, r.after) for r in rows] == [
        ("-", "testclient", "refused", "api key",
         {"path": "/api/v1/jobs", "reason": UNAUTHORIZED, "refused_since_last_row": 0})
    ]  # fmt: skip
    client.app.state.services.failed_sign_ins["testclient"] = (-1e9, 2)  # as if a minute had gone by
    assert client.get("/api/v1/whoami", headers=unknown).status_code == 401
    read = client.get("/api/v1/audit", params={"action": "sign_in"}, headers=_auth(admin)).json()
    assert [(r["after"]["path"], r["after"]["refused_since_last_row"]) for r in read] == [
        ("/api/v1/whoami", 2), ("/api/v1/jobs", 0),
    ]  # fmt: skip
