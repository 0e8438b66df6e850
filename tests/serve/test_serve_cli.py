"""`gpuforge serve` as a real process on loopback: ready after warm-up, answers, refuses what it must,
finishes the requests it holds when stopped, says where it listens; behind the team server too."""

import concurrent.futures
import json
import signal
import time

import httpx
import pytest

from gpuforge.server.local import LocalServer
from gpuforge.spec import load_spec
from gpuforge.train.engine import train
from tests.helpers.cli import run_cli
from tests.helpers.paths import ROOT
from tests.helpers.serving import start_serve as _serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-cli")
    train(load_spec(ROOT / "examples" / "digits-cnn.yaml", ["train.max_steps=10"]), tmp / "run")
    return tmp / "run" / "model"


def test_serve_answers_and_finishes_in_flight_requests_on_sigterm(digits_model):
    from sklearn.datasets import load_digits

    images = (load_digits().images[:64] / 16.0).tolist()
    process, url = _serve(digits_model, "--max-batch", "128", "--max-wait-ms", "1500")
    try:
        # a batch of 128: the next batch, coming within 1.5 s, waits that long for as many
        answer = httpx.post(f"{url}/predict", json={"inputs": images * 2}, timeout=30).json()
        assert len(answer["outputs"]) == 128 and answer["model"] == "digits-cnn"

        def ask(i):
            return httpx.post(f"{url}/predict", json={"inputs": images[i : i + 8]}, timeout=60).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            pending = [pool.submit(ask, i) for i in range(0, 64, 8)]
            deadline = time.monotonic() + 10
            while _in_flight(url) < 8:  # all eight held by the batcher (a batch waits up to 1.5 s to fill)
                assert time.monotonic() < deadline
                time.sleep(0.02)
            process.send_signal(signal.SIGTERM)  # stop accepting, answer what is held, exit
            codes = [p.result() for p in pending]
        assert codes == [200] * 8
        assert process.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once done
    finally:
        if process.poll() is None:
            process.kill()


def _in_flight(url) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("gpuforge_serve_requests_in")
    )


def test_serve_refuses_what_it_must_in_one_line(digits_model, tmp_path):
    wide = run_cli("serve", str(digits_model), "--host", "0.0.0.0", env={"GPUFORGE_API_KEY": ""})
    assert wide.returncode == 2 and "beyond loopback without a key (GPUFORGE_API_KEY or --api-key-file)" in (
        wide.stderr
    )
    empty = run_cli("serve", str(tmp_path))
    assert empty.returncode == 2 and f"{tmp_path}: not a gpuforge model directory" in empty.stderr
    missing = run_cli("serve", str(tmp_path / "nope"))
    assert missing.returncode == 2 and f"{tmp_path / 'nope'}: no such directory" in missing.stderr
    run_dir = run_cli("serve", str(digits_model.parent))  # the run, not its model/
    assert run_dir.returncode == 2 and f"(no gpuforge.json); did you mean {digits_model}?" in run_dir.stderr
    adapter = run_cli("serve", str(digits_model), "--adapter", f"x={digits_model}")
    assert adapter.returncode == 2 and "is a full model; serve an adapter" in adapter.stderr
    shape = run_cli("serve", str(digits_model), "--adapter", "nonsense")
    assert shape.returncode == 2 and "expected NAME=DIR" in shape.stderr


