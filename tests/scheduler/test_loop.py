"""The scheduling loop with real job processes, driven through the API: run, queue, cancel, restart."""

import json
import logging
import os
import signal
import time

import pytest
import yaml
from fastapi.testclient import TestClient

from gpuforge.executors.local import LocalExecutor
from gpuforge.scheduler.loop import SchedulerOptions
from gpuforge.server.app import create_app
from gpuforge.server.settings import Settings
from tests.helpers.jobs import wait_for_job
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """The shared server's home (its store, keys, runs and uploads)."""
    return tmp_path_factory.mktemp("server") / "home"


@pytest.fixture(scope="module")
def api(home):
    """One server for the module's tests (a server start is imports and a store migration): a test's jobs
    queue behind any an earlier test left stopping, on the one slot, and each test waits for its own."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("GPUFORGE_CPU_SLOTS", "1")  # one CPU job at a time: the second one queues
        settings = Settings(home=home, data_roots=str(TEST_MODELS.parent))
        with TestClient(create_app(settings)) as client:
            key = (home / "admin.key").read_text().strip()
            client.headers["Authorization"] = f"Bearer {key}"
            yield client


def _submit(api, tmp_path, **train) -> int:
    spec = image_spec(tmp_path, **train)
    response = api.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)})
    assert response.status_code == 201, response.text
    return response.json()["id"]


@pytest.mark.slow
def test_jobs_run_one_slot_at_a_time_and_their_runs_are_ingested(api, tmp_path):
    first = _submit(api, tmp_path, max_steps=6)
    second = _submit(api, tmp_path, max_steps=4)
    a = wait_for_job(api, first, lambda j: j["state"] == "finished")
    b = wait_for_job(api, second, lambda j: j["state"] == "finished")
    assert (a["step"], a["total_steps"], a["devices"]) == (6, 6, "cpu:0")
    assert b["started_at"] >= a["finished_at"]  # one CPU slot: the second waited for the first
    kinds = [e["kind"] for e in api.get(f"/api/v1/jobs/{first}/events").json()]
    assert kinds[0] == "started" and kinds[-1] == "finished"


@pytest.mark.slow
def test_cancel_stops_a_running_job_with_a_checkpoint(api, tmp_path):
    job_id = _submit(api, tmp_path, max_steps=500, options={"sleep_s": 0.05})
    wait_for_job(api, job_id, lambda j: j["state"] == "running" and (j["step"] or 0) >= 2)
    assert api.post(f"/api/v1/jobs/{job_id}/cancel").json()["state"] == "running"  # stopping
    job = wait_for_job(api, job_id, lambda j: j["state"] == "cancelled")
    kinds = [e["kind"] for e in api.get(f"/api/v1/jobs/{job_id}/events").json()]
    assert kinds[-2:] == ["checkpoint", "cancelled"] and job["reason"] == "cancelled by admin"


@pytest.mark.slow
def test_a_cancelled_job_resumes_from_the_checkpoint_its_cancel_wrote(api, tmp_path):
    job_id = _submit(api, tmp_path, max_steps=40, options={"sleep_s": 0.05})
    wait_for_job(api, job_id, lambda j: j["state"] == "running" and (j["step"] or 0) >= 3)
    api.post(f"/api/v1/jobs/{job_id}/cancel")
    cancelled = wait_for_job(api, job_id, lambda j: j["state"] == "cancelled")
    resumed = api.post(f"/api/v1/jobs/{job_id}/resume", json={})
    assert resumed.status_code == 200 and resumed.json()["state"] == "queued", resumed.text
    assert resumed.json()["finished_at"] is None and "with no budget" in resumed.json()["reason"]
    done = wait_for_job(api, job_id, lambda j: j["state"] in ("finished", "failed", "cancelled"))
    assert done["state"] == "finished" and done["step"] == 40, done
    starts = [e for e in api.get(f"/api/v1/jobs/{job_id}/events").json() if e["kind"] == "started"]
    assert starts[1]["data"]["resumed_from"] == cancelled["step"]
    steps = [m["step"] for m in api.get(f"/api/v1/jobs/{job_id}/metrics", params={"limit": 1000}).json()]
    assert steps == list(range(1, 41))  # each step once, across the cancel


def test_a_job_cancelled_before_its_first_checkpoint_says_it_cannot_resume(api, tmp_path):
    running = _submit(api, tmp_path, max_steps=500, options={"sleep_s": 0.05})
    waiting = _submit(api, tmp_path, max_steps=4)  # one CPU slot: it waits, and never checkpoints
    assert api.post(f"/api/v1/jobs/{waiting}/cancel").json()["state"] == "cancelled"
    refused = api.post(f"/api/v1/jobs/{waiting}/resume", json={})
    assert refused.status_code == 409 and "before its first checkpoint" in refused.json()["detail"]
    finished_too = api.post(f"/api/v1/jobs/{running}/resume", json={})
    assert finished_too.status_code == 409 and "only a paused or cancelled" in finished_too.json()["detail"]
    api.post(f"/api/v1/jobs/{running}/cancel")


@pytest.mark.slow
def test_a_killed_training_process_is_restarted_from_its_checkpoint(api, tmp_path):
    job_id = _submit(api, tmp_path, max_steps=60, checkpoint_every=5, options={"sleep_s": 0.05})
    running = wait_for_job(api, job_id, lambda j: j["state"] == "running" and (j["step"] or 0) >= 12)
    pid = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_runner(int(p), running["run_dir"]))
    os.kill(pid, signal.SIGKILL)
    job = wait_for_job(api, job_id, lambda j: j["state"] == "finished")
    assert job["step"] == 60 and "restart 1 of 2" in (job["reason"] or "")
    events = api.get(f"/api/v1/jobs/{job_id}/events").json()
    starts = [e for e in events if e["kind"] == "started"]
    assert len(starts) == 2 and starts[1]["data"]["resumed_from"] >= 10


def _is_runner(pid: int, run_dir: str) -> bool:
    try:
        return run_dir in open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return False


@pytest.mark.slow
def test_a_spent_budget_pauses_the_job_and_resume_goes_on_from_its_checkpoint(api, tmp_path):
    spec = image_spec(tmp_path, max_steps=40, options={"sleep_s": 0.05})
    spec["cost"] = {"usd_per_hour": 3600.0, "budget_usd": 0.4}  # a dollar a second: paused within a second
    job_id = api.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec)}).json()["id"]
    paused = wait_for_job(api, job_id, lambda j: j["state"] in ("paused", "finished", "failed"))
    assert paused["state"] == "paused" and "cost.budget_usd 0.4 spent" in paused["reason"]
    assert paused["cost_usd"] >= 0.4 and paused["step"] < 40 and paused["finished_at"] is None
    event = api.get(f"/api/v1/jobs/{job_id}/events").json()[-1]
    assert event["kind"] == "paused" and event["data"]["budget_usd"] == 0.4
    assert event["data"]["cost_usd"] >= 0.4
    assert api.get(f"/api/v1/jobs/{job_id}/summary").json()["status"] == "paused"

    too_low = api.post(f"/api/v1/jobs/{job_id}/resume", json={"budget_usd": 0.1})
    assert too_low.status_code == 422 and "not above" in too_low.json()["detail"]
    resumed = api.post(f"/api/v1/jobs/{job_id}/resume", json={"budget_usd": 1000.0})
    assert resumed.status_code == 200 and resumed.json()["state"] == "queued"
    done = wait_for_job(api, job_id, lambda j: j["state"] in ("finished", "failed", "paused"))
    assert done["state"] == "finished" and done["step"] == 40
    starts = [e for e in api.get(f"/api/v1/jobs/{job_id}/events").json() if e["kind"] == "started"]
    assert starts[1]["data"]["resumed_from"] == paused["step"]
    steps = [m["step"] for m in api.get(f"/api/v1/jobs/{job_id}/metrics", params={"limit": 1000}).json()]
    assert steps == list(range(1, 41))  # each step once, across the pause
    again = api.post(f"/api/v1/jobs/{job_id}/resume", json={"budget_usd": 2000.0})
    assert again.status_code == 409


@pytest.mark.slow
def test_metrics_pages_logs_and_the_live_stream_of_a_running_job(api, tmp_path):
    job_id = _submit(api, tmp_path, max_steps=30, options={"sleep_s": 0.05})
    with api.stream("GET", f"/api/v1/jobs/{job_id}/logs/stream", params={"metrics": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events, event = [], None
        for line in response.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                events.append((event, json.loads(line[6:])))
    kinds = [kind for kind, _ in events]
    assert kinds[-1] == "end" and events[-1][1]["state"] == "finished"
    assert [d["step"] for kind, d in events if kind == "metric"] == list(range(1, 31))
    assert any(kind == "log" and "finished at step 30/30" in d["line"] for kind, d in events)

    page = api.get(f"/api/v1/jobs/{job_id}/metrics", params={"after_step": 10, "limit": 5}).json()
    assert [m["step"] for m in page] == [11, 12, 13, 14, 15] and "samples_per_s" in page[0]
    tail = api.get(f"/api/v1/jobs/{job_id}/logs", params={"tail": 3}).json()
    assert len(tail["lines"]) == 3 and tail["offset"] > 0
    summary = api.get(f"/api/v1/jobs/{job_id}/summary").json()
    assert summary["status"] == "finished" and summary["steps"] == 30
    metrics_text = api.get("/metrics").text
    assert 'gpuforge_device_busy_seconds{device="cpu:0"}' in metrics_text
    assert "gpuforge_scheduling_tick_seconds_count" in metrics_text


def test_a_cancel_signals_no_process_that_is_not_the_jobs_runner(tmp_path):
    """After a server restart the recorded pid may belong to another program by now: it is left alone."""
    import subprocess

    from gpuforge.scheduler.allocator import inventory
    from gpuforge.scheduler.loop import Scheduler
    from gpuforge.store.db import connect, migrate, session
    from gpuforge.store.models import Job

    engine = connect(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(engine)
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        with session(engine) as s:
            run_dir = str(tmp_path / "run")
            s.add(Job(name="j", state="running", pid=stranger.pid, run_dir=run_dir, spec_yaml="",
                      devices="cpu:0", cancel_requested=True, max_restarts=0))  # fmt: skip
        Scheduler(engine, inventory(), LocalExecutor()).tick()
        time.sleep(0.2)
        assert stranger.poll() is None  # not signalled
        with session(engine) as s:
            assert s.get(Job, 1).state == "failed"  # its runner is gone: it ends as any lost runner does
    finally:
        stranger.kill()
        stranger.wait()
        engine.dispose()


@pytest.mark.slow
def test_a_runner_that_refuses_its_input_fails_once_with_its_error_in_the_users_names(api, home, tmp_path):
    import numpy as np

    uploads = home / "uploads"  # a file the client sent: the server keeps it by its hash
    uploads.mkdir(exist_ok=True)
    upload = uploads / f"{'ab' * 32}.npz"
    np.savez(upload, a=np.zeros(3))  # no x and y: the runner says so and exits 2
    spec = image_spec(tmp_path, data={"train": str(upload)})
    files = {str(upload): "/home/me/digits.npz"}
    response = api.post("/api/v1/jobs", json={"spec": yaml.safe_dump(spec), "files": files})
    assert response.status_code == 201, response.text
    job = wait_for_job(api, response.json()["id"], lambda j: j["state"] in ("failed", "finished"))
    assert job["state"] == "failed" and job["restarts"] == 0  # never started again: it would refuse again
    assert job["reason"] == (
        "data.train: /home/me/digits.npz: expected arrays 'x' and 'y' (or 'images' and 'labels'), found a"
    )


def test_a_re_attached_runner_is_judged_by_its_logs_last_line_and_ends_are_logged_plainly(tmp_path, caplog):
    """After a server restart nobody has the runner's exit code: its log says whether it refused its input."""
    from gpuforge.scheduler.allocator import inventory
    from gpuforge.scheduler.loop import Scheduler
    from gpuforge.store.db import connect, migrate, session
    from gpuforge.store.models import Job

    engine = connect(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(engine)
    logs = {
        "refused": "loading data\ngpuforge: error: data.train: /srv/up/0f.csv: holds no records\n",
        "killed": "gpuforge: error: an old line\nstep 3 loss 0.5\n",  # ended on something else: lost
        "finished": "",
    }
    for name, log in logs.items():
        (tmp_path / name / "logs").mkdir(parents=True)
        (tmp_path / name / "logs" / "process.log").write_text(log)
    (tmp_path / "finished" / "events.jsonl").write_text('{"ts": 1.0, "event": "finished"}\n')
    try:
        with session(engine) as s:
            for name in logs:
                s.add(Job(name=name, state="running", run_dir=str(tmp_path / name), spec_yaml="",
                          devices="cpu:0", files={"/srv/up/0f.csv": "mine.csv"}, max_restarts=0))  # fmt: skip
        with caplog.at_level("INFO", logger="gpuforge.scheduler"):
            Scheduler(engine, inventory(), LocalExecutor()).tick()
        with session(engine) as s:
            ended = {j.name: (j.state, j.reason) for j in s.query(Job)}
    finally:
        engine.dispose()
    assert ended["refused"] == ("failed", "data.train: mine.csv: holds no records")
    assert ended["killed"] == ("failed", "process ended without a word 1 times")
    assert ended["finished"] == ("finished", None)
    said = [r.getMessage() for r in caplog.records]
    assert "job 3: finished" in said and "job 1: failed (data.train: mine.csv: holds no records)" in said


@pytest.mark.slow
def test_a_job_seen_ended_late_is_charged_to_its_end_and_one_found_ended_is_charged_to_its_last_word(
    tmp_path,
):
    """Issue 34: a job that ended while a tick was slow in coming was charged only to the last tick that
    saw it run, and one that ended while the server was down only to the mark the killed server left
    (9.5 s of a 20 s job unpaid, under load). The tick that sees a job it watched ended charges it to its
    own time, the job's finished_at; a job found ended at a server's first look is charged to its
    runner's last word, held between its mark and now (a job's clock is a hint, not a measure)."""
    import subprocess
    import sys
    from datetime import timedelta

    from sqlalchemy import func, select

    from gpuforge.scheduler.allocator import inventory
    from gpuforge.scheduler.loop import Scheduler
    from gpuforge.store.db import connect, migrate, session
    from gpuforge.store.models import Job, LedgerEntry, utcnow

    engine = connect(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(engine)
    began = utcnow() - timedelta(seconds=10)
    said = {  # events.jsonl of each: the runner's word on its end, on its own clock
        "late": [("started", began.timestamp())],
        "told": [("started", began.timestamp()), ("finished", began.timestamp() + 3.0)],
        "lying": [("started", began.timestamp()), ("finished", began.timestamp() + 1e6)],  # in the future
        "silent": [("started", 1.0)],  # killed, long ago by its clock
    }
    for name, events in said.items():
        (tmp_path / name).mkdir()
        lines = "".join(json.dumps({"ts": ts, "event": kind}) + "\n" for kind, ts in events)
        (tmp_path / name / "events.jsonl").write_text(lines)
    # a runner of another server process: known by its run directory in its command line
    runner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path / "late")])
    try:
        with session(engine) as s:
            for name in said:
                pid = runner.pid if name == "late" else 4_000_000  # the others: gone before this server
                s.add(Job(name=name, state="running", pid=pid, run_dir=str(tmp_path / name), spec_yaml="",
                          devices="cpu:0", usd_per_hour=3600.0, max_restarts=0, run_started_at=began,
                          accrued_at=began))  # fmt: skip
        scheduler = Scheduler(engine, inventory(), LocalExecutor())
        scheduler.tick()  # "late" runs: charged to now; the others end, each dated as said above
        after_first = utcnow()
        runner.kill()
        runner.wait()
        with open(tmp_path / "late" / "events.jsonl", "a") as events:
            events.write(json.dumps({"ts": time.time(), "event": "finished"}) + "\n")
        time.sleep(1.5)  # the next tick is slow in coming: the job ended somewhere in between
        scheduler.tick()
        with session(engine) as s:
            jobs = {j.name: j for j in s.scalars(select(Job))}
            rows = s.execute(
                select(LedgerEntry.subject, func.sum(LedgerEntry.device_seconds)).group_by(
                    LedgerEntry.subject
                )
            )
            charged = {subject: seconds for subject, seconds in rows}
    finally:
        engine.dispose()
    seconds = {name: charged.get(f"job:{job.id}", 0.0) for name, job in jobs.items()}
    for name, job in jobs.items():
        assert job.accrued_at == job.finished_at, name  # each charged to its end, and no further
        assert seconds[name] == pytest.approx((job.finished_at - began).total_seconds(), abs=1e-3), name
    assert (jobs["late"].state, jobs["told"].state, jobs["silent"].state) == (
        "finished",
        "finished",
        "failed",
    )
    assert seconds["late"] > 11.5  # its 10 s before, and the slow tick's 1.5 s
    assert seconds["told"] == pytest.approx(3.0, abs=1e-3)  # to its last word
    assert seconds["silent"] == 0.0  # its word is older than its mark: nothing more
    assert jobs["lying"].finished_at < after_first  # held to the tick that saw it ended


