"""Every move of store/states.py on a real store, no process started: where each may leave from, what it
writes, and the races between the API and the scheduling loop that its conditional update settles."""

import json
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from gpuforge.store import states
from gpuforge.store.db import session
from gpuforge.store.models import (
    ACTIVE_JOB_STATES,
    ENDED_DEPLOYMENT_STATES,
    ENDED_JOB_STATES,
    LIVE_DEPLOYMENT_STATES,
    Deployment,
    DeploymentState,
    Job,
    JobState,
)

Q, R, P, PRE = JobState.QUEUED, JobState.RUNNING, JobState.PAUSED, JobState.PREEMPTED
FINISHED, FAILED, CANCELLED = JobState.FINISHED, JobState.FAILED, JobState.CANCELLED
STARTING, READY, STOPPING = DeploymentState.STARTING, DeploymentState.READY, DeploymentState.STOPPING
FAILING, D_FAILED, STOPPED = DeploymentState.FAILING, DeploymentState.FAILED, DeploymentState.STOPPED
WAITING = "waiting for quota max_running"

# each move: (what it does to a row, {the state it leaves from: the state it leaves the row in})
JOB_MOVES: dict[str, tuple[Callable[[Session, int], bool], dict[JobState, JobState]]] = {
    "claim": (lambda s, j: states.claim(s, j, ["cpu:0"], WAITING), {Q: R, PRE: R}),
    "start": (lambda s, j: states.start(s, j, 4242), {R: R}),
    "end paused": (lambda s, j: states.end(s, j, "paused", "budget spent"), {R: P}),
    "end finished": (lambda s, j: states.end(s, j, "finished", None), {R: FINISHED}),
    "end failed": (lambda s, j: states.end(s, j, "failed", "CUDA error"), {R: FAILED}),
    "end cancelled": (lambda s, j: states.end(s, j, "cancelled", None), {R: CANCELLED}),
    "requeue": (lambda s, j: states.requeue(s, j, "process ended without a word"), {R: Q}),
    "fail": (lambda s, j: states.fail(s, j, "refused its input"), {R: FAILED}),
    "reject": (lambda s, j: states.reject(s, j, "asks for 8 cpu device(s)"), {Q: FAILED, PRE: FAILED}),
    "hold": (lambda s, j: states.hold(s, j, WAITING), {Q: Q, PRE: PRE}),
    "cancel": (
        lambda s, j: states.cancel(s, j, "cancelled by admin"),
        {Q: CANCELLED, PRE: CANCELLED, P: CANCELLED, R: R},
    ),
    "resume": (lambda s, j: states.resume(s, j, "name: j\n", "resumed by admin"), {P: Q}),
    "resume cancelled": (
        lambda s, j: states.resume(s, j, "name: j\n", "resumed by admin", seen=CANCELLED),
        {CANCELLED: Q},
    ),
    "request_stop": (lambda s, j: states.request_stop(s, j, "preempt", "preempted by job 9"), {R: R}),
    "preempt": (lambda s, j: states.preempt(s, j, "preempted by job 9"), {R: PRE}),
    "pause": (lambda s, j: states.pause(s, j, "project budget spent"), {R: P}),
}
DEPLOYMENT_MOVES: dict[str, tuple[Callable[[Session, int], bool], dict[DeploymentState, DeploymentState]]] = {
    "ready": (states.deployment_ready, {STARTING: READY}),
    "starting": (states.deployment_starting, {READY: STARTING}),
    "failing": (
        lambda s, d: states.deployment_failing(s, d, "replica 0: no model"),
        {STARTING: FAILING, READY: FAILING},
    ),
    "undeploy": (states.undeploy, {state: STOPPING for state in LIVE_DEPLOYMENT_STATES}),
    "stopped": (states.deployment_stopped, {STOPPING: STOPPED}),
    "failed": (states.deployment_failed, {FAILING: D_FAILED}),
}


def _job(engine, state: JobState = Q, **fields) -> int:
    with session(engine) as s:
        job = Job(name="j", spec_yaml="name: j\n", run_dir="/tmp/runs/j", state=state, **fields)
        s.add(job)
        s.flush()
        return job.id


def _deployment(engine, state: DeploymentState, name: str) -> int:
    with session(engine) as s:
        deployment = Deployment(name=name, model_dir="m", worker_key="", workers=[], state=state)
        s.add(deployment)
        s.flush()
        return deployment.id


def _move(engine, move: Callable[..., bool], *args) -> bool:
    with session(engine) as s:
        return move(s, *args)


def _read(engine, row: type[Job | Deployment], row_id: int):
    with session(engine) as s:
        return s.get(row, row_id)


def test_a_state_is_its_plain_string_in_the_store_in_json_and_in_messages(engine):
    job_id = _job(engine, R)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT state FROM jobs")).scalar() == "running"  # no migration
    state = _read(engine, Job, job_id).state
    assert state is R and state == "running" and {"running": 1}[state] == 1
    assert f"{state}" == str(state) == "running" and json.dumps({"state": state}) == '{"state": "running"}'
    with session(engine) as s:  # a filter the API was sent, as a plain string
        assert s.scalars(select(Job.id).where(Job.state == "running")).all() == [job_id]


