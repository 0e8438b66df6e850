"""Every move of a job or a deployment from one state to another, one named function each.

Jobs (the API submits them `queued`):

    queued | preempted --claim-->  running   (the loop picked it: devices given, no process yet)
    running  --start-->            running   (its process exists: its pid)
    running  --end-->              paused | finished | failed | cancelled   (its runner's last event;
                                              paused: its cost budget spent)
    running  --requeue-->          queued    (its process died without a word: resumed from a checkpoint)
    running  --fail-->             failed    (it refused its input, or died once too often)
    queued | preempted --reject--> failed    (it can never start: more devices than exist)
    queued | preempted --hold-->   the same  (its reason says why it waits: a quota, devices, a budget)
    queued | preempted | paused --cancel-->  cancelled (no process: it ends at once)
    running  --cancel-->           running   (cancel_requested: the loop stops its runner, whose
                                              `cancelled` event ends it)
    running  --request_stop-->     running   (stop_requested: preempt | pause | timeout | prune; the loop
                                              stops its runner, which checkpoints)
    running  --preempt-->          preempted (stopped for a job of higher priority: back in the queue,
                                              resumed from its checkpoint at its turn)
    running  --pause-->            paused    (its project's budget spent, or its max_time run)
    running  --prune-->            pruned    (a search's trial its pruner stopped: ended for good)
    paused | cancelled --resume--> queued    (from its last checkpoint: a cancelled one must have one)

Searches (the API makes them `running`; their trials are jobs):

    running --stop_search-->       running   (stop_requested: the loop stops its trials, then ends it)
    running --hold_search-->       running   (its reason says why it queues no trial now: its key's quotas)
    running --end_search-->        finished | budget_spent | stopped | failed

The queue is queued and preempted jobs (QUEUE_JOB_STATES): a preempted job waits like a queued one and
only says what happened to it.

Deployments (the API makes them `starting`):

    starting --deployment_ready-->     ready      (every replica answers)
    ready    --deployment_starting-->  starting   (a replica is being started again)
    starting | ready --deployment_failing-->  failing  (a replica cannot serve: its replicas are stopped)
    live     --undeploy-->             stopping
    stopping --deployment_stopped-->   stopped    (no replica left)
    failing  --deployment_failed-->    failed     (no replica left)

The API and the scheduling loop write the same rows from different transactions, so each move is one
UPDATE that holds only while the row is still in a state it may leave from: a cancel is never overwritten
by a runner's late `finished`, a claim that lands after a cancel starts nothing. Each function says
whether the move happened; the rows loaded in the session see its new values. Nothing is committed here.

A move that someone may want to hear of (a job finished, failed, preempted or paused, a deployment failed)
adds its event to the notifications' outbox (store/outbox.py) in the same transaction, only when it
happened: the change and its event are committed together or not at all.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any

from sqlalchemy import case, func, or_, select, update
from sqlalchemy.orm import Session

from gpuforge.store import outbox
from gpuforge.store.models import (
    LIVE_DEPLOYMENT_STATES,
    QUEUE_JOB_STATES,
    Deployment,
    DeploymentState,
    Job,
    JobState,
    Search,
    SearchState,
    utcnow,
)

# the runner's events (runs.py) that end its process, and the state each leaves its job in
RUNNER_ENDINGS = {
    "paused": JobState.PAUSED,
    "finished": JobState.FINISHED,
    "failed": JobState.FAILED,
    "cancelled": JobState.CANCELLED,
}
# the outbox's event for each ending (a cancel was asked for by someone who knows of it: none)
ENDING_EVENTS = {
    JobState.PAUSED: outbox.JOB_PAUSED_BUDGET,  # the runner's own cost budget spent
    JobState.FINISHED: outbox.JOB_FINISHED,
    JobState.FAILED: outbox.JOB_FAILED,
}


def _move(
    s: Session, row: type[Job | Deployment], row_id: int, sources: Collection, values: dict, *also: Any
) -> bool:
    """Set `values` on the row if its state is one of `sources` at this moment (and `also` holds); whether
    it was."""
    moved = s.execute(
        update(row)
        .where(row.id == row_id, row.state.in_(sources), *also)
        .values(**values)
        .execution_options(synchronize_session="fetch")  # what the store did, not what the session guessed
    )
    return moved.rowcount == 1


def _move_job(s: Session, job_id: int, sources: Collection[JobState], *also: Any, **values: Any) -> bool:
    return _move(s, Job, job_id, sources, values, *also)


NOT_CANCELLED = Job.cancel_requested.is_(False)  # a cancel asked for meanwhile wins over the server's stop


def _move_deployment(
    s: Session, deployment_id: int, sources: Collection[DeploymentState], **values: Any
) -> bool:
    return _move(s, Deployment, deployment_id, sources, values)


# --- jobs ---
_QUEUED, _RUNNING, _PAUSED = QUEUE_JOB_STATES, (JobState.RUNNING,), (JobState.PAUSED,)  # to leave from
STOPS = ("preempt", "pause", "timeout", "prune")  # what the server stops a running job for (stop_requested)


def claim(
    s: Session, job_id: int, device_ids: list[str], waiting_reason: str, isolation: str | None = None
) -> bool:
    """queued or preempted → running on `device_ids`, before its process exists (no pid yet); a reason
    that says why it waited (it starts with `waiting_reason`) is cleared, any other kept. `isolation`:
    what its fraction of a device got, in words (scheduler/sharing.py)."""
    waited = or_(Job.reason.startswith(waiting_reason), Job.reason.startswith("preempted"))
    kept_reason = case((waited, None), else_=Job.reason)
    devices = ",".join(device_ids)
    return _move_job(
        s,
        job_id,
        _QUEUED,
        state=JobState.RUNNING,
        pid=None,
        devices=devices,
        isolation=isolation,
        reason=kept_reason,
        accrued_at=None,  # the ledger charges it from its first tick running, not from its last run
    )


def start(s: Session, job_id: int, pid: int) -> bool:
    """A claimed job's process exists: its pid, and when it first started (a restart keeps that)."""
    now = utcnow()
    return _move_job(
        s, job_id, _RUNNING, pid=pid, started_at=func.coalesce(Job.started_at, now), run_started_at=now
    )


