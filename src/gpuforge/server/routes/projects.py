"""Projects (store/projects.py): an admin key makes and changes them; a key sees its own project, an admin
key every one, each with its month's spend, budget, devices held, jobs waiting and running, and members. A
maintainer of the project (or an admin) sets who is in it and their roles:

    PUT    /api/v1/projects/{name}/members/{key}  {"role"}   put a key in the project (from none), or change
                                                             its role there
    DELETE /api/v1/projects/{name}/members/{key}             take it out (to no project)
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Request, status
from fastapi import Path as PathParam

from gpuforge.errors import GpuforgeError
from gpuforge.server.auth import Key, forget_key, forget_person
from gpuforge.server.permissions import audited, has, permit
from gpuforge.server.routes.jobs import wake_scheduler
from gpuforge.server.schemas import MemberSet, ProjectCreate, ProjectPublic, ProjectUpdate
from gpuforge.server.services import services
from gpuforge.store.db import session
from gpuforge.store.keys import key_named
from gpuforge.store.models import ApiKey, Role
from gpuforge.store.projects import (
    ProjectFigures,
    create_project,
    figures,
    project_named,
    project_names,
    set_project,
)
from gpuforge.store.users import roles_of, set_table_role, user_of

router = APIRouter(prefix="/api/v1/projects", tags=["projects"])
Name = Annotated[str, PathParam(max_length=100, description="the project's name")]
KeyName = Annotated[str, PathParam(max_length=100, description="the key's name")]


def _public(row: ProjectFigures) -> ProjectPublic:
    p = row.project
    return ProjectPublic(
        id=p.id, name=p.name, budget_usd_month=p.budget_usd_month, max_devices=p.max_devices, share=p.share,
        created_at=p.created_at, spend_usd_month=row.spend_usd_month, devices_held=row.devices_held,
        jobs_queued=row.jobs_queued, jobs_running=row.jobs_running, keys=row.keys, roles=row.roles,
    )  # fmt: skip


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=ProjectPublic,
    dependencies=[permit("projects.create")],
)
def make_project(body: ProjectCreate, request: Request, key: Key) -> ProjectPublic:
    """A new project (admin key): keys join it with `keys create|set NAME --project P`, or by its
    maintainers (`projects member P KEY --role R`)."""
    with session(services(request).engine) as s:
        try:
            made = create_project(s, **body.model_dump())
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from err
        except GpuforgeError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from err
        s.flush()
        audited(s, request, key, f"project {made.name}", made.id, after=body.model_dump(mode="json"))
        return _public(figures(s, only=made.id)[0])


@router.get("", response_model=list[ProjectPublic], dependencies=[permit("projects.read")])
def list_projects(request: Request, key: Key) -> list[ProjectPublic]:
    """Projects by name, with where each stands: every one with an admin key, else the key's own (if any)."""
    if not key.admin and key.project_id is None:
        return []
    with session(services(request).engine) as s:
        return [_public(row) for row in figures(s, only=None if key.admin else key.project_id)]


@router.get("/{name}", response_model=ProjectPublic, dependencies=[permit("projects.read")])
def get_project(name: Name, request: Request, key: Key) -> ProjectPublic:
    """One project: its members and an admin key see it; others, no such project."""
    with session(services(request).engine) as s:
        found = _seen(s, key, name)
        return _public(figures(s, only=found)[0])


@router.patch("/{name}", response_model=ProjectPublic, dependencies=[permit("projects.change")])
def change_project(name: Name, body: ProjectUpdate, request: Request, key: Key) -> ProjectPublic:
    """Change a project's budget, device cap or share (admin key): those sent; null: no budget, no cap.
    They hold from the scheduler's next look (a few seconds)."""
    asked = body.model_dump(exclude_unset=True)
    with session(services(request).engine) as s:
        try:
            found = project_named(s, name)
            before = {k: getattr(found, k) for k in asked}
            changed = set_project(s, name, asked)
        except LookupError as err:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from err
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from err
        public = _public(figures(s, only=changed.id)[0])
        after = {k: getattr(public, k) for k in asked}
        audited(s, request, key, f"project {name}", changed.id, before, after)
    wake_scheduler(request)  # the queue holds or starts jobs by the projects' settings
    return public


