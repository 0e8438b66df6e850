"""`gpuforge server` as a real process on loopback, driven by the client verbs.

The tests of the API and client share one API-only server (a server start is a process, torch and a store
migration), but for the one that revokes a key: each makes keys of names of its own and checks what its
own calls changed, against the jobs and uploads the tests before it left. The tests of scheduling share
another."""

import json
import re
from pathlib import Path

import httpx
import pytest

from gpuforge.runtime.host import free_port
from gpuforge.server.local import LocalServer
from tests.helpers.cli import run_cli
from tests.helpers.paths import ROOT


def _api_only_server(where: Path) -> LocalServer:
    """A server for the API and the client alone: its jobs stay queued."""
    return LocalServer(
        where / "home",
        log=where / "server.log",
        GPUFORGE_DATA_ROOTS=str(ROOT / "examples"),
        GPUFORGE_SCHEDULE="false",
    )


@pytest.fixture(scope="module")
def api_server(tmp_path_factory):
    with _api_only_server(tmp_path_factory.mktemp("api-server")) as server:
        yield server


@pytest.fixture
def live_server(api_server, monkeypatch):
    monkeypatch.setenv("GPUFORGE_URL", api_server.url)
    monkeypatch.setenv("GPUFORGE_API_KEY", api_server.key)
    return api_server.url, api_server.process, api_server.home


@pytest.fixture
def own_server(tmp_path, monkeypatch):
    """A server of its own, for the test that revokes a key: a revoked key's date squeezes the columns of
    `keys list` (120 wide in a pipe), whose quota headers another test reads."""
    with _api_only_server(tmp_path) as server:
        monkeypatch.setenv("GPUFORGE_URL", server.url)
        monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
        yield server.url, server.process, server.home


@pytest.fixture(scope="module")
def scheduling_server(tmp_path_factory):
    where = tmp_path_factory.mktemp("scheduling-server")
    with LocalServer(where / "home", log=where / "server.log") as server:  # scheduling on
        yield server


