"""The notifications' API on the real app: targets made, listed, tested against a real receiver on
127.0.0.1 and removed, each by the keys that may; bad URLs refused with a 422 that says why; a target's
URL and secret never shown to another key."""

from __future__ import annotations

import pytest

from tests.helpers.receivers import WebhookReceiver, signature_holds

API = "/api/v1/notifications"


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _key(client, admin: str, name: str, **body) -> str:
    made = client.post("/api/v1/keys", json={"name": name, **body}, headers=_auth(admin))
    assert made.status_code == 201, made.text
    return made.json()["key"]


@pytest.fixture
def receiver():
    made = WebhookReceiver()
    yield made
    made.close()


def test_a_key_makes_tests_and_removes_its_own_target(server, receiver):
    client, admin = server
    ada = _key(client, admin, "ada")
    made = client.post(f"{API}/targets", json={"url": receiver.url("/ada"), "events": ["job.failed"]},
                       headers=_auth(ada))  # fmt: skip
    assert made.status_code == 201, made.text
    target = made.json()
    shown = (target["format"], target["owner"], target["project"], target["events"])
    assert shown == ("json", "ada", None, ["job.failed"])
    assert target["secret"].startswith("gfs_") and target["url"] == receiver.url("/ada")
    listed = client.get(f"{API}/targets", headers=_auth(ada)).json()
    assert [t["id"] for t in listed] == [target["id"]] and "secret" not in listed[0]  # shown once

    tested = client.post(f"{API}/targets/{target['id']}/test", headers=_auth(ada))
    assert tested.status_code == 200, tested.text
    assert (tested.json()["state"], tested.json()["kind"], tested.json()["attempts"]) == (
        "delivered",
        "test",
        1,
    )
    (sent,) = receiver.received
    assert signature_holds(target["secret"], sent.headers["X-Gpuforge-Signature"], sent.body)
    assert sent.json()["text"] == f"a test of notification target {target['id']}, sent for key ada"
    deliveries = client.get(f"{API}/deliveries", headers=_auth(ada)).json()
    assert [(d["target_id"], d["state"]) for d in deliveries] == [(target["id"], "delivered")]

    removed = client.delete(f"{API}/targets/{target['id']}", headers=_auth(ada))
    assert removed.status_code == 200 and client.get(f"{API}/targets", headers=_auth(ada)).json() == []
    assert client.get(f"{API}/deliveries", headers=_auth(ada)).json() == []  # its deliveries went with it


def test_a_test_to_a_receiver_that_is_down_says_why_and_stays_pending(server):
    client, admin = server
    down = WebhookReceiver(listening=False)
    try:
        made = client.post(
            f"{API}/targets", json={"url": down.url(), "format": "slack"}, headers=_auth(admin)
        )
        tested = client.post(f"{API}/targets/{made.json()['id']}/test", headers=_auth(admin)).json()
    finally:
        down.close()
    assert tested["state"] == "pending" and "ConnectError" in tested["last_error"]
    assert tested["next_attempt_at"] is not None and down.url() not in tested["last_error"]


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"url": "ftp://example.com/hook"}, "only http and https URLs are sent to, not ftp:"),
        ({"url": "file:///etc/passwd"}, "only http and https URLs are sent to, not file:"),
        ({"url": "example.com/hook"}, "only http and https URLs are sent to, not no scheme"),
        ({"url": "http:///path-only"}, "the url names no host"),
        ({"url": "http://example.com:99999/"}, "cannot be read as a URL"),
        ({"url": "https://example.com/a b"}, "spaces or control characters"),
        ({"url": "https://example.com/" + "a" * 2000}, "at most 2000 characters"),
        ({"url": "ada@example.com"}, "only http and https URLs"),  # json is the default format
        ({"url": "https://example.com/", "format": "email"}, "an email target's url is one address"),
        ({"url": "ada@example.com\r\nBcc: eve@example.com", "format": "email"}, "one address"),
        ({"url": "https://example.com/", "format": "sms"}, "format"),
        ({"url": "https://example.com/", "events": ["job.exploded"]}, "events: give some of job.finished"),
        ({"url": "https://example.com/", "events": []}, "at least 1 item"),
    ],
)
def test_a_bad_target_is_a_422_that_says_why(server, body, said):
    client, admin = server
    refused = client.post(f"{API}/targets", json=body, headers=_auth(admin))
    assert refused.status_code == 422, refused.text
    assert said in str(refused.json()["detail"])


