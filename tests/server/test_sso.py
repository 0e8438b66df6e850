"""Single sign-on wired into the server (server/sso.py, store/users.py), against a real OpenID provider on
loopback: a person signs in through the dashboard's code flow (the real `gpuforge server`) or presents the
CLI's ID token, gets the projects and roles their groups and the server's table give, acts on their own
rows through every key of theirs, makes personal keys with at most their rights, and each sign-in, and
each refused token, is an audit row."""

from datetime import timedelta

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import select

from gpuforge.server.app import create_app
from gpuforge.server.local import LocalServer
from gpuforge.server.settings import Settings
from gpuforge.store.db import session
from gpuforge.store.models import ApiKey, AuditEntry, User, utcnow
from tests.helpers.oidc_provider import ALICE, CLI, DASHBOARD, SECRET

MINILM_SPEC = {
    "name": "tiny",
    "model": {"source": "bundled:minilm", "task": "sequence-classification"},
    "data": {"train": "stdlib:docstrings"},
    "train": {"max_steps": 3},
}


def _auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def sso_server(tmp_path, oidc_provider):
    """The API (no scheduling) with single sign-on at the provider: ml-team members are vision's members."""
    settings = Settings(
        home=tmp_path / "home", db=f"sqlite:///{tmp_path / 'store.db'}", schedule=False,
        oidc_issuer=oidc_provider.issuer, oidc_client_id=DASHBOARD, oidc_cli_client_id=CLI,
        oidc_client_secret=SecretStr(SECRET), oidc_roles="ml-team=vision:member, ops=admin",
    )  # fmt: skip
    with TestClient(create_app(settings)) as client:
        admin = (tmp_path / "home" / "admin.key").read_text().strip()
        for project in ("vision", "nlp"):
            assert (
                client.post("/api/v1/projects", json={"name": project}, headers=_auth(admin)).status_code
                == 201
            )
        yield client, admin, oidc_provider


def test_an_id_token_is_a_person_with_the_role_their_groups_give(sso_server):
    client, _, provider = sso_server
    token = provider.mint(audience=CLI)
    me = client.get("/api/v1/whoami", headers=_auth(token))
    assert me.status_code == 200, me.text
    assert me.json() | {"states": None} == {"name": ALICE.email, "admin": False, "project": "vision",
                                            "role": "member", "read_only": False, "states": None}  # fmt: skip
    job = client.post("/api/v1/jobs", json={"spec": yaml.safe_dump(MINILM_SPEC)}, headers=_auth(token))
    assert job.status_code == 201 and job.json()["owner"] == ALICE.email, job.text
    assert client.get("/api/v1/keys", headers=_auth(token)).status_code == 403  # a member, not an admin
    with session(client.app.state.services.engine) as s:
        user = s.scalar(select(User))
        assert (user.subject, user.name, user.email) == (ALICE.sub, ALICE.name, ALICE.email)
        signed = list(s.scalars(select(AuditEntry).where(AuditEntry.action == "sign_in")))
    assert [(r.actor, r.outcome, r.after["through"]) for r in signed] == [(ALICE.email, "done", "cli")]
    # the same token again is remembered, not signed in twice; a group that makes admins makes one
    assert client.get("/api/v1/whoami", headers=_auth(token)).status_code == 200
    ops = provider.mint({"groups": ["ops"]}, audience=CLI)
    assert client.get("/api/v1/whoami", headers=_auth(ops)).json()["admin"] is True


@pytest.mark.parametrize(
    "claims, audience, why",
    [
        ({"exp": 1_000_000, "iat": 999_000}, CLI, "expired"),
        ({}, "someone-else", "audience"),
        ({"iss": "https://other.example.org"}, CLI, "issuer"),
    ],
)  # fmt: skip
def test_a_refused_token_is_401_with_its_reason_and_an_audit_row(sso_server, claims, audience, why):
    client, admin, provider = sso_server
    answer = client.get("/api/v1/jobs", headers=_auth(provider.mint(claims, audience=audience)))
    assert answer.status_code == 401 and answer.json()["detail"].startswith("ID token refused"), answer.text
    assert why in answer.json()["detail"]
    rows = client.get("/api/v1/audit", params={"action": "sign_in"}, headers=_auth(admin)).json()
    assert [(r["outcome"], r["target"]) for r in rows] == [("refused", "id token")]
    assert why in rows[0]["after"]["reason"]


