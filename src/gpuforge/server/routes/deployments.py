"""Deployments: serve a finished job's model with N replicas, and forward requests to them.

    POST   /api/v1/deployments                 {"job_id", "name", "replicas", "options"}
    GET    /api/v1/deployments[?all=true]         live ones (all: stopped and failed ones too)
    GET    /api/v1/deployments/{name}
    DELETE /api/v1/deployments/{name}          (undeploy: replicas finish what they hold, then stop)
    GET    /api/v1/deployments/{name}/stats    each replica's figures, from its own /metrics
    GET    /api/v1/deployments/{name}/events   versions rolled out or refused, replicas scaled, cold starts

`POST /api/v1/deployments` on the name of a live deployment makes the job's model its next version
(routes/deployment_versions.py has the versions, rollback and adapters; routes/forward.py forwards the
requests). The scheduling loop starts, restarts, rolls out and scales the replicas
(scheduler/deployments.py). Any key may send predictions to a deployment; its owner, an admin and its
project's members see it (server/visibility.py); only its owner or an admin changes or undeploys it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import httpx
from fastapi import APIRouter, HTTPException, Query, Request, status
from pydantic import ValidationError

from gpuforge.artifact.manifest import MANIFEST, ArtifactError, Manifest, read_manifest
from gpuforge.errors import GpuforgeError
from gpuforge.scheduler.worker_keys import replicas_key, worker_key
from gpuforge.serve.adapters import check_adapters
from gpuforge.server.auth import Key
from gpuforge.server.permissions import audited, permit
from gpuforge.server.pricing import device_price
from gpuforge.server.refusals import quota_refusal
from gpuforge.server.replica_stats import read_metrics, replica_figures, restarted
from gpuforge.server.routes.forward import Name
from gpuforge.server.schemas import (
    DeploymentCreate,
    DeploymentEventPublic,
    DeploymentPublic,
    DeploymentStats,
    ReplicaStats,
)
from gpuforge.server.services import services
from gpuforge.server.visibility import check_change, may_change, may_read, readable
from gpuforge.spec.sections import ResourcesSpec
from gpuforge.store import deployments, states, versions
from gpuforge.store.db import session
from gpuforge.store.keys import digest, key_name
from gpuforge.store.models import (
    LIVE_DEPLOYMENT_STATES,
    ApiKey,
    Deployment,
    DeploymentState,
    Job,
    JobState,
    VersionState,
    utcnow,
)
from gpuforge.store.quotas import check_deployment

router = APIRouter(prefix="/api/v1/deployments", tags=["deployments"])
STATS_WINDOW_S = 10.0  # the stats' figures cover at least this long (after the first look)
KEPT_BY_A_NEW_VERSION = (
    "replicas",
    "devices",
    "min_replicas",
    "max_replicas",
    "target_queue",
    "scale_down_after_s",
    "options",
)


def public(s, d: Deployment) -> DeploymentPublic:
    """The deployment as the API shows it, with the version it is rolling out, if any: both read in one
    statement, so a rollout that ends between two reads never shows as neither rolling nor served."""
    deployment, rolling_version = deployments.with_rolling_version(s, d.id)
    shown = DeploymentPublic.model_validate(deployment)
    shown.url = f"/api/v1/deployments/{d.name}"
    shown.rolling_version = rolling_version
    return shown


def visible(s, key: ApiKey, name: str) -> Deployment:
    deployment = deployments.named(s, name)
    if deployment is None or not may_read(key, deployment):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no deployment {name!r}")
    return deployment


def changeable(s, key: ApiKey, name: str, action: str) -> Deployment:
    """The deployment, if `key` may do `action` to it: 404 as visible, 403 for a teammate's it may not."""
    deployment = visible(s, key, name)
    if not may_change(key, deployment, action):
        owner = key_name(s, deployment.owner_id)
        check_change(key, deployment, action, f"deployment {name!r}", owner)
    return deployment


