"""Each attack of the security issue, replayed as a non-admin key against a real server on loopback, on
SQLite and on PostgreSQL: the refusal, no file written by the attacker's code, nothing stored changed.

The first test is the attack exactly as reported: an uploaded Python module, a config whose auto_map
names it, and a job whose model.options ask transformers to trust and load them.
"""

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import socket
import stat
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gpuforge.server.local import LocalServer
from tests.helpers.cli import run_cli
from tests.helpers.paths import TEST_MODELS, TOPICS

pytestmark = pytest.mark.slow  # every test here is slow (docs/testing.md)

ADMIN_KEY = "gf_" + "a" * 40  # given through GPUFORGE_ADMIN_KEY: the env a job must not see


def _server(tmp_path: Path, store_url: str, schedule: bool) -> LocalServer:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    shutil.copy(TOPICS, data / "topics.jsonl")
    return LocalServer(
        tmp_path / "home",
        log=tmp_path / "server.log",
        GPUFORGE_DB=store_url,
        GPUFORGE_DATA_ROOTS=os.pathsep.join([str(data), str(TEST_MODELS.parent)]),  # data, and admin code
        GPUFORGE_ADMIN_KEY=ADMIN_KEY,
        GPUFORGE_SCHEDULE=str(schedule).lower(),
        MY_SERVICE_TOKEN="do-not-leak",  # a secret of the server's own environment
    )


@pytest.fixture
def team(tmp_path, store_url):
    """A real server on loopback (on `store_url`, jobs stay queued) with one data root, its admin and a
    non-admin key."""
    with _server(tmp_path, store_url, schedule=False) as server:
        admin = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
        )
        made = admin.post("/api/v1/keys", json={"name": "mallory"})
        assert made.status_code == 201, made.text
        user = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {made.json()['key']}"}, timeout=30
        )
        yield server, admin, user, tmp_path / "data"
        admin.close()
        user.close()


def _upload(client: httpx.Client, content: bytes, name: str) -> str:
    sha = hashlib.sha256(content).hexdigest()
    answer = client.put(f"/api/v1/uploads/{sha}", params={"name": name}, content=content)
    assert answer.status_code == 200, answer.text
    return answer.json()["path"]


def _jobs(admin: httpx.Client) -> list[dict]:
    return admin.get("/api/v1/jobs").json()


def _spec(model: dict, data: dict | None = None) -> str:
    spec = {
        "name": "attack",
        "model": model,
        "data": data or {"train": "sklearn:digits"},
        "train": {"max_steps": 1},
    }
    return yaml.safe_dump(spec)


def test_the_reported_uploaded_module_attack_is_refused_and_runs_nothing(team, tmp_path):
    server, admin, user, _ = team
    marker = tmp_path / "pwned"
    module = f"open({str(marker)!r}, 'w').write('ran')\nclass C:\n    pass\n"
    module_path = Path(_upload(user, module.encode(), "m.py"))
    uploads = module_path.parent
    config = {"auto_map": {"AutoConfig": f"{uploads}--{module_path.stem}.C"}, "model_type": "bert"}
    config_path = _upload(user, json.dumps(config).encode(), "config.json")
    spec = _spec(
        {
            "source": "bundled:minilm",
            "task": "sequence-classification",
            "options": {"trust_remote_code": True, "_configuration_file": config_path},
        },
        {"train": str(uploads / "none.jsonl")},
    )
    refused = user.post("/api/v1/jobs", json={"spec": spec})
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"]
    assert "model.options.trust_remote_code: runs the model directory's own Python" in detail
    assert "model.options._configuration_file: unknown for bundled:minilm" in detail
    assert not marker.exists() and _jobs(admin) == []
    # without trust_remote_code, the other keys that read files elsewhere are refused by name too
    for option, value in (("subfolder", "../../"), ("cache_dir", "/tmp"), ("code_revision", "main")):
        spec = _spec(
            {"source": "bundled:minilm", "task": "sequence-classification", "options": {option: value}}
        )
        refused = user.post("/api/v1/jobs", json={"spec": spec})
        assert refused.status_code == 422 and f"model.options.{option}: unknown" in refused.text
    assert not marker.exists() and _jobs(admin) == [] and server.process.poll() is None


