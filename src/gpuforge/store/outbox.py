"""The notifications' outbox: an event, and one pending delivery to each target that wants it, added in the
transaction of the change that caused it (a move of store/states.py, a rollout ended, a budget passed), so
a server killed at any moment has committed both the change and its event, or neither. The sender
(notify/worker.py) reads the deliveries from here; it never decides what happened.

Who hears of what:
    a job's or a deployment's event   the person targets of its owner key, the targets of its project
    a project's budget (80 %, 100 %)  the project's targets, the person targets of its members' keys
    a test                            the one target it tests, whatever that target subscribes to
A person target of a revoked key hears nothing more; a target hears only the kinds it subscribes to (None:
all of EVENT_KINDS).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import and_, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from gpuforge.store.models import (
    ApiKey,
    Deployment,
    Job,
    NotificationDelivery,
    NotificationEvent,
    NotificationTarget,
    Project,
    utcnow,
)

JOB_FINISHED = "job.finished"
JOB_FAILED = "job.failed"  # its runner failed, it died too often, or it can never start here
JOB_PREEMPTED = "job.preempted"  # stopped at a checkpoint for a job of higher priority: it queues again
JOB_PAUSED_BUDGET = "job.paused_budget"  # its cost budget, its project's month or its search's budget spent
JOB_PAUSED_MAX_TIME = "job.paused_max_time"  # it ran past resources.max_time
DEPLOYMENT_REFUSED = "deployment.refused"  # a new version refused (its metric fell) or would not serve
DEPLOYMENT_FAILED = "deployment.failed"  # no replica of it serves any more
BUDGET_80 = "budget.80"  # a project's month's spend reached 80 % of its budget (once a month)
BUDGET_100 = "budget.100"  # ... all of it: its jobs pause (once a month)
EVENT_KINDS = (
    JOB_FINISHED, JOB_FAILED, JOB_PREEMPTED, JOB_PAUSED_BUDGET, JOB_PAUSED_MAX_TIME,
    DEPLOYMENT_REFUSED, DEPLOYMENT_FAILED, BUDGET_80, BUDGET_100,
)  # fmt: skip
TEST = "test"  # `gpuforge notifications test ID`: no target subscribes to it
BUDGET_LEVELS = {BUDGET_80: 0.8, BUDGET_100: 1.0}  # the share of its budget each is recorded at


def record(
    s: Session,
    kind: str,
    subject: str,
    data: dict[str, Any],
    owner_id: int | None = None,
    project_id: int | None = None,
    once: str | None = None,
    only: NotificationTarget | None = None,
) -> NotificationEvent | None:
    """Add an event and a pending delivery to each target that wants it (`only`: to that one target), in
    the caller's transaction; None, and nothing added, when no target wants it. `once`: the event's name
    among those that happen once; None, and nothing added, when one of that name exists (recorded by an
    earlier tick, or by another server meanwhile)."""
    if once is not None and s.scalar(select(NotificationEvent.id).where(NotificationEvent.once == once)):
        return None  # told already (each tick past a budget's level asks again: one indexed read)
    targets = [only] if only is not None else _listening(s, kind, owner_id, project_id)
    if not targets and once is None:
        return None  # nobody hears of it: no row (a once-event is kept all the same, to be told once)
    values = {"kind": kind, "subject": subject, "data": data, "owner_id": owner_id, "project_id": project_id,
              "once": once, "created_at": utcnow()}  # fmt: skip
    if once is None:
        event = NotificationEvent(**values)
        s.add(event)
        s.flush()  # its id, for the deliveries
    else:
        event = _insert_once(s, values)
        if event is None:
            return None
    for target in targets:
        s.add(NotificationDelivery(event_id=event.id, target_id=target.id, next_attempt_at=event.created_at))
    return event


def _insert_once(s: Session, values: dict[str, Any]) -> NotificationEvent | None:
    """Insert the event unless one of its `once` name exists (two servers may see the same budget passed at
    once: one row wins, and the other's transaction goes on). ON CONFLICT rather than a savepoint: SQLite's
    driver would commit the whole transaction at a savepoint's release when it had not begun one yet."""
    insert = postgresql.insert if s.get_bind().dialect.name == "postgresql" else sqlite.insert
    added = s.scalar(
        insert(NotificationEvent)
        .values(**values)
        .on_conflict_do_nothing(index_elements=["once"])
        .returning(NotificationEvent.id)
    )
    return None if added is None else s.get(NotificationEvent, added)


def _listening(
    s: Session, kind: str, owner_id: int | None, project_id: int | None
) -> list[NotificationTarget]:
    """The targets that hear of an event of `kind` about something of `owner_id`'s in `project_id`."""
    person = and_(NotificationTarget.project_id.is_(None), ApiKey.revoked_at.is_(None))
    who = []
    if project_id is not None:
        who.append(NotificationTarget.project_id == project_id)
    if kind in BUDGET_LEVELS and project_id is not None:
        who.append(and_(person, ApiKey.project_id == project_id))  # the project's members
    elif owner_id is not None:
        who.append(and_(person, NotificationTarget.owner_id == owner_id))
    if not who:
        return []
    rows = s.scalars(
        select(NotificationTarget)
        .join(ApiKey, ApiKey.id == NotificationTarget.owner_id)
        .where(or_(*who))
        .order_by(NotificationTarget.id)
    )
    return [t for t in rows if t.events is None or kind in t.events]


# --- what each kind says ---
def job_event(s: Session, job_id: int, kind: str) -> NotificationEvent | None:
    """The event of a job that just moved (its row as the move left it)."""
    job = s.get(Job, job_id, populate_existing=True)  # as the move left it in the store
    if job is None:
        return None
    state = str(job.state)
    reason = (job.reason or "").removeprefix(f"{state}: ")  # the loop's reasons say "paused: ..." already
    said = f": {reason}" if reason else ""
    data = {
        "text": f"job {job.id} ({job.name}) {state}{said}",
        "job": {
            "id": job.id, "name": job.name, "state": state, "reason": job.reason,
            "owner": job.owner, "project": job.project, "step": job.step, "total_steps": job.total_steps,
            "cost_usd": job.cost_usd,
        },
    }  # fmt: skip
    return record(s, kind, f"job:{job.id}", data, job.owner_id, job.project_id)


def deployment_event(s: Session, deployment_id: int, kind: str, why: str | None) -> NotificationEvent | None:
    """The event of a deployment that failed, or whose new version was refused, for `why` (None: the
    deployment's reason)."""
    d = s.get(Deployment, deployment_id, populate_existing=True)
    if d is None:
        return None
    why = why or d.reason
    said = f": {why}" if why else ""
    what = "failed" if kind == DEPLOYMENT_FAILED else "refused a new version"
    data = {
        "text": f"deployment {d.name} {what}{said}",
        "deployment": {
            "id": d.id,
            "name": d.name,
            "state": str(d.state),
            "version": d.version,
            "reason": why,
        },
    }
    return record(s, kind, f"deployment:{d.id}", data, d.owner_id, d.project_id)


def budget_event(
    s: Session, project: Project, kind: str, spend_usd: float, now: datetime
) -> NotificationEvent | None:
    """A project's month's spend passed a level of its budget: once in the month (UTC), whichever server
    or tick sees it first."""
    month = f"{now:%Y-%m}"
    percent = round(BUDGET_LEVELS[kind] * 100)
    budget = project.budget_usd_month or 0.0
    then = "; its jobs pause until the budget is raised or the month turns" if kind == BUDGET_100 else ""
    data = {
        "text": f"project {project.name} has spent ${spend_usd:.2f} of its ${budget:g} budget for {month} "
        f"({percent} %){then}",
        "project": {"id": project.id, "name": project.name, "budget_usd_month": budget, "month": month,
                    "spend_usd": spend_usd, "percent": percent},
    }  # fmt: skip
    once = f"{kind}:project:{project.id}:{month}"
    return record(s, kind, f"project:{project.id}", data, project_id=project.id, once=once)


def ping(s: Session, target: NotificationTarget, by: str) -> NotificationDelivery:
    """A test of `target` asked for by key `by`, to it alone: its delivery."""
    data = {"text": f"a test of notification target {target.id}, sent for key {by}"}
    event = record(s, TEST, f"target:{target.id}", data, target.owner_id, target.project_id, only=target)
    s.flush()
    return s.scalar(select(NotificationDelivery).where(NotificationDelivery.event_id == event.id))
