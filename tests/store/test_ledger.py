"""The cost ledger on SQLite and PostgreSQL, with the clock given: time cut at minute boundaries, nothing
counted twice (the same tick again, or a tick rolled back and run again), rates for all the devices a job
holds or a deployment's replicas, month spend per project with the month's first minute as the boundary,
and daily sums read back."""

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from gpuforge.store import ledger
from gpuforge.store.db import session
from gpuforge.store.models import ApiKey, Deployment, Job, JobState, LedgerEntry, Project

T0 = datetime(2026, 3, 10, 10, 0, 30, tzinfo=UTC)


def _setup(engine) -> dict[str, int]:
    """Two projects, a key in each, and an admin key in none: their ids by name."""
    with session(engine) as s:
        vision, nlp = Project(name="vision"), Project(name="nlp")
        s.add_all([vision, nlp])
        s.flush()
        keys = [
            ApiKey(name="ada", digest="a" * 64, project_id=vision.id),
            ApiKey(name="bob", digest="b" * 64, project_id=nlp.id),
            ApiKey(name="root", digest="c" * 64, admin=True),
        ]
        s.add_all(keys)
        s.flush()
        return {"vision": vision.id, "nlp": nlp.id, **{k.name: k.id for k in keys}}


def _job(engine, owner: int | None = None, project: int | None = None, **fields) -> int:
    values = {"state": JobState.RUNNING, "pid": 4242, "devices": "cpu:0", "usd_per_hour": 3.6, **fields}
    with session(engine) as s:
        job = Job(name="j", spec_yaml="name: j\n", run_dir="/tmp/runs/j", owner_id=owner, project_id=project)
        for name, value in values.items():
            setattr(job, name, value)
        s.add(job)
        s.flush()
        return job.id


def _tick(engine, now: datetime) -> None:
    """What the scheduling loop does each tick: accrue every running job and live deployment, commit."""
    with session(engine) as s:
        running = s.scalars(select(Job).where(Job.state == JobState.RUNNING))
        ledger.accrue(s, running, s.scalars(select(Deployment)), now)


def _rows(engine, subject: str) -> list[tuple[datetime, float, float]]:
    with session(engine) as s:
        entries = s.scalars(
            select(LedgerEntry).where(LedgerEntry.subject == subject).order_by(LedgerEntry.minute)
        )
        return [(e.minute, round(e.device_seconds, 6), round(e.usd, 9)) for e in entries]


def test_time_is_cut_at_minute_boundaries_from_the_process_start(engine):
    job_id = _job(engine, run_started_at=T0)  # no mark yet: the first tick charges from the start
    _tick(engine, T0 + timedelta(seconds=105))  # 10:00:30 .. 10:02:15
    minute = T0.replace(second=0)
    assert _rows(engine, f"job:{job_id}") == [
        (minute, 30.0, 0.03),
        (minute + timedelta(minutes=1), 60.0, 0.06),
        (minute + timedelta(minutes=2), 15.0, 0.015),
    ]
    _tick(engine, T0 + timedelta(seconds=120))  # 15 s more, into the row of 10:02
    assert _rows(engine, f"job:{job_id}")[-1] == (minute + timedelta(minutes=2), 30.0, 0.03)
    with session(engine) as s:
        assert s.get(Job, job_id).accrued_at == T0 + timedelta(seconds=120)


def test_the_same_tick_twice_or_a_rolled_back_one_run_again_counts_nothing_twice(engine):
    job_id = _job(engine, accrued_at=T0)
    later = T0 + timedelta(seconds=90)
    _tick(engine, later)
    _tick(engine, later)  # the same `now` again: the mark is there already
    with session(engine) as s:
        job = s.get(Job, job_id)
        what = ledger._job_charge(job)
        assert ledger.charge(s, job, what, later) == 0.0
    before = _rows(engine, f"job:{job_id}")
    assert sum(ds for _, ds, _ in before) == 90.0

    crashed_at = later + timedelta(seconds=45)
    with pytest.raises(RuntimeError), session(engine) as s:  # a server killed mid-tick: nothing commits
        ledger.accrue(s, [s.get(Job, job_id)], [], crashed_at)
        s.flush()  # the rows reached the store's transaction, not its committed state
        raise RuntimeError("killed")
    assert _rows(engine, f"job:{job_id}") == before
    with session(engine) as s:
        assert s.get(Job, job_id).accrued_at == later  # the mark did not move either
    _tick(engine, crashed_at)  # the next server's tick charges those 45 s once
    assert sum(ds for _, ds, _ in _rows(engine, f"job:{job_id}")) == 135.0


