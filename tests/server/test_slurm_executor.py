"""`gpuforge server --executor slurm` on the tests' real one-node Slurm cluster (scripts/slurm.sh): the
devices are the partition's, a probe job shows the node sees the run directory before the server listens,
a job becomes one Slurm job whose metrics stream and whose batch script is shown, a server killed outright
finds its jobs still followed when it starts again, a cancel reaches the ranks as SIGTERM (a checkpoint),
a job over its Slurm time limit fails with Slurm's own reason, and a job is charged while its Slurm job runs
alone, not for its waits in Slurm's queue."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from datetime import datetime

import httpx
import pytest
import yaml

from gpuforge.executors.slurm_holding import READ_S
from gpuforge.runs import RunDir
from gpuforge.server.local import LocalServer
from tests.helpers.cli import run_cli
from tests.helpers.jobs import wait_for_job
from tests.helpers.paths import TEST_MODELS
from tests.helpers.slurm import slurm, slurm_conf
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def conf() -> str:
    return slurm_conf()


START_S = 200  # a server's start waits for its probe job, which waits for a CPU other tests' jobs may hold


def _server(folder, conf: str) -> LocalServer:
    env = {"SLURM_CONF": conf, "GPUFORGE_EXECUTOR": "slurm", "GPUFORGE_DATA_ROOTS": str(TEST_MODELS.parent)}
    return LocalServer(folder / "home", log=folder / "server.log", **env)


def _cancel_followed(server: LocalServer, conf: str) -> None:
    """The Slurm jobs the server's runners still follow, cancelled: a failed test leaves no job holding the
    node's CPUs."""
    for followed in (server.home / "runs").glob("*/logs/slurm-job"):
        slurm("scancel", followed.read_text().split()[0], conf=conf)


@pytest.fixture
def server(tmp_path, conf):
    """A server of the test's own on the cluster (not started): for the tests that read its costs, which
    sum every job it ran, or that start it with settings of their own."""
    server = _server(tmp_path, conf)
    yield server
    server.stop()
    _cancel_followed(server, conf)


@pytest.fixture(scope="module")
def module_server(tmp_path_factory, conf):
    server = _server(tmp_path_factory.mktemp("shared"), conf)
    yield server
    server.stop()
    _cancel_followed(server, conf)


@pytest.fixture
def shared(module_server, conf):
    """One server (started) for the tests whose jobs and assertions are their own alone: one start, and one
    probe job, for them all; a test may kill it and start it again. The jobs a test leaves followed are
    cancelled after it, as its own server's would be."""
    if module_server.process is None or module_server.process.poll() is not None:
        module_server.start(START_S)
    yield module_server
    _cancel_followed(module_server, conf)


def _client(server: LocalServer) -> httpx.Client:
    # a server busy starting a runner may take seconds to answer on a loaded machine
    http = httpx.Client(base_url=server.url, timeout=60)
    http.headers["Authorization"] = f"Bearer {server.key}"
    return http


def _submit(http: httpx.Client, tmp_path, **train) -> int:
    spec = image_spec(tmp_path, options={"sleep_s": 0.05}, **train)  # 20 steps a second at most
    answer = http.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)})
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def _slurm_job(run_dir: str) -> str:
    """The Slurm job id the runner recorded (launch/slurm.py's slurm-job file)."""
    path = RunDir(run_dir).logs_dir / "slurm-job"
    deadline = time.monotonic() + 60
    while not path.is_file():
        assert time.monotonic() < deadline, f"no Slurm job recorded in {path}"
        time.sleep(0.2)
    return path.read_text().split()[0]