def finished_model(
    s, key: ApiKey, job_id: int, action: str, variant: str | None = None
) -> tuple[Job, Path, Manifest]:
    """A finished job's model/ (or the `variant` its compress: section made, compressed/<name>) that `key`
    may `action` (a teammate's: a maintainer), and its manifest: 404, 403, or 409 saying why it has none."""
    job = s.get(Job, job_id)
    if job is None or not may_read(key, job):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    check_change(key, job, action, f"job {job_id}", job.owner)  # the deployment is the key's own
    run = Path(job.run_dir)
    model_dir = run / (variant or "model")
    if job.state != JobState.FINISHED or not (model_dir / MANIFEST).is_file():
        if job.state == JobState.FINISHED and variant:
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"job {job.id} has no {variant} (its compress: section)"
            )
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id} is {job.state}: it has no trained model")
    if variant and run.resolve() not in model_dir.resolve().parents:  # a link in the run, pointing out
        raise HTTPException(
            status.HTTP_409_CONFLICT, f"job {job.id}: {variant} lies outside its run directory"
        )
    try:
        return job, model_dir, read_manifest(model_dir)
    except ArtifactError as err:  # a file anyone with the run directory could have edited
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job.id}: {err}") from None


def check_fit(deployment: Deployment, model_dir: str, adapters: dict[str, str] | None) -> None:
    """422 unless each of `adapters` fits the model at `model_dir` (its base, task and labels)."""
    if not adapters:
        return
    try:
        check_adapters(Path(model_dir), {name: Path(path) for name, path in adapters.items()})
    except GpuforgeError as err:
        raise _unprocessable(f"deployment {deployment.name!r}: {err}") from None


def _unprocessable(why: str) -> HTTPException:
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, why)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=DeploymentPublic,
    dependencies=[permit("deployments.deploy")],
)
def deploy(body: DeploymentCreate, request: Request, key: Key) -> DeploymentPublic:
    """Serve a finished job's model; the replicas start on free devices (state starting, then ready). On
    the name of a live deployment: its next version, rolled out replica by replica. Past its key's
    max_deployments: 429."""
    with session(services(request).engine) as s:
        job, model_dir, manifest = finished_model(s, key, body.job_id, "deployments.deploy", body.model)
        if manifest.task == "causal-lm":
            raise _unprocessable(
                f"job {job.id} trained a causal-lm: the server forwards /predict only; run `gpuforge serve` "
                "for its /v1/completions"
            )
        existing = deployments.named(s, body.name)
        live = existing is not None and existing.state in LIVE_DEPLOYMENT_STATES
        quantize = (existing.options or {}).get("quantize") if live else body.options.quantize
        if manifest.format == "onnx" and quantize:
            raise _unprocessable(
                f"{body.model}: an ONNX export, quantized (or not) when it was made; a deployment's quantize "
                f"({quantize}) does not apply to it"
            )
        if live:
            deployment = changeable(s, key, body.name, "deployments.deploy")  # 404 or 403: a teammate's
            s.refresh(deployment, with_for_update=True)  # one change at a time (PostgreSQL)
            before = {"version": deployment.version}
            made = _next_version(s, deployment, job, model_dir, body)
            shown = public(s, deployment)
            after = {"rolling": made, "job_id": job.id}
            audited(s, request, key, f"deployment {body.name}", deployment.project_id, before, after)
        else:
            if existing is not None and not may_change(key, existing, "deployments.deploy"):
                raise HTTPException(status.HTTP_409_CONFLICT, f"a deployment named {body.name!r} exists")
            shown = _first_version(s, request, key, job, model_dir, body, existing)
            after = {
                "job_id": job.id,
                "replicas": shown.replicas,
                "options": body.options.model_dump(exclude_none=True),
            }
            audited(s, request, key, f"deployment {body.name}", key.project_id, after=after)
    services(request).scheduler.wake()
    return shown