def test_no_path_leaves_the_roots_and_python_models_need_an_admin(team, tmp_path, tiny_bert_dir):
    server, admin, user, data = team
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.jsonl").write_text('{"text": "x", "label": "a"}\n')
    (data / "link.jsonl").symlink_to(outside / "secret.jsonl")
    model_dir = data / "bert"
    shutil.copytree(tiny_bert_dir, model_dir)
    (model_dir / "model.safetensors").unlink()  # its weights become another user's file, through a link
    shutil.copy(tiny_bert_dir / "model.safetensors", outside / "weights.safetensors")
    (model_dir / "model.safetensors").symlink_to(outside / "weights.safetensors")
    text = {"source": "bundled:gpt-tiny", "task": "causal-lm"}
    topics = {"train": str(data / "topics.jsonl")}
    cases = [
        (_spec(text, {"train": "/etc/passwd"}), "data.train: /etc/passwd is outside the server's data roots"),
        (_spec(text, {"train": str(data / ".." / "outside" / "secret.jsonl")}), "data.train"),
        (_spec(text, {"train": str(data / "link.jsonl")}), "data.train"),
        (_spec(text, {**topics, "eval": str(outside / "secret.jsonl")}), "data.eval"),
        (_spec(text, {**topics, "tokenizer": f"hf:{outside}"}), "data.tokenizer"),
        (
            _spec({"source": f"hf:{model_dir}", "task": "sequence-classification"}, topics),
            f"(through {model_dir / 'model.safetensors'}) is outside",
        ),
        (
            _spec({"source": f"python:{TEST_MODELS}:image_model", "task": "image-classification"}),
            "model.source: python: models run their own code",
        ),
    ]
    for spec, message in cases:
        refused = user.post("/api/v1/jobs", json={"spec": spec})
        assert refused.status_code == 422 and message in refused.json()["detail"], (spec, refused.text)
    assert _jobs(admin) == []
    accepted = user.post("/api/v1/jobs", json={"spec": _spec(text, topics)})
    assert accepted.status_code == 201, accepted.text  # the same key, inside its roots: fine
    assert server.process.poll() is None


def test_bodies_are_bounded_and_a_keyless_client_is_refused_before_it_sends_one(team):
    server, admin, user, _ = team
    spec = _spec({"source": "bundled:gpt-tiny", "task": "causal-lm"}) + "#" * (256 * 1024)
    too_big = user.post("/api/v1/jobs", json={"spec": spec})
    assert too_big.status_code == 413 and "over 262144" in too_big.text
    host, port = server.url.removeprefix("http://").split(":")
    for path in ("/api/v1/jobs", f"/api/v1/uploads/{'0' * 64}?name=x.bin"):
        # headers announce 1 GiB and no byte of it follows: a server that read the body would wait
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            method = "POST" if path.endswith("jobs") else "PUT"
            conn.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {2**30}\r\n\r\n".encode())
            assert conn.recv(4096).split(b"\r\n")[0] == b"HTTP/1.1 401 Unauthorized"
    for path in ("/docs", "/openapi.json", "/metrics"):
        assert httpx.get(server.url + path).status_code == 401
        assert admin.get(path).status_code == 200
    assert _jobs(admin) == []


def test_streams_are_bounded_per_key_and_end_when_the_key_is_revoked(team):
    server, admin, user, data = team
    spec = _spec({"source": "bundled:gpt-tiny", "task": "causal-lm"}, {"train": str(data / "topics.jsonl")})
    url = f"/api/v1/jobs/{user.post('/api/v1/jobs', json={'spec': spec}).json()['id']}/logs/stream"
    with contextlib.ExitStack() as held:
        opened = [held.enter_context(user.stream("GET", url)) for _ in range(8)]
        assert [r.status_code for r in opened] == [200] * 8
        deadline = time.monotonic() + 10  # a stream counts once its first poll ran
        while (ninth := user.get(url)).status_code != 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ninth.status_code == 429 and "8 open streams" in ninth.text
        assert admin.delete("/api/v1/keys/mallory").status_code == 200
        lines = list(itertools.islice(opened[0].iter_lines(), 2))
        assert lines[0] == "event: end" and json.loads(lines[1].removeprefix("data: "))["state"] == "revoked"
    assert user.get("/api/v1/jobs").status_code == 401