def _wait_slurm_state(job: str, state: str, conf: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while f"JobState={state}" not in slurm("scontrol", "show", "job", job, conf=conf):
        assert time.monotonic() < deadline, f"Slurm job {job} not {state} within {timeout} s"
        time.sleep(0.2)


def _admin(*args: str, conf: str) -> None:
    """An scontrol command that must take (an error where Slurm refused it)."""
    env = {**os.environ, "SLURM_CONF": conf}
    done = subprocess.run(["scontrol", *args], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, f"scontrol {' '.join(args)}: {done.stderr.strip()}"


def test_a_job_runs_as_a_slurm_job_its_metrics_stream_and_its_batch_script_is_shown(tmp_path, shared):
    server = shared
    http = _client(server)
    job_id = _submit(http, tmp_path, max_steps=30)
    running = wait_for_job(http, job_id, lambda j: j["state"] != "queued" and (j["step"] or 0) >= 3, 180)
    assert running["state"] == "running"
    seen_live = [m["step"] for m in http.get(f"/api/v1/jobs/{job_id}/metrics").json()]
    done = wait_for_job(http, job_id, lambda j: j["state"] not in ("queued", "running"), 180)
    assert done["state"] == "finished", done
    steps = [m["step"] for m in http.get(f"/api/v1/jobs/{job_id}/metrics").json()]
    env = {"GPUFORGE_URL": server.url, "GPUFORGE_API_KEY": server.key}
    shown = run_cli("job", str(job_id), "--slurm-script", env=env)
    too_many = run_cli("submit", str(_big_spec(tmp_path)), env=env)
    missing = http.get(f"/api/v1/jobs/{job_id + 1000}/slurm-script")
    assert 3 <= len(seen_live) < 30 and steps == list(range(1, 31))  # read while it ran, then all of them
    assert shown.returncode == 0, shown.stderr
    script = shown.stdout
    assert script.startswith("#!/bin/bash") and "#SBATCH --ntasks=1" in script and "exec srun" in script
    assert "#SBATCH --requeue" in script and "gpuforge.train.rank" in script
    assert missing.status_code == 404
    log = server.log_path.read_text()  # its start's lines (the server writes each line out whole)
    assert "a probe job on " in log and "wrote into" in log  # the node saw the run directory
    # the partition's CPUs (scripts/slurm.sh's node: every core) are the server's slots; one more is refused
    assert too_many.returncode == 2 and f"this server has {CORES} (cpu:0, cpu:1" in too_many.stderr


CORES = len(os.sched_getaffinity(0))


def _big_spec(tmp_path):
    spec = {**image_spec(tmp_path), "resources": {"devices": CORES + 1}, "distributed": {"strategy": "ddp"}}
    return write_spec(tmp_path / "big.yaml", spec)


def test_a_server_killed_outright_finds_its_slurm_job_still_followed_and_a_cancel_checkpoints_it(
    tmp_path, conf, shared
):
    server = shared
    http = _client(server)
    job_id = _submit(http, tmp_path, max_steps=2000, checkpoint_every=1000)
    running = wait_for_job(http, job_id, lambda j: (j["step"] or 0) >= 10, 180)
    slurm_job = _slurm_job(running["run_dir"])
    server.kill()  # SIGKILL (waited for): the runner, in a session of its own, goes on following its job
    server.start(START_S)
    later = wait_for_job(http, job_id, lambda j: (j["step"] or 0) >= running["step"] + 10, 120)
    assert later["state"] == "running" and later["restarts"] == 0  # re-attached, not restarted
    assert http.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 200
    ended = wait_for_job(http, job_id, lambda j: j["state"] not in ("queued", "running"), 120)
    events = http.get(f"/api/v1/jobs/{job_id}/events").json()
    assert ended["state"] == "cancelled", ended
    run = RunDir(ended["run_dir"])
    saved = run.latest_checkpoint()
    assert saved is not None and saved[0] >= later["step"]  # the ranks checkpointed on Slurm's SIGTERM
    assert sorted(p.name for p in run.logs_dir.glob("slurm-attempt*.sh")) == ["slurm-attempt0.sh"]
    assert [e["kind"] for e in events].count("started") == 1
    assert "RUNNING" not in slurm("scontrol", "show", "job", slurm_job, conf=conf)


def test_a_job_over_its_slurm_time_limit_fails_with_slurms_reason(tmp_path, conf, shared):
    http = _client(shared)
    job_id = _submit(http, tmp_path, max_steps=20000)
    running = wait_for_job(http, job_id, lambda j: (j["step"] or 0) >= 3, 180)
    slurm_job = _slurm_job(running["run_dir"])
    # as an admin would: Slurm's limit (1 minute, its least) ends the job where gpuforge's did not, its end
    # brought forward to now (EndTime, which Slurm takes for a running job): the test waits for slurmctld's
    # check of the limits (every 30 s) rather than for the rest of that minute too
    _admin("update", f"jobid={slurm_job}", "TimeLimit=1", conf=conf)
    _admin("update", f"jobid={slurm_job}", "EndTime=now+2", conf=conf)
    ended = wait_for_job(http, job_id, lambda j: j["state"] not in ("queued", "running"), 240)
    kinds = [e["kind"] for e in http.get(f"/api/v1/jobs/{job_id}/events").json()]
    assert ended["state"] == "failed", ended
    assert f"Slurm job {slurm_job} ended TIMEOUT" in ended["reason"], ended["reason"]
    assert ended["restarts"] == 0  # a restart would only meet the same limit
    # the ranks checkpointed on Slurm's SIGTERM and said `cancelled`; Slurm's end is the job's all the same
    assert kinds[-2:] == ["cancelled", "failed"] and RunDir(ended["run_dir"]).latest_checkpoint() is not None


def test_a_preempted_slurm_job_resumes_from_its_checkpoint_as_a_new_slurm_job(tmp_path, server):
    server.env["GPUFORGE_CPU_SLOTS"] = "1"  # one slot: a job of higher priority must stop the running one
    server.start(START_S)
    http = _client(server)
    try:
        low = _submit(http, tmp_path, max_steps=400, checkpoint_every=5)  # 20 s: time to be preempted
        wait_for_job(http, low, lambda j: (j["step"] or 0) >= 10, 180)
        spec = image_spec(tmp_path, max_steps=6)
        high = http.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec), "priority": 10}).json()["id"]
        wait_for_job(http, low, lambda j: j["state"] == "preempted", 120)  # SIGTERM, by scancel, checkpointed
        ended = [wait_for_job(http, i, lambda j: j["state"] not in ("queued", "running", "preempted"), 240)
                 for i in (high, low)]  # fmt: skip
        events = http.get(f"/api/v1/jobs/{low}/events").json()
        steps = [m["step"] for m in http.get(f"/api/v1/jobs/{low}/metrics").json()]
    finally:
        server.stop()
    assert [j["state"] for j in ended] == ["finished", "finished"], ended
    starts = [e["data"] for e in events if e["kind"] == "started"]
    assert len(starts) == 2 and starts[1]["resumed_from"] >= 10 and steps == list(range(1, 401))
    # the resumed runner submitted a Slurm job of its own: it did not follow the one its preemption ended
    assert len(list((RunDir(ended[1]["run_dir"]).logs_dir).glob("slurm-[0-9]*.log"))) == 2