def test_the_groups_split_the_states_once():
    assert set(ACTIVE_JOB_STATES) | set(ENDED_JOB_STATES) == set(JobState)
    assert not set(ACTIVE_JOB_STATES) & set(ENDED_JOB_STATES)
    assert set(LIVE_DEPLOYMENT_STATES) | set(ENDED_DEPLOYMENT_STATES) == set(DeploymentState)
    assert not set(LIVE_DEPLOYMENT_STATES) & set(ENDED_DEPLOYMENT_STATES)


@pytest.mark.parametrize("name", JOB_MOVES)
def test_a_job_move_leaves_only_from_its_states_and_refuses_the_others(engine, name):
    move, legal = JOB_MOVES[name]
    for state in JobState:
        job_id = _job(engine, state)
        assert _move(engine, move, job_id) == (state in legal), state
        assert _read(engine, Job, job_id).state == legal.get(state, state), state


@pytest.mark.parametrize("name", DEPLOYMENT_MOVES)
def test_a_deployment_move_leaves_only_from_its_states_and_refuses_the_others(engine, name):
    move, legal = DEPLOYMENT_MOVES[name]
    for state in DeploymentState:
        deployment_id = _deployment(engine, state, name=f"d-{state}")
        assert _move(engine, move, deployment_id) == (state in legal), state
        assert _read(engine, Deployment, deployment_id).state == legal.get(state, state), state


def test_a_claim_gives_devices_and_clears_only_the_reason_it_waited_for(engine):
    held = _job(engine, reason=f"{WAITING}: its key runs 1 jobs, its limit")
    restarted = _job(engine, reason="process ended without a word (restart 1 of 2)")
    for job_id in (held, restarted):
        assert _move(engine, states.claim, job_id, ["cuda:0", "cuda:1"], WAITING)
    job = _read(engine, Job, held)
    assert (job.devices, job.pid, job.reason) == ("cuda:0,cuda:1", None, None)
    assert _read(engine, Job, restarted).reason == "process ended without a word (restart 1 of 2)"


def test_start_records_the_pid_and_keeps_the_first_start_time(engine):
    job_id = _job(engine, R)
    assert _move(engine, states.start, job_id, 100)
    first = _read(engine, Job, job_id)
    assert first.pid == 100 and first.started_at.tzinfo is not None
    assert _move(engine, states.start, job_id, 200)  # restarted after its runner was killed
    again = _read(engine, Job, job_id)
    assert again.pid == 200 and again.started_at == first.started_at


def test_an_ending_event_ends_the_job_and_keeps_a_reason_it_had(engine):
    cancelled = _job(engine, R, pid=7, devices="cpu:0", cancel_requested=True, reason="cancelled by admin")
    failed = _job(engine, R, pid=8, devices="cpu:0")
    before = datetime.now(UTC)
    assert _move(engine, states.end, cancelled, "cancelled", "SIGTERM")
    assert _move(engine, states.end, failed, "failed", "CUDA error")
    job = _read(engine, Job, cancelled)
    assert (job.state, job.reason, job.pid, job.devices) == (CANCELLED, "cancelled by admin", None, "cpu:0")
    assert job.finished_at >= before
    assert _read(engine, Job, failed).reason == "CUDA error"
    with pytest.raises(ValueError, match="`started` event ends nothing"), session(engine) as s:
        states.end(s, failed, "started", None)


def test_a_pause_gives_the_devices_back_and_leaves_the_job_unfinished(engine):
    job_id = _job(engine, R, pid=7, devices="cuda:0", reason="resumed by admin with $1")
    assert _move(engine, states.end, job_id, "paused", "cost.budget_usd 1 spent")
    job = _read(engine, Job, job_id)
    assert (job.state, job.devices, job.pid, job.finished_at) == (P, None, None, None)
    assert job.reason == "cost.budget_usd 1 spent"


def test_a_lost_runner_is_requeued_with_one_restart_more_or_failed(engine):
    requeued, failed = _job(engine, R, pid=7, devices="cpu:0", restarts=1), _job(engine, R, pid=8)
    assert _move(engine, states.requeue, requeued, "restart 2 of 2")
    assert _move(engine, states.fail, failed, "process ended without a word 3 times")
    job = _read(engine, Job, requeued)
    assert (job.state, job.restarts, job.devices, job.pid, job.reason) == (Q, 2, None, None, "restart 2 of 2")
    job = _read(engine, Job, failed)
    assert (job.state, job.pid, job.reason) == (FAILED, None, "process ended without a word 3 times")
    assert job.finished_at is not None


def test_cancel_ends_a_waiting_job_at_once_and_asks_a_running_one_to_stop(engine):
    queued, running = _job(engine, Q), _job(engine, R, pid=7)
    assert _move(engine, states.cancel, queued, "cancelled by admin")
    assert _move(engine, states.cancel, running, "cancelled by admin")
    job = _read(engine, Job, queued)
    assert (job.state, job.reason, job.cancel_requested) == (CANCELLED, "cancelled by admin", False)
    assert job.finished_at is not None
    job = _read(engine, Job, running)
    assert (job.state, job.reason, job.cancel_requested, job.finished_at) == (
        R,
        "cancelled by admin",
        True,
        None,
    )