def _replica_counts(
    body: DeploymentCreate, have: int, device_type: str, room: str | None = None
) -> tuple[int, int, int]:
    """(replicas at the start, min, max), checked against the devices this server has."""
    low = body.min_replicas if body.min_replicas is not None else (body.replicas or 1)
    high = body.max_replicas if body.max_replicas is not None else max(low, body.replicas or 1)
    if low > high:
        raise _unprocessable(f"min_replicas {low} is above max_replicas {high}")
    if high > have:
        raise _unprocessable(
            f"replicas: {high} asked, this server has {room or f'{have} {device_type} device(s)'}"
        )
    start = body.replicas if body.replicas is not None else max(low, 1)
    if not low <= start <= high:
        raise _unprocessable(f"replicas {start} is outside min_replicas..max_replicas ({low}..{high})")
    return start, low, high


def _share(devices: float) -> float | None:
    """A replica's fraction of a device (None: a whole one), as a spec's resources.devices reads it."""
    try:
        share = ResourcesSpec(devices=devices).share
    except ValidationError as err:
        raise _unprocessable(f"devices: {err.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    return share


def _first_version(s, request, key, job, model_dir, body, existing) -> DeploymentPublic:
    devices = services(request).devices
    share = _share(body.devices)
    have = sum(1 for d in devices if d.kind == job.device_type)
    room = None
    if share is not None:  # replicas that fit on them, each on a fraction of one
        room = f"room for {int(have / share + 1e-6)} at {share:g} on its {have} {job.device_type} device(s)"
        have = int(have / share + 1e-6)
    start, low, high = _replica_counts(body, have, job.device_type, room)
    price = device_price(request, job.device_type)  # one replica's device: the ledger's rate
    with quota_refusal():  # 429 past max_deployments, counted in this transaction
        check_deployment(s, key)
    if existing is not None:
        s.delete(existing)  # a stopped or failed one gives its name back
        s.flush()
    deployment = Deployment(
        name=body.name, owner_id=key.id, job_id=job.id, model_dir=str(model_dir), device_share=share,
        options=body.options.model_dump(exclude_none=True), replicas=start, min_replicas=low,
        max_replicas=high, target_queue=body.target_queue, scale_down_after_s=body.scale_down_after_s,
        max_metric_drop=body.max_metric_drop, adapters={}, device_type=job.device_type, worker_key="",
        workers=[], created_at=utcnow(), project_id=key.project_id,
        usd_per_hour=(price[1] if price is not None else 0.0) * (share or 1.0),
    )  # fmt: skip
    if not deployments.add_named(s, deployment):
        raise HTTPException(status.HTTP_409_CONFLICT, f"a deployment named {body.name!r} exists")
    deployment.worker_key = digest(worker_key(services(request).worker_secret, deployment))
    versions.add(s, deployment, job.id, str(model_dir), VersionState.SERVING)
    shown = public(s, deployment)
    if high >= have:  # nothing is left for jobs: said now, not found later in a queued job's reason
        kind = job.device_type
        more = " (GPUFORGE_CPU_SLOTS)" if kind == "cpu" else ""
        shown.note = (
            f"its replicas can take every {kind} device this server has ({have}): {kind} jobs wait while "
            f"they hold them; `gpuforge undeploy {body.name}` frees them, or start the server with more{more}"
        )
    return shown


def _next_version(s, deployment: Deployment, job: Job, model_dir: Path, body: DeploymentCreate) -> int:
    """The job's model as the deployment's next version, rolling out (checked against the serving one)."""
    if deployment.state not in (DeploymentState.STARTING, DeploymentState.READY):
        raise HTTPException(status.HTTP_409_CONFLICT, f"deployment {deployment.name!r} is {deployment.state}")
    given = sorted(set(body.model_fields_set) & set(KEPT_BY_A_NEW_VERSION))
    if given:
        raise _unprocessable(
            f"{', '.join(given)}: a new version of {deployment.name!r} keeps its replicas and options; leave "
            "them out, or undeploy it first"
        )
    if job.device_type != deployment.device_type:
        raise _unprocessable(
            f"job {job.id} trained on {job.device_type}; deployment {deployment.name!r} serves on "
            f"{deployment.device_type}"
        )
    rolling = versions.of_state(s, deployment.id, VersionState.ROLLING)
    if rolling is not None:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"v{rolling.version} of {deployment.name!r} is rolling out: wait for it, or roll back first",
        )
    check_fit(deployment, str(model_dir), deployment.adapters)  # the adapters added to it must fit too
    if "max_metric_drop" in body.model_fields_set:  # this version's check, and the next ones'
        deployment.max_metric_drop = body.max_metric_drop
    made = versions.add(s, deployment, job.id, str(model_dir), VersionState.ROLLING)
    versions.record(s, deployment.id, "rolling", version=made.version, job_id=job.id)
    return made.version


