"""Jobs: submit, list, read, cancel, events."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from fastapi import APIRouter, HTTPException, Query, Request, status
from sqlalchemy import select

from gpuforge.errors import SpecError
from gpuforge.server.auth import Key
from gpuforge.server.schemas import EventPublic, JobCreate, JobPublic
from gpuforge.spec import DATA_SCHEMES, JobSpec, parse_spec
from gpuforge.store.db import session
from gpuforge.store.models import Event, Job, utcnow

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])
FINAL_STATES = ("finished", "failed", "cancelled")


def _server_paths(spec: JobSpec) -> list[tuple[str, Path]]:
    """The files and directories on the server a spec would read, by the field that names them."""
    paths = []
    for field, value in (("data.train", spec.data.train), ("data.eval", spec.data.eval)):
        if value and value.partition(":")[0] not in DATA_SCHEMES:
            paths.append((field, Path(value)))
    if spec.data.tokenizer and spec.data.tokenizer.startswith("hf:"):
        paths.append(("data.tokenizer", Path(spec.data.tokenizer[3:])))
    scheme, _, rest = spec.model.source.partition(":")
    if scheme == "hf":
        paths.append(("model.source", Path(rest)))
    elif scheme == "python" and rest.split(":")[0].endswith(".py"):
        paths.append(("model.source", Path(rest.split(":")[0])))
    return paths


def _check_roots(spec: JobSpec, roots: list[Path]) -> None:
    for field, path in _server_paths(spec):
        real = path.resolve()  # follows symlinks and `..`: the place that would really be read
        if not any(real == root or root in real.parents for root in roots):
            allowed = ", ".join(map(str, roots)) or "none configured (GPUFORGE_DATA_ROOTS)"
            raise SpecError(f"{field}: {path} is outside the server's data roots ({allowed})")


def _parse(body: JobCreate, request: Request) -> JobSpec:
    settings = request.app.state.settings
    try:
        raw = yaml.safe_load(body.spec)
        base = settings.roots[0] if settings.roots else settings.home
        spec = parse_spec(raw, base, default_name=body.name or "job")
        _check_roots(spec, settings.roots)
    except yaml.YAMLError as err:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, f"spec: not valid YAML: {err}") from err
    except SpecError as err:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, str(err)) from err
    return spec


def _device_type(spec: JobSpec, request: Request) -> str:
    wanted = spec.resources.device_type
    if wanted == "auto":
        return "cuda" if any(d.kind == "cuda" for d in request.app.state.devices) else "cpu"
    return wanted


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic)
def submit(body: JobCreate, request: Request, key: Key) -> Job:
    """Validate a spec and queue it; a spec that fails validation is refused (422), never queued."""
    spec = _parse(body, request)
    with session(request.app.state.engine) as s:
        job = Job(
            name=body.name or spec.name,
            owner_id=key.id,
            priority=body.priority if body.priority is not None else spec.priority,
            device_type=_device_type(spec, request),
            devices_wanted=spec.resources.devices,
            spec_yaml=spec.to_yaml(),
            run_dir="",
        )
        s.add(job)
        s.flush()
        job.run_dir = str(request.app.state.settings.runs_dir / f"job-{job.id}")
    return job


def _visible(s, key, job_id: int) -> Job:
    job = s.get(Job, job_id)
    if job is None or not (key.admin or job.owner_id == key.id):  # others' jobs do not exist for you
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    return job


@router.get("", response_model=list[JobPublic])
def list_jobs(
    request: Request,
    key: Key,
    state: Annotated[str | None, Query(description="only jobs in this state")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> list[Job]:
    """Jobs, newest first: your own, or everyone's with an admin key."""
    query = select(Job).order_by(Job.id.desc()).limit(limit).offset(offset)
    if not key.admin:
        query = query.where(Job.owner_id == key.id)
    if state:
        query = query.where(Job.state == state)
    with session(request.app.state.engine) as s:
        return list(s.scalars(query))


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: int, request: Request, key: Key) -> Job:
    """One job."""
    with session(request.app.state.engine) as s:
        return _visible(s, key, job_id)


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(job_id: int, request: Request, key: Key) -> Job:
    """Cancel a job; a job already ended answers 409 with its state."""
    with session(request.app.state.engine) as s:
        job = _visible(s, key, job_id)
        if job.state in FINAL_STATES:
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is already {job.state}")
        job.reason = f"cancelled by {key.name}"
        if job.state == "queued":
            job.state, job.finished_at = "cancelled", utcnow()
        else:  # running or paused: the scheduler loop sends SIGTERM; the runner checkpoints and stops
            job.cancel_requested = True
        return job


@router.get("/{job_id}/events", response_model=list[EventPublic])
def job_events(
    job_id: int,
    request: Request,
    key: Key,
    after: Annotated[int, Query(ge=-1, description="only events after this seq")] = -1,
) -> list[Event]:
    """The job's events, in order."""
    with session(request.app.state.engine) as s:
        _visible(s, key, job_id)
        return list(
            s.scalars(select(Event).where(Event.job_id == job_id, Event.seq > after).order_by(Event.seq))
        )