def test_secrets_stay_put(tmp_path, store_url):
    with _server(tmp_path, store_url, schedule=True) as server:
        home, admin = (
            server.home,
            httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}),
        )
        for path in (home, home / "runs"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
        assert stat.S_IMODE((home / "worker.secret").stat().st_mode) == 0o600
        # an admin's python: job: its runner's environment, read from /proc while it runs
        spec = {
            "name": "env",
            "model": {"source": f"python:{TEST_MODELS}:image_model", "task": "image-classification",
                      "options": {"sleep_s": 0.2}},
            "data": {"train": "sklearn:digits"},
            "train": {"max_steps": 1000},
        }  # fmt: skip
        submitted = admin.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)})
        assert submitted.status_code == 201, submitted.text
        job = submitted.json()
        env = _environment_of(Path(job["run_dir"]))
        admin.post(f"/api/v1/jobs/{job['id']}/cancel")
    assert not {"GPUFORGE_ADMIN_KEY", "GPUFORGE_DB", "MY_SERVICE_TOKEN"} & set(env), sorted(env)
    assert env["GPUFORGE_USER_CODE"] == "1" and str(tmp_path / "data") in env["GPUFORGE_CONFINE_ROOTS"]
    assert env["PATH"] == os.environ["PATH"]
    assert ADMIN_KEY not in (tmp_path / "server.log").read_text()


def _environment_of(run_dir: Path, timeout: float = 60) -> dict[str, str]:
    """The environment of the process whose command line names `run_dir` (a job's runner)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and os.fsencode(run_dir) in (proc / "cmdline").read_bytes().split(
                    b"\0"
                ):
                    raw = (proc / "environ").read_bytes().split(b"\0")
                    return dict(item.decode().partition("=")[::2] for item in raw if item)
            except OSError:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no runner for {run_dir} within {timeout} s")


def test_a_runner_holds_to_its_policy_whatever_its_spec_file_says(tmp_path, tiny_bert_dir):
    """A spec edited on disk (or written by an older version) cannot get past the runner's own check."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(TOPICS, data / "topics.jsonl")
    confined = {"GPUFORGE_USER_CODE": "0", "GPUFORGE_CONFINE_ROOTS": str(data)}
    marker = tmp_path / "pwned"
    code_dir = data / "custom"
    shutil.copytree(tiny_bert_dir, code_dir)
    (code_dir / "custom_config.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import BertConfig\n"
        "class CustomConfig(BertConfig):\n    model_type = 'custom-bert'\n"
    )
    config = json.loads((code_dir / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "custom_config.CustomConfig"}
    (code_dir / "config.json").write_text(json.dumps(config))
    topics = {"train": str(data / "topics.jsonl"), "max_records": 32}
    cases = [
        ({"source": f"python:{TEST_MODELS}:image_model", "task": "image-classification"}, "python: models"),
        (
            {
                "source": f"hf:{code_dir}",
                "task": "sequence-classification",
                "options": {"trust_remote_code": True},
            },
            "model.options.trust_remote_code",
        ),
        ({"source": "bundled:gpt-tiny", "task": "causal-lm", "options": {"subfolder": ".."}}, "unknown"),
        ({"source": "bundled:gpt-tiny", "task": "causal-lm"}, None),
    ]
    for i, (model, message) in enumerate(cases):
        raw = {"name": "edited", "model": model, "data": topics, "train": {"max_steps": 1, "batch_size": 8}}
        if message is None:
            raw["data"] = {**topics, "eval": "/etc/hostname"}
            message = "data.eval: /etc/hostname is outside the server's data roots"
        spec = tmp_path / f"spec{i}.yaml"
        spec.write_text(yaml.safe_dump(raw))
        result = run_cli("train", str(spec), "--out", str(tmp_path / f"run{i}"), env=confined)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert not (tmp_path / f"run{i}").exists()
    # without trust_remote_code the directory's own code is never imported, even by a run that trains
    raw = {
        "name": "plain",
        "model": {"source": f"hf:{code_dir}", "task": "sequence-classification"},
        "data": topics,
        "train": {"max_steps": 1, "batch_size": 8},
    }
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(raw))
    trained = run_cli("train", str(tmp_path / "plain.yaml"), "--out", str(tmp_path / "plain"), env=confined)
    assert trained.returncode == 0, trained.stderr
    assert not marker.exists()
