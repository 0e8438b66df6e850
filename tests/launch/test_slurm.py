"""Jobs as Slurm jobs (GPUFORGE_EXECUTOR=slurm, launch/slurm.py) on a real single-node Slurm cluster that
scripts/slurm.sh starts on this machine (munged, slurmctld, slurmd, as root): the ranks started by srun,
a stop passed on by scancel, a requeued job resuming from its checkpoint, and a launcher killed outright
that a new one replaces by following the same Slurm job. Skipped with the reason where the daemons
cannot start, unless GPUFORGE_REQUIRE_SLURM=1 (CI) says they must."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuforge.launch import slurm as slurm_lib
from gpuforge.runs import RunDir
from tests.helpers.cli import run_cli
from tests.helpers.slurm import slurm, slurm_conf
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    """The environment a job runner needs to submit to the test cluster."""
    conf = slurm_conf()
    # a CPU (and 2 GiB, slurm.sh's DefMemPerCPU) a job: the tests' two workers' jobs run at once
    return {"SLURM_CONF": conf, "GPUFORGE_EXECUTOR": "slurm", "OMP_NUM_THREADS": "1"}


def _spec(tmp_path: Path, name: str, **train) -> Path:
    spec = image_spec(tmp_path, **train)
    spec["name"] = name
    spec["model"]["options"] = {"sleep_s": 0.05}  # 20 steps a second: time to act while it trains
    return write_spec(tmp_path / f"{name}.yaml", spec)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _wait(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.2)


def _slurm(*args: str, env: dict[str, str]) -> str:
    return subprocess.run(args, capture_output=True, text=True, env={**os.environ, **env}, timeout=30).stdout


def _runner(spec: Path, run: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gpuforge", "train", str(spec), "--out", str(run)],
        env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_a_two_process_ddp_job_runs_its_ranks_by_srun(tmp_path, slurm_env):
    spec = _spec(tmp_path, "slurm-ddp", max_steps=6)
    raw = spec.read_text() + "resources: {devices: 2}\ndistributed: {strategy: ddp}\n"
    spec.write_text(raw)
    run = tmp_path / "run"
    done = run_cli("train", str(spec), "--out", str(run), env={**slurm_env, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["processes"] == 2 and summary["steps"] == 6
    script = (run / "logs" / "slurm-attempt0.sh").read_text()
    assert "#SBATCH --ntasks=2" in script and "exec srun" in script
    assert not (run / "logs" / "slurm-job").exists()  # its end was seen: nothing left to follow
    (log,) = (run / "logs").glob("slurm-[0-9]*.log")
    assert "[rank 0]" in log.read_text() and "[rank 1]" in log.read_text()  # a task a rank, in its output


def test_a_requeued_job_resumes_from_its_checkpoint_and_a_stop_reaches_its_ranks(tmp_path, slurm_env):
    spec, run = _spec(tmp_path, "slurm-requeue", max_steps=2000, checkpoint_every=5), tmp_path / "run"
    runner = _runner(spec, run, slurm_env)
    metrics, events = run / "metrics.jsonl", run / "events.jsonl"
    try:
        _wait(lambda: len(_lines(metrics)) >= 8, "its first steps")
        job_id = (run / "logs" / "slurm-job").read_text().split()[0]
        at_requeue = len(_lines(metrics))
        _slurm("scontrol", "requeue", job_id, env=slurm_env)  # as an admin, or a preemption, would
        _wait(lambda: "PENDING" in _slurm("scontrol", "show", "job", job_id, env=slurm_env), "requeued")
        _slurm("scontrol", "update", f"jobid={job_id}", "StartTime=now", env=slurm_env)  # no 2 min hold
        starts = lambda: [e for e in _lines(events) if e["event"] == "started"]  # noqa: E731
        _wait(lambda: len(starts()) == 2, "the requeued job's ranks started again")
        resumed = starts()[1]["resumed_from"]
        _wait(lambda: len(_lines(metrics)) >= resumed + 5, "steps past the resume")
        runner.send_signal(signal.SIGTERM)  # a cancel: the ranks checkpoint and exit
        out, _ = runner.communicate(timeout=120)
    finally:
        if runner.poll() is None:
            runner.kill()
    assert runner.returncode == 143, out[-3000:]
    assert resumed >= at_requeue  # the checkpoint the requeue's SIGTERM made (not the last of every 5)
    steps = [m["step"] for m in _lines(metrics)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 2000  # each step once
    ended = _lines(events)[-1]
    assert ended["event"] == "cancelled" and "SIGTERM" in ended["reason"], ended
    assert json.loads((run / "summary.json").read_text())["status"] == "cancelled"
    assert "RUNNING" not in _slurm("scontrol", "show", "job", job_id, env=slurm_env)

    # the same command again (a resume): a new Slurm job, from the checkpoint; the ended one is not followed
    runner = _runner(spec, run, slurm_env)
    try:
        _wait(lambda: len(starts()) == 3, "the resumed run's ranks started")
        again = (run / "logs" / "slurm-job").read_text().split()[0]
        runner.send_signal(signal.SIGTERM)
        runner.communicate(timeout=120)
    finally:
        if runner.poll() is None:
            runner.kill()
    assert again != job_id and starts()[2]["resumed_from"] >= len(steps)


def test_a_launcher_killed_outright_is_replaced_by_one_that_follows_the_same_slurm_job(tmp_path, slurm_env):
    spec, run = _spec(tmp_path, "slurm-follow", max_steps=200), tmp_path / "run"
    runner = _runner(spec, run, slurm_env)
    try:
        _wait(lambda: len(_lines(run / "metrics.jsonl")) >= 5, "its first steps")
    finally:
        runner.kill()  # SIGKILL: no word to Slurm; its job goes on
        runner.wait()
    job_id = (run / "logs" / "slurm-job").read_text().split()[0]
    again = run_cli("train", str(spec), "--out", str(run), env=slurm_env, timeout=180)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"following Slurm job {job_id}" in again.stdout + again.stderr
    scripts = [p.name for p in (run / "logs").glob("slurm-attempt*.sh")]
    assert scripts == ["slurm-attempt0.sh"]  # no second job submitted
    assert not (run / "logs" / "slurm-job").exists()  # its end seen: a later run of the command submits anew
    steps = [m["step"] for m in _lines(run / "metrics.jsonl")]
    assert steps == list(range(1, 201))
    assert [e["event"] for e in _lines(run / "events.jsonl")].count("started") == 1  # one run, followed


def test_a_stop_cancels_a_job_that_waits_in_the_queue_and_a_forgotten_job_is_no_answer(
    tmp_path, slurm_env, monkeypatch
):
    import threading

    from gpuforge.launch import slurm

    script = tmp_path / "held.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/held-%j.log\nsleep 600\n")
    env = {**os.environ, **slurm_env}
    job_id = _slurm("sbatch", "--parsable", "--hold", str(script), env=slurm_env).strip()
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])  # for the module's own calls, here
    try:
        stop = threading.Event()
        stop.set()  # asked to stop while Slurm holds it: SIGTERM would reach nothing, so it is cancelled
        fields = slurm.follow(job_id, stop)
        assert fields["JobState"] == "CANCELLED", fields
        assert slurm.outcome_of(job_id, fields)[0].startswith(f"Slurm job {job_id} ended CANCELLED")
        assert slurm.job_state("999999") == {}  # Slurm knows no such job: an answer, not a failure
    finally:
        subprocess.run(["scancel", job_id], env=env, capture_output=True)


def test_a_running_job_is_known_by_its_scripts_folder_even_with_its_output_moved(tmp_path, monkeypatch):
    """What the server's ledger checks the runners' marks against (launch/slurm.holding_logs_folders): a
    job's owner may move its output while it waits, not the batch script it was submitted with."""
    conf = slurm_conf()
    monkeypatch.setenv("SLURM_CONF", conf)
    run = RunDir(tmp_path / "run %j 100%")
    run.logs_dir.mkdir(parents=True)
    script = run.slurm_script_path(0)
    script.write_text("#!/bin/bash\nsleep 60\n")
    output = str(run.logs_dir).replace("%", "%%") + "/slurm-%j.log"
    job = slurm("sbatch", "--parsable", "--hold", f"--output={output}", str(script), conf=conf).strip()
    assert job.isdigit(), job
    try:
        slurm("scontrol", "update", f"JobId={job}", f"StdOut={tmp_path}/elsewhere.log", conf=conf)
        assert f"StdOut={tmp_path}/elsewhere.log" in slurm("scontrol", "show", "job", job, conf=conf)
        slurm("scontrol", "release", job, conf=conf)
        _wait(lambda: str(run.logs_dir) in (slurm_lib.holding_logs_folders() or set()), "seen running", 60)
    finally:
        slurm("scancel", job, conf=conf)
    _wait(lambda: str(run.logs_dir) not in (slurm_lib.holding_logs_folders() or set()), "seen ended", 60)
