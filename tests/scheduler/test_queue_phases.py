"""The queue's pass, phase by phase (scheduler/loop.py: snapshot → plan → apply): the snapshot read from a
real SQLite store, and the apply step writing a plan built by hand. (The plan between them is
queue.plan_starts, pure: tests/scheduler/test_queue.py.)"""

from __future__ import annotations

from datetime import timedelta

import pytest

from gpuforge.executors.local import LocalExecutor
from gpuforge.scheduler.allocator import DeviceInfo
from gpuforge.scheduler.budgets import ProjectBudgets
from gpuforge.scheduler.executor import Launched
from gpuforge.scheduler.loop import Scheduler
from gpuforge.scheduler.queue import Plan
from gpuforge.scheduler.snapshot import read_queue
from gpuforge.store.db import connect, migrate, session
from gpuforge.store.models import ApiKey, Deployment, Job, JobState, Project, utcnow

SLOTS = [DeviceInfo(f"cpu:{i}", "cpu", "a CPU slot", threads=1) for i in range(4)]


@pytest.fixture
def engine(tmp_path):
    engine = connect(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(engine)
    yield engine
    engine.dispose()


def _job(s, tmp_path, **fields) -> int:
    job = Job(**{"name": "j", "spec_yaml": "name: j\n", "run_dir": "", **fields})
    s.add(job)
    s.flush()
    job.run_dir = str(tmp_path / "runs" / str(job.id))
    return job.id


def test_the_snapshot_reads_running_and_queued_jobs_replicas_and_limits_in_one_place(engine, tmp_path):
    now = utcnow()
    labelled = [*SLOTS[:3], DeviceInfo("cpu:3", "cpu", "a CPU slot", threads=1, labels=(("site", "lab"),))]
    with session(engine) as s:
        team = Project(name="team", max_devices=2)
        alice = ApiKey(name="alice", digest="a" * 64, max_running=1)
        s.add_all([team, alice])
        s.flush()
        ids = {
            "running": _job(s, tmp_path, state=JobState.RUNNING, devices="cpu:0", owner_id=alice.id,
                            project_id=team.id, priority=3, boost=2, max_time_s=600.0,
                            run_started_at=now - timedelta(seconds=100)),
            "stopping": _job(s, tmp_path, state=JobState.RUNNING, devices="cpu:1", stop_requested="preempt",
                             preemptible=False),
            "queued": _job(s, tmp_path, state=JobState.QUEUED, devices_wanted=2, owner_id=alice.id,
                           placement={"site": "lab"}),
            "preempted": _job(s, tmp_path, state=JobState.PREEMPTED, project_id=team.id,
                              reason="preempted by job 9 (priority 5)"),
            "ended": _job(s, tmp_path, state=JobState.FINISHED, devices="cpu:3"),
        }  # fmt: skip
        s.add(Deployment(name="d", model_dir="m", worker_key="", state="ready",
                         workers=[{"index": 0, "pid": 1, "device": "cpu:2"}]))  # fmt: skip
        s.commit()
    asked = []
    with session(engine) as s:
        budgets = ProjectBudgets()
        budgets.refresh(s)
        since = LocalExecutor().holds_devices_since
        snapshot = read_queue(s, labelled, budgets, since, lambda: asked.append(1) or ({}, {}), now)

    running = {r.id: r for r in snapshot.running}
    assert set(running) == {ids["running"], ids["stopping"]}
    first = running[ids["running"]]
    assert (first.priority, first.device_ids, first.project) == (5, ("cpu:0",), team_id(engine))
    assert first.ends_in_s == pytest.approx(500.0, abs=1.0)  # its max_time from the executor's start
    assert running[ids["stopping"]].stopping and not running[ids["stopping"]].preemptible
    assert running[ids["stopping"]].ends_in_s is None  # no max_time: unknown
    queued = {q.id: q for q in snapshot.queued}
    assert set(queued) == {ids["queued"], ids["preempted"]}
    assert (queued[ids["queued"]].devices, queued[ids["queued"]].placement) == (2, (("site", "lab"),))
    assert snapshot.shown[ids["preempted"]] == (JobState.PREEMPTED, "preempted by job 9 (priority 5)")
    # cpu:0 and cpu:1 run jobs, cpu:2 a replica; a finished job holds nothing
    assert (snapshot.free, snapshot.every) == ({"cpu": ["cpu:3"]}, {"cpu": [d.id for d in SLOTS]})
    assert snapshot.limits.replicas == {"cpu:2": "replica 0 (v1) of deployment d"}
    assert dict(snapshot.limits.running) == {alice_id(engine): 1, None: 1}
    assert dict(snapshot.limits.max_running) == {alice_id(engine): 1}
    assert dict(snapshot.limits.max_devices) == {team_id(engine): 2}
    assert snapshot.labels == {"cpu:3": (("site", "lab"),)}
    # two groups wait (alice's key, the project team): fair share weighs them, usage read once
    assert snapshot.fairness is not None and asked == [1]


def team_id(engine) -> int:
    with session(engine) as s:
        return s.query(Project).one().id


def alice_id(engine) -> int:
    with session(engine) as s:
        return s.query(ApiKey).one().id


def test_the_apply_step_writes_a_plan_built_by_hand(engine, tmp_path, monkeypatch):
    started = []

    def start_nothing(spec_path, run_dir, env):  # the runner is not the point: what the store says is
        started.append((spec_path.read_text(), env["GPUFORGE_JOB_ID"], env.get("CUDA_VISIBLE_DEVICES")))
        return Launched(pid=4_000_000 + len(started), process=None)

    executor = LocalExecutor()
    monkeypatch.setattr(executor, "start_runner", start_nothing)
    scheduler = Scheduler(engine, SLOTS, executor)
    with session(engine) as s:
        victim = _job(s, tmp_path, state=JobState.RUNNING, devices="cpu:0", pid=None)
        queued = (_job(s, tmp_path, state=JobState.QUEUED, priority=p) for p in (9, 8, 7, 6))
        start, blocked, never, unheld = queued
        s.get(Job, unheld).reason = "waiting: max_running 1 reached"
        cancelled = _job(s, tmp_path, state=JobState.CANCELLED)
        s.commit()
    with session(engine) as s:
        snapshot = scheduler.read_queue(s)
        plan = Plan(
            starts=[(start, ["cpu:1"]), (cancelled, ["cpu:2"])],  # the second one ended since the read
            preempt={victim: start},
            blocked={blocked: "waiting: 2 cpu devices busy"},
            impossible={never: "resources.devices: 9 cpu devices asked for; the server has 4"},
            order=[start, blocked, never, unheld],
        )
        scheduler.apply(s, snapshot, plan)

    with session(engine) as s:
        jobs = {j.id: j for j in s.query(Job)}
    assert (jobs[start].state, jobs[start].devices, jobs[start].pid) == (JobState.RUNNING, "cpu:1", 4_000_001)
    assert started == [("name: j\n", str(start), "")]  # its spec, its id, its devices' environment (no GPU)
    assert jobs[cancelled].state == JobState.CANCELLED and jobs[cancelled].devices is None
    preempted = ("preempt", f"preempted by job {start} (priority 9)")
    assert (jobs[victim].stop_requested, jobs[victim].reason) == preempted
    assert (jobs[blocked].state, jobs[blocked].reason) == (JobState.QUEUED, "waiting: 2 cpu devices busy")
    assert jobs[never].state == JobState.FAILED and jobs[never].reason.startswith("resources.devices: 9")
    assert jobs[unheld].reason is None  # its wait no longer holds: its place says it
    assert scheduler.queue_positions == {blocked: 1, never: 2, unheld: 3}
