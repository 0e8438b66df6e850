"""Jobs: submit, list, read, cancel, resume; a job's events, metrics, logs and summary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask

from gpuforge.dashboard.read_routes import JobId
from gpuforge.dashboard.read_schemas import JobPublic
from gpuforge.run_files import small_text
from gpuforge.runs import RunDir
from gpuforge.server.auth import Key
from gpuforge.server.follow import REVOKED, follow
from gpuforge.server.permissions import audited, permit
from gpuforge.server.schemas import JobCreate, JobResume
from gpuforge.server.services import services
from gpuforge.server.submit import Server, admit
from gpuforge.server.visibility import changeable_job, visible_job
from gpuforge.store import states
from gpuforge.store.db import session
from gpuforge.store.keys import is_revoked
from gpuforge.store.models import MAX_IDEMPOTENCY_KEY, Job, JobState
from gpuforge.store.quotas import INT32

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])
MAX_SLURM_SCRIPT = 64 * 2**10  # a batch script is a few lines


IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        pattern=r"^[!-~]+$",  # printable ASCII, no spaces: a UUID is the usual one
        max_length=MAX_IDEMPOTENCY_KEY,
        description="a key of the client's choosing, new for each job: a submit sent again with the same "
        "key (its answer was lost) answers 200 with the job the first one queued, never a second job",
    ),
]
SUBMIT_ANSWERS = {
    200: {"model": JobPublic, "description": "this Idempotency-Key's job, queued by an earlier submit"},
    409: {"description": "this Idempotency-Key was used already, for another spec"},
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobPublic,
    responses=SUBMIT_ANSWERS,
    dependencies=[permit("jobs.submit")],
)
def submit(
    body: JobCreate, request: Request, response: Response, key: Key, idempotency_key: IdempotencyKey = None
) -> Job:
    """Validate a spec and queue it (201); a spec that fails validation is refused (422), never queued, and
    so is one past its key's quotas (max_priority: 422; max_queued: 429). With an Idempotency-Key a submit
    is safe to send again: the same key (of the same API key) and the same request answer 200 with the
    job the first one queued; the same key with another spec, name or priority answers 409."""
    state = services(request)
    server = Server.of(state)

    def record(s, job: Job) -> None:  # in the transaction that queues it
        audited(s, request, key, f"job {job.id}", job.project_id, after={"name": job.name, "state": "queued"})

    admitted = admit(body, key, idempotency_key, server, record)
    if admitted.replayed:
        response.status_code = status.HTTP_200_OK
    else:
        wake_scheduler(request)
    return admitted.job


def wake_scheduler(request: Request) -> None:
    """Tick now: a job or a project changed (routes/projects.py too)."""
    scheduler = services(request).scheduler
    if scheduler is not None:
        scheduler.wake()


@router.post("/{job_id}/cancel", response_model=JobPublic, dependencies=[permit("jobs.cancel")])
def cancel_job(job_id: JobId, request: Request, key: Key) -> Job:
    """Cancel a job (its owner or an admin: 403 for a teammate's); a job already ended answers 409."""
    with session(services(request).engine) as s:
        job = changeable_job(s, key, job_id, "jobs.cancel")
        before = {"state": str(job.state)}
        # queued or paused: cancelled now; running: the loop sends SIGTERM, the runner checkpoints and stops
        if not states.cancel(s, job.id, f"cancelled by {key.name}"):
            s.refresh(job)  # the state that ended it, perhaps since it was read
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is already {job.state}")
        audited(s, request, key, f"job {job_id}", job.project_id, before, {"state": str(job.state)})
    wake_scheduler(request)
    return job


ONLY_THESE_RESUME = "only a paused or cancelled job resumes"


@router.post("/{job_id}/resume", response_model=JobPublic, dependencies=[permit("jobs.resume")])
def resume_job(job_id: JobId, body: JobResume, request: Request, key: Key) -> Job:
    """Queue a paused job again, or a cancelled one that left a checkpoint, from its last checkpoint (its
    owner or an admin). `budget_usd` given: its new cost budget (null: none); left out: the one it had."""
    with session(services(request).engine) as s:
        job = changeable_job(s, key, job_id, "jobs.resume")
        before = {"state": str(job.state), "budget_usd": _budget(job.spec_yaml)}
        if job.state not in (JobState.PAUSED, JobState.CANCELLED):
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {job.state}: {ONLY_THESE_RESUME}")
        if job.state == JobState.CANCELLED and RunDir(job.run_dir).latest_checkpoint() is None:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"job {job_id} was cancelled before its first checkpoint: nothing to resume from; submit its "
                f"spec again (`gpuforge submit`; its spec: GET /api/v1/jobs/{job_id}/spec)",
            )
        spec = yaml.safe_load(job.spec_yaml)
        spent = job.cost_usd or 0.0
        if "budget_usd" in body.model_fields_set:
            if body.budget_usd is not None and body.budget_usd <= spent:
                raise HTTPException(
                    status.HTTP_422_UNPROCESSABLE_CONTENT,
                    f"budget_usd: {body.budget_usd:g} is not above the ${spent:.4f} job {job_id} has spent",
                )
            spec.setdefault("cost", {})["budget_usd"] = body.budget_usd
        budget = (spec.get("cost") or {}).get("budget_usd")
        if budget is not None and budget <= spent:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"job {job_id} has spent ${spent:.4f} of its cost.budget_usd {budget:g}: give a higher "
                "budget_usd (`gpuforge resume ID --budget USD`), or null for none",
            )
        said = f"${budget:g}" if budget is not None else "no budget"
        reason = f"resumed by {key.name} with {said}"
        if not states.resume(s, job.id, yaml.safe_dump(spec, sort_keys=False), reason, seen=job.state):
            s.refresh(job)  # resumed or cancelled since it was read
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {job.state}: {ONLY_THESE_RESUME}")
        after = {"state": str(job.state), "budget_usd": budget}
        audited(s, request, key, f"job {job_id}", job.project_id, before, after)
    wake_scheduler(request)
    return job