def end(s: Session, job_id: int, event: str, reason: str | None, at: datetime | None = None) -> bool:
    """running → the state its runner's last event names (RUNNER_ENDINGS), for `reason`: paused gives its
    devices back and stays resumable; finished, failed and cancelled take `reason` only where the job has
    none yet (a cancel's "cancelled by ..." stays). `at`: when it was seen ended (the tick's time, to which
    the ledger charged it), else now."""
    ending = RUNNER_ENDINGS.get(event)
    if ending is None:
        raise ValueError(f"a runner's `{event}` event ends nothing (endings: {', '.join(RUNNER_ENDINGS)})")
    if ending is JobState.PAUSED:
        moved = _move_job(
            s, job_id, _RUNNING, state=ending, pid=None, devices=None, stop_requested=None, reason=reason
        )
    else:
        first_reason = func.coalesce(Job.reason, reason)
        moved = _move_job(
            s,
            job_id,
            _RUNNING,
            state=ending,
            pid=None,
            finished_at=at or utcnow(),
            stop_requested=None,
            reason=first_reason,
        )
    return _told(s, job_id, moved, ENDING_EVENTS.get(ending))


def _told(s: Session, job_id: int, moved: bool, kind: str | None) -> bool:
    """Add the job's event of `kind` to the outbox when it moved (None: nobody is told of this move)."""
    if moved and kind is not None:
        outbox.job_event(s, job_id, kind)
    return moved


