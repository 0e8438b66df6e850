"""The HTTP API on a real app (store, migrations, auth): submit, list, read, cancel, and bad input."""

import os

import pytest
import yaml
from fastapi.testclient import TestClient

from gpuforge.server.app import create_app
from gpuforge.server.settings import Settings
from tests.helpers.paths import TEST_MODELS


@pytest.fixture
def server(tmp_path, store_url):
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("hello world\n" * 50)
    roots = os.pathsep.join([str(data), str(TEST_MODELS.parent)])  # data, and the code of python: models
    settings = Settings(
        home=tmp_path / "home",
        db=store_url,
        data_roots=roots,
        max_body_bytes=10_000,
        max_request_bytes=10_000,
        schedule=False,
    )
    with TestClient(create_app(settings)) as client:
        admin = (tmp_path / "home" / "admin.key").read_text().strip()
        yield client, admin, data


def _spec(**changes) -> str:
    spec = {
        "name": "tiny",
        "model": {"source": f"python:{TEST_MODELS}:image_model", "task": "image-classification"},
        "data": {"train": "sklearn:digits"},
        "train": {"max_steps": 3},
    }
    spec.update(changes)
    return yaml.safe_dump(spec)


def _auth(key):
    return {"Authorization": f"Bearer {key}"}


def test_health_needs_no_key_and_everything_else_does(server):
    client, admin, _ = server
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}
    assert client.get("/api/v1/jobs").status_code == 401
    assert client.get("/api/v1/jobs", headers=_auth("gf_wrong")).status_code == 401
    assert client.get("/api/v1/jobs", headers={"X-API-Key": admin}).json() == []


def test_submit_queues_a_valid_spec_and_lists_it(server):
    client, admin, _ = server
    created = client.post("/api/v1/jobs", json={"spec": _spec(), "priority": 4}, headers=_auth(admin))
    assert created.status_code == 201, created.text
    job = created.json()
    assert (job["state"], job["priority"], job["name"], job["devices_wanted"]) == ("queued", 4, "tiny", 1)
    assert job["run_dir"].endswith(f"runs/job-{job['id']}")
    assert [j["id"] for j in client.get("/api/v1/jobs", headers=_auth(admin)).json()] == [job["id"]]
    assert client.get(f"/api/v1/jobs/{job['id']}", headers=_auth(admin)).json()["state"] == "queued"
    assert client.get(f"/api/v1/jobs/{job['id']}/events", headers=_auth(admin)).json() == []
    assert 'gpuforge_jobs{state="queued"} 1.0' in client.get("/metrics", headers=_auth(admin)).text


def test_a_bad_spec_is_refused_with_its_errors_and_not_queued(server):
    client, admin, data = server
    cases = [
        ("model: [unclosed", "not valid YAML"),
        (_spec(train={"lr": -1}), "train.lr"),
        (_spec(data={"train": "/etc/passwd"}), "data.train: /etc/passwd is outside the server's data roots"),
        (_spec(data={"train": str(data / ".." / ".." / "secret.txt")}), "outside the server's data roots"),
    ]
    (data / "escape.txt").symlink_to("/etc/hostname")
    cases.append((_spec(data={"train": str(data / "escape.txt")}), "outside the server's data roots"))
    for spec, message in cases:
        response = client.post("/api/v1/jobs", json={"spec": spec}, headers=_auth(admin))
        assert response.status_code == 422 and message in response.text, (spec, response.text)
    assert client.get("/api/v1/jobs", headers=_auth(admin)).json() == []
    inside = _spec(
        data={"train": str(data / "notes.txt")}, model={"source": "bundled:gpt-tiny", "task": "causal-lm"}
    )
    assert client.post("/api/v1/jobs", json={"spec": inside}, headers=_auth(admin)).status_code == 201


def test_unknown_ids_malformed_and_oversized_bodies_are_4xx(server):
    client, admin, _ = server
    assert client.get("/api/v1/jobs/999", headers=_auth(admin)).status_code == 404
    assert client.post("/api/v1/jobs", content=b"{not json", headers=_auth(admin)).status_code == 422
    assert (
        client.post("/api/v1/jobs", json={"spec": _spec(), "extra": 1}, headers=_auth(admin)).status_code
        == 422
    )
    big = client.post("/api/v1/jobs", json={"spec": "x" * 20_000}, headers=_auth(admin))
    assert big.status_code == 413 and "over the 10000 allowed" in big.text
    assert client.get("/healthz").status_code == 200  # still up


