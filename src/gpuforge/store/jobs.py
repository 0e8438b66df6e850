"""Reads of jobs for the API: a page of the list, a job's events, the job an Idempotency-Key queued, jobs
by id, the job holding each device, counts by state and devices' busy time (/metrics). A job's changes of
state are store/states.py's."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session, undefer

from gpuforge.store.models import ApiKey, Device, Event, Job, JobState


def page(
    s: Session,
    readable: ColumnElement[bool],
    state: str | None,
    owner: str | None,
    limit: int,
    offset: int,
    search: int | None = None,
) -> tuple[int, list[Job]]:
    """(how many jobs match, the page of them asked for, newest first): those `readable` lets the caller
    see, in `state`, of the key named `owner`, trials of `search`, where given."""
    which = select(Job.id).where(readable)
    if search is not None:
        which = which.where(Job.search_id == search)
    if state:
        which = which.where(Job.state == state)
    if owner:
        which = which.where(Job.owner_id == select(ApiKey.id).where(ApiKey.name == owner).scalar_subquery())
    total = s.scalar(select(func.count()).select_from(which.subquery())) or 0
    ids = which.order_by(Job.id.desc()).limit(limit).offset(offset)
    return total, list(s.scalars(select(Job).where(Job.id.in_(ids)).order_by(Job.id.desc())))


def events(s: Session, job_id: int, after: int, limit: int) -> list[Event]:
    """The job's events after seq `after`, in order, `limit` at most."""
    query = select(Event).where(Event.job_id == job_id, Event.seq > after)
    return list(s.scalars(query.order_by(Event.seq).limit(limit)))


def submitted_with(s: Session, owner_id: int, idempotency_key: str) -> Job | None:
    """The job the key `owner_id` queued with this Idempotency-Key, if one (with its spec loaded)."""
    query = (
        select(Job)
        .where(Job.owner_id == owner_id, Job.idempotency_key == idempotency_key)
        .options(undefer(Job.spec_yaml))
    )
    return s.scalar(query)


def by_ids(s: Session, ids: Iterable[int]) -> dict[int, Job]:
    """id -> job, for those of `ids` that exist."""
    return {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(list(ids))))}


def device_holders(s: Session) -> dict[str, Job]:
    """device id -> the job holding it now (claimed or running)."""
    holding = dict(s.execute(select(Device.id, Device.job_id).where(Device.job_id.is_not(None))).all())
    holders = by_ids(s, set(holding.values()))
    return {device: holders[job_id] for device, job_id in holding.items() if job_id in holders}


def count_by_state(s: Session) -> dict[JobState, int]:
    """How many jobs each state holds (a state no job is in is absent)."""
    return dict(s.execute(select(Job.state, func.count()).group_by(Job.state)).all())


def device_busy_seconds(s: Session) -> list[tuple[str, float]]:
    """Each device the scheduler has seen, with the seconds jobs and replicas held it."""
    return [
        (device_id, seconds or 0.0)
        for device_id, seconds in s.execute(select(Device.id, Device.busy_seconds))
    ]
