"""Real job processes: launched in their own session, cancelled with a checkpoint, killed if stuck."""

import json
import os
import signal
import time

import pytest

from gpuforge.child_env import child_environment
from gpuforge.runtime.host import is_alive
from gpuforge.scheduler.executor import cancel, launch
from tests.helpers.specs import image_spec, write_spec


def _wait_for_step(run_dir, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and sum(1 for _ in metrics.open()) >= step:
            return
        time.sleep(0.1)
    raise AssertionError(
        f"no step {step} within {timeout} s: {(run_dir / 'logs' / 'process.log').read_text()}"
    )


@pytest.mark.slow
def test_a_cancelled_job_checkpoints_and_its_process_is_gone(tmp_path):
    spec = write_spec(tmp_path / "job.yaml", image_spec(tmp_path, max_steps=400, options={"sleep_s": 0.05}))
    launched = launch(spec, tmp_path / "run", child_environment({"OMP_NUM_THREADS": "1"}))
    assert os.getsid(launched.pid) == launched.pid  # a session of its own: outlives the server
    _wait_for_step(tmp_path / "run", 3)
    assert is_alive(launched.pid)
    assert cancel(launched.pid, grace_s=60) == "stopped by SIGTERM"
    assert not is_alive(launched.pid) and launched.process.wait(5) == 128 + signal.SIGTERM
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "cancelled" and any(e["event"] == "checkpoint" for e in events)
    assert "stopped by SIGTERM" in (tmp_path / "run" / "logs" / "process.log").read_text()


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    import subprocess
    import sys

    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
        ]
    )
    time.sleep(0.5)
    assert cancel(stubborn.pid, grace_s=0.5) == "killed after 0.5 s"
    assert stubborn.wait(5) == -signal.SIGKILL and not is_alive(stubborn.pid)
    assert cancel(stubborn.pid) == "already gone"