def test_cancel_a_queued_job_then_cancel_again_is_a_conflict(server):
    client, admin, _ = server
    job = client.post("/api/v1/jobs", json={"spec": _spec()}, headers=_auth(admin)).json()
    cancelled = client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=_auth(admin)).json()
    assert cancelled["state"] == "cancelled" and cancelled["reason"] == "cancelled by admin"
    again = client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=_auth(admin))
    assert again.status_code == 409 and again.json() == {"detail": f"job {job['id']} is already cancelled"}


def test_every_route_declares_its_response(server):
    client, admin, _ = server
    schema = client.get("/openapi.json", headers=_auth(admin)).json()
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            answers = operation["responses"]
            ok = answers.get("200") or answers.get("201") or answers.get("202")
            assert ok and ok.get("content"), f"{method.upper()} {path} has no response model"


def test_yaml_aliases_and_out_of_range_figures_are_refused(server):
    client, admin, _ = server
    bomb = "a: &a [x, x]\nb: &b [*a, *a]\nname: tiny\n"
    refused = client.post("/api/v1/jobs", json={"spec": bomb}, headers=_auth(admin))
    assert refused.status_code == 422 and "aliases" in refused.json()["detail"]
    for body in (
        {"spec": _spec(), "priority": 2**63},
        {"spec": _spec(priority=2**40)},
        {"spec": _spec(), "name": "x" * 101},
    ):
        assert client.post("/api/v1/jobs", json=body, headers=_auth(admin)).status_code == 422


def test_a_chunked_body_over_the_limit_is_refused_too(server):
    client, admin, _ = server

    def chunks():
        for _ in range(50):
            yield b" " * 1000  # 50 kB of whitespace, no Content-Length: the limit is 10 kB

    response = client.post(
        "/api/v1/jobs", content=chunks(), headers={**_auth(admin), "content-type": "application/json"}
    )
    assert response.status_code == 413 and "over the 10000 allowed" in response.json()["detail"]


def test_a_job_asking_more_devices_than_the_server_has_is_refused_at_submit(server):
    client, admin, _ = server
    spec = _spec(resources={"devices": 2}, distributed={"strategy": "ddp"})
    refused = client.post("/api/v1/jobs", json={"spec": spec}, headers=_auth(admin))
    assert refused.status_code == 422
    assert "resources.devices: 2 cpu devices asked for; this server has 1 (cpu:0" in refused.text
    assert client.get("/api/v1/jobs", headers=_auth(admin)).json() == []


def test_a_revoked_key_opens_nothing_and_its_jobs_stay(server):
    client, admin, _ = server
    alice = client.post("/api/v1/keys", json={"name": "alice"}, headers=_auth(admin)).json()["key"]
    job = client.post(
        "/api/v1/jobs",
        json={
            "spec": _spec(
                model={"source": "bundled:minilm", "task": "sequence-classification"},
                data={"train": "stdlib:docstrings"},
            )
        },
        headers=_auth(alice),
    )
    assert job.status_code == 201, job.text
    assert client.get("/api/v1/jobs", headers=_auth(alice)).status_code == 200  # cached from here on
    assert client.delete("/api/v1/keys/alice", headers=_auth(alice)).status_code == 403  # admins only

    revoked = client.delete("/api/v1/keys/alice", headers=_auth(admin))
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert client.get("/api/v1/jobs", headers=_auth(alice)).status_code == 401  # at once, cache or not
    assert client.delete("/api/v1/keys/alice", headers=_auth(admin)).status_code == 409  # already
    assert client.delete("/api/v1/keys/bob", headers=_auth(admin)).status_code == 404
    # the last admin key cannot go: nobody could make keys again
    last = client.delete("/api/v1/keys/admin", headers=_auth(admin))
    assert last.status_code == 409 and "last admin key" in last.text
    listed = {k["name"]: k["revoked_at"] for k in client.get("/api/v1/keys", headers=_auth(admin)).json()}
    assert listed["admin"] is None and listed["alice"] is not None
    # her jobs stay, for the admin to see
    assert job.json()["id"] in [j["id"] for j in client.get("/api/v1/jobs", headers=_auth(admin)).json()]


def _submit(client, key, body, idempotency_key=None):
    headers = {**_auth(key), **({"Idempotency-Key": idempotency_key} if idempotency_key else {})}
    return client.post("/api/v1/jobs", json=body, headers=headers)