def test_the_table_raises_a_role_and_personal_keys_carry_at_most_it(sso_server):
    client, admin, provider = sso_server
    token = provider.mint(audience=CLI)
    assert client.get("/api/v1/whoami", headers=_auth(token)).json()["role"] == "member"
    # a member may not make a maintainer's key; a viewer's it may
    too_much = client.post("/api/v1/me/keys", json={"role": "maintainer"}, headers=_auth(token))
    assert too_much.status_code == 422 and "above the member" in too_much.text
    made = client.post("/api/v1/me/keys", json={"name": "alice-ci", "role": "viewer"}, headers=_auth(token))
    assert made.status_code == 201 and made.json()["kind"] == "personal", made.text
    ci = made.json()["key"]
    assert (
        client.post("/api/v1/jobs", json={"spec": yaml.safe_dump(MINILM_SPEC)}, headers=_auth(ci)).status_code
        == 403
    )
    # the admin makes her a maintainer of vision in the server's table: the higher role holds
    raised = client.put("/api/v1/projects/vision/members/" + ALICE.email, json={"role": "maintainer"},
                        headers=_auth(admin))  # fmt: skip
    assert raised.status_code == 200, raised.text
    assert client.get("/api/v1/whoami", headers=_auth(token)).json()["role"] == "maintainer"
    lead = client.post("/api/v1/me/keys", json={"role": "maintainer"}, headers=_auth(token))
    assert lead.status_code == 201
    assert client.get("/api/v1/audit", headers=_auth(lead.json()["key"])).status_code == 200  # a maintainer's
    # taken back out of the table: her personal maintainer key falls back to her member rights at once
    assert (
        client.delete("/api/v1/projects/vision/members/" + ALICE.email, headers=_auth(admin)).status_code
        == 200
    )
    assert client.get("/api/v1/audit", headers=_auth(lead.json()["key"])).status_code == 403
    listed = client.get("/api/v1/me/keys", headers=_auth(token)).json()
    assert [k["name"] for k in listed] == ["alice-ci", lead.json()["name"]]
    assert client.delete("/api/v1/me/keys/alice-ci", headers=_auth(token)).status_code == 200
    assert client.get("/api/v1/whoami", headers=_auth(ci)).status_code == 401
    # a plain key has no personal keys to make
    assert client.post("/api/v1/me/keys", json={}, headers=_auth(admin)).status_code == 422
    rows = client.get("/api/v1/audit", params={"actor": ALICE.email}, headers=_auth(admin)).json()
    assert [(r["action"], r["target"]) for r in rows if r["action"] == "me.keys.change"] == [
        ("me.keys.change", "key alice-ci"),
        ("me.keys.change", f"key {lead.json()['name']}"),
        ("me.keys.change", "key alice-ci"),
    ]  # fmt: skip  (newest first: the revoke, the maintainer's key, the viewer's key)


def test_a_persons_rows_are_their_own_through_every_key_of_theirs(sso_server):
    client, _, provider = sso_server
    token = provider.mint(audience=CLI)
    client.get("/api/v1/whoami", headers=_auth(token))
    ci = client.post("/api/v1/me/keys", json={"name": "alice-ci"}, headers=_auth(token)).json()["key"]
    job = client.post("/api/v1/jobs", json={"spec": yaml.safe_dump(MINILM_SPEC)}, headers=_auth(ci)).json()
    cancelled = client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=_auth(token))  # a member: its own
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled", cancelled.text


def test_a_session_opens_nothing_once_expired(sso_server):
    client, _, provider = sso_server
    client.get("/api/v1/whoami", headers=_auth(provider.mint(audience=CLI)))
    from gpuforge.store.users import new_user_key  # the key a dashboard sign-in makes

    engine = client.app.state.services.engine
    with session(engine) as s:
        user_key = s.scalar(select(ApiKey).where(ApiKey.kind == "user"))
        secret, row = new_user_key(s, user_key, "session", None, None)
    assert client.get("/api/v1/whoami", headers=_auth(secret)).status_code == 200
    with session(engine) as s:
        s.scalar(select(ApiKey).where(ApiKey.kind == "session")).expires_at = utcnow() - timedelta(seconds=1)
    client.app.state.services.known_keys.clear()  # as 30 s later
    assert client.get("/api/v1/whoami", headers=_auth(secret)).status_code == 401


