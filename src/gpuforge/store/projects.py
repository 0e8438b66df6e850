"""Projects: the teams sharing a server. An admin makes them (`gpuforge projects create NAME`) and puts keys
in them (`gpuforge keys create NAME --project P`); an admin key belongs to none.

    budget_usd_month  the month's spend (the ledger, store/ledger.py) at which the project's jobs pause and
                      no more start, until the admin raises it or the month turns (UTC); None: no budget
    max_devices       devices its running jobs hold at once at most (0 freezes it); None: no cap
    share             its weight in fair share (scheduler/queue.py): 2 gets twice the device-time of 1

The scheduler reads them each few seconds (scheduler/budgets.py): a change holds from then on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuforge.errors import GpuforgeError
from gpuforge.store.ledger import month_spend
from gpuforge.store.models import (
    MAX_NAME,
    NAME_PATTERN,
    QUEUE_JOB_STATES,
    ApiKey,
    Job,
    JobState,
    Project,
    utcnow,
)

# the one definition of what a project may be: the API's schemas (server/schemas.py) are made of these
ProjectName = Annotated[str, StringConstraints(pattern=NAME_PATTERN, min_length=1, max_length=MAX_NAME)]
BudgetUsdMonth = Annotated[
    float, Field(ge=0, le=1e9, allow_inf_nan=False, description="USD a month; null: none")
]
MaxDevices = Annotated[int, Field(ge=0, le=2**31 - 1, description="devices held at once; null: no cap")]
Share = Annotated[
    float,
    Field(gt=0, le=1e6, allow_inf_nan=False, description="fair-share weight: 2 gets twice the time of 1"),
]


class ProjectSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    budget_usd_month: BudgetUsdMonth | None = None
    max_devices: MaxDevices | None = None
    share: Share = 1.0


SETTABLE = tuple(ProjectSettings.model_fields)


def _first_problem(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "value"
    return f"{where}: {first['msg']}"


@dataclass
class ProjectFigures:
    """A project and where it stands now: what `projects list` shows."""

    project: Project
    spend_usd_month: float = 0.0
    devices_held: float = 0  # devices its running jobs hold now (a fraction counts as that much)
    jobs_queued: int = 0  # queued or preempted: waiting for devices
    jobs_running: int = 0
    keys: list[str] = field(default_factory=list)  # its live keys, by name
    roles: dict[str, str] = field(default_factory=dict)  # key name -> its role in the project


def check_name(name: str) -> None:
    try:
        TypeAdapter(ProjectName).validate_python(name)
    except ValidationError:
        raise ValueError(
            f"name: {name!r} is not a project name (letters, digits and . _ @ -, starting with a letter or "
            f"digit, at most {MAX_NAME})"
        ) from None


def check_settable(values: dict[str, Any]) -> None:
    """ValueError naming the field, unless each is a setting a project may have (None: no budget, no cap)."""
    try:
        ProjectSettings.model_validate(values)
    except ValidationError as err:
        raise ValueError(_first_problem(err)) from None


def create_project(s: Session, name: str, **settings: Any) -> Project:
    """A new project named `name` (unique) with the settings given (SETTABLE; the others: no budget, no
    cap, share 1). ValueError naming a bad field; GpuforgeError for a name taken."""
    check_name(name)
    check_settable(settings)
    if s.scalar(select(Project.id).where(Project.name == name)) is not None:
        raise GpuforgeError(f"a project named {name!r} exists already")
    project = Project(name=name, **{"share": 1.0, **settings}, created_at=utcnow())
    s.add(project)
    s.flush()
    return project


def project_named(s: Session, name: str) -> Project:
    project = s.scalar(select(Project).where(Project.name == name))
    if project is None:
        raise LookupError(f"no project named {name!r} (an admin makes it: gpuforge projects create {name})")
    return project


def set_project(s: Session, name: str, settings: dict[str, Any]) -> Project:
    """Change the settings given (None: no budget, no cap). LookupError: no such project; ValueError: a bad
    field, or nothing to change."""
    project = project_named(s, name)
    if not settings:
        raise ValueError(f"nothing to change: give one of {', '.join(SETTABLE)}")
    check_settable(settings)
    for setting, value in settings.items():
        setattr(project, setting, value)
    s.flush()
    return project


def figures(s: Session, only: int | None = None) -> list[ProjectFigures]:
    """Every project (or the one with id `only`) by name, with its spend this month, devices held and jobs
    waiting and running: five grouped queries, whatever the number of projects."""
    query = select(Project).order_by(Project.name)
    if only is not None:
        query = query.where(Project.id == only)
    rows = {p.id: ProjectFigures(p) for p in s.scalars(query)}
    if not rows:
        return []
    for project_id, usd in month_spend(s, utcnow()).items():
        if project_id in rows:
            rows[project_id].spend_usd_month = usd
    running = select(Job.project_id, Job.devices, Job.device_share).where(
        Job.project_id.in_(rows), Job.state == JobState.RUNNING, Job.devices.is_not(None)
    )
    for project_id, devices, share in s.execute(running):  # the devices a claim gave it ("cuda:0,cuda:1")
        rows[project_id].devices_held += share if share is not None else len(devices.split(","))
    states = (
        select(Job.project_id, Job.state, func.count())
        .where(Job.project_id.in_(rows), Job.state.in_((*QUEUE_JOB_STATES, JobState.RUNNING)))
        .group_by(Job.project_id, Job.state)
    )
    for project_id, state, count in s.execute(states):
        if state == JobState.RUNNING:
            rows[project_id].jobs_running += count
        else:
            rows[project_id].jobs_queued += count
    members = select(ApiKey.project_id, ApiKey.name, ApiKey.role).where(
        ApiKey.project_id.in_(rows), ApiKey.revoked_at.is_(None)
    )
    for project_id, key_name, role in s.execute(members.order_by(ApiKey.name)):
        rows[project_id].keys.append(key_name)
        rows[project_id].roles[key_name] = str(role)
    return list(rows.values())


def project_names(s: Session, ids: Iterable[int | None]) -> dict[int, str]:
    """project id -> name, for those of `ids` that name one (None: no project)."""
    wanted = {i for i in ids if i is not None}
    if not wanted:
        return {}
    return dict(s.execute(select(Project.id, Project.name).where(Project.id.in_(wanted))).tuples().all())