QUEUED_S = 6.0  # how long a job is kept waiting in Slurm's queue behind a blocker: past the bound's 4 s


def test_a_slurm_job_is_charged_from_its_ranks_start_not_for_its_wait_in_slurms_queue(tmp_path, conf, server):
    server.start(START_S)
    http = _client(server)
    # every CPU of the node held by a job of someone else's, until ours has waited QUEUED_S in Slurm's queue
    # (Slurm's --time ends it should the test not)
    argv = ["sbatch", "--parsable", "--job-name=blocker", f"--ntasks={CORES}", "--time=2"]
    argv += ["--output=/dev/null", "--wrap", "sleep 600"]  # no slurm-N.out in the tests' folder
    blocker = slurm(*argv, conf=conf).strip()
    try:
        _wait_slurm_state(blocker, "RUNNING", conf)
        job_id = _submit(http, tmp_path, max_steps=40)
        claimed = wait_for_job(http, job_id, lambda j: j["run_dir"] is not None, 180)
        ours = _slurm_job(claimed["run_dir"])
        _wait_slurm_state(ours, "PENDING", conf)
        time.sleep(QUEUED_S)  # the wait to be left out of its charge
        assert "JobState=PENDING" in slurm("scontrol", "show", "job", ours, conf=conf)  # behind it all along
        slurm("scancel", blocker, conf=conf)
        done = wait_for_job(http, job_id, lambda j: j["state"] not in ("queued", "running"), 240)
        events = http.get(f"/api/v1/jobs/{job_id}/events").json()
        charged_s = http.get("/api/v1/costs").json()["total_device_hours"] * 3600
    finally:
        slurm("scancel", blocker, conf=conf)
        server.stop()
    assert done["state"] == "finished", done
    log = (RunDir(done["run_dir"]).logs_dir / "process.log").read_text()
    assert "is PENDING" in log, log[-2000:]  # its Slurm job waited for the blocker's CPUs
    began, ended = (datetime.fromisoformat(done[f]) for f in ("started_at", "finished_at"))
    runner_s = (ended - began).total_seconds()
    ranks_started = min(e["ts"] for e in events if e["kind"] == "started")
    finished = max(e["ts"] for e in events if e["kind"] == "finished")
    # charged from when its Slurm job ran (setup, steps, exit), not for the seconds it waited before
    assert finished - ranks_started <= charged_s <= runner_s - 4, (charged_s, runner_s)


HELD_S = 10.0  # how long the test keeps a requeued job in Slurm's queue


