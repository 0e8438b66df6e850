"""A live deployment's versions and adapters, changed without stopping it.

    GET    /api/v1/deployments/{name}/versions              every version, newest first
    POST   /api/v1/deployments/{name}/rollback  {"to"?}     roll out a version it served (default: the one
                                                            before); one rolling out is refused first
    POST   /api/v1/deployments/{name}/adapters  {"job_id", "name"?}   a LoRA job's adapter, added to the
                                                            running replicas (none restarts)
    DELETE /api/v1/deployments/{name}/adapters/{adapter}

A new version itself comes from POST /api/v1/deployments on the deployment's name (routes/deployments.py).
The scheduling loop carries each change out (scheduler/deployments.py); only the deployment's owner or an
admin changes it.
"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, HTTPException, Request, status
from fastapi import Path as PathParam

from gpuforge.serve.adapters import NAME_MAX, NAME_PATTERN, OWN
from gpuforge.server.auth import Key
from gpuforge.server.permissions import audited, permit
from gpuforge.server.routes.deployments import changeable, check_fit, finished_model, public, visible
from gpuforge.server.routes.forward import Name
from gpuforge.server.schemas import AdapterAdd, DeploymentPublic, Rollback, VersionPublic
from gpuforge.server.services import services
from gpuforge.store import versions
from gpuforge.store.db import session
from gpuforge.store.models import DeploymentState, DeploymentVersion, VersionState

router = APIRouter(prefix="/api/v1/deployments", tags=["deployments"])
Adapter = Annotated[str, PathParam(max_length=100, description="the adapter's name in the deployment")]
SERVING_STATES = (DeploymentState.STARTING, DeploymentState.READY)


def _serving(s, key, name: str, action: str):
    """The deployment `key` may change, locked against a second change at the same moment (PostgreSQL;
    SQLite has one writer at a time anyway); 409 unless it is starting or ready."""
    deployment = changeable(s, key, name, action)
    s.refresh(deployment, with_for_update=True)
    if deployment.state not in SERVING_STATES:
        raise HTTPException(status.HTTP_409_CONFLICT, f"deployment {name!r} is {deployment.state}")
    return deployment


@router.get("/{name}/versions", response_model=list[VersionPublic], dependencies=[permit("deployments.read")])
def list_versions(name: Name, request: Request, key: Key) -> list[VersionPublic]:
    """Every version of the deployment, newest first: its job, state (rolling, serving, retired, refused,
    failed), why it was refused or failed, and the eval metric its replica measured at load."""
    with session(services(request).engine) as s:
        deployment = visible(s, key, name)
        return [VersionPublic.model_validate(v) for v in versions.all_versions(s, deployment.id)]


@router.post(
    "/{name}/rollback", response_model=DeploymentPublic, dependencies=[permit("deployments.rollback")]
)
def rollback(name: Name, body: Rollback, request: Request, key: Key) -> DeploymentPublic:
    """Stop a rollout under way (its version is refused); and roll out `to` (default: the version served
    before this one, when nothing was rolling out), replica by replica, without the metric check."""
    with session(services(request).engine) as s:
        deployment = _serving(s, key, name, "deployments.rollback")
        rolling = versions.of_state(s, deployment.id, VersionState.ROLLING)
        before = {"version": deployment.version, "rolling": rolling.version if rolling else None}
        if rolling is not None:
            # a version that served before (a rollback's own rollout) may come back again; a new one not
            stopped = versions.refuse(s, rolling.id, "rolled back") if rolling.checked else (
                versions.retire_again(s, rolling.id))  # fmt: skip
            if not stopped:
                raise HTTPException(status.HTTP_409_CONFLICT, f"v{rolling.version} finished rolling out "
                                    "meanwhile: ask again to roll it back")  # fmt: skip
            versions.record(s, deployment.id, "rolled_back", version=rolling.version)
        target = _rollback_target(s, deployment, body.to, stopped_one=rolling is not None)
        if target is not None:
            check_fit(deployment, target.model_dir, deployment.adapters)
            if not versions.roll_out_again(s, target.id):
                raise HTTPException(status.HTTP_409_CONFLICT, f"v{target.version} changed meanwhile")
            versions.record(s, deployment.id, "rolling", version=target.version, job_id=target.job_id,
                            rollback=True)  # fmt: skip
        shown = public(s, deployment)
        after = {"version": deployment.version, "rolling": target.version if target else None}
        audited(s, request, key, f"deployment {name}", deployment.project_id, before, after)
    services(request).scheduler.wake()
    return shown


def _rollback_target(s, deployment, to: int | None, stopped_one: bool) -> DeploymentVersion | None:
    """The retired version to roll out again: `to`, or the one served last before the serving one (none
    when a rollout was just stopped and no `to` was asked: stopping it was the rollback)."""
    if to is None and stopped_one:
        return None
    if to is not None:
        found = versions.numbered(s, deployment.id, to)
        if found is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"deployment {deployment.name!r} has no v{to}")
        if found.version == deployment.version:
            raise HTTPException(status.HTTP_409_CONFLICT, f"v{to} is the version serving")
        if found.state != VersionState.RETIRED:
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"v{to} is {found.state}: only a version that served may come back"
            )
        return found
    found = versions.last_retired(s, deployment.id)
    if found is None:
        raise HTTPException(
            status.HTTP_409_CONFLICT, f"deployment {deployment.name!r} served no version before"
        )
    return found


@router.post(
    "/{name}/adapters",
    status_code=status.HTTP_201_CREATED,
    response_model=DeploymentPublic,
    dependencies=[permit("deployments.adapters")],
)
def add_adapter(name: Name, body: AdapterAdd, request: Request, key: Key) -> DeploymentPublic:
    """A finished LoRA job's adapter, served by the running replicas under `name` (default: the job's
    name) without restarting one: requests name it with "adapter"."""
    with session(services(request).engine) as s:
        deployment = _serving(s, key, name, "deployments.adapters")
        job, model_dir, _ = finished_model(s, key, body.job_id, "deployments.adapters")
        adapter = body.name or job.name
        if not _fits_name(adapter):
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"job {job.id}'s name {adapter!r} cannot name an adapter: give one (--adapter-name)",
            )
        if adapter == OWN:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT, f"{OWN!r} names the deployment's own adapter"
            )
        added = dict(deployment.adapters or {})
        if added.get(adapter, str(model_dir)) != str(model_dir):
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"adapter {adapter!r} is job {added[adapter]}'s: remove it first"
            )
        rolling = versions.of_state(s, deployment.id, VersionState.ROLLING)
        for served in {deployment.model_dir, *([rolling.model_dir] if rolling else [])}:
            check_fit(deployment, served, {adapter: str(model_dir)})  # the replicas check again
        deployment.adapters = {**added, adapter: str(model_dir)}
        versions.record(s, deployment.id, "adapter_added", adapter=adapter, job_id=job.id)
        shown = public(s, deployment)
        after = {"adapter": adapter, "job_id": job.id}
        audited(
            s, request, key, f"deployment {name}", deployment.project_id, {"adapters": sorted(added)}, after
        )
    services(request).scheduler.wake()
    return shown


@router.delete(
    "/{name}/adapters/{adapter}",
    response_model=DeploymentPublic,
    dependencies=[permit("deployments.adapters")],
)
def remove_adapter(name: Name, adapter: Adapter, request: Request, key: Key) -> DeploymentPublic:
    """Stop serving an adapter added to the deployment (requests naming it are refused from then on)."""
    with session(services(request).engine) as s:
        deployment = _serving(s, key, name, "deployments.adapters")
        added = dict(deployment.adapters or {})
        if adapter not in added:
            raise HTTPException(
                status.HTTP_404_NOT_FOUND, f"deployment {name!r} has no added adapter {adapter!r}"
            )
        before = {"adapter": adapter, "job_model": added.pop(adapter)}
        deployment.adapters = added
        versions.record(s, deployment.id, "adapter_removed", adapter=adapter)
        shown = public(s, deployment)
        audited(s, request, key, f"deployment {name}", deployment.project_id, before, {"adapter": None})
    services(request).scheduler.wake()
    return shown


def _fits_name(name: str) -> bool:
    return re.fullmatch(NAME_PATTERN, name) is not None and len(name) <= NAME_MAX