def _budget(spec_text: str) -> float | None:
    spec = yaml.safe_load(spec_text) or {}
    return (spec.get("cost") or {}).get("budget_usd") if isinstance(spec, dict) else None


@router.get(
    "/{job_id}/slurm-script",
    dependencies=[permit("jobs.read")],
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {}}}, 404: {"description": "not submitted to Slurm"}},
)
def job_slurm_script(job_id: JobId, request: Request, key: Key) -> PlainTextResponse:
    """The batch script the job's last launch attempt submitted to Slurm (a server with --executor slurm)."""
    with session(services(request).engine) as s:
        run = RunDir(visible_job(s, key, job_id).run_dir)
    path = run.latest_slurm_script()
    try:
        text = small_text(path, MAX_SLURM_SCRIPT) if path is not None else None
    except OSError as err:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"job {job_id}: {err}") from None
    if text is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has not been submitted to Slurm")
    return PlainTextResponse(text)


SSE = {200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}}


def _stream(request: Request, key: Key, job_id: int, **what) -> StreamingResponse:
    """A job's live stream: at most max_streams_per_key open at once for a key (429 past it); it ends with
    its job, or as soon as its key is revoked."""
    engine, settings = services(request).engine, services(request).settings
    with session(engine) as s:
        run_dir = Path(visible_job(s, key, job_id).run_dir)
    streams = services(request).open_streams
    if streams.get(key.id, 0) >= settings.max_streams_per_key:
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            f"key {key.name!r} holds {settings.max_streams_per_key} open streams already (the most a key "
            "may): close one first",
        )
    streams[key.id] = streams.get(key.id, 0) + 1  # taken now: requests at the same moment count at once
    released = False

    def release() -> None:  # once, whether the stream ran to its end or never started
        nonlocal released
        if not released:
            released = True
            streams[key.id] -= 1

    def state() -> tuple[str, str | None]:
        with session(engine) as s:
            if is_revoked(s, key.id):
                return REVOKED, f"the key {key.name!r} was revoked"
            job = s.get(Job, job_id)
            return job.state, job.reason

    async def counted():
        try:
            async for chunk in follow(run_dir, state, **what):
                yield chunk
        finally:
            release()

    return StreamingResponse(
        counted(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(release),
    )


@router.get(
    "/{job_id}/metrics/stream",
    response_class=StreamingResponse,
    responses=SSE,
    dependencies=[permit("jobs.read")],
)
def stream_metrics(
    job_id: JobId,
    request: Request,
    key: Key,
    after_step: Annotated[int, Query(ge=-1, le=INT32, description="only steps after this one")] = -1,
) -> StreamingResponse:
    """Metrics records as the runner writes them (`event: metric`), then `event: end` with the state
    the job stopped in."""
    return _stream(request, key, job_id, after_step=after_step)


@router.get(
    "/{job_id}/logs/stream",
    response_class=StreamingResponse,
    responses=SSE,
    dependencies=[permit("jobs.read")],
)
def stream_logs(
    job_id: JobId,
    request: Request,
    key: Key,
    offset: Annotated[
        int, Query(ge=0, le=2**62, description="byte offset to follow from (GET logs gives it)")
    ] = 0,
    metrics: Annotated[bool, Query(description="interleave metrics records (`event: metric`)")] = False,
    after_step: Annotated[
        int, Query(ge=-1, le=INT32, description="with metrics: only steps after this one")
    ] = -1,
) -> StreamingResponse:
    """Log lines as the runner writes them (`event: log`), then `event: end`."""
    return _stream(request, key, job_id, log_offset=offset, after_step=after_step if metrics else None)
