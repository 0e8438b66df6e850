"""`gpuforge serve` as a real process on loopback: ready after warm-up, answers, refuses what it must, and
finishes the requests it holds when stopped."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from gpuforge.server.local import free_port, wait_until_ready
from gpuforge.spec import load_spec
from gpuforge.train.engine import train
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-cli")
    train(load_spec(ROOT / "examples" / "digits-cnn.yaml", ["train.max_steps=10"]), tmp / "run")
    return tmp / "run" / "model"


def _serve(model_dir, *options, env=None):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuforge", "serve", str(model_dir), "--port", str(port), *options],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    if wait_until_ready(url, process, 90):
        return process, url
    process.kill()
    raise AssertionError(f"serve did not get ready: {process.stdout.read()}")


def test_serve_answers_and_finishes_in_flight_requests_on_sigterm(digits_model):
    from sklearn.datasets import load_digits

    images = (load_digits().images[:64] / 16.0).tolist()
    process, url = _serve(digits_model, "--max-batch", "128", "--max-wait-ms", "1500")
    try:
        answer = httpx.post(f"{url}/predict", json={"inputs": images[:3]}, timeout=30).json()
        assert len(answer["outputs"]) == 3 and answer["model"] == "digits-cnn"

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
    missing = run_cli("serve", str(tmp_path))
    assert missing.returncode == 2 and "not a gpuforge model directory" in missing.stderr
    adapter = run_cli("serve", str(digits_model), "--adapter", f"x={digits_model}")
    assert adapter.returncode == 2 and "is a full model; serve an adapter" in adapter.stderr
    shape = run_cli("serve", str(digits_model), "--adapter", "nonsense")
    assert shape.returncode == 2 and "expected NAME=DIR" in shape.stderr


def test_a_client_that_goes_away_frees_its_place(digits_model):
    from sklearn.datasets import load_digits

    image = (load_digits().images[0] / 16.0).tolist()
    process, url = _serve(digits_model, "--max-batch", "64", "--max-wait-ms", "1500")
    try:
        with pytest.raises(httpx.ReadTimeout):  # the batch would wait 1.5 s to fill: the client leaves first
            httpx.post(f"{url}/predict", json={"inputs": [image]}, timeout=0.3)
        time.sleep(2.0)  # past the batch's wait
        figures = _figures(url)
        assert figures['gpuforge_serve_rejected_total{reason="client gone"}'] == 1
        assert figures["gpuforge_serve_inputs_total"] == 0  # the model never saw it
        assert httpx.post(f"{url}/predict", json={"inputs": [image]}, timeout=30).status_code == 200
    finally:
        process.kill()


def _figures(url) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    }