def test_a_replica_gets_its_owners_policy_and_a_key_the_store_keeps_only_the_digest_of(tmp_path, monkeypatch):
    """What a deployment's replica is started with: never the server's secrets, its owner's policy, and
    the key whose sha256 alone the store holds."""
    import hashlib

    from gpuforge.scheduler.allocator import DeviceInfo
    from gpuforge.scheduler.loop import Scheduler
    from gpuforge.scheduler.worker_keys import load_secret, worker_key
    from gpuforge.server.settings import Settings, job_policy
    from gpuforge.store.db import connect, migrate, session
    from gpuforge.store.models import ApiKey, Deployment, utcnow

    monkeypatch.setenv("GPUFORGE_ADMIN_KEY", "gf_" + "s" * 40)  # the server's secrets, in its environment
    monkeypatch.setenv("GPUFORGE_DB", "postgresql://user:pw@db/gpuforge")
    store = f"sqlite:///{tmp_path / 'store.db'}"
    settings = Settings(home=tmp_path / "home", db=store, data_roots=str(tmp_path / "data"))
    settings.make_home()
    engine = connect(settings.db_url)
    migrate(engine)
    secret = load_secret(settings.home)
    device = DeviceInfo("cpu:0", "cpu", "a CPU slot", threads=1)
    policy_of = lambda key: job_policy(settings, key)  # noqa: E731 (as the server passes it)
    options = SchedulerOptions(policy_of=policy_of, worker_secret=secret)
    scheduler = Scheduler(engine, [device], LocalExecutor(), options)
    with session(engine) as s:
        for admin in (False, True):
            owner = ApiKey(name=f"owner-{admin}", digest=f"{admin:064d}", admin=admin)
            s.add(owner)
            s.flush()
            deployment = Deployment(name=f"d-{admin}", owner_id=owner.id, model_dir="m", worker_key="",
                                    created_at=utcnow(), workers=[])  # fmt: skip
            s.add(deployment)
            s.flush()
            deployment.worker_key = hashlib.sha256(worker_key(secret, deployment).encode()).hexdigest()
            env = scheduler.replica_env(s, deployment, device)
            assert env["GPUFORGE_USER_CODE"] == ("1" if admin else "0")
            assert str(tmp_path / "data") in env["GPUFORGE_CONFINE_ROOTS"]
            assert hashlib.sha256(env["GPUFORGE_API_KEY"].encode()).hexdigest() == deployment.worker_key
            assert not {"GPUFORGE_ADMIN_KEY", "GPUFORGE_DB"} & set(env)
    engine.dispose()