def test_a_submit_sent_again_with_its_idempotency_key_returns_the_first_job(server):
    client, admin, _ = server
    first = _submit(client, admin, {"spec": _spec(), "priority": 2}, "5b1f0a7e-retry")
    again = _submit(client, admin, {"spec": _spec(), "priority": 2}, "5b1f0a7e-retry")
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()
    other = _submit(client, admin, {"spec": _spec(train={"max_steps": 4})}, "5b1f0a7e-retry")
    assert other.status_code == 409
    assert other.json()["detail"].startswith(
        f"Idempotency-Key '5b1f0a7e-retry': already used for job {first.json()['id']}"
    )
    # the same key of another owner is another job; no key at all is a new job each time
    alice = client.post("/api/v1/keys", json={"name": "alice"}, headers=_auth(admin)).json()["key"]
    minilm = _spec(model={"source": "bundled:minilm", "task": "sequence-classification"})
    assert _submit(client, alice, {"spec": minilm}, "5b1f0a7e-retry").status_code == 201
    assert _submit(client, admin, {"spec": _spec(), "priority": 2}).status_code == 201
    for bad in ("x" * 201, "has space"):
        refused = _submit(client, admin, {"spec": _spec()}, bad)
        assert refused.status_code == 422 and "Idempotency-Key" in refused.text
    assert len(client.get("/api/v1/jobs", headers=_auth(admin)).json()) == 3


def test_a_replay_is_answered_even_at_the_queued_quota(server):
    client, admin, _ = server
    alice = client.post("/api/v1/keys", json={"name": "alice", "max_queued": 1}, headers=_auth(admin)).json()[
        "key"
    ]
    minilm = _spec(model={"source": "bundled:minilm", "task": "sequence-classification"})
    first = _submit(client, alice, {"spec": minilm}, "k1")
    assert first.status_code == 201
    assert _submit(client, alice, {"spec": minilm}, "k2").status_code == 429  # a new job: past the quota
    again = _submit(client, alice, {"spec": minilm}, "k1")  # the first one's answer, lost and asked again
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]


def test_concurrent_submits_with_one_idempotency_key_make_one_job(server):
    from concurrent.futures import ThreadPoolExecutor

    client, admin, _ = server
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _submit(client, admin, {"spec": _spec()}, "same-key"), range(8)))
    assert sorted(a.status_code for a in answers) == [200] * 7 + [201], [a.text for a in answers]
    assert len({a.json()["id"] for a in answers}) == 1
    assert len(client.get("/api/v1/jobs", headers=_auth(admin)).json()) == 1


def test_what_the_runner_would_refuse_first_is_refused_at_submit(server, tmp_path):
    client, admin, data = server
    (data / "sentences.csv").write_text("text,label\nhello there,greeting\n" + 'broken,"\n' * 3)
    (data / "lines.jsonl").write_text('{"body": "hi", "label": "a"}\n{not json\n')
    (data / "model").mkdir()
    text_model = {"source": "bundled:minilm", "task": "sequence-classification"}
    cases = [
        (
            {"model": text_model, "data": {"train": str(data / "sentences.csv"), "label_field": "lable"}},
            f"data.label_field: 'lable' not found in {data / 'sentences.csv'} (columns: text, label)",
        ),
        (  # the first record only: the broken second line is the runner's to find
            {"model": text_model, "data": {"train": str(data / "lines.jsonl")}},
            f"data.text_field: 'text' not found in {data / 'lines.jsonl'} (columns: body, label)",
        ),
        (
            {
                "model": text_model,
                "data": {"train": str(data / "sentences.csv"), "eval": str(data / "no.csv")},
            },
            f"data.eval: {data / 'no.csv'}: no such file",
        ),
        (
            {"model": {"source": f"hf:{data / 'absent'}", "task": "sequence-classification"}},
            f"model.source: {data / 'absent'}: no such directory",
        ),
        (
            {"model": {"source": f"hf:{data / 'model'}", "task": "sequence-classification"}},
            f"model.source: {data / 'model'}: no config.json",
        ),
    ]
    for changes, message in cases:
        changes.setdefault("data", {"train": str(data / "sentences.csv")})
        refused = _submit(client, admin, {"spec": _spec(**changes)})
        assert refused.status_code == 422 and message in refused.json()["detail"], refused.text
    # the client's names for its uploads stand in for the server's paths
    named = _submit(
        client,
        admin,
        {
            "spec": _spec(model=text_model, data={"train": str(data / "sentences.csv"), "label_field": "y"}),
            "files": {str(data / "sentences.csv"): "my/sentences.csv"},
        },
    )
    assert named.json()["detail"] == (
        "data.label_field: 'y' not found in my/sentences.csv (columns: text, label)"
    )
    stray = _submit(client, admin, {"spec": _spec(), "files": {"/etc/hostname": "mine"}})
    assert (
        stray.status_code == 422
        and stray.json()["detail"] == "files: /etc/hostname is not a file the spec names"
    )
    assert client.get("/api/v1/jobs", headers=_auth(admin)).json() == []
    right = _spec(model=text_model, data={"train": str(data / "sentences.csv")})
    assert _submit(client, admin, {"spec": right}).status_code == 201
