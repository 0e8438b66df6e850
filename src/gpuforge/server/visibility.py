"""Who may read and who may change a job or a deployment, in one place for every route; what is the
admin's alone (keys, projects).

Read: its owner, an admin, and the other members of its project (a team sees each other's runs).
Change (cancel, resume, undeploy): its owner or an admin alone. A row the key may not read does not exist
for it (404, as if there were none); one it reads but may not change is a 403 that says whose it is.
"""

from __future__ import annotations

from fastapi import HTTPException, status
from sqlalchemy import ColumnElement, and_, or_, true
from sqlalchemy.orm import Session

from gpuforge.store.models import ApiKey, Deployment, Job, NotificationTarget


def may_read(key: ApiKey, row: Job | Deployment) -> bool:
    return may_change(key, row) or (key.project_id is not None and row.project_id == key.project_id)


def may_change(key: ApiKey, row: Job | Deployment) -> bool:
    return key.admin or row.owner_id == key.id


def readable(key: ApiKey, model: type[Job] | type[Deployment]) -> ColumnElement[bool]:
    """may_read as a SQL condition, for list queries: the filter travels with the query, no second read."""
    if key.admin:
        return true()
    own = model.owner_id == key.id
    return own if key.project_id is None else or_(own, model.project_id == key.project_id)


def admin_only(key: ApiKey) -> None:
    """403 unless an admin key: making and changing keys and projects is the admin's alone."""
    if not key.admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"key {key.name!r} is not an admin key")


def check_change(key: ApiKey, row: Job | Deployment, what: str, owner: str | None) -> None:
    """403 unless `key` may change `row` (which it may read): `what` names it, `owner` is its key's name."""
    if not may_change(key, row):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"{what} belongs to key {owner!r}: a member of its project may read it; only its owner or an "
            "admin may change it",
        )


def visible_job(s: Session, key: ApiKey, job_id: int) -> Job:
    """The job, if `key` may read it: 404 otherwise, as if there were none."""
    job = s.get(Job, job_id)
    if job is None or not may_read(key, job):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    return job


def changeable_job(s: Session, key: ApiKey, job_id: int) -> Job:
    """The job, if `key` may change it: 404 as visible_job, 403 for a teammate's job."""
    job = visible_job(s, key, job_id)
    check_change(key, job, f"job {job_id}", job.owner)
    return job


# --- notification targets (routes/notifications.py): every decision of who may manage one is here ---
def may_manage_target(key: ApiKey, owner_id: int, project_id: int | None) -> bool:
    """Who may make, see, test and remove a notification target (and its deliveries): a person's target
    (no project) its own key; a project's target an admin, for now (a project role would be checked here).
    An admin may manage every target. Its URL and secret are shown to no one else."""
    return key.admin or (project_id is None and owner_id == key.id)


def manageable_targets(key: ApiKey) -> ColumnElement[bool]:
    """may_manage_target as a SQL condition, for the lists."""
    if key.admin:
        return true()
    return and_(NotificationTarget.owner_id == key.id, NotificationTarget.project_id.is_(None))