def test_resume_queues_a_paused_job_with_its_new_spec_and_all_its_restarts(engine):
    job_id = _job(engine, P, restarts=2)
    assert _move(
        engine, states.resume, job_id, "name: j\ncost: {budget_usd: 5}\n", "resumed by admin with $5"
    )
    with session(engine) as s:
        job = s.get(Job, job_id)
        assert (job.state, job.restarts, job.reason) == (Q, 0, "resumed by admin with $5")
        assert job.spec_yaml == "name: j\ncost: {budget_usd: 5}\n"


def test_a_deployment_that_stops_or_fails_says_when_and_a_failing_one_why(engine):
    stopping, failing = _deployment(engine, STOPPING, "a"), _deployment(engine, READY, "b")
    assert _move(engine, states.deployment_failing, failing, "replica 0: no model")
    assert _read(engine, Deployment, failing).reason == "replica 0: no model"
    assert _move(engine, states.deployment_failed, failing)
    assert _move(engine, states.deployment_stopped, stopping)
    for deployment_id in (stopping, failing):
        assert _read(engine, Deployment, deployment_id).stopped_at is not None


# --- races: the loop read a row, the API changed it before the loop wrote ---
def test_a_preempted_job_waits_in_the_queue_counting_its_preemptions_and_its_boost(engine):
    job_id = _job(engine, R)
    with session(engine) as s:
        assert states.request_stop(s, job_id, "preempt", "preempted by job 9 (priority 5)")
        assert s.get(Job, job_id).stop_requested == "preempt"
        assert states.preempt(s, job_id, "preempted by job 9 (priority 5)", boost=5)
        job = s.get(Job, job_id)
        assert (job.state, job.preemptions, job.boost, job.stop_requested, job.devices) == (
            PRE,
            1,
            5,
            None,
            None,
        )
        assert states.claim(s, job_id, ["cpu:0"], WAITING)  # it is in the queue: it starts again
        assert s.get(Job, job_id).reason is None  # "preempted by" is what happened, not why it runs
    with pytest.raises(ValueError, match="not a stop"):
        with session(engine) as s:
            states.request_stop(s, job_id, "nap", "?")


def test_a_claim_after_a_cancel_starts_nothing(engine):
    job_id = _job(engine, Q)
    with session(engine) as loop:
        assert loop.get(Job, job_id).state == Q  # the loop's read of the queue
        with session(engine) as api:
            assert states.cancel(api, job_id, "cancelled by admin")
        assert not states.claim(loop, job_id, ["cpu:0"], WAITING)
        assert loop.get(Job, job_id).devices is None
    job = _read(engine, Job, job_id)
    assert (job.state, job.devices, job.reason) == (CANCELLED, None, "cancelled by admin")


def test_a_cancel_after_a_claim_asks_the_runner_to_stop(engine):
    job_id = _job(engine, Q)
    with session(engine) as api:
        assert api.get(Job, job_id).state == Q  # the API's read: still queued
        with session(engine) as loop:
            assert states.claim(loop, job_id, ["cpu:0"], WAITING)
        assert states.cancel(api, job_id, "cancelled by admin")
        assert api.get(Job, job_id).state == R  # the session sees what the store did
    job = _read(engine, Job, job_id)
    assert (job.state, job.cancel_requested, job.finished_at) == (R, True, None)


def test_a_late_ending_event_never_overwrites_a_cancel(engine):
    job_id = _job(engine, P)
    assert _move(engine, states.cancel, job_id, "cancelled by admin")
    cancelled_at = _read(engine, Job, job_id).finished_at
    for event in ("finished", "failed", "paused"):
        assert not _move(engine, states.end, job_id, event, "late")
    assert not _move(engine, states.requeue, job_id, "late")
    job = _read(engine, Job, job_id)
    assert (job.state, job.reason, job.finished_at) == (CANCELLED, "cancelled by admin", cancelled_at)


def test_a_resume_after_a_cancel_queues_nothing(engine):
    job_id = _job(engine, P)
    with session(engine) as first, session(engine) as second:
        assert first.get(Job, job_id).state == second.get(Job, job_id).state == P  # both read it paused
        assert states.cancel(first, job_id, "cancelled by admin")
        first.commit()
        assert not states.resume(second, job_id, "name: j\n", "resumed by admin")
    assert _read(engine, Job, job_id).state == CANCELLED


def test_an_undeploy_mid_pass_is_never_overwritten_by_the_loop(engine):
    deployment_id = _deployment(engine, READY, "d")
    with session(engine) as loop:
        assert loop.get(Deployment, deployment_id).state == READY  # the pass's read
        with session(engine) as api:
            assert states.undeploy(api, deployment_id)
        assert not states.deployment_failing(loop, deployment_id, "replica 0 ended 6 times")
        assert not states.deployment_starting(loop, deployment_id)
    assert _read(engine, Deployment, deployment_id).state == STOPPING
