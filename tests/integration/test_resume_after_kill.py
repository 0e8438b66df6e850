"""Kill a real training process (SIGKILL: no handler runs) and resume it: the loss curve is unchanged."""

import signal
import subprocess
import sys
import time

import pytest

from gpuforge.runs import RunDir
from tests.helpers.cli import run_cli
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.slow  # every test here is slow (docs/testing.md)

STEPS, EVERY = 24, 6


def _wait_for(predicate, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"training exited early ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.02)
    pytest.fail("timed out waiting for the training process")


@pytest.mark.parametrize("signum, expected_rc", [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 143)])
def test_killed_training_resumes_with_the_same_loss_curve(tmp_path, signum, expected_rc):
    # dropout on: the resumed run must restore the RNG too; a sleep per forward so it can be caught mid-run
    spec = write_spec(
        tmp_path / "job.yaml",
        image_spec(
            tmp_path, max_steps=STEPS, checkpoint_every=EVERY, options={"sleep_s": 0.03, "dropout": 0.2}
        ),
    )
    reference = run_cli("train", str(spec), "--out", str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr

    run = RunDir(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuforge", "train", str(spec), "--out", str(run.root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(lambda: run.latest_checkpoint() is not None and run.latest_checkpoint()[0] >= 2 * EVERY, proc)
    _wait_for(lambda: len(run.metrics()) >= 2 * EVERY + 2, proc)  # past the checkpoint: these steps re-run
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == expected_rc
    killed_at = max(m["step"] for m in run.metrics())
    assert killed_at < STEPS and not run.model_dir.exists()
    if signum == signal.SIGTERM:
        assert run.events()[-1]["event"] == "cancelled" and run.latest_checkpoint()[0] == killed_at

    resumed = run_cli("train", str(spec), "--out", str(run.root))
    assert resumed.returncode == 0, resumed.stderr
    metrics, ref = run.metrics(), RunDir(tmp_path / "reference").metrics()
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # no step lost or counted twice
    for mine, theirs in zip(metrics, ref, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6, abs=1e-7), mine["step"]
        assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-9)
    assert run.summary()["resumed_from"] >= 2 * EVERY and run.model_dir.exists()
