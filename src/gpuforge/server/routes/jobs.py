"""Jobs: submit, list, read, cancel, resume; a job's events, metrics, logs and summary."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Annotated, Any

import yaml
from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from fastapi import Path as PathParam
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask

from gpuforge.run_files import log_tail, metrics_page, read_report, series, small_text
from gpuforge.runs import RunDir
from gpuforge.server.auth import Key
from gpuforge.server.follow import REVOKED, follow
from gpuforge.server.schemas import (
    EventPublic,
    JobCreate,
    JobPublic,
    JobResume,
    JobSpecPublic,
    LogTail,
    Series,
)
from gpuforge.server.services import services
from gpuforge.server.submit import Server, admit
from gpuforge.server.visibility import check_change, may_read, readable
from gpuforge.store import jobs, states
from gpuforge.store.db import session
from gpuforge.store.keys import is_revoked
from gpuforge.store.models import MAX_IDEMPOTENCY_KEY, QUEUE_JOB_STATES, Event, Job, JobState
from gpuforge.store.quotas import INT32

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])
JobId = Annotated[int, PathParam(ge=1, le=INT32, description="the job's id")]
MAX_SLURM_SCRIPT = 64 * 2**10  # a batch script is a few lines
GZIP_MIN_BYTES = 8 * 2**10  # a chart's series past this is sent gzipped (numbers compress ~2.5x)


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


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic, responses=SUBMIT_ANSWERS)
def submit(
    body: JobCreate, request: Request, response: Response, key: Key, idempotency_key: IdempotencyKey = None
) -> Job:
    """Validate a spec and queue it (201); a spec that fails validation is refused (422), never queued, and
    so is one past its key's quotas (max_priority: 422; max_queued: 429). With an Idempotency-Key a submit
    is safe to send again: the same key (of the same API key) and the same request answer 200 with the
    job the first one queued; the same key with another spec, name or priority answers 409."""
    state = services(request)
    admitted = admit(body, key, idempotency_key, Server(state.settings, state.devices, state.engine))
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


def visible_job(s, key, job_id: int) -> Job:
    job = s.get(Job, job_id)
    if job is None or not may_read(key, job):  # others' jobs do not exist for you (server/visibility.py)
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
    return job


def changeable_job(s, key, job_id: int) -> Job:
    """The job, if `key` may change it: 404 as visible_job, 403 for a teammate's job."""
    job = visible_job(s, key, job_id)
    check_change(key, job, f"job {job_id}", job.owner)
    return job


# The two hot reads are `async def` with their (sub-millisecond, never-blocking WAL) store read inline:
# the thread-pool hop of a plain `def` route cost 2.4x in throughput (402 against 968 requests/s,
# benchmarks/api_load.py). Writes stay plain `def`, in the pool: they may wait for the store's lock.
@router.get("", response_model=list[JobPublic])
async def list_jobs(
    request: Request,
    response: Response,
    key: Key,
    state: Annotated[str | None, Query(description="only jobs in this state", max_length=20)] = None,
    owner: Annotated[str | None, Query(description="only this key's jobs (its name)", max_length=100)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=INT32)] = 0,
) -> list[Job]:
    """Jobs, newest first: your own and your project's, or everyone's with an admin key. X-Total-Count: how
    many match."""
    with session(services(request).engine) as s:
        total, page = jobs.page(s, readable(key, Job), state, owner, limit, offset)
        response.headers["X-Total-Count"] = str(total)
        return with_places(request, page)


def with_places(request: Request, rows: list[Job]) -> list[Job]:
    """Each waiting job with its place in the queue as the scheduler's last tick ordered it."""
    scheduler = services(request).scheduler
    places = scheduler.queue_positions if scheduler is not None else {}
    for job in rows:
        job.queue_position = places.get(job.id) if job.state in QUEUE_JOB_STATES else None
    return rows


@router.get("/{job_id}", response_model=JobPublic)
async def get_job(job_id: JobId, request: Request, key: Key) -> Job:
    """One job."""
    with session(services(request).engine) as s:
        return with_places(request, [visible_job(s, key, job_id)])[0]


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(job_id: JobId, request: Request, key: Key) -> Job:
    """Cancel a job (its owner or an admin: 403 for a teammate's); a job already ended answers 409."""
    with session(services(request).engine) as s:
        job = changeable_job(s, key, job_id)
        # queued or paused: cancelled now; running: the loop sends SIGTERM, the runner checkpoints and stops
        if not states.cancel(s, job.id, f"cancelled by {key.name}"):
            s.refresh(job)  # the state that ended it, perhaps since it was read
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is already {job.state}")
    wake_scheduler(request)
    return job


ONLY_THESE_RESUME = "only a paused or cancelled job resumes"


@router.post("/{job_id}/resume", response_model=JobPublic)
def resume_job(job_id: JobId, body: JobResume, request: Request, key: Key) -> Job:
    """Queue a paused job again, or a cancelled one that left a checkpoint, from its last checkpoint (its
    owner or an admin). `budget_usd` given: its new cost budget (null: none); left out: the one it had."""
    with session(services(request).engine) as s:
        job = changeable_job(s, key, job_id)
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
    wake_scheduler(request)
    return job


