"""Deployments: serve a finished job's model with N replicas, and forward requests to them.

    POST   /api/v1/deployments                 {"job_id", "name", "replicas", "options"}
    GET    /api/v1/deployments[?all=true]         live ones (all: stopped and failed ones too)
    GET    /api/v1/deployments/{name}
    DELETE /api/v1/deployments/{name}          (undeploy: replicas finish what they hold, then stop)
    POST   /api/v1/deployments/{name}/predict  forwarded to the least loaded ready replica

The scheduling loop starts and restarts the replicas (scheduler/deployments.py). Any key may send
predictions to a deployment; its owner, an admin and its project's members see it (server/visibility.py);
only its owner or an admin undeploys it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated

import httpx
from fastapi import APIRouter, HTTPException, Query, Request, Response, status
from fastapi import Path as PathParam
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm.exc import StaleDataError

from gpuforge.artifact.manifest import MANIFEST, ArtifactError, read_manifest
from gpuforge.scheduler.worker_keys import replicas_key, worker_key
from gpuforge.server.auth import Key
from gpuforge.server.pricing import device_price
from gpuforge.server.refusals import quota_refusal
from gpuforge.server.replica_stats import read_metrics, replica_figures, restarted
from gpuforge.server.schemas import DeploymentCreate, DeploymentPublic, DeploymentStats, ReplicaStats
from gpuforge.server.visibility import check_change, may_change, may_read, readable
from gpuforge.store import states
from gpuforge.store.db import session
from gpuforge.store.keys import digest
from gpuforge.store.models import (
    ENDED_DEPLOYMENT_STATES,
    LIVE_DEPLOYMENT_STATES,
    ApiKey,
    Deployment,
    Job,
    JobState,
    utcnow,
)
from gpuforge.store.quotas import check_deployment

router = APIRouter(prefix="/api/v1/deployments", tags=["deployments"])
Name = Annotated[str, PathParam(max_length=100, description="the deployment's name")]
FORWARDED_HEADERS = ("content-type", "retry-after")
STATS_WINDOW_S = 10.0  # the stats' figures cover at least this long (after the first look)
_turns = itertools.count()  # breaks ties between equally loaded replicas: round-robin


def _public(d: Deployment) -> DeploymentPublic:
    public = DeploymentPublic.model_validate(d)
    public.url = f"/api/v1/deployments/{d.name}"
    return public


def _visible(s, key: ApiKey, name: str) -> Deployment:
    deployment = s.scalar(select(Deployment).where(Deployment.name == name))
    if deployment is None or not may_read(key, deployment):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no deployment {name!r}")
    return deployment


def _changeable(s, key: ApiKey, name: str) -> Deployment:
    """The deployment, if `key` may change it: 404 as _visible, 403 for a teammate's."""
    deployment = _visible(s, key, name)
    if not may_change(key, deployment):
        owner = s.scalar(select(ApiKey.name).where(ApiKey.id == deployment.owner_id))
        check_change(key, deployment, f"deployment {name!r}", owner)
    return deployment


@router.post("", status_code=status.HTTP_201_CREATED, response_model=DeploymentPublic)
def deploy(body: DeploymentCreate, request: Request, key: Key) -> DeploymentPublic:
    """Serve a finished job's model; the replicas start on free devices (state starting, then ready). Past
    its key's max_deployments: 429."""
    devices = request.app.state.devices
    with session(request.app.state.engine) as s:
        job = s.get(Job, body.job_id)
        if job is None or not may_read(key, job):  # a teammate's model too: the deployment is the key's own
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {body.job_id}")
        model_dir = Path(job.run_dir) / "model"
        if job.state != JobState.FINISHED or not (model_dir / MANIFEST).is_file():
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"job {job.id} is {job.state}: it has no trained model"
            )
        try:
            task = read_manifest(model_dir).task
        except ArtifactError as err:  # a file anyone with the run directory could have edited
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id}: {err}") from None
        if task == "causal-lm":
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"job {job.id} trained a causal-lm: the server forwards /predict only; run `gpuforge serve` "
                "for its /v1/completions",
            )
        existing = s.scalar(select(Deployment).where(Deployment.name == body.name))
        reusable = existing is None or (
            existing.state in ENDED_DEPLOYMENT_STATES and may_change(key, existing)
        )
        if not reusable:
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"a deployment named {body.name!r} exists ({existing.state})"
            )
        have = sum(1 for d in devices if d.kind == job.device_type)
        if body.replicas > have:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"replicas: {body.replicas} asked, this server has {have} {job.device_type} device(s)",
            )
        price = device_price(request, job.device_type)  # one replica's device: the ledger's rate
        with quota_refusal():  # 429 past max_deployments, counted in this transaction
            check_deployment(s, key)
        if existing is not None:
            s.delete(existing)  # a stopped or failed one gives its name back
            s.flush()
        deployment = Deployment(
            name=body.name, owner_id=key.id, job_id=job.id, model_dir=str(model_dir),
            options=body.options.model_dump(exclude_none=True), replicas=body.replicas,
            device_type=job.device_type, worker_key="", workers=[], created_at=utcnow(),
            project_id=key.project_id, usd_per_hour=price[1] if price is not None else 0.0,
        )  # fmt: skip
        s.add(deployment)
        try:
            s.flush()
        except (IntegrityError, StaleDataError) as err:  # the same name, deployed at the same moment
            raise HTTPException(status.HTTP_409_CONFLICT, f"a deployment named {body.name!r} exists") from err
        deployment.worker_key = digest(worker_key(request.app.state.worker_secret, deployment))
        public = _public(deployment)
    request.app.state.scheduler.wake()
    return public


