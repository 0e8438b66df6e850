"""The notifications' outbox on a real store: a move of store/states.py adds its event in its own
transaction (none when it did not happen, none when the transaction is rolled back), each to the targets
that hear of it, once."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from gpuforge.store import outbox, states
from gpuforge.store.db import session
from gpuforge.store.models import (
    ApiKey,
    Deployment,
    DeploymentState,
    Job,
    JobState,
    NotificationDelivery,
    NotificationEvent,
    Project,
    utcnow,
)
from gpuforge.store.notification_targets import create_target


def _setup(engine) -> dict[str, int]:
    """A project with two members (ada, bob), a key of no project (cy), each with a person target, and a
    project target made by the admin: ids by name."""
    with session(engine) as s:
        vision = Project(name="vision")
        s.add(vision)
        s.flush()
        keys = {
            "ada": ApiKey(name="ada", digest="a" * 64, project_id=vision.id),
            "bob": ApiKey(name="bob", digest="b" * 64, project_id=vision.id),
            "cy": ApiKey(name="cy", digest="c" * 64),
            "root": ApiKey(name="root", digest="d" * 64, admin=True),
        }
        s.add_all(keys.values())
        s.flush()
        ids = {"vision": vision.id, **{name: k.id for name, k in keys.items()}}
        for name in ("ada", "bob", "cy"):
            ids[f"{name}-target"] = create_target(s, keys[name].id, "json", f"http://127.0.0.1:9/{name}")[
                0
            ].id
        made, _ = create_target(s, keys["root"].id, "slack", "https://hooks.example/x", project_id=vision.id)
        ids["vision-target"] = made.id
        return ids


def _job(engine, owner: int, project: int | None, state=JobState.RUNNING, **fields) -> int:
    with session(engine) as s:
        job = Job(name="digits", spec_yaml="", run_dir="/tmp/r", owner_id=owner, project_id=project,
                  state=state, pid=4242, **fields)  # fmt: skip
        s.add(job)
        s.flush()
        return job.id


def _told(engine) -> list[tuple[str, str, list[int]]]:
    """(kind, subject, the targets it goes to) of each event, oldest first."""
    with session(engine) as s:
        events = list(s.scalars(select(NotificationEvent).order_by(NotificationEvent.id)))
        return [
            (e.kind, e.subject, sorted(s.scalars(select(NotificationDelivery.target_id).where(
                NotificationDelivery.event_id == e.id))))
            for e in events
        ]  # fmt: skip


def test_a_finished_job_tells_its_owner_and_its_project_once(engine):
    ids = _setup(engine)
    job_id = _job(engine, ids["ada"], ids["vision"])
    with session(engine) as s:
        assert states.end(s, job_id, "finished", None)
        assert not states.end(s, job_id, "finished", None)  # a late second ending moves nothing: no event
    assert _told(engine) == [("job.finished", f"job:{job_id}", [ids["ada-target"], ids["vision-target"]])]
    with session(engine) as s:
        event = s.scalar(select(NotificationEvent))
        assert event.owner_id == ids["ada"] and event.data["job"]["state"] == "finished"
        assert event.data["text"] == f"job {job_id} (digits) finished"


@pytest.mark.parametrize(
    ("move", "kind"),
    [
        (lambda s, j: states.end(s, j, "failed", "CUDA error"), "job.failed"),
        (lambda s, j: states.fail(s, j, "refused its input"), "job.failed"),
        (lambda s, j: states.end(s, j, "paused", "cost.budget_usd 1 spent"), "job.paused_budget"),
        (lambda s, j: states.preempt(s, j, "preempted by job 9"), "job.preempted"),
        (lambda s, j: states.end(s, j, "cancelled", None), None),  # its owner asked for it
        (lambda s, j: states.requeue(s, j, "process ended without a word"), None),
    ],
)
def test_each_ending_a_person_may_want_to_hear_of_is_one_event(engine, move, kind):
    ids = _setup(engine)
    job_id = _job(engine, ids["cy"], None)
    with session(engine) as s:
        assert move(s, job_id)
    assert [k for k, _, _ in _told(engine)] == ([kind] if kind else [])


def test_a_pause_says_whether_a_budget_or_max_time_stopped_the_job(engine):
    ids = _setup(engine)
    timed_out = _job(engine, ids["cy"], None, stop_requested="timeout")
    over_budget = _job(engine, ids["cy"], None, stop_requested="pause")
    with session(engine) as s:
        assert states.pause(s, timed_out, "paused: resources.max_time (60 s) run")
        assert states.pause(s, over_budget, "paused: project vision's budget is spent")
    told = _told(engine)
    assert [(k, subject) for k, subject, _ in told] == [
        ("job.paused_max_time", f"job:{timed_out}"), ("job.paused_budget", f"job:{over_budget}"),
    ]  # fmt: skip
    with session(engine) as s:
        texts = [e.data["text"] for e in s.scalars(select(NotificationEvent).order_by(NotificationEvent.id))]
    assert (
        texts[0] == f"job {timed_out} (digits) paused: resources.max_time (60 s) run"
    )  # no "paused: paused:"


def test_a_queued_job_that_can_never_start_is_a_failure_too(engine):
    ids = _setup(engine)
    job_id = _job(engine, ids["bob"], ids["vision"], state=JobState.QUEUED)
    with session(engine) as s:
        assert states.reject(s, job_id, "asks for 8 cpu device(s); 1 exist")
    assert _told(engine) == [("job.failed", f"job:{job_id}", [ids["bob-target"], ids["vision-target"]])]


def test_a_rolled_back_move_leaves_no_event_and_its_replay_one(engine):
    """A server killed before the tick commits: neither the move nor its event stands; the next tick moves
    the job again, and tells once."""
    ids = _setup(engine)
    job_id = _job(engine, ids["cy"], None)
    with pytest.raises(RuntimeError), session(engine) as s:
        assert states.end(s, job_id, "finished", None)
        raise RuntimeError("killed before the commit")
    assert _told(engine) == []
    with session(engine) as s:
        assert states.end(s, job_id, "finished", None)
    assert [k for k, _, _ in _told(engine)] == ["job.finished"]


def test_a_target_hears_only_the_kinds_it_subscribes_to_and_a_revoked_keys_nothing(engine):
    ids = _setup(engine)
    with session(engine) as s:
        picky, _ = create_target(s, ids["cy"], "json", "http://127.0.0.1:9/picky", events=["job.failed"])
        picky_id = picky.id
    finished, failed = _job(engine, ids["cy"], None), _job(engine, ids["cy"], None)
    with session(engine) as s:
        states.end(s, finished, "finished", None)
        states.end(s, failed, "failed", "OOM")
        s.get(ApiKey, ids["bob"]).revoked_at = utcnow()
    bobs = _job(engine, ids["bob"], ids["vision"])
    with session(engine) as s:
        states.end(s, bobs, "finished", None)
    assert [(k, t) for k, _, t in _told(engine)] == [
        ("job.finished", [ids["cy-target"]]),
        ("job.failed", [ids["cy-target"], picky_id]),
        ("job.finished", [ids["vision-target"]]),  # bob's own target is gone with his key; his project's not
    ]


def test_a_deployment_that_fails_tells_its_owner_and_project(engine):
    ids = _setup(engine)
    with session(engine) as s:
        d = Deployment(name="topics", owner_id=ids["ada"], project_id=ids["vision"], model_dir="/m",
                       worker_key="k" * 64, state=DeploymentState.STARTING)  # fmt: skip
        s.add(d)
        s.flush()
        assert states.deployment_failing(s, d.id, "replica 0: no model")
        assert states.deployment_failed(s, d.id)
    assert _told(engine) == [
        ("deployment.failed", f"deployment:{d.id}", [ids["ada-target"], ids["vision-target"]])
    ]
    with session(engine) as s:
        assert (
            s.scalar(select(NotificationEvent)).data["text"]
            == "deployment topics failed: replica 0: no model"
        )


def test_an_event_named_once_is_recorded_once(engine):
    ids = _setup(engine)
    with session(engine) as s:
        vision = s.get(Project, ids["vision"])
        vision.budget_usd_month = 10.0
        assert outbox.budget_event(s, vision, outbox.BUDGET_80, 8.5, utcnow()) is not None
    with session(engine) as s:  # another tick, or another server's
        assert outbox.budget_event(s, s.get(Project, ids["vision"]), outbox.BUDGET_80, 9.0, utcnow()) is None
    assert _told(engine) == [  # the project's target and its members' person targets; cy is in no project
        (
            "budget.80",
            f"project:{ids['vision']}",
            sorted([ids["ada-target"], ids["bob-target"], ids["vision-target"]]),
        )
    ]


def test_two_servers_recording_the_same_once_event_at_once_keep_one_row(engine):
    """The race the read before the insert cannot close: both read none, both insert; the second insert
    adds nothing and its transaction goes on (what else the tick wrote stands)."""
    ids = _setup(engine)
    with session(engine) as s:
        vision = s.get(Project, ids["vision"])
        vision.budget_usd_month = 10.0
        outbox.budget_event(s, vision, outbox.BUDGET_100, 10.0, utcnow())
    with session(engine) as s:
        once = s.scalar(select(NotificationEvent.once))
        s.get(Project, ids["vision"]).share = 3.0  # the rest of the late server's tick
        values = {"kind": "budget.100", "subject": "x", "data": {}, "once": once, "created_at": utcnow()}
        assert outbox._insert_once(s, values) is None
    with session(engine) as s:
        assert s.get(Project, ids["vision"]).share == 3.0
        assert len(s.scalars(select(NotificationEvent)).all()) == 1


def test_an_event_nobody_hears_of_leaves_no_row(engine):
    ids = _setup(engine)
    job_id = _job(engine, ids["root"], None)  # the admin has no target of its own, and no project
    with session(engine) as s:
        assert states.end(s, job_id, "finished", None)
    assert _told(engine) == []