@router.get("/{job_id}/events", response_model=list[EventPublic])
def job_events(
    job_id: JobId,
    request: Request,
    key: Key,
    after: Annotated[int, Query(ge=-1, le=INT32, description="only events after this seq")] = -1,
    limit: Annotated[int, Query(ge=1, le=10_000, description="at most this many (next page: after)")] = 1000,
) -> list[Event]:
    """The job's events, in order, a page at a time."""
    with session(services(request).engine) as s:
        visible_job(s, key, job_id)
        return jobs.events(s, job_id, after, limit)


@router.get("/{job_id}/metrics", response_model=list[dict[str, Any]])
def job_metrics(
    job_id: JobId,
    request: Request,
    key: Key,
    after_step: Annotated[int, Query(ge=-1, le=INT32, description="only steps after this one")] = -1,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[dict[str, Any]]:
    """The job's metrics records (DESIGN: metrics.jsonl), a page at a time, by step."""
    with session(services(request).engine) as s:
        run_dir = Path(visible_job(s, key, job_id).run_dir)
    return metrics_page(run_dir / "metrics.jsonl", after_step, limit)


@router.get("/{job_id}/summary", response_model=dict[str, Any])
def job_summary(job_id: JobId, request: Request, key: Key) -> dict[str, Any]:
    """The run's summary.json: written when the runner stops (finished, failed, cancelled, paused)."""
    with session(services(request).engine) as s:
        run_dir = Path(visible_job(s, key, job_id).run_dir)
    summary = RunDir(run_dir).readable_summary()  # torn, or not a summary: as good as none
    if summary is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no summary yet")
    return summary


@router.get("/{job_id}/logs", response_model=LogTail)
def job_logs(
    job_id: JobId,
    request: Request,
    key: Key,
    tail: Annotated[int, Query(ge=0, le=100_000, description="the last N lines")] = 200,
) -> LogTail:
    """The end of the job's process log (its runner's output, all restarts appended)."""
    with session(services(request).engine) as s:
        run_dir = Path(visible_job(s, key, job_id).run_dir)
    lines, offset = log_tail(run_dir / "logs" / "process.log", tail)
    return LogTail(lines=lines, offset=offset)


@router.get(
    "/{job_id}/slurm-script",
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


@router.get("/{job_id}/spec", response_model=JobSpecPublic)
def job_spec(job_id: JobId, request: Request, key: Key) -> JobSpecPublic:
    """The resolved spec the job runs (defaults filled in, paths absolute)."""
    with session(services(request).engine) as s:
        job = visible_job(s, key, job_id)
        text, files = job.spec_yaml, job.files or {}
    return JobSpecPublic(yaml=text, spec=yaml.safe_load(text) or {}, files=files)


@router.get("/{job_id}/series", response_model=Series, responses={304: {"description": "unchanged"}})
def job_series(
    job_id: JobId,
    request: Request,
    key: Key,
    max_points: Annotated[int, Query(ge=10, le=20_000, description="points a metric at most")] = 1000,
) -> Response:
    """The job's metrics as one series a metric, for charts: a long run is downsampled here (the min and
    max of each bucket of steps), never sent whole. With an ETag: a page polling a run that has logged
    nothing new gets 304 and no body."""
    with session(services(request).engine) as s:
        path = Path(visible_job(s, key, job_id).run_dir) / "metrics.jsonl"
    try:
        stat = path.stat()
        tag = f'W/"{stat.st_ino:x}-{stat.st_size:x}-{stat.st_mtime_ns:x}-{max_points}"'
    except FileNotFoundError:
        tag = f'W/"none-{max_points}"'
    # the browser asks again each time; the answer depends on how it may be encoded
    headers = {"ETag": tag, "Cache-Control": "private, no-cache", "Vary": "Accept-Encoding"}
    if request.headers.get("if-none-match") == tag:
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=headers)
    body = json.dumps(series(path, max_points), separators=(",", ":")).encode()
    if len(body) > GZIP_MIN_BYTES and "gzip" in request.headers.get("accept-encoding", ""):
        # gzipped here, not by a middleware: that would wrap every request of the API, hot reads too
        body, headers["Content-Encoding"] = gzip.compress(body, compresslevel=5), "gzip"
    return Response(body, media_type="application/json", headers=headers)


@router.get("/{job_id}/report", response_model=dict[str, Any])
def job_report(job_id: JobId, request: Request, key: Key) -> dict[str, Any]:
    """The compression report of the run (compressed/report.json), where it has one."""
    with session(services(request).engine) as s:
        run_dir = Path(visible_job(s, key, job_id).run_dir)
    report = read_report(run_dir)
    if report is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no compression report")
    return report


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


@router.get("/{job_id}/metrics/stream", response_class=StreamingResponse, responses=SSE)
def stream_metrics(
    job_id: JobId,
    request: Request,
    key: Key,
    after_step: Annotated[int, Query(ge=-1, le=INT32, description="only steps after this one")] = -1,
) -> StreamingResponse:
    """Metrics records as the runner writes them (`event: metric`), then `event: end` with the state
    the job stopped in."""
    return _stream(request, key, job_id, after_step=after_step)


@router.get("/{job_id}/logs/stream", response_class=StreamingResponse, responses=SSE)
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
