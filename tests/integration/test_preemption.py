"""Preemption on a real server with one CPU slot and real `gpuforge train` runners: a job of higher
priority stops a running one at a checkpoint, runs, and the stopped one resumes exactly where it was (each
step once, the loss of an uninterrupted run); a job an admin marked not preemptible is never stopped (the
other waits, saying why); a job past its resources.max_time is paused."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import pytest
import yaml

from gpuforge.executors.local import LocalExecutor
from gpuforge.runs import RunDir
from gpuforge.scheduler.allocator import DeviceInfo
from gpuforge.scheduler.loop import Scheduler
from gpuforge.server.local import LocalServer
from gpuforge.store.db import session
from gpuforge.store.models import Job, JobState
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.slow

STEPS, EVERY = 60, 5  # the low job: ~6 s of steps (sleep_s), a checkpoint every 5 of them
ENDED = ("finished", "failed", "cancelled")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("preemption")
    env = {
        "GPUFORGE_DATA_ROOTS": str(TEST_MODELS.parent),
        "GPUFORGE_ALLOW_USER_CODE": "true",  # the jobs use the tests' python: model
        "GPUFORGE_CPU_SLOTS": "1",
    }
    with LocalServer(home / "home", log=home / "server.log", **env) as started:
        yield started


def _client(server: LocalServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def admin(server):
    return _client(server, server.key)


@pytest.fixture(scope="module")
def user(server, admin):
    made = admin.post("/api/v1/keys", json={"name": "user"})
    assert made.status_code == 201, made.text
    return _client(server, made.json()["key"])


def _submit(client: httpx.Client, spec: dict, name: str, priority: int = 0) -> int:
    answer = client.post(
        "/api/v1/jobs", json={"spec": yaml.safe_dump(spec), "name": name, "priority": priority}
    )
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def _job(admin: httpx.Client, job_id: int) -> dict:
    return admin.get(f"/api/v1/jobs/{job_id}").json()


def _until(what: str, check: Callable[[], object], timeout: float = 120.0, every: float = 0.1):
    """Poll `check` until it returns something true, and return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(every)
    pytest.fail(f"timed out waiting for {what}")


def _all_ended(admin: httpx.Client, *job_ids: int) -> dict[int, dict]:
    def ended():
        jobs = {i: _job(admin, i) for i in job_ids}
        return jobs if all(j["state"] in ENDED for j in jobs.values()) else None

    jobs = _until(f"jobs {job_ids} to end", ended, every=0.5)
    assert all(j["state"] == "finished" for j in jobs.values()), jobs
    return jobs


