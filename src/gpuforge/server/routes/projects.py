"""Projects (store/projects.py): an admin key makes and changes them; a member key sees its own project,
an admin key every one, each with its month's spend, budget, devices held and jobs waiting and running."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Request, status
from fastapi import Path as PathParam

from gpuforge.errors import GpuforgeError
from gpuforge.server.auth import Key
from gpuforge.server.routes.jobs import wake_scheduler
from gpuforge.server.schemas import ProjectCreate, ProjectPublic, ProjectUpdate
from gpuforge.server.services import services
from gpuforge.server.visibility import admin_only
from gpuforge.store.db import session
from gpuforge.store.models import ApiKey
from gpuforge.store.projects import ProjectFigures, create_project, figures, project_named, set_project

router = APIRouter(prefix="/api/v1/projects", tags=["projects"])
Name = Annotated[str, PathParam(max_length=100, description="the project's name")]


def _public(row: ProjectFigures) -> ProjectPublic:
    p = row.project
    return ProjectPublic(
        id=p.id, name=p.name, budget_usd_month=p.budget_usd_month, max_devices=p.max_devices, share=p.share,
        created_at=p.created_at, spend_usd_month=row.spend_usd_month, devices_held=row.devices_held,
        jobs_queued=row.jobs_queued, jobs_running=row.jobs_running, keys=row.keys,
    )  # fmt: skip


@router.post("", status_code=status.HTTP_201_CREATED, response_model=ProjectPublic)
def make_project(body: ProjectCreate, request: Request, key: Key) -> ProjectPublic:
    """A new project (admin key): keys join it with `keys create|set NAME --project P`."""
    admin_only(key)
    with session(services(request).engine) as s:
        try:
            made = create_project(s, **body.model_dump())
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from err
        except GpuforgeError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from err
        return _public(figures(s, only=made.id)[0])


@router.get("", response_model=list[ProjectPublic])
def list_projects(request: Request, key: Key) -> list[ProjectPublic]:
    """Projects by name, with where each stands: every one with an admin key, else the key's own (if any)."""
    if not key.admin and key.project_id is None:
        return []
    with session(services(request).engine) as s:
        return [_public(row) for row in figures(s, only=None if key.admin else key.project_id)]


@router.get("/{name}", response_model=ProjectPublic)
def get_project(name: Name, request: Request, key: Key) -> ProjectPublic:
    """One project: its members and an admin key see it; others, no such project."""
    with session(services(request).engine) as s:
        found = _seen(s, key, name)
        return _public(figures(s, only=found)[0])


@router.patch("/{name}", response_model=ProjectPublic)
def change_project(name: Name, body: ProjectUpdate, request: Request, key: Key) -> ProjectPublic:
    """Change a project's budget, device cap or share (admin key): those sent; null: no budget, no cap.
    They hold from the scheduler's next look (a few seconds)."""
    admin_only(key)
    with session(services(request).engine) as s:
        try:
            changed = set_project(s, name, body.model_dump(exclude_unset=True))
        except LookupError as err:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from err
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from err
        public = _public(figures(s, only=changed.id)[0])
    wake_scheduler(request)  # the queue holds or starts jobs by the projects' settings
    return public


def _seen(s, key: ApiKey, name: str) -> int:
    """The id of project `name` if `key` may see it; 404 otherwise (another team's does not exist for it)."""
    try:
        project = project_named(s, name)
    except LookupError as err:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no project {name!r}") from err
    if not (key.admin or key.project_id == project.id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no project {name!r}")
    return project.id