def test_targets_are_their_owners_alone_and_a_projects_an_admins(server, receiver):
    client, admin = server
    assert client.post("/api/v1/projects", json={"name": "vision"}, headers=_auth(admin)).status_code == 201
    ada, bob = _key(client, admin, "ada", project="vision"), _key(client, admin, "bob", project="vision")
    secret_url = receiver.url("/ada-only")
    ada_target = client.post(f"{API}/targets", json={"url": secret_url}, headers=_auth(ada)).json()
    # bob, in ada's project, neither sees, tests nor removes it: it does not exist for him
    assert client.get(f"{API}/targets", headers=_auth(bob)).json() == []
    for method, path in (("post", f"/{ada_target['id']}/test"), ("delete", f"/{ada_target['id']}")):
        answer = getattr(client, method)(f"{API}/targets{path}", headers=_auth(bob))
        assert answer.status_code == 404 and secret_url not in answer.text
    refused = client.post(
        f"{API}/targets", json={"url": receiver.url(), "project": "vision"}, headers=_auth(bob)
    )
    assert refused.status_code == 403 and "may not make project vision's targets" in refused.json()["detail"]
    project_target = client.post(f"{API}/targets", json={"url": receiver.url("/vision"), "project": "vision"},
                                 headers=_auth(admin))  # fmt: skip
    assert project_target.status_code == 201 and project_target.json()["project"] == "vision"
    unknown = client.post(
        f"{API}/targets", json={"url": receiver.url(), "project": "nope"}, headers=_auth(admin)
    )
    assert unknown.status_code == 404
    assert [t["id"] for t in client.get(f"{API}/targets", headers=_auth(admin)).json()] == [
        ada_target["id"], project_target.json()["id"],
    ]  # fmt: skip
    client.post(f"{API}/targets/{ada_target['id']}/test", headers=_auth(ada))
    assert client.get(f"{API}/deliveries", headers=_auth(bob)).json() == []  # not his target's
    assert len(client.get(f"{API}/deliveries", headers=_auth(ada)).json()) == 1
    assert client.get(f"{API}/targets", headers={}).status_code == 401


@pytest.mark.slow
def test_the_cli_adds_tests_lists_and_removes_and_the_servers_sender_delivers_a_jobs_end(
    tmp_path, monkeypatch
):
    """`gpuforge server` as users run it: its sender thread sends what a move commits to the store."""
    import json
    import time

    from sqlalchemy import select

    from gpuforge.server.local import LocalServer
    from gpuforge.store import states
    from gpuforge.store.db import connect, session
    from gpuforge.store.models import ApiKey, Job, JobState
    from tests.helpers.cli import run_cli

    receiver = WebhookReceiver()
    url_file = tmp_path / "hook-url"
    url_file.write_text(receiver.url("/from-file") + "\n")
    try:
        with LocalServer(tmp_path / "home", log=tmp_path / "server.log") as live:
            monkeypatch.setenv("GPUFORGE_URL", live.url)
            monkeypatch.setenv("GPUFORGE_API_KEY", live.key)
            bad = run_cli("notifications", "add", "--url", "ftp://example.com/x")
            assert bad.returncode == 2 and "url: only http and https URLs are sent to, not ftp:" in bad.stderr
            added = run_cli(
                "notifications", "add", "--url-file", str(url_file), "--events", "job.finished,job.failed"
            )
            assert added.returncode == 0, added.stderr
            assert (
                "notification target 1 made (json, key admin, events: job.finished, job.failed)"
                in added.stdout
            )
            secret = added.stdout.split("shown this once: ")[1].strip()
            tested = run_cli("notifications", "test", "1")
            assert (tested.returncode, tested.stdout.strip()) == (0, "notification target 1: test delivered")
            assert signature_holds(
                secret, receiver.received[0].headers["X-Gpuforge-Signature"], receiver.received[0].body
            )

            engine = connect(f"sqlite:///{tmp_path / 'home' / 'gpuforge.db'}")  # a move, as the loop makes it
            with session(engine) as s:
                admin_id = s.scalar(select(ApiKey.id).where(ApiKey.name == "admin"))
                job = Job(
                    name="digits", spec_yaml="", run_dir="/tmp/r", owner_id=admin_id, state=JobState.RUNNING
                )
                s.add(job)
                s.flush()
                states.end(s, job.id, "finished", None)
            engine.dispose()
            client, deadline = (
                live.client(),
                time.monotonic() + 60,
            )  # the server's own sender, within its poll
            while client.notification_deliveries()[0]["state"] != "delivered" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert [r.json()["kind"] for r in receiver.received] == ["test", "job.finished"]
            listed = json.loads(run_cli("notifications", "--json").stdout)
            assert [(d["kind"], d["state"]) for d in listed] == [
                ("job.finished", "delivered"),
                ("test", "delivered"),
            ]
            assert "job.finished" in run_cli("notifications").stdout
            assert receiver.url("/from-file") in run_cli("notifications", "targets").stdout
            assert run_cli("notifications", "remove", "1").stdout.strip() == "notification target 1: removed"
            assert json.loads(run_cli("notifications", "targets", "--json").stdout) == []
    finally:
        receiver.close()
