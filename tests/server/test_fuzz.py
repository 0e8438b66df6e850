"""Fuzz every route of the HTTP API from its own OpenAPI schema: no request, valid or not, gets a 5xx.

schemathesis generates requests that fit the schema and requests that break it (wrong types, missing or
extra fields, odd strings, out-of-range numbers), one test per operation; each request is sent in-process
with the admin key, a quota-limited key, no key and a wrong key. A 4xx is fine: the server refuses bad
input, it never fails on it. An exception in the app reaches the test with its traceback and the failing
request.
"""

import pytest
import schemathesis
from fastapi.testclient import TestClient
from schemathesis.python.asgi import get_client

from gpuforge.server.app import create_app
from gpuforge.server.settings import Settings
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow  # every test here is slow (docs/testing.md)

# Bounded and repeatable: a fixed seed, derandomized generation, up to 25 examples per operation and
# phase (examples, coverage, fuzzing; positive and negative), no example database on disk.
CONFIG = schemathesis.Config.from_dict(
    {
        "seed": 0,
        "generation": {"mode": "all", "max-examples": 25, "deterministic": True, "database": "none"},
        "phases": {"stateful": {"enabled": False}},
    }
)
KEYS = {"admin": None, "none": "", "wrong": "gf_wrong"}  # the admin key is known once the app has started

# The schema the app publishes; generating from it needs no running app.
schema = schemathesis.openapi.from_dict(create_app(Settings(schedule=False)).openapi(), config=CONFIG)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    home = tmp_path_factory.mktemp("fuzz") / "home"
    settings = Settings(home=home, data_roots=str(ROOT / "examples"), max_body_bytes=10_000, schedule=False)
    app = create_app(settings)
    with TestClient(app) as client:  # the lifespan: migrations, admin.key
        admin = (home / "admin.key").read_text().strip()
        auth = {"Authorization": f"Bearer {admin}"}
        assert client.get("/openapi.json", headers=auth).json() == schema.raw_schema
        spec = (ROOT / "examples" / "digits-cnn.yaml").read_text()
        for _ in range(2):  # jobs 1 (queued) and 2 (cancelled): /jobs/{id} routes get past the lookup
            assert client.post("/api/v1/jobs", json={"spec": spec}, headers=auth).status_code == 201
        assert client.post("/api/v1/jobs/2/cancel", headers=auth).status_code == 200
        quotas = {"max_queued": 1, "max_running": 1, "max_upload_bytes": 1000, "max_deployments": 0}
        limited = {"name": "limited", **quotas, "max_priority": 0}
        made = client.post("/api/v1/keys", json=limited, headers=auth)
        assert made.status_code == 201, made.text
        # schemathesis's own ASGI client, not entered: it sends to the app without starting its lifespan
        # a second time (the TestClient above runs it).
        yield get_client(app), {**KEYS, "admin": admin, "quota-limited": made.json()["key"]}


@schema.parametrize()
def test_no_request_gets_a_server_error(case, api):
    session, keys = api
    for who, key in keys.items():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = case.call(session=session, headers=headers, base_url="http://testserver")
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} with {who} key: {response.status_code}"
            f" {response.text[:500]}\n{case.as_curl_command(headers)}"
        )