@router.get("", response_model=list[DeploymentPublic], dependencies=[permit("deployments.read")])
def list_deployments(
    request: Request,
    key: Key,
    every: Annotated[bool, Query(alias="all", description="the stopped and failed ones too")] = False,
) -> list[DeploymentPublic]:
    """Live deployments, newest first (?all=true: with the stopped and failed): your own and your project's,
    or everyone's with an admin key."""
    with session(services(request).engine) as s:
        return [public(s, d) for d in deployments.listed(s, readable(key, Deployment), every)]


@router.get("/{name}", response_model=DeploymentPublic, dependencies=[permit("deployments.read")])
def get_deployment(name: Name, request: Request, key: Key) -> DeploymentPublic:
    """One deployment, with its replicas."""
    with session(services(request).engine) as s:
        return public(s, visible(s, key, name))


@router.delete("/{name}", response_model=DeploymentPublic, dependencies=[permit("deployments.undeploy")])
def undeploy(name: Name, request: Request, key: Key) -> DeploymentPublic:
    """Stop the replicas (each finishes the requests it holds)."""
    with session(services(request).engine) as s:
        deployment = changeable(s, key, name, "deployments.undeploy")
        before = {"state": str(deployment.state)}
        if not states.undeploy(s, deployment.id):
            s.refresh(deployment)  # the state that ended it, perhaps since it was read
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"deployment {name!r} is already {deployment.state}"
            )
        shown = public(s, deployment)
        audited(
            s, request, key, f"deployment {name}", deployment.project_id, before, {"state": str(shown.state)}
        )
    services(request).scheduler.wake()
    return shown


@router.get("/{name}/stats", response_model=DeploymentStats, dependencies=[permit("deployments.read")])
async def deployment_stats(name: Name, request: Request, key: Key) -> DeploymentStats:
    """Each replica's requests/s, p50/p99 latency (ms) and refusals over the last STATS_WINDOW_S or so
    (over its whole life at the first look), read from the replica's own /metrics."""
    with session(services(request).engine) as s:
        deployment = visible(s, key, name)
        workers = list(deployment.workers or [])
        key_of_replicas = replicas_key(services(request).worker_secret, deployment)
    readings = services(request).replica_readings  # (deployment, replica index) -> last Reading
    replicas = []
    for worker in workers:
        figures = {}
        if worker.get("ready") and worker.get("port"):
            try:
                answer = await services(request).http.get(
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


@router.get(
    "/{name}/events", response_model=list[DeploymentEventPublic], dependencies=[permit("deployments.read")]
)
def deployment_events(
    name: Name,
    request: Request,
    key: Key,
    limit: Annotated[int, Query(ge=1, le=1000, description="the latest this many")] = 200,
) -> list[DeploymentEventPublic]:
    """What happened to it, oldest first: versions rolling out, rolled out, refused or failed; replicas
    scaled and why; cold starts; adapters added, removed or refused."""
    with session(services(request).engine) as s:
        deployment = visible(s, key, name)
        rows = versions.latest_events(s, deployment.id, limit)
        return [DeploymentEventPublic.model_validate(e) for e in rows]