@router.put(
    "/{name}/members/{member}", response_model=ProjectPublic, dependencies=[permit("projects.members")]
)
def set_member(name: Name, member: KeyName, body: MemberSet, request: Request, key: Key) -> ProjectPublic:
    """Put the key `member` in the project with `role`, or change its role there (a maintainer of the
    project, or an admin). A maintainer takes in only keys that are in no project: moving a key out of
    another project is its admin's."""
    with session(services(request).engine) as s:
        project_id = _maintained(s, key, name)
        person = _person(s, member)
        if person is not None:  # a signed-in person: the server's table of them
            public = _set_person(s, request, key, person, project_id, body.role)
        else:
            target = _member_key(s, member)
            if target.project_id not in (None, project_id) and not key.admin:
                raise HTTPException(
                    status.HTTP_403_FORBIDDEN,
                    f"key {member!r} is in another project: only an admin moves it (`gpuforge keys set`)",
                )
            public = _set_key(s, request, key, target, project_id, project_id, body.role)
    _forget(request, person, None if person is not None else target)  # after the commit
    return public


@router.delete(
    "/{name}/members/{member}", response_model=ProjectPublic, dependencies=[permit("projects.members")]
)
def remove_member(name: Name, member: KeyName, request: Request, key: Key) -> ProjectPublic:
    """Take the key `member` out of the project (to none; its jobs made so far stay in the project)."""
    with session(services(request).engine) as s:
        project_id = _maintained(s, key, name)
        person = _person(s, member)
        if person is not None:
            public = _set_person(s, request, key, person, project_id, None)
        else:
            target = _member_key(s, member)
            if target.project_id != project_id:
                raise HTTPException(status.HTTP_404_NOT_FOUND, f"key {member!r} is not in project {name!r}")
            public = _set_key(s, request, key, target, project_id, None, Role.MEMBER)
    _forget(request, person, None if person is not None else target)
    return public


def _set_key(s, request, key: ApiKey, target: ApiKey, project_id: int, to: int | None, role: Role):
    """Key `target` into project `to` (None: out of `project_id`) with `role`, audited in `s`."""
    before = _membership(s, target)
    target.project_id, target.role = to, role
    s.flush()
    audited(s, request, key, f"key {target.name}", project_id, before, _membership(s, target))
    return _public(figures(s, only=project_id)[0])


def _forget(request, person, target: ApiKey | None) -> None:
    """After the commit (a lookup meanwhile would cache the old rights again): the changed key's or
    person's keys read afresh."""
    if person is not None:
        forget_person(request, person.id)
    else:
        forget_key(request, target.digest)


def _set_person(s, request, key: ApiKey, person, project_id: int, role: Role | None) -> ProjectPublic:
    """A signed-in person's role in the project, as the server's table holds it (their groups may give
    more: the higher holds), audited."""
    project = project_names(s, {project_id})[project_id]
    before = {"project": project, "role": _str(roles_of(s, person.id).get(project_id))}
    set_table_role(s, person.id, project_id, role)
    after = {"project": project, "role": _str(roles_of(s, person.id).get(project_id))}
    audited(s, request, key, f"user {person.email or person.subject}", project_id, before, after)
    return _public(figures(s, only=project_id)[0])


def _person(s, member: str):
    try:
        return user_of(s, member)
    except LookupError as err:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from None


def _str(role: Role | None) -> str | None:
    return None if role is None else str(role)


def _maintained(s, key: ApiKey, name: str) -> int:
    """Project `name`'s id if `key` sets its members: 404 if it may not see it, 403 if it only reads it."""
    project_id = _seen(s, key, name)
    if not (key.admin or has(key, Role.MAINTAINER)):  # the route's permit checked the role already
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"project {name!r}: its maintainers set its members")
    return project_id


def _member_key(s, name: str) -> ApiKey:
    found = key_named(s, name)
    if found is None or found.revoked_at is not None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no API key named {name!r}")
    if found.admin:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"{name!r} is an admin key: it belongs to no project"
        )
    if found.user_id is not None:  # a session's or a personal key: its person's rights hold, not its own
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"{name!r} is a signed-in person's {found.kind} key: name the person (their email or own key)",
        )
    return found


def _membership(s, key: ApiKey) -> dict:
    names = project_names(s, {key.project_id})
    return {"project": names.get(key.project_id), "role": str(key.role)}


def _seen(s, key: ApiKey, name: str) -> int:
    """The id of project `name` if `key` may see it; 404 otherwise (another team's does not exist for it)."""
    try:
        project = project_named(s, name)
    except LookupError as err:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no project {name!r}") from err
    if not (key.admin or key.project_id == project.id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no project {name!r}")
    return project.id