def test_a_slurm_job_requeued_by_slurm_is_not_charged_for_its_second_wait(tmp_path, conf, server):
    server.start(START_S)
    http = _client(server)
    try:
        job_id = _submit(http, tmp_path, max_steps=200, checkpoint_every=5)  # 10 s of steps
        running = wait_for_job(http, job_id, lambda j: (j["step"] or 0) >= 10, 180)
        slurm_job = _slurm_job(running["run_dir"])
        slurm("scontrol", "requeue", slurm_job, conf=conf)  # as an admin, or a preemption, would
        _wait_slurm_state(slurm_job, "PENDING", conf, timeout=60)  # requeued
        time.sleep(HELD_S)  # Slurm holds a requeued job a while (BeginTime): the test holds it HELD_S
        slurm("scontrol", "update", f"jobid={slurm_job}", "StartTime=now", conf=conf)
        done = wait_for_job(http, job_id, lambda j: j["state"] not in ("queued", "running"), 240)
        events = http.get(f"/api/v1/jobs/{job_id}/events").json()
        steps = [m["step"] for m in http.get(f"/api/v1/jobs/{job_id}/metrics").json()]
        charged_s = http.get("/api/v1/costs").json()["total_device_hours"] * 3600
    finally:
        server.stop()
    assert done["state"] == "finished" and done["restarts"] == 0, done  # one runner followed it throughout
    assert steps == list(range(1, 201))  # each step once: the second run resumed from the checkpoint
    starts = [e for e in events if e["kind"] == "started"]
    assert len(starts) == 2 and starts[1]["data"]["resumed_from"] >= 10, starts
    stopped = next(e for e in events if e["kind"] == "cancelled")  # the ranks' checkpoint on Slurm's SIGTERM
    finished = next(e for e in events if e["kind"] == "finished")
    ran_s = (stopped["ts"] - starts[0]["ts"]) + (finished["ts"] - starts[1]["ts"])  # the ranks' two runs
    began, ended = (datetime.fromisoformat(done[f]) for f in ("started_at", "finished_at"))
    runner_s = (ended - began).total_seconds()
    # charged while its Slurm job ran, twice (setup, steps, exit): not for the HELD_S it waited between
    assert ran_s <= charged_s <= runner_s - HELD_S, (ran_s, charged_s, runner_s)


def test_a_job_that_rewrites_its_runners_marks_is_charged_for_the_time_slurm_shows_it_running(
    tmp_path, server
):
    server.start(START_S)
    http = _client(server)
    forging, forger = threading.Event(), None
    try:
        job_id = _submit(http, tmp_path, max_steps=100)  # 5 s of steps
        claimed = wait_for_job(http, job_id, lambda j: j["run_dir"] is not None, 180)
        marks = RunDir(claimed["run_dir"]).logs_dir / "slurm-running"

        def forge():  # as a job's own code could, from the runner's first mark on: one run, long over
            while not forging.wait(0.05):
                if marks.is_file():
                    pid = marks.read_text().split()[0]
                    marks.write_text(f"{pid} 1.000:2.000\n")

        forger = threading.Thread(target=forge, daemon=True)
        forger.start()
        done = wait_for_job(http, job_id, lambda j: j["state"] not in ("queued", "running"), 240)
        events = http.get(f"/api/v1/jobs/{job_id}/events").json()
        charged_s = http.get("/api/v1/costs").json()["total_device_hours"] * 3600
        began, ended = (datetime.fromisoformat(done[f]) for f in ("started_at", "finished_at"))
        runner_s = (ended - began).total_seconds()
    finally:
        forging.set()
        if forger is not None:
            forger.join()
        server.stop()
    assert done["state"] == "finished", done
    started = next(e for e in events if e["kind"] == "started")
    finished = next(e for e in events if e["kind"] == "finished")
    ran_s = finished["ts"] - started["ts"]
    # squeue is read every READ_S: all but the first read's wait is seen (the forged file alone: 0 s charged)
    assert ran_s - READ_S <= charged_s <= runner_s, (ran_s, charged_s, runner_s)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--executor", "slurm", "--partition", "nosuch"],
            "Slurm has no partition nosuch (partitions: debug)",
        ),
        (["--executor", "slurm", "--partition", "a b"], "GPUFORGE_SLURM_PARTITION: 'a b' is not a Slurm"),
        (["--partition", "debug"], "GPUFORGE_SLURM_PARTITION: for --executor slurm (this server's is local)"),
    ],
)
def test_a_server_refuses_to_start_on_slurm_settings_it_cannot_use(tmp_path, conf, args, message):
    env = {"GPUFORGE_HOME": str(tmp_path / "home"), "SLURM_CONF": conf}
    done = run_cli("server", *args, "--port", "0", env=env, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_without_slurm_commands_the_server_says_which_are_missing(tmp_path):
    env = {"GPUFORGE_HOME": str(tmp_path / "home"), "PATH": os.path.dirname(os.__file__)}
    done = run_cli("server", "--executor", "slurm", "--port", "0", env=env, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "sbatch, scontrol, scancel, sinfo, squeue not found on PATH" in done.stderr
