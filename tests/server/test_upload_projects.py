"""Issue 35: uploads belong to their project (on the real app, SQLite and PostgreSQL). A key of another
project that knows a file's SHA-256 is told the server has none, cannot name it in a spec, and holds it
only once it has sent the bytes itself (stored once, charged once); a teammate and the admin see it."""

import hashlib

import yaml

from tests.server.test_projects import _auth, _key, _project

ROWS = b'{"text": "the striker scored", "label": "sports"}\n{"text": "rates rose", "label": "economy"}\n' * 8


def _spec(path: str) -> str:
    return yaml.safe_dump({
        "name": "topics", "model": {"source": "bundled:minilm", "task": "sequence-classification"},
        "data": {"train": path, "label_field": "nope"}, "train": {"max_steps": 3},
    })  # fmt: skip


def test_another_projects_upload_is_unknown_to_a_key_until_it_sends_the_bytes_itself(server):
    client, admin = server
    for name in ("vision", "nlp"):
        _project(client, admin, name)
    ada, amy, bob = (
        _key(client, admin, n, p) for n, p in (("ada", "vision"), ("amy", "vision"), ("bob", "nlp"))
    )
    sha = hashlib.sha256(ROWS).hexdigest()
    url = f"/api/v1/uploads/{sha}"
    sent = client.put(url, params={"name": "rows.jsonl"}, content=ROWS, headers=_auth(ada))
    assert sent.status_code == 200, sent.text
    path = sent.json()["path"]

    for key in (ada, amy, admin):  # its project, and the admin
        assert client.get(url, params={"name": "rows.jsonl"}, headers=_auth(key)).status_code == 200
    assert client.get(url, params={"name": "rows.jsonl"}, headers=_auth(bob)).status_code == 404
    refused = client.post("/api/v1/jobs", json={"spec": _spec(path)}, headers=_auth(bob))
    assert refused.status_code == 422 and "no such upload here" in refused.json()["detail"]
    assert "text" not in refused.json()["detail"]  # nothing of its columns is told
    teammate = client.post("/api/v1/jobs", json={"spec": _spec(path)}, headers=_auth(amy))
    assert teammate.status_code == 422 and "label_field" in teammate.json()["detail"]  # it reads the file

    wrong = client.put(url, params={"name": "rows.jsonl"}, content=b"other bytes", headers=_auth(bob))
    assert wrong.status_code == 422  # a hash alone proves nothing
    assert client.get(url, params={"name": "rows.jsonl"}, headers=_auth(bob)).status_code == 404
    again = client.put(url, params={"name": "rows.jsonl"}, content=ROWS, headers=_auth(bob))
    assert again.status_code == 200 and again.json()["path"] == path  # the same file, kept once
    assert client.get(url, params={"name": "rows.jsonl"}, headers=_auth(bob)).status_code == 200
