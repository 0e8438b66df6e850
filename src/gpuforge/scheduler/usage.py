"""Each key's device-time lately, for fair share (queue.py): the device-seconds of its jobs, each job's
weighed down by half every HALF_LIFE_S since it ran, so that what a key used yesterday barely counts
against it today. Read from the jobs' start and end times (a job resumed counts from its first start)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from gpuforge.store.models import Job, JobState, utcnow

HALF_LIFE_S = 3600.0
HORIZON_HALF_LIVES = 6  # older than this weighs under 2 %: not read


def recent_usage(
    s: Session, now: datetime | None = None, half_life_s: float = HALF_LIFE_S
) -> tuple[dict[int | None, float], dict[int | None, float]]:
    """(key -> decayed device-seconds of its jobs that ran within the horizon, project -> the same)."""
    now = now or utcnow()
    since = now - timedelta(seconds=half_life_s * HORIZON_HALF_LIVES)
    rows = s.execute(
        select(Job.owner_id, Job.project_id, Job.devices_wanted, Job.started_at, Job.finished_at).where(
            Job.started_at.is_not(None),
            or_(Job.state == JobState.RUNNING, Job.finished_at > since),
        )
    )
    usage: dict[int | None, float] = {}
    by_project: dict[int | None, float] = {}
    for owner, project, devices, started, finished in rows:
        end = finished or now
        seconds = max(0.0, (end - max(started, since)).total_seconds())
        weight = 0.5 ** (max(0.0, (now - end).total_seconds()) / half_life_s)
        usage[owner] = usage.get(owner, 0.0) + devices * seconds * weight
        if project is not None:
            by_project[project] = by_project.get(project, 0.0) + devices * seconds * weight
    return usage, by_project