def test_a_client_that_goes_away_frees_its_place(digits_model):
    from sklearn.datasets import load_digits

    image = (load_digits().images[0] / 16.0).tolist()
    process, url = _serve(digits_model, "--max-batch", "64", "--max-wait-ms", "1500")
    try:
        assert httpx.post(f"{url}/predict", json={"inputs": [image] * 2}, timeout=30).status_code == 200
        with pytest.raises(httpx.ReadTimeout):  # after a batch of 2 the next waits 1.5 s for a second input:
            httpx.post(f"{url}/predict", json={"inputs": [image]}, timeout=0.3)  # the client leaves first
        # past the batch's wait: the queue is empty once the batch formed and skipped the input left behind
        gone = 'gpuforge_serve_rejected_total{reason="client gone"}'
        deadline = time.monotonic() + 30
        while (figures := _figures(url)).get(gone, 0) < 1 or figures["gpuforge_serve_queue_length"] > 0:
            assert time.monotonic() < deadline, figures
            time.sleep(0.05)
        assert figures[gone] == 1
        assert figures["gpuforge_serve_inputs_total"] == 2  # the model never saw the third
        assert httpx.post(f"{url}/predict", json={"inputs": [image]}, timeout=30).status_code == 200
        assert _figures(url)["gpuforge_serve_inputs_total"] == 3  # this one only, not the third as well
    finally:
        process.kill()


def _figures(url) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    }


def test_serve_says_where_it_listens_and_stops_at_once_when_idle(digits_model):
    from sklearn.datasets import load_digits

    process, url = _serve(digits_model)
    try:
        image = (load_digits().images[0] / 16.0).tolist()
        with httpx.Client() as client:  # its connection stays open (keep-alive), idle, as clients leave it
            assert client.post(f"{url}/predict", json={"inputs": [image]}, timeout=30).status_code == 200
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) in (0, -signal.SIGTERM)
            seconds = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
    lines = process.stdout.read().splitlines()
    assert f"gpuforge serve: listening on {url} (model {digits_model})" in lines
    assert lines[-1] == "gpuforge serve: stopped"
    assert seconds < 2, f"{seconds:.1f} s from SIGTERM to exit with nothing in flight"


def test_the_team_server_says_where_it_listens_and_that_it_stopped(tmp_path):
    server = LocalServer(tmp_path / "home", log=tmp_path / "server.log").start()
    try:
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) in (0, -signal.SIGTERM)
    finally:
        server.stop()
    lines = (tmp_path / "server.log").read_text().splitlines()
    assert f"gpuforge server: listening on {server.url} (home {tmp_path / 'home'})" in lines
    assert lines[-1] == "gpuforge server: stopped"


def test_the_team_server_forwards_a_curl_d_body_to_its_replica(digits_model, tmp_path):
    """`curl -d` says application/x-www-form-urlencoded; the server and its replica read JSON anyway."""
    from fastapi.testclient import TestClient
    from sklearn.datasets import load_digits

    from gpuforge.scheduler.worker_keys import replicas_key
    from gpuforge.server.app import create_app
    from gpuforge.server.settings import Settings
    from gpuforge.store.db import session
    from gpuforge.store.models import Deployment

    home = tmp_path / "home"
    with TestClient(create_app(Settings(home=home, schedule=False))) as api:  # the replica started here
        state = api.app.state.services
        with session(state.engine) as s:
            deployment = Deployment(name="digits", model_dir=str(digits_model), worker_key="", workers=[])
            s.add(deployment)
            s.flush()
            key = replicas_key(state.worker_secret, deployment)
        process, url = _serve(digits_model, env={"GPUFORGE_API_KEY": key})
        try:
            with session(state.engine) as s:
                s.get(Deployment, deployment.id).workers = [
                    {"index": 0, "ready": True, "port": int(url.rsplit(":", 1)[1])}
                ]
            image = (load_digits().images[0] / 16.0).tolist()
            headers = {
                "Authorization": "Bearer " + (home / "admin.key").read_text().strip(),
                "Content-Type": "application/x-www-form-urlencoded",
            }
            path = "/api/v1/deployments/digits/predict"
            answer = api.post(path, content=json.dumps({"inputs": [image]}), headers=headers)
            assert answer.status_code == 200 and len(answer.json()["outputs"]) == 1, answer.text
            not_json = api.post(path, content=b"inputs=1", headers=headers)
            assert not_json.status_code == 422 and "JSON decode error" in not_json.text
        finally:
            process.kill()
