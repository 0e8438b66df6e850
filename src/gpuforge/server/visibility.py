"""Who may read and who may change one job, search or deployment, by the rules of server/permissions.py.

Read: its owner, an admin, and the others in its project (a team sees each other's runs, a viewer too).
Change (cancel, resume, undeploy...): its owner, an admin, and a maintainer of its project (the action's
`others` role). The route's permit has checked the key's role for the action already. A row the key may
not read does not exist for it (404, as if there were none); one it reads but may not change is a 403 that
says whose it is and which role would.
"""

from __future__ import annotations

from fastapi import HTTPException, status
from sqlalchemy import ColumnElement, and_, or_, true
from sqlalchemy.orm import Session

from gpuforge.server.permissions import RULES, has
from gpuforge.store.models import ApiKey, Deployment, Job, NotificationTarget, Role, Search

Row = Job | Deployment | Search


def may_read(key: ApiKey, row: Row) -> bool:
    return key.admin or _own(key, row) or _teammate(key, row)


def may_change(key: ApiKey, row: Row, action: str) -> bool:
    """Whether `key` may do `action` to `row` (one it may read): its own, or as its project's `others`."""
    return key.admin or _own(key, row) or (_teammate(key, row) and has(key, RULES[action].others))


def own_ids(key: ApiKey) -> frozenset[int]:
    """The keys whose rows are `key`'s own: a signed-in person's every key (store/users.py), else itself."""
    return key.owned or frozenset({key.id})


def _own(key: ApiKey, row: Row) -> bool:
    return row.owner_id in own_ids(key)


def _teammate(key: ApiKey, row: Row) -> bool:
    return key.project_id is not None and row.project_id == key.project_id


def readable(key: ApiKey, model: type[Job] | type[Deployment] | type[Search]) -> ColumnElement[bool]:
    """may_read as a SQL condition, for list queries: the filter travels with the query, no second read."""
    if key.admin:
        return true()
    own = model.owner_id == key.id if key.owned is None else model.owner_id.in_(sorted(key.owned))
    return own if key.project_id is None else or_(own, model.project_id == key.project_id)


def check_change(key: ApiKey, row: Row, action: str, what: str, owner: str | None) -> None:
    """403 unless `key` may do `action` to `row` (which it may read): `what` names it, `owner` is its key's
    name."""
    if not may_change(key, row, action):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"{what} belongs to key {owner!r}: {action} on a teammate's needs its owner, an admin, or "
            f"a {RULES[action].others} of its project (key {key.name!r} is a {key.role})",
        )


def visible_job(s: Session, key: ApiKey, job_id: int) -> Job:
    """The job, if `key` may read it: 404 otherwise, as if there were none."""
    job = s.get(Job, job_id)
    if job is None or not may_read(key, job):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    return job


def changeable_job(s: Session, key: ApiKey, job_id: int, action: str) -> Job:
    """The job, if `key` may do `action` to it: 404 as visible_job, 403 for a teammate's job it may not."""
    job = visible_job(s, key, job_id)
    check_change(key, job, action, f"job {job_id}", job.owner)
    return job


# --- notification targets (routes/notifications.py): every decision of who may manage one is here ---
def may_manage_target(key: ApiKey, owner_id: int, project_id: int | None) -> bool:
    """Who may make, see, test and remove a notification target (and its deliveries): a person's target
    (no project) its own key; a project's target a maintainer of the project; an admin every target. Its
    URL and secret are shown to no one else."""
    if key.admin:
        return True
    if project_id is None:
        return owner_id in own_ids(key)
    return project_id == key.project_id and has(key, Role.MAINTAINER)


def manageable_targets(key: ApiKey) -> ColumnElement[bool]:
    """may_manage_target as a SQL condition, for the lists."""
    if key.admin:
        return true()
    mine = NotificationTarget.owner_id.in_(sorted(own_ids(key)))
    own = and_(mine, NotificationTarget.project_id.is_(None))
    if key.project_id is None or not has(key, Role.MAINTAINER):
        return own
    return or_(own, NotificationTarget.project_id == key.project_id)