@pytest.mark.slow
def test_the_dashboard_signs_a_person_in_through_the_provider(tmp_path, oidc_provider):
    env = {
        "GPUFORGE_SCHEDULE": "false",
        "GPUFORGE_OIDC_ISSUER": oidc_provider.issuer,
        "GPUFORGE_OIDC_CLIENT_ID": DASHBOARD,
        "GPUFORGE_OIDC_CLI_CLIENT_ID": CLI,
        "GPUFORGE_OIDC_CLIENT_SECRET": SECRET,
        "GPUFORGE_OIDC_ROLES": "ml-team=vision:maintainer",
        "GPUFORGE_OIDC_SCOPES": "openid profile email groups",
    }  # the provider's groups claim: its scope
    with LocalServer(tmp_path / "home", log=tmp_path / "server.log", **env) as live:
        oidc_provider.register_client(
            DASHBOARD, secret=SECRET, redirect_uris=[f"{live.url}/auth/oidc/callback"]
        )
        made = httpx.post(f"{live.url}/api/v1/projects", json={"name": "vision"}, headers=_auth(live.key))
        assert made.status_code == 201, made.text
        with httpx.Client(follow_redirects=False) as browser:
            hop = browser.get(f"{live.url}/auth/oidc/start", params={"next": "/costs"})
            for _ in range(3):  # start -> the provider -> the callback -> the page, with its one-time code
                hop = browser.get(hop.headers["location"])
                if hop.status_code not in (302, 303, 307):
                    break
                if "#sso=" in hop.headers["location"]:
                    break
            page, _, fragment = hop.headers["location"].partition("#")
            assert page == "/costs" and fragment.startswith("sso="), hop.headers
            code = fragment.removeprefix("sso=")
            # another browser with the code (sent a link by whoever signed in): no session (login CSRF)
            stolen = httpx.post(f"{live.url}/auth/oidc/session", json={"code": code})
            assert stolen.status_code == 401 and "not this browser's" in stolen.text
        # the code was spent by that try: the browser that signed in signs in again, and trades its code
        with httpx.Client(follow_redirects=False) as browser:
            hop = browser.get(f"{live.url}/auth/oidc/start", params={"next": "/costs"})
            while "#sso=" not in hop.headers.get("location", ""):
                hop = browser.get(hop.headers["location"])
            code = hop.headers["location"].partition("#sso=")[2]
            traded = browser.post(f"{live.url}/auth/oidc/session", json={"code": code})
            assert traded.status_code == 200, traded.text
            again = browser.post(f"{live.url}/auth/oidc/session", json={"code": code})
            assert again.status_code == 401  # once
        me = httpx.get(f"{live.url}/api/v1/whoami", headers=_auth(traded.json()["key"])).json()
        assert (me["name"], me["project"], me["role"]) == (ALICE.email, "vision", "maintainer")
        rows = httpx.get(
            f"{live.url}/api/v1/audit", params={"action": "sign_in"}, headers=_auth(live.key)
        ).json()
        assert [(r["actor"], r["after"]["through"]) for r in rows] == [(ALICE.email, "dashboard")] * 2
        shell = httpx.get(f"{live.url}/auth/oidc/config").json()
        assert shell["issuer"] == oidc_provider.issuer


def test_a_revoked_person_signs_in_to_nothing_and_their_keys_stop(sso_server):
    client, admin, provider = sso_server
    token = provider.mint(audience=CLI)
    assert client.get("/api/v1/whoami", headers=_auth(token)).status_code == 200
    ci = client.post("/api/v1/me/keys", json={"name": "alice-ci"}, headers=_auth(token)).json()["key"]
    assert client.delete(f"/api/v1/keys/{ALICE.email}", headers=_auth(admin)).status_code == 200
    for presented in (token, provider.mint(audience=CLI), ci):  # remembered, new, and a personal key
        refused = client.get("/api/v1/whoami", headers=_auth(presented))
        assert refused.status_code == 401, refused.text
    assert "revoked" in client.get("/api/v1/whoami", headers=_auth(token)).json()["detail"]


def test_another_projects_maintainer_taking_a_person_in_does_not_move_them(sso_server):
    client, admin, provider = sso_server
    token = provider.mint(audience=CLI)
    assert client.get("/api/v1/whoami", headers=_auth(token)).json()["project"] == "vision"
    lead = client.post(
        "/api/v1/keys", json={"name": "bob", "project": "nlp", "role": "maintainer"}, headers=_auth(admin)
    ).json()["key"]  # fmt: skip  (nlp sorts before vision)
    taken = client.put(
        f"/api/v1/projects/nlp/members/{ALICE.email}", json={"role": "viewer"}, headers=_auth(lead)
    )
    assert taken.status_code == 200, taken.text
    me = client.get("/api/v1/whoami", headers=_auth(provider.mint(audience=CLI))).json()
    assert (me["project"], me["role"]) == ("vision", "member")  # still where she acts