def requeue(s: Session, job_id: int, reason: str) -> bool:
    """running → queued, one restart more: its process died without a word; the next one resumes from
    its last checkpoint."""
    return _move_job(
        s,
        job_id,
        _RUNNING,
        state=JobState.QUEUED,
        pid=None,
        devices=None,
        restarts=Job.restarts + 1,
        stop_requested=None,
        reason=reason,
    )


def request_stop(s: Session, job_id: int, why: str, reason: str) -> bool:
    """A running job is to stop at its next step for the server's reason `why` (STOPS): the loop sends
    its runner SIGTERM; a cancel asked for already wins. False when it is no longer running."""
    if why not in STOPS:
        raise ValueError(f"{why!r}: not a stop the server asks for ({', '.join(STOPS)})")
    return _move_job(s, job_id, _RUNNING, stop_requested=why, reason=reason)


def preempt(s: Session, job_id: int, reason: str, boost: int | None = None) -> bool:
    """running → preempted (in the queue again), one preemption more in a row; `boost`, when given, is
    its new lift in the queue (it was preempted too often). False when a cancel was asked for meanwhile."""
    lift = {} if boost is None else {"boost": boost}
    moved = _move_job(
        s,
        job_id,
        _RUNNING,
        NOT_CANCELLED,
        state=JobState.PREEMPTED,
        pid=None,
        devices=None,
        stop_requested=None,
        preemptions=Job.preemptions + 1,
        reason=reason,
        **lift,
    )
    return _told(s, job_id, moved, outbox.JOB_PREEMPTED)


def pause(s: Session, job_id: int, reason: str) -> bool:
    """running → paused for the server's `reason` (its project's budget, its max_time): resumable. False
    when a cancel was asked for meanwhile."""
    why = s.scalar(
        select(Job.stop_requested).where(Job.id == job_id)
    )  # which pause: the outbox tells them apart
    kind = outbox.JOB_PAUSED_MAX_TIME if why == "timeout" else outbox.JOB_PAUSED_BUDGET
    moved = _move_job(
        s,
        job_id,
        _RUNNING,
        NOT_CANCELLED,
        state=JobState.PAUSED,
        pid=None,
        devices=None,
        stop_requested=None,
        reason=reason,
    )
    return _told(s, job_id, moved, kind)


def prune(s: Session, job_id: int, reason: str) -> bool:
    """running → pruned, for `reason` (the figures that condemned it): a search's trial its pruner
    stopped, ended for good. False when a cancel was asked for meanwhile."""
    return _move_job(
        s, job_id, _RUNNING, NOT_CANCELLED, state=JobState.PRUNED, pid=None, devices=None,
        stop_requested=None, finished_at=utcnow(), reason=reason,
    )  # fmt: skip


def fail(s: Session, job_id: int, reason: str, at: datetime | None = None) -> bool:
    """running → failed, for `reason`: its runner refused its input, or died once too often; `at` as
    for end()."""
    moved = _move_job(
        s, job_id, _RUNNING, state=JobState.FAILED, pid=None, finished_at=at or utcnow(), reason=reason
    )
    return _told(s, job_id, moved, outbox.JOB_FAILED)


def reject(s: Session, job_id: int, reason: str) -> bool:
    """queued → failed, for `reason`: it can never start here."""
    moved = _move_job(s, job_id, _QUEUED, state=JobState.FAILED, finished_at=utcnow(), reason=reason)
    return _told(s, job_id, moved, outbox.JOB_FAILED)


def hold(s: Session, job_id: int, reason: str | None) -> bool:
    """A queued job stays queued, saying why (None: nothing but its place in the queue)."""
    return _move_job(s, job_id, _QUEUED, reason=reason)


