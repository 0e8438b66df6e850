"""`gpuforge server` as a real process on loopback, driven by the client verbs."""

import json

import pytest

from gpuforge.server.local import LocalServer, free_port
from tests.conftest import ROOT, run_cli


@pytest.fixture
def live_server(tmp_path, monkeypatch):
    server = LocalServer(
        tmp_path / "home",
        log=tmp_path / "server.log",
        GPUFORGE_DATA_ROOTS=str(ROOT / "examples"),
        GPUFORGE_SCHEDULE="false",  # the API and client alone: jobs stay queued
    )
    with server:
        monkeypatch.setenv("GPUFORGE_URL", server.url)
        monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
        yield server.url, server.process, server.home


def test_submit_list_and_cancel_through_the_cli(live_server):
    url, process, _ = live_server
    submitted = run_cli("submit", str(ROOT / "examples" / "digits-cnn.yaml"), "--priority", "3", "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["id"]
    listed = json.loads(run_cli("jobs", "--json").stdout)
    assert [(j["id"], j["state"], j["priority"]) for j in listed] == [(job_id, "queued", 3)]
    assert "queued" in run_cli("jobs").stdout
    assert run_cli("cancel", str(job_id)).stdout.strip() == f"job {job_id}: cancelled"
    again = run_cli("cancel", str(job_id))
    assert again.returncode == 2
    assert (
        again.stderr.strip().splitlines()[-1]
        == f"gpuforge: error: server answered 409: job {job_id} is already cancelled"
    )
    assert process.poll() is None  # still up


def test_client_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUFORGE_API_KEY", raising=False)
    result = run_cli("jobs")
    assert result.returncode == 2 and "no API key" in result.stderr
    monkeypatch.setenv("GPUFORGE_API_KEY", "gf_x")
    result = run_cli("jobs", "--url", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 2 and "server unreachable" in result.stderr


def test_a_second_key_sees_and_cancels_only_its_own_jobs(live_server, monkeypatch):
    admin_job = json.loads(run_cli("submit", str(ROOT / "examples" / "digits-cnn.yaml"), "--json").stdout)[
        "id"
    ]
    made = run_cli("keys", "create", "alice", "--json")
    assert made.returncode == 0, made.stderr
    alice = json.loads(made.stdout)
    assert alice["name"] == "alice" and not alice["admin"] and alice["key"].startswith("gf_")
    assert run_cli("keys", "create", "alice").returncode == 2  # names are unique

    monkeypatch.setenv("GPUFORGE_API_KEY", alice["key"])
    code = run_cli("submit", str(ROOT / "examples" / "digits-cnn.yaml"))  # a python: model is code
    assert code.returncode == 2 and "only an admin key may submit them" in code.stderr
    own = json.loads(run_cli("submit", str(ROOT / "examples" / "minilm-topics.yaml"), "--json").stdout)["id"]
    assert [j["id"] for j in json.loads(run_cli("jobs", "--json").stdout)] == [own]
    hidden = run_cli("cancel", str(admin_job))
    assert hidden.returncode == 2 and f"404: no job {admin_job}" in hidden.stderr
    assert "403" in run_cli("keys", "create", "mallory").stderr  # only an admin makes keys
    assert run_cli("cancel", str(own)).stdout.strip() == f"job {own}: cancelled"

    monkeypatch.setenv("GPUFORGE_API_KEY", (live_server[2] / "admin.key").read_text().strip())
    assert {j["id"] for j in json.loads(run_cli("jobs", "--json").stdout)} == {admin_job, own}

    assert run_cli("keys", "revoke", "alice").stdout.strip() == "key alice: revoked"
    assert "revoked" in run_cli("keys", "list").stdout
    monkeypatch.setenv("GPUFORGE_API_KEY", alice["key"])
    refused = run_cli("jobs")
    assert refused.returncode == 2 and "401" in refused.stderr


def test_submit_sends_local_data_files_once_by_content(live_server, tmp_path):
    elsewhere = tmp_path / "client-side"  # not under the server's data roots
    elsewhere.mkdir()
    (elsewhere / "reviews.jsonl").write_text((ROOT / "examples" / "data" / "sentiment.jsonl").read_text())
    spec = (ROOT / "examples" / "minilm-sentiment-lora.yaml").read_text()
    (elsewhere / "job.yaml").write_text(spec.replace("data/sentiment.jsonl", "reviews.jsonl"))
    ids = [
        json.loads(run_cli("submit", str(elsewhere / "job.yaml"), "--json").stdout)["id"] for _ in range(2)
    ]
    uploads = list((live_server[2] / "uploads").iterdir())
    assert len(uploads) == 1 and uploads[0].suffix == ".jsonl"  # two submits, one copy
    assert uploads[0].read_bytes() == (elsewhere / "reviews.jsonl").read_bytes()
    stored = json.loads(run_cli("job", str(ids[1])).stdout)
    assert stored["state"] == "queued"
    (elsewhere / "missing.yaml").write_text(
        spec.replace("data/sentiment.jsonl", str(tmp_path / "nope.jsonl"))
    )
    refused = run_cli("submit", str(elsewhere / "missing.yaml"))
    assert refused.returncode == 2 and "data.train" in refused.stderr


def test_the_server_will_not_listen_beyond_loopback_without_a_key(tmp_path):
    home = tmp_path / "fresh"
    refused = run_cli(
        "server", "--host", "0.0.0.0", "--port", str(free_port()), env={"GPUFORGE_HOME": str(home)}
    )
    assert refused.returncode == 2 and "refusing to listen beyond loopback" in refused.stderr
    assert not (home / "admin.key").exists()


def test_a_store_that_cannot_open_is_one_line(tmp_path):
    bad = run_cli(
        "server", "--db", "postgresql+psycopg://nobody@127.0.0.1:1/none", env={"GPUFORGE_HOME": str(tmp_path)}
    )
    assert bad.returncode == 2 and "cannot open the store" in bad.stderr and "Traceback" not in bad.stderr


def test_logs_follow_prints_log_and_metrics_lines_until_the_job_stops(tmp_path, monkeypatch):
    from tests.conftest import TEST_MODELS, image_spec, write_spec

    spec = write_spec(tmp_path / "job.yaml", image_spec(tmp_path, max_steps=12, options={"sleep_s": 0.05}))
    with LocalServer(tmp_path / "home", log=tmp_path / "server.log") as server:  # scheduling on
        monkeypatch.setenv("GPUFORGE_URL", server.url)
        monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
        job_id = json.loads(run_cli("submit", str(spec), "--json").stdout)["id"]
        followed = run_cli("logs", str(job_id), "--follow", timeout=120)
    assert followed.returncode == 0, followed.stderr
    lines = followed.stdout.splitlines()
    steps = [int(line.split()[2].rstrip(",")) for line in lines if line.startswith("metrics: step")]
    assert steps == list(range(1, 13))  # every step once, in order
    assert any("finished at step 12/12" in line for line in lines)
    assert lines[-1] == f"job {job_id} finished"
    assert str(TEST_MODELS) not in (tmp_path / "home" / "runs" / f"job-{job_id}.yaml").read_text()  # uploaded