# --- the loop's decisions on a store, no process started (launch is faked) ---
@pytest.fixture
def loop_store(tmp_path, monkeypatch):
    """(a Scheduler on 3 CPU slots and an empty store, the job ids it launched): `launch` starts nothing."""
    from gpuforge.scheduler import loop
    from gpuforge.scheduler.allocator import DeviceInfo
    from gpuforge.scheduler.executor import Launched
    from gpuforge.store.db import connect, migrate

    launched = []

    def fake_launch(spec_path, run_dir, env):
        launched.append(int(run_dir.name))
        return Launched(pid=40_000 + len(launched), process=None)

    executor = LocalExecutor()
    monkeypatch.setattr(executor, "start_runner", fake_launch)
    engine = connect(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(engine)
    slots = [DeviceInfo(f"cpu:{i}", "cpu", "a CPU slot", threads=1) for i in range(3)]
    yield loop.Scheduler(engine, slots, executor), launched
    engine.dispose()


def _add_job(s, tmp_path, **fields) -> int:
    from gpuforge.store.models import Job

    job = Job(**{"name": "j", "spec_yaml": "name: j\n", "run_dir": "", **fields})
    s.add(job)
    s.flush()
    job.run_dir = str(tmp_path / "runs" / str(job.id))  # its id: what the fake launch reports
    return job.id


def test_a_cancel_landing_between_the_queue_read_and_the_claim_starts_nothing(loop_store, tmp_path):
    from gpuforge.store import states
    from gpuforge.store.db import session
    from gpuforge.store.models import Job

    scheduler, launched = loop_store
    scheduler.tick()  # the devices' rows made: the next tick writes nothing before its claims (no lock held)
    with session(scheduler.engine) as s:
        first, second = _add_job(s, tmp_path), _add_job(s, tmp_path)

    with session(scheduler.engine) as s:  # the tick's queue pass, phase by phase
        snapshot = scheduler.read_queue(s)
        plan = snapshot.plan()
        assert [job_id for job_id, _ in plan.starts] == [first, second]
        with session(scheduler.engine) as api:  # the API's cancel, after the loop planned to start both
            states.cancel(api, second, "cancelled by admin")
        scheduler.apply(s, snapshot, plan)
    assert launched == [first]
    with session(scheduler.engine) as s:
        started, cancelled = s.get(Job, first), s.get(Job, second)
        assert (started.state, started.devices, started.pid) == ("running", "cpu:0", 40_001)
        assert started.started_at is not None
        assert (cancelled.state, cancelled.devices, cancelled.pid) == ("cancelled", None, None)


def test_a_tick_ends_gone_runners_by_their_last_word_and_restarts_a_silent_one(loop_store, tmp_path):
    from gpuforge.store.db import session
    from gpuforge.store.models import Job

    scheduler, launched = loop_store
    words = {
        "paused": '{"ts": 1.0, "event": "paused", "reason": "cost.budget_usd 1 spent"}\n',
        "cancelled": '{"ts": 1.0, "event": "cancelled"}\n',
        "silent": '{"ts": 1.0, "event": "started"}\n',  # killed: no ending event, no error line
    }
    ids = {}
    with session(scheduler.engine) as s:
        for i, (name, events) in enumerate(words.items()):
            ids[name] = _add_job(s, tmp_path, name=name, state="running", devices=f"cpu:{i}", max_restarts=2)
            run = tmp_path / "runs" / str(ids[name])
            run.mkdir(parents=True)
            (run / "events.jsonl").write_text(events)
        s.get(Job, ids["cancelled"]).cancel_requested = True
        s.get(Job, ids["cancelled"]).reason = "cancelled by admin"
    scheduler.tick()
    with session(scheduler.engine) as s:
        ended = {name: s.get(Job, job_id) for name, job_id in ids.items()}
        paused, cancelled, silent = ended["paused"], ended["cancelled"], ended["silent"]
        assert (paused.state, paused.devices, paused.reason) == ("paused", None, "cost.budget_usd 1 spent")
        assert (cancelled.state, cancelled.reason) == ("cancelled", "cancelled by admin")
        assert cancelled.finished_at is not None and paused.finished_at is None
        # queued again, one restart more, and started again in the same tick on a free slot
        assert (silent.state, silent.restarts, silent.pid) == ("running", 1, 40_001)
        assert silent.reason == "process ended without a word (restart 1 of 2)"
    assert launched == [ids["silent"]]


def test_a_tick_fails_a_job_that_can_never_start_and_says_once_why_a_held_one_waits(
    loop_store, tmp_path, monkeypatch
):
    from gpuforge.scheduler.loop import Scheduler
    from gpuforge.store.db import session
    from gpuforge.store.models import ApiKey, Job

    scheduler, launched = loop_store
    monkeypatch.setattr(Scheduler, "_alive", lambda self, job: True)  # its running job's runner goes on
    with session(scheduler.engine) as s:
        owner = ApiKey(name="alice", digest="a" * 64, max_running=1)
        s.add(owner)
        s.flush()
        _add_job(s, tmp_path, owner_id=owner.id, state="running", devices="cpu:0", pid=1)
        held = _add_job(s, tmp_path, owner_id=owner.id)
        too_big = _add_job(s, tmp_path, devices_wanted=4)
    scheduler.tick()
    scheduler.tick()
    with session(scheduler.engine) as s:
        waiting, failed = s.get(Job, held), s.get(Job, too_big)
        assert (waiting.state, waiting.reason) == (
            "queued",
            "waiting for quota max_running: its key runs 1 jobs, its limit",
        )
        assert (failed.state, failed.reason) == ("failed", "asks for 4 cpu device(s); this server has 3")
        assert failed.finished_at is not None
    assert launched == []


@pytest.mark.slow
def test_a_clusters_devices_are_read_again_into_the_list_the_server_shares_and_a_failed_read_keeps_them(
    tmp_path, monkeypatch, caplog
):
    from gpuforge.scheduler import loop
    from gpuforge.scheduler.allocator import DeviceInfo
    from gpuforge.store.db import connect, migrate

    monkeypatch.setattr(loop, "DEVICES_REFRESH_S", 0.05)
    caplog.set_level(logging.INFO, "gpuforge")
    engine = connect(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(engine)
    one = [DeviceInfo("cpu:0", "cpu", "a CPU core of Slurm node a", None, 1)]
    two = [*one, DeviceInfo("cuda:0", "cuda", "a GPU of Slurm node b")]
    answer: dict = {"read": two}

    def source():
        if isinstance(answer["read"], Exception):
            raise answer["read"]
        return answer["read"]

    def until(condition, what: str) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, f"{what}: {devices}; {caplog.text}"
            time.sleep(0.05)

    class NodesComeAndGo(LocalExecutor):  # a partition's nodes drained and added, as sinfo would say
        rereads_devices = True

        def devices(self):
            return source()

    devices = list(one)
    scheduler = loop.Scheduler(engine, devices, NodesComeAndGo())
    scheduler.start()
    try:
        until(lambda: len(devices) == 2, "a node with a GPU joined")
        # the list the routes and the keeper hold is the one updated, in a tick, not a copy
        assert scheduler.devices is devices and [d.id for d in devices] == ["cpu:0", "cuda:0"]
        answer["read"] = RuntimeError("sinfo down")
        until(lambda: "devices not read again: sinfo down" in caplog.text, "a failed read")
        time.sleep(0.6)  # a tick or more: the devices known stay
        assert len(devices) == 2
        answer["read"] = one
        until(lambda: len(devices) == 1, "the node with the GPU left")
    finally:
        scheduler.stop()
        engine.dispose()
    assert "devices now: 1 cpu, 1 cuda (were 1 cpu)" in caplog.text
    assert "devices now: 1 cpu (were 1 cpu, 1 cuda)" in caplog.text