def _job_ids(url: str, home) -> set[int]:
    """Every job on the server now (as its admin sees them, through the API): what the tests before left."""
    key = (home / "admin.key").read_text().strip()
    answer = httpx.get(f"{url}/api/v1/jobs", params={"limit": 1000}, timeout=30,
                       headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    assert answer.status_code == 200, answer.text
    return {j["id"] for j in answer.json()}


@pytest.mark.slow
def test_submit_list_and_cancel_through_the_cli(live_server):
    url, process, home = live_server
    before = _job_ids(url, home)
    submitted = run_cli("submit", str(ROOT / "examples" / "digits-cnn.yaml"), "--priority", "3", "--json")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["id"]
    listed = json.loads(run_cli("jobs", "--json").stdout)
    assert {j["id"] for j in listed} >= before
    assert [(j["id"], j["state"], j["priority"]) for j in listed if j["id"] not in before] == [
        (job_id, "queued", 3)
    ]
    assert re.search(rf"^\W+{job_id} .* queued ", run_cli("jobs").stdout, re.MULTILINE)  # its row
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


@pytest.mark.slow
def test_a_second_key_sees_and_cancels_only_its_own_jobs(own_server, monkeypatch):
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

    monkeypatch.setenv("GPUFORGE_API_KEY", (own_server[2] / "admin.key").read_text().strip())
    assert {j["id"] for j in json.loads(run_cli("jobs", "--json").stdout)} == {admin_job, own}

    assert run_cli("keys", "revoke", "alice").stdout.strip() == "key alice: revoked"
    assert "revoked" in run_cli("keys", "list").stdout
    monkeypatch.setenv("GPUFORGE_API_KEY", alice["key"])
    refused = run_cli("jobs")
    assert refused.returncode == 2 and "401" in refused.stderr


@pytest.mark.slow
def test_submit_sends_local_data_files_once_by_content(live_server, tmp_path):
    elsewhere = tmp_path / "client-side"  # not under the server's data roots
    elsewhere.mkdir()
    (elsewhere / "reviews.jsonl").write_text((ROOT / "examples" / "data" / "sentiment.jsonl").read_text())
    spec = (ROOT / "examples" / "minilm-sentiment-lora.yaml").read_text()
    (elsewhere / "job.yaml").write_text(spec.replace("data/sentiment.jsonl", "reviews.jsonl"))
    before = set((live_server[2] / "uploads").glob("*"))  # no other test sends this file's bytes
    ids = [
        json.loads(run_cli("submit", str(elsewhere / "job.yaml"), "--json").stdout)["id"] for _ in range(2)
    ]
    uploads = list(set((live_server[2] / "uploads").iterdir()) - before)
    assert len(uploads) == 1 and uploads[0].suffix == ".jsonl"  # two submits, one copy
    assert uploads[0].read_bytes() == (elsewhere / "reviews.jsonl").read_bytes()
    stored = json.loads(run_cli("job", str(ids[1])).stdout)
    assert stored["state"] == "queued"
    (elsewhere / "missing.yaml").write_text(
        spec.replace("data/sentiment.jsonl", str(tmp_path / "nope.jsonl"))
    )
    refused = run_cli("submit", str(elsewhere / "missing.yaml"))
    assert refused.returncode == 2 and "data.train" in refused.stderr


@pytest.mark.slow
def test_the_server_will_not_listen_beyond_loopback_without_a_key(tmp_path):
    home = tmp_path / "fresh"
    refused = run_cli(
        "server", "--host", "0.0.0.0", "--port", str(free_port()), env={"GPUFORGE_HOME": str(home)}
    )
    assert refused.returncode == 2 and "refusing to listen beyond loopback" in refused.stderr
    assert not (home / "admin.key").exists()


@pytest.mark.slow
def test_a_store_that_cannot_open_is_one_line(tmp_path):
    bad = run_cli(
        "server", "--db", "postgresql+psycopg://nobody@127.0.0.1:1/none", env={"GPUFORGE_HOME": str(tmp_path)}
    )
    assert bad.returncode == 2 and "cannot open the store" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_logs_follow_prints_log_and_metrics_lines_until_the_job_stops(
    scheduling_server, tmp_path, monkeypatch
):
    from tests.helpers.paths import TEST_MODELS
    from tests.helpers.specs import image_spec, write_spec

    spec = write_spec(tmp_path / "job.yaml", image_spec(tmp_path, max_steps=12, options={"sleep_s": 0.05}))
    server = scheduling_server
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
    assert str(TEST_MODELS) not in (server.home / "runs" / f"job-{job_id}.yaml").read_text()  # uploaded


def _last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_keys_quotas_are_set_shown_changed_and_enforced_through_the_cli(live_server, monkeypatch):
    topics = str(ROOT / "examples" / "minilm-topics.yaml")
    made = run_cli("keys", "create", "alice", "--max-queued", "1", "--max-priority", "5", "--json")
    assert made.returncode == 0, made.stderr
    alice = json.loads(made.stdout)
    listed = {k["name"]: k for k in json.loads(run_cli("keys", "list", "--json").stdout)}
    shown = ("max_queued", "max_running", "max_upload_bytes", "max_priority")
    assert [listed["alice"][q] for q in shown] == [1, 4, 10 * 2**30, 5]
    assert listed["admin"]["max_queued"] is None  # an admin key has no quotas
    table = run_cli("keys", "list").stdout
    assert "max_queued" in table and "10 GiB" in table and "none" in table

    monkeypatch.setenv("GPUFORGE_API_KEY", alice["key"])
    too_high = run_cli("submit", topics, "--priority", "6")
    assert too_high.returncode == 2 and _last_line(too_high) == (
        "gpuforge: error: server answered 422: quota max_priority: key 'alice' may ask for priority 5 at "
        "most, not 6; the admin can raise it: gpuforge keys set alice --max-priority N"
    )
    assert run_cli("submit", topics).returncode == 0
    full = run_cli("submit", topics)
    assert (
        full.returncode == 2
        and "server answered 429: quota max_queued: key 'alice' has 1 jobs" in full.stderr
    )
    assert "403" in run_cli("keys", "set", "alice", "--max-queued", "5").stderr  # the admin's alone

    monkeypatch.setenv("GPUFORGE_API_KEY", live_server[2].joinpath("admin.key").read_text().strip())
    changed = run_cli("keys", "set", "alice", "--max-queued", "2")
    assert changed.returncode == 0, changed.stderr
    assert changed.stdout.strip() == (
        "key alice: max_queued 2, max_running 4, max_upload_bytes 10 GiB, max_deployments 4, max_priority 5"
    )
    nothing = run_cli("keys", "set", "alice")
    assert nothing.returncode == 2 and "nothing to change" in nothing.stderr
    monkeypatch.setenv("GPUFORGE_API_KEY", alice["key"])
    assert run_cli("submit", topics).returncode == 0  # the new limit holds at once


@pytest.mark.slow
def test_the_api_key_comes_from_the_environment_or_a_file_never_the_command_line(
    live_server, tmp_path, monkeypatch
):
    key = live_server[2].joinpath("admin.key").read_text().strip()
    monkeypatch.delenv("GPUFORGE_API_KEY")
    key_file = tmp_path / "key"
    key_file.write_text(f"  {key}  \nanything after the first line\n")
    every = _job_ids(live_server[0], live_server[2])
    listed = run_cli("jobs", "--json", "--api-key-file", str(key_file))
    assert listed.returncode == 0, listed.stderr
    assert {j["id"] for j in json.loads(listed.stdout)} == every  # the admin's view: the key was read whole
    (tmp_path / "empty").write_text("\n")
    for path, why in ((tmp_path / "missing", "cannot read it (No such file or directory)"),
                      (tmp_path / "empty", "its first line is empty; it should hold the API key"),
                      (tmp_path, "cannot read it (Is a directory)")):  # fmt: skip
        bad = run_cli("jobs", "--api-key-file", str(path))
        assert bad.returncode == 2 and bad.stderr.strip() == f"gpuforge: error: --api-key-file {path}: {why}"
    gone = run_cli("jobs", "--key", key)
    assert gone.returncode == 2 and "No such option: --key" in gone.stderr


@pytest.mark.slow
def test_a_store_url_with_a_password_is_refused_on_the_command_line_and_never_shown(tmp_path):
    env = {"GPUFORGE_HOME": str(tmp_path / "home"), "GPUFORGE_DB": ""}
    for url in ("postgresql+psycopg://gf:s3cret@127.0.0.1:1/none",
                "postgresql+psycopg://gf@127.0.0.1:1/none?password=s3cret"):  # fmt: skip
        refused = run_cli("server", "--db", url, env=env)
        assert refused.returncode == 2 and "s3cret" not in refused.stdout + refused.stderr
        assert refused.stderr.strip().startswith("gpuforge: error: --db postgresql+psycopg://gf")
        assert "GPUFORGE_DB or in a file named by --db-file PATH" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    db_file = tmp_path / "db-url"
    db_file.write_text("postgresql+psycopg://gf:s3cret@127.0.0.1:1/none\n")
    unreachable = run_cli("server", "--db-file", str(db_file), env=env)  # taken, then cannot open
    assert unreachable.returncode == 2 and "cannot open the store" in unreachable.stderr
    assert "s3cret" not in unreachable.stdout + unreachable.stderr and "gf:***@" in unreachable.stderr
    missing = run_cli("server", "--db-file", str(tmp_path / "nope"), env=env)
    assert missing.returncode == 2 and f"--db-file {tmp_path / 'nope'}: cannot read it" in missing.stderr
    both = run_cli("server", "--db", "sqlite:///x.db", "--db-file", str(db_file), env=env)
    assert both.returncode == 2 and "give one of them" in both.stderr


@pytest.mark.slow
def test_a_wrong_column_is_refused_at_submit_in_the_users_names(live_server, tmp_path):
    before = _job_ids(live_server[0], live_server[2])
    (tmp_path / "sentences.csv").write_text("text,label\nwhat a day,happy\n")
    spec = {
        "model": {"source": "bundled:minilm", "task": "sequence-classification"},
        "data": {"train": "sentences.csv", "label_field": "lable"},
    }
    (tmp_path / "job.yaml").write_text(json.dumps(spec))
    refused = run_cli("submit", str(tmp_path / "job.yaml"))
    assert refused.returncode == 2
    assert _last_line(refused) == (
        "gpuforge: error: server answered 422: data.label_field: 'lable' not found in "
        f"{tmp_path / 'sentences.csv'} (columns: text, label)"
    )
    assert {j["id"] for j in json.loads(run_cli("jobs", "--json").stdout)} == before  # none queued


@pytest.mark.slow
def test_a_missing_local_file_is_named_as_written_before_anything_is_sent(live_server, tmp_path):
    (tmp_path / "train.csv").write_text("text,label\nwhat a night,happy\n")  # bytes no other test sends
    before = set((live_server[2] / "uploads").glob("*"))
    spec = {
        "model": {"source": "bundled:minilm", "task": "sequence-classification"},
        "data": {"train": "train.csv", "eval": "sentence.csv"},
    }
    (tmp_path / "job.yaml").write_text(json.dumps(spec))
    refused = run_cli("submit", str(tmp_path / "job.yaml"))
    assert refused.returncode == 2
    assert _last_line(refused) == "gpuforge: error: data.eval: sentence.csv: no such file"
    assert set((live_server[2] / "uploads").glob("*")) == before  # train.csv was not sent either
    overridden = run_cli("submit", str(tmp_path / "job.yaml"), "--set", "data.eval=../elsewhere/x.csv")
    assert _last_line(overridden) == "gpuforge: error: data.eval: ../elsewhere/x.csv: no such file"


@pytest.mark.slow
def test_a_runner_refusing_its_input_fails_its_job_once_with_the_users_file_name(
    scheduling_server, tmp_path, monkeypatch
):
    import numpy as np

    from tests.helpers.specs import image_spec, write_spec

    np.savez(tmp_path / "digits.npz", pixels=np.zeros((4, 8, 8)))  # no x/y arrays: only the runner looks
    spec = write_spec(tmp_path / "job.yaml", image_spec(tmp_path, data={"train": "digits.npz"}))
    server = scheduling_server
    monkeypatch.setenv("GPUFORGE_URL", server.url)
    monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
    job_id = json.loads(run_cli("submit", str(spec), "--json").stdout)["id"]
    waited = run_cli("wait", str(job_id), timeout=120)
    job = json.loads(run_cli("job", str(job_id), "--json").stdout)
    assert waited.returncode != 0
    assert (job["state"], job["restarts"]) == ("failed", 0)  # never started again: it would refuse again
    assert job["reason"] == (
        f"data.train: {tmp_path / 'digits.npz'}: expected arrays 'x' and 'y' (or 'images' and 'labels'), "
        "found pixels"
    )
    assert f"job {job_id}: failed (data.train: " in server.log_path.read_text()


@pytest.mark.slow
def test_a_submit_tried_again_across_a_server_restart_queues_one_job(tmp_path):
    import os
    import subprocess
    import sys

    server = LocalServer(tmp_path / "home", log=tmp_path / "server.log", GPUFORGE_SCHEDULE="false").start()
    server.kill()  # down when the client starts: its first tries find nobody
    env = {**os.environ, "GPUFORGE_URL": server.url, "GPUFORGE_API_KEY": server.key, "COLUMNS": "200"}
    client = subprocess.Popen(
        [sys.executable, "-m", "gpuforge", "submit", str(ROOT / "examples" / "digits-cnn.yaml"), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        said = ""
        while "trying again" not in said and (line := client.stderr.readline()):
            said += line
        assert "server unreachable (ConnectError); trying again in 0.5 s" in said, said
        server.start()  # the same home and port: back while the client waits
        out, err = client.communicate(timeout=60)
    finally:
        client.kill()
        server.stop()
    assert client.returncode == 0, err
    job_id = json.loads(out)["id"]
    with server:
        jobs = server.client().jobs()
    assert [j["id"] for j in jobs] == [job_id]