@router.get("", response_model=list[DeploymentPublic])
def list_deployments(
    request: Request,
    key: Key,
    every: Annotated[bool, Query(alias="all", description="the stopped and failed ones too")] = False,
) -> list[DeploymentPublic]:
    """Live deployments, newest first (?all=true: with the stopped and failed): your own and your project's,
    or everyone's with an admin key."""
    query = select(Deployment).order_by(Deployment.id.desc())
    if not every:
        query = query.where(Deployment.state.in_(LIVE_DEPLOYMENT_STATES))
    with session(request.app.state.engine) as s:
        return [_public(d) for d in s.scalars(query.where(readable(key, Deployment)))]


@router.get("/{name}", response_model=DeploymentPublic)
def get_deployment(name: Name, request: Request, key: Key) -> DeploymentPublic:
    """One deployment, with its replicas."""
    with session(request.app.state.engine) as s:
        return _public(_visible(s, key, name))


@router.delete("/{name}", response_model=DeploymentPublic)
def undeploy(name: Name, request: Request, key: Key) -> DeploymentPublic:
    """Stop the replicas (each finishes the requests it holds)."""
    with session(request.app.state.engine) as s:
        deployment = _changeable(s, key, name)
        if not states.undeploy(s, deployment.id):
            s.refresh(deployment)  # the state that ended it, perhaps since it was read
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"deployment {name!r} is already {deployment.state}"
            )
        public = _public(deployment)
    request.app.state.scheduler.wake()
    return public


@router.post("/{name}/predict", response_model=dict)
async def predict(name: Name, request: Request, key: Key) -> Response:
    """Forwarded as it is to the least loaded ready replica (body: as `gpuforge serve` takes it)."""
    with session(request.app.state.engine) as s:
        deployment = s.scalar(select(Deployment).where(Deployment.name == name))
        if deployment is None or deployment.state in ENDED_DEPLOYMENT_STATES:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no deployment {name!r} serving")
        ready = [w for w in deployment.workers or [] if w.get("ready") and w.get("port")]
        key_of_replicas = replicas_key(request.app.state.worker_secret, deployment)
    if not ready:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, f"deployment {name!r} has no ready replica yet",
            headers={"Retry-After": "2"},
        )  # fmt: skip
    load = request.app.state.replica_load
    turn = next(_turns)
    worker = min(ready, key=lambda w: (load.get((name, w["index"]), 0), (w["index"] - turn) % len(ready)))
    slot = (name, worker["index"])
    load[slot] = load.get(slot, 0) + 1
    try:
        answer = await request.app.state.http.post(
            f"http://127.0.0.1:{worker['port']}/predict",
            content=await request.body(),
            # JSON whatever the client said (`curl -d` says a form): the replica reads JSON alone
            headers={"content-type": "application/json", "authorization": f"Bearer {key_of_replicas}"},
        )
    except httpx.HTTPError as err:
        raise HTTPException(
            status.HTTP_502_BAD_GATEWAY, f"replica {worker['index']}: {type(err).__name__}"
        ) from err
    finally:
        load[slot] -= 1
    headers = {k: v for k, v in answer.headers.items() if k.lower() in FORWARDED_HEADERS}
    headers["x-gpuforge-replica"] = str(worker["index"])
    return Response(answer.content, answer.status_code, headers=headers)


@router.get("/{name}/stats", response_model=DeploymentStats)
async def deployment_stats(name: Name, request: Request, key: Key) -> DeploymentStats:
    """Each replica's requests/s, p50/p99 latency (ms) and refusals over the last STATS_WINDOW_S or so
    (over its whole life at the first look), read from the replica's own /metrics."""
    with session(request.app.state.engine) as s:
        deployment = _visible(s, key, name)
        workers = list(deployment.workers or [])
        key_of_replicas = replicas_key(request.app.state.worker_secret, deployment)
    readings = request.app.state.replica_readings  # (deployment, replica index) -> last Reading
    replicas = []
    for worker in workers:
        figures = {}
        if worker.get("ready") and worker.get("port"):
            try:
                answer = await request.app.state.http.get(
                    f"http://127.0.0.1:{worker['port']}/metrics",
                    headers={"authorization": f"Bearer {key_of_replicas}"},
                    timeout=2,
                )
                answer.raise_for_status()
                now = read_metrics(answer.text)
                slot = (name, worker["index"])
                before = readings.get(slot)
                figures = replica_figures(now, before)
                if before is None or now.at - before.at >= STATS_WINDOW_S or restarted(now, before):
                    readings[slot] = now  # else the window grows: a 2 s poll is too short a window
            except (httpx.HTTPError, ValueError):  # a replica restarting: no figures this time
                figures = {}
        replicas.append(ReplicaStats(index=worker["index"], ready=bool(worker.get("ready")), **figures))
    return DeploymentStats(name=name, replicas=replicas)