def test_a_preempted_job_resumes_where_it_stopped_with_the_loss_of_an_uninterrupted_run(
    tmp_path, admin, user
):
    # dropout on: the resumed run must restore the RNG too; a sleep per forward so it runs long enough
    low_spec = image_spec(
        tmp_path, max_steps=STEPS, checkpoint_every=EVERY, options={"sleep_s": 0.1, "dropout": 0.2}
    )
    spec_path = write_spec(tmp_path / "low.yaml", low_spec)
    reference = subprocess.Popen(  # the same spec uninterrupted, meanwhile, with no server
        [sys.executable, "-m", "gpuforge", "train", str(spec_path), "--out", str(tmp_path / "reference")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    low = _submit(user, low_spec, "low", priority=0)
    _until("the low job's 8th step", lambda: (_job(admin, low)["step"] or 0) >= 8)
    high = _submit(user, image_spec(tmp_path, max_steps=6), "high", priority=10)

    preempted = _until(
        "the low job to be preempted", lambda: (j := _job(admin, low))["state"] == "preempted" and j
    )
    reason = preempted["reason"]
    assert reason.startswith(f"preempted by job {high} (priority 10)"), reason
    assert preempted["preemptions"] == 1 and preempted["devices"] is None
    assert preempted["step"] < STEPS
    stored = user.get(f"/api/v1/jobs/{low}/events").json()  # in the store while it waits, not once resumed
    assert [e["data"].get("by_job") for e in stored if e["kind"] == "preempted"] == [high]
    waiting = _until(  # in the queue it says why it waits too, and keeps saying who preempted it
        "the preempted job to say why it waits",
        lambda: f"held by job {high}" in ((j := _job(admin, low))["reason"] or "") and j,
    )
    assert waiting["state"] == "preempted", waiting
    assert waiting["reason"].startswith(f"preempted by job {high} (priority 10); waiting for 1 cpu"), waiting

    jobs = _all_ended(admin, low, high)
    assert jobs[high]["started_at"] > jobs[low]["started_at"]
    assert jobs[high]["finished_at"] < jobs[low]["finished_at"]  # it ran while the low one waited
    assert jobs[low]["restarts"] == 0 and jobs[low]["step"] == STEPS
    assert jobs[low]["reason"] is None  # resumed: what it waited for is over

    run = RunDir(jobs[low]["run_dir"])
    kinds = [e["event"] for e in run.events()]
    stopped = [e for e in run.events() if e["event"] == "preempted"]
    assert len(stopped) == 1 and stopped[0]["by_job"] == high, stopped
    assert kinds.count("started") == 2 and kinds[-1] == "finished", kinds
    # the runner stopped at a checkpoint on SIGTERM, then the server said why
    at = kinds.index("cancelled")
    assert kinds[at - 1 : at + 2] == ["checkpoint", "cancelled", "preempted"], kinds

    assert reference.wait(timeout=120) == 0, reference.stderr.read()
    metrics, ref = run.metrics(), RunDir(tmp_path / "reference").metrics()
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # no step lost or counted twice
    for mine, theirs in zip(metrics, ref, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6, abs=1e-7), mine["step"]
        assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-9)
    summary = run.summary()
    assert summary["status"] == "finished" and summary["steps"] == STEPS
    assert summary["resumed_from"] == preempted["step"] and run.model_dir.exists()  # where it stopped
    assert summary["final_loss"] == pytest.approx(
        RunDir(tmp_path / "reference").summary()["final_loss"], rel=1e-6
    )


def test_a_job_that_is_not_preemptible_keeps_its_device_and_the_other_waits_saying_why(tmp_path, admin, user):
    protected_spec = image_spec(tmp_path, max_steps=30, options={"sleep_s": 0.1})
    protected_spec["resources"] = {"preemptible": False}
    refused = user.post("/api/v1/jobs", json={"spec": yaml.safe_dump(protected_spec)})
    assert refused.status_code == 403 and "admin" in refused.json()["detail"], refused.text

    protected = _submit(admin, protected_spec, "protected", priority=0)
    _until("the protected job's first step", lambda: (_job(admin, protected)["step"] or 0) >= 1)
    assert _job(admin, protected)["preemptible"] is False
    high = _submit(user, image_spec(tmp_path, max_steps=6), "high-waits", priority=10)

    waiting = _until(
        "the high job to say why it waits",
        lambda: "not preemptible" in ((j := _job(admin, high))["reason"] or "") and j,
    )
    assert waiting["state"] == "queued"
    assert f"held by job {protected}" in waiting["reason"], waiting["reason"]
    assert _job(admin, protected)["state"] == "running"

    jobs = _all_ended(admin, protected, high)
    assert jobs[protected]["preemptions"] == 0 and jobs[protected]["step"] == 30
    assert jobs[high]["started_at"] >= jobs[protected]["finished_at"]  # it waited its whole run
    assert "preempted" not in [e["event"] for e in RunDir(jobs[protected]["run_dir"]).events()]


def test_a_job_past_its_max_time_is_paused_at_a_checkpoint(tmp_path, admin, user):
    spec = image_spec(tmp_path, max_steps=1000, options={"sleep_s": 0.1})  # 100 s of steps, if let run
    spec["resources"] = {"max_time": "15s"}  # from its process's start: a busy machine takes seconds to it
    job_id = _submit(user, spec, "timed")

    paused = _until(
        "the job to be paused", lambda: (j := _job(admin, job_id))["state"] not in ("queued", "running") and j
    )
    assert paused["state"] == "paused", paused
    assert "resources.max_time (15 s)" in paused["reason"], paused["reason"]
    assert paused["devices"] is None and 0 < paused["step"] < 1000
    run = RunDir(paused["run_dir"])
    assert run.latest_checkpoint()[0] == max(m["step"] for m in run.metrics())  # stopped at a checkpoint


def test_a_resumed_runner_that_dies_before_its_first_word_restarts_and_is_not_ended_by_the_last_cancel(
    engine, tmp_path
):
    # the run before it was stopped for a preemption: its runner wrote `cancelled`, the server `preempted`
    run = RunDir(tmp_path / "run")
    run.create()
    for event in ("started", "checkpoint", "cancelled"):
        run.event(event)
    run.event("preempted", by_job=2, reason="preempted by job 2 (priority 10)")
    scheduler = Scheduler(engine, [DeviceInfo("cpu:0", "cpu", "a CPU slot", threads=1)], LocalExecutor())
    with session(engine) as s:
        job = Job(
            name="j", spec_yaml="name: j\n", run_dir=str(run.root), state=JobState.RUNNING, devices="cpu:0"
        )
        job.preemptions, job.max_restarts = 1, 2
        s.add(job)
        s.flush()
        scheduler._watch(s, job)  # its new process (no pid: gone) wrote nothing
    with session(engine) as s:
        job = s.get(Job, job.id)
        assert (job.state, job.restarts) == (JobState.QUEUED, 1), job.reason
        assert job.reason == "process ended without a word (restart 1 of 2)"