def cancel(s: Session, job_id: int, reason: str) -> bool:
    """queued or paused → cancelled at once (no process to stop); running: cancel_requested, and the
    loop stops its runner, whose `cancelled` event ends it. False when it has ended already."""
    waiting = _QUEUED + _PAUSED
    if _move_job(s, job_id, waiting, state=JobState.CANCELLED, finished_at=utcnow(), reason=reason):
        return True
    return _move_job(s, job_id, _RUNNING, cancel_requested=True, reason=reason)  # claimed since it was read


def resume(s: Session, job_id: int, spec_yaml: str, reason: str, seen: JobState = JobState.PAUSED) -> bool:
    """paused or cancelled (`seen`: the state the one who resumes it read) → queued with `spec_yaml` (its
    new budget) and all its restarts again; it goes on from its last checkpoint. A job cancelled since it
    was read paused stays cancelled: a resume never undoes a cancel it did not see."""
    if seen not in (JobState.PAUSED, JobState.CANCELLED):
        raise ValueError(f"{seen}: only a paused or cancelled job resumes")
    return _move_job(
        s, job_id, (seen,), state=JobState.QUEUED, spec_yaml=spec_yaml, restarts=0, reason=reason,
        finished_at=None, cancel_requested=False,
    )  # fmt: skip


# --- searches ---
def stop_search(s: Session, search_id: int) -> bool:
    """A running search is to stop: the loop stops its trials at a checkpoint, then ends it `stopped`."""
    return _move(s, Search, search_id, (SearchState.RUNNING,), {"stop_requested": True})


def hold_search(s: Session, search_id: int, reason: str | None) -> bool:
    """A running search says why it queues no trial now (its key's quotas), or nothing (None)."""
    return _move(
        s,
        Search,
        search_id,
        (SearchState.RUNNING,),
        {"reason": reason},
        Search.reason.is_distinct_from(reason),
    )


def end_search(s: Session, search_id: int, state: SearchState, reason: str | None) -> bool:
    """running → `state` (finished, budget_spent, stopped, failed), for `reason`."""
    if state is SearchState.RUNNING:
        raise ValueError("a search ends in another state than running")
    values = {"state": state, "reason": reason, "finished_at": utcnow()}
    return _move(s, Search, search_id, (SearchState.RUNNING,), values)


# --- deployments ---
def deployment_ready(s: Session, deployment_id: int) -> bool:
    """starting → ready: every replica answers /readyz."""
    return _move_deployment(s, deployment_id, [DeploymentState.STARTING], state=DeploymentState.READY)


def deployment_starting(s: Session, deployment_id: int) -> bool:
    """ready → starting: a replica is being started again."""
    return _move_deployment(s, deployment_id, [DeploymentState.READY], state=DeploymentState.STARTING)


def deployment_failing(s: Session, deployment_id: int, reason: str) -> bool:
    """starting or ready → failing, for `reason`: a replica cannot serve; the loop stops the others."""
    serving = [DeploymentState.STARTING, DeploymentState.READY]
    return _move_deployment(s, deployment_id, serving, state=DeploymentState.FAILING, reason=reason)


def undeploy(s: Session, deployment_id: int) -> bool:
    """Any live state → stopping: its replicas finish what they hold, then stop. False once it has ended."""
    return _move_deployment(s, deployment_id, LIVE_DEPLOYMENT_STATES, state=DeploymentState.STOPPING)


def deployment_stopped(s: Session, deployment_id: int) -> bool:
    """stopping → stopped: no replica is left."""
    stopping = [DeploymentState.STOPPING]
    return _move_deployment(s, deployment_id, stopping, state=DeploymentState.STOPPED, stopped_at=utcnow())


def deployment_failed(s: Session, deployment_id: int) -> bool:
    """failing → failed: no replica is left."""
    failing = [DeploymentState.FAILING]
    moved = _move_deployment(s, deployment_id, failing, state=DeploymentState.FAILED, stopped_at=utcnow())
    if moved:
        outbox.deployment_event(s, deployment_id, outbox.DEPLOYMENT_FAILED, None)  # why: what `failing` said
    return moved