def test_a_job_charged_within_its_runs_pays_for_the_time_in_them_alone(engine):
    """A Slurm job (scheduler/loop.py): charged while its Slurm job ran, not for its waits in the queue,
    however the ticks fall, and a server down across a requeue charges both runs' parts on its return."""
    job_id = _job(engine, accrued_at=T0)
    at = lambda seconds: T0 + timedelta(seconds=seconds)  # noqa: E731
    runs = [(at(10), at(40)), (at(100), None)]  # waited 10 s, ran 30 s, requeued: waited 60 s, runs on

    def tick(now: datetime, spans) -> None:
        with session(engine) as s:
            ledger.accrue(s, [s.get(Job, job_id)], [], now, within={job_id: spans})

    tick(at(5), [])  # waiting for its first run: nothing
    tick(at(20), runs[:1])  # 10 s of its first run
    tick(at(130), runs)  # the server away across the requeue: the first run's last 20 s and 30 s now
    assert sum(ds for _, ds, _ in _rows(engine, f"job:{job_id}")) == 60.0
    tick(at(130), runs)  # the same tick again: nothing twice
    tick(at(150), [(at(10), at(40)), (at(100), at(140))])  # ended at 140: 10 s, not 20
    assert sum(ds for _, ds, _ in _rows(engine, f"job:{job_id}")) == 70.0
    with session(engine) as s:
        assert s.get(Job, job_id).accrued_at == at(150)


def test_a_job_pays_its_rate_for_all_its_devices_and_a_deployment_per_replica_up(engine):
    two = _job(engine, accrued_at=T0, devices="cuda:0,cuda:1", devices_wanted=2, usd_per_hour=7.2)
    unpriced = _job(engine, accrued_at=T0, usd_per_hour=None)
    claimed = _job(engine, accrued_at=None, pid=None)  # no process yet: nothing runs
    with session(engine) as s:
        workers = [{"index": i, "pid": 100 + i} for i in range(2)] + [{"index": 2, "pid": None}]
        deployment = Deployment(
            name="d", model_dir="m", worker_key="", workers=workers, usd_per_hour=1.8, accrued_at=T0
        )
        idle = Deployment(name="idle", model_dir="m", worker_key="", workers=[{"pid": None}], accrued_at=T0)
        s.add_all([deployment, idle])
        s.flush()
        served, idle_id = deployment.id, idle.id
    _tick(engine, T0 + timedelta(seconds=20))  # all within 10:00
    minute = T0.replace(second=0)
    assert _rows(engine, f"job:{two}") == [(minute, 40.0, 0.04)]  # Job.usd_per_hour is for both devices
    assert _rows(engine, f"job:{unpriced}") == [(minute, 20.0, 0.0)]  # device time still counts
    assert _rows(engine, f"job:{claimed}") == []
    assert _rows(engine, f"deployment:{served}") == [(minute, 40.0, 0.02)]  # 2 replicas of $1.8/h
    assert _rows(engine, f"deployment:{idle_id}") == []
    with session(engine) as s:
        assert s.get(Deployment, idle_id).accrued_at is None  # its next replica starts a new mark


def test_month_spend_per_project_ends_at_the_first_minute_of_the_month(engine):
    ids = _setup(engine)
    eve = datetime(2026, 3, 31, 23, 59, 15, tzinfo=UTC)
    a = _job(engine, ids["ada"], ids["vision"], accrued_at=eve, usd_per_hour=36.0)  # $0.01 a second
    b = _job(engine, ids["bob"], ids["nlp"], accrued_at=eve, usd_per_hour=3.6)
    _job(engine, ids["root"], None, accrued_at=eve)  # an admin's job: in no project's month
    april = datetime(2026, 4, 1, 0, 0, 30, tzinfo=UTC)
    _tick(engine, april)  # 45 s in March, 30 s in April
    with session(engine) as s:
        assert ledger.month_spend(s, april) == pytest.approx({ids["vision"]: 0.30, ids["nlp"]: 0.03})
        assert ledger.month_spend(s, eve) == pytest.approx({ids["vision"]: 0.45, ids["nlp"]: 0.045})
        total = s.scalar(select(func.sum(LedgerEntry.usd)).where(LedgerEntry.subject == f"job:{a}"))
        assert total == pytest.approx(0.75)
        assert ledger.month_start(april) == datetime(2026, 4, 1, tzinfo=UTC)
    assert [day for day, _, _ in _rows(engine, f"job:{b}")][0].month == 3


def test_spend_sums_per_utc_day_key_project_and_subject(engine):
    ids = _setup(engine)
    late = datetime(2026, 3, 10, 23, 59, 0, tzinfo=UTC)
    a = _job(engine, ids["ada"], ids["vision"], accrued_at=late)
    b = _job(engine, ids["bob"], ids["nlp"], accrued_at=late + timedelta(seconds=30))
    _tick(engine, late + timedelta(seconds=150))  # a: 60 s on the 10th, 90 s on the 11th
    with session(engine) as s:
        rows = ledger.spend(s, datetime(2026, 3, 10, tzinfo=UTC), datetime(2026, 3, 12, tzinfo=UTC))
        got = sorted((r.day, r.subject, r.key_id, r.project_id, round(r.device_seconds, 6)) for r in rows)
        assert got == [
            ("2026-03-10", f"job:{a}", ids["ada"], ids["vision"], 60.0),
            ("2026-03-10", f"job:{b}", ids["bob"], ids["nlp"], 30.0),
            ("2026-03-11", f"job:{a}", ids["ada"], ids["vision"], 90.0),
            ("2026-03-11", f"job:{b}", ids["bob"], ids["nlp"], 90.0),
        ]
        only = ledger.spend(
            s,
            datetime(2026, 3, 11, tzinfo=UTC),
            datetime(2026, 3, 12, tzinfo=UTC),
            LedgerEntry.key_id == ids["ada"],
        )
        assert [(r.day, r.usd) for r in only] == [("2026-03-11", pytest.approx(0.09))]
