"""Jobs: submit, list, read, cancel, resume; a job's events, metrics, logs and summary."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

import yaml
from fastapi import APIRouter, Header, HTTPException, Query, Request, Response, status
from fastapi import Path as PathParam
from fastapi.responses import PlainTextResponse, StreamingResponse
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, undefer
from starlette.background import BackgroundTask

from gpuforge.admission import check_script, check_spec
from gpuforge.data.columns import check_columns
from gpuforge.errors import GpuforgeError, ModelError, SpecError
from gpuforge.launch.shipped import entry_not_sent
from gpuforge.run_files import log_tail, metrics_page, read_report, series, small_text
from gpuforge.runs import RunDir
from gpuforge.server.auth import Key
from gpuforge.server.follow import REVOKED, follow
from gpuforge.server.pricing import device_price
from gpuforge.server.refusals import quota_refusal
from gpuforge.server.schemas import (
    EventPublic,
    JobCreate,
    JobPublic,
    JobResume,
    JobSpecPublic,
    LogTail,
    Series,
)
from gpuforge.server.settings import job_policy
from gpuforge.server.visibility import check_change, may_read, readable
from gpuforge.spec import JobSpec, ScriptJobSpec, parse_spec
from gpuforge.store import states
from gpuforge.store.db import session
from gpuforge.store.ingest import in_users_names
from gpuforge.store.models import MAX_IDEMPOTENCY_KEY, QUEUE_JOB_STATES, ApiKey, Event, Job, JobState
from gpuforge.store.quotas import INT32, check_job
from gpuforge.store.uploads import may_use, split_name

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])
JobId = Annotated[int, PathParam(ge=1, le=INT32, description="the job's id")]
MAX_SPEC_BYTES = 256 * 2**10  # a spec is a page of YAML; its data travel as uploads
MAX_SLURM_SCRIPT = 64 * 2**10  # a batch script is a few lines
GZIP_MIN_BYTES = 8 * 2**10  # a chart's series past this is sent gzipped (numbers compress ~2.5x)


MAX_SPEC_NODES = 2000  # values in a spec (a real one holds a few dozen): past it, no more work is done
MAX_SPEC_DEPTH = 32  # levels of nesting (a real spec has four)
_OPENS = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSES = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def spec_yaml(text: str) -> Any:
    """A spec's YAML, read with bounded work: its events are counted first (libyaml's parser, stopping at
    the first that passes a limit), then it is loaded; no aliases: a few hundred bytes of nested aliases
    expand to gigabytes once the spec is written back out (a 'billion laughs'), and a spec never needs
    one. SpecError past MAX_SPEC_NODES values or MAX_SPEC_DEPTH levels; yaml.YAMLError for bad YAML."""
    nodes = depth = 0
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        if isinstance(event, yaml.AliasEvent):
            line = event.start_mark.line + 1
            raise yaml.YAMLError(f"aliases (*name) are not accepted in a spec (line {line})")
        if isinstance(event, (yaml.ScalarEvent, *_OPENS)) and (nodes := nodes + 1) > MAX_SPEC_NODES:
            raise SpecError(f"spec: more than {MAX_SPEC_NODES} values (a job spec holds a few dozen)")
        if isinstance(event, _OPENS) and (depth := depth + 1) > MAX_SPEC_DEPTH:
            line = event.start_mark.line + 1
            raise SpecError(f"spec: nested deeper than {MAX_SPEC_DEPTH} levels (line {line})")
        if isinstance(event, _CLOSES):
            depth -= 1
    return yaml.load(text, Loader=yaml.CSafeLoader)  # noqa: S506 (a safe loader)


def _parse(body: JobCreate, request: Request, key: ApiKey) -> JobSpec:
    settings = request.app.state.settings
    if len(body.spec.encode()) > MAX_SPEC_BYTES:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE, f"spec: {len(body.spec.encode())} bytes, over {MAX_SPEC_BYTES}"
        )
    try:
        raw = spec_yaml(body.spec)
        base = settings.roots[0] if settings.roots else settings.home
        spec = parse_spec(raw, base, default_name=body.name or "job")
        if spec.kind == "script":
            return _parse_script(spec, body, request, key)
        if body.script_files:
            raise SpecError("script_files: only for a spec of kind: script")
        check_spec(job_policy(settings, key), spec)
        _check_uploads(request, key, [(f, p) for f, p in spec.file_references()])
        _check_inputs(spec)
    except yaml.YAMLError as err:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"spec: not valid YAML: {err}") from err
    except GpuforgeError as err:  # SpecError, DataError, or a ModelError of the source (no such model)
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, in_users_names(str(err), body.files)
        ) from err
    named = {str(path) for _, path in spec.file_references()}
    if stray := sorted(set(body.files or {}) - named):  # it renames in messages only the spec's own files
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"files: {stray[0]} is not a file the spec names"
        )
    return spec


def _parse_script(spec: ScriptJobSpec, body: JobCreate, request: Request, key: ApiKey) -> ScriptJobSpec:
    """A script job: user code (an admin key, or GPUFORGE_ALLOW_USER_CODE), and a working copy made of
    uploads only, each at a path inside it that `script.files` names, every name sent."""
    settings = request.app.state.settings
    spec.script.workdir = ""  # always the copy this server makes beside the run directory
    check_script(job_policy(settings, key), spec)
    if body.files:
        raise SpecError("files: a script job sends its files as script_files")
    sent = body.script_files or {}
    uploads = settings.uploads_dir.resolve()
    for rel, server_path in sent.items():
        parts = PurePosixPath(rel).parts
        if not parts or PurePosixPath(rel).is_absolute() or ".." in parts or "\\" in rel:
            raise SpecError(f"script_files: {rel!r}: a path inside the working copy expected")
        if not any(rel == f or rel.startswith(f.rstrip("/") + "/") for f in spec.script.files):
            raise SpecError(f"script_files: {rel} is not under a path script.files names")
        where = Path(server_path).resolve()
        if where.parent != uploads or not where.is_file():
            raise SpecError(f"script_files: {rel}: {server_path} is not an upload of this server")
    for name in spec.script.files:
        if not any(rel == name or rel.startswith(name.rstrip("/") + "/") for rel in sent):
            raise SpecError(f"script.files: {name} was not sent")
    if (unsent := entry_not_sent(spec, set(sent))) is not None:  # it would fail at its start, not here
        raise SpecError(unsent)
    _check_uploads(request, key, [(f"script_files: {rel}", Path(path)) for rel, path in sent.items()])
    return spec


def _check_uploads(request: Request, key: ApiKey, named: list[tuple[str, Path]]) -> None:
    """Each upload a spec names must be one this key's project sent (store/uploads.py): another
    project's file is refused as if the server had none."""
    uploads = request.app.state.settings.uploads_dir.resolve()
    with session(request.app.state.engine) as s:
        for field, path in named:
            where = Path(path).resolve()
            if where.parent == uploads and not may_use(s, key, *split_name(where)):
                raise SpecError(
                    f"{field}: {path}: no such upload here (gpuforge submit sends the files a spec names)"
                )


def make_working_copy(spec: ScriptJobSpec, files: dict[str, str], run_dir: Path) -> None:
    """<run>.work: each upload at its path, linked where the file system allows (uploads never change)."""
    work = Path(f"{run_dir}.work")
    for rel, server_path in files.items():
        target = work / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(server_path, target)
        except OSError:
            shutil.copyfile(server_path, target)


def _check_inputs(spec: JobSpec) -> None:
    """What the runner would refuse in its first second, refused now instead of a job that starts and
    fails: its data files and their columns (read no further than the first record), an hf: model's
    directory (the same words as models/hf.py)."""
    check_columns(spec)
    scheme, _, rest = spec.model.source.partition(":")
    if scheme == "hf":
        if not Path(rest).is_dir():
            raise ModelError(f"model.source: {rest}: no such directory (gpuforge never downloads models)")
        if not (Path(rest) / "config.json").is_file():
            raise ModelError(f"model.source: {rest}: no config.json, not a saved transformers model")


def _device_type(spec: JobSpec, request: Request) -> str:
    wanted = spec.resources.device_type
    if wanted == "auto":
        return "cuda" if any(d.kind == "cuda" for d in request.app.state.devices) else "cpu"
    return wanted


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
    spec = _parse(body, request, key)
    device_type = _device_type(spec, request)
    have = [d.id for d in request.app.state.devices if d.kind == device_type]
    if spec.resources.devices > len(have):
        # it could never start: say so now, with what exists, rather than fail it at its turn in the queue
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"resources.devices: {spec.resources.devices} {device_type} devices asked for; this server has "
            f"{len(have)} ({', '.join(have) or 'none'}"
            + ("; CPU slots are set by GPUFORGE_CPU_SLOTS)" if device_type == "cpu" else ")"),
        )
    _check_placement(spec, device_type, request)
    if not spec.resources.preemptible and not key.admin:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            "resources.preemptible: false is for admin keys (a job nobody can "
            "preempt holds its devices against every priority)",
        )
    _fill_price(spec, device_type, request, key)
    priority = body.priority if body.priority is not None else spec.priority
    job = Job(
        name=body.name or spec.name,
        owner_id=key.id,
        project_id=key.project_id,
        priority=priority,
        device_type=device_type,
        devices_wanted=spec.resources.devices,
        usd_per_hour=spec.cost.usd_per_hour * spec.resources.devices,
        preemptible=spec.resources.preemptible,
        max_time_s=spec.resources.max_time_s,
        placement=dict(spec.resources.placement) or None,
        spec_yaml=spec.to_yaml(),
        run_dir="",
        idempotency_key=idempotency_key,
        files=body.files,
    )
    if idempotency_key is not None and (earlier := _earlier(request, key, idempotency_key)) is not None:
        return _replayed(earlier, job, response)  # before the quotas: a job queued already counts once
    try:
        with session(request.app.state.engine) as s:
            with quota_refusal():  # max_priority (422) and max_queued (429), counted in this transaction
                check_job(s, key, priority)  # it also holds the key's row: its submits go one at a time
            if idempotency_key is not None and (earlier := _earlier(s, key, idempotency_key)) is not None:
                return _replayed(earlier, job, response)  # committed while this one waited for the row
            s.add(job)
            s.flush()
            job.run_dir = str(request.app.state.settings.runs_dir / f"job-{job.id}")
            if spec.kind == "script":
                make_working_copy(spec, body.script_files or {}, Path(job.run_dir))
            s.refresh(job, ["owner", "project"])  # read by the answer, after the session has closed
    except IntegrityError:  # the unique (owner, idempotency key) held against a submit at the same moment
        if idempotency_key is None or (earlier := _earlier(request, key, idempotency_key)) is None:
            raise
        return _replayed(earlier, job, response)
    wake_scheduler(request)
    return job


def _check_placement(spec: JobSpec, device_type: str, request: Request) -> None:
    """A placement no device of this server could ever match is refused now, with the labels that exist."""
    wanted = spec.resources.placement
    if not wanted:
        return
    of_type = [d for d in request.app.state.devices if d.kind == device_type]
    matching = [d for d in of_type if all((k, v) in d.labels for k, v in wanted.items())]
    if len(matching) >= spec.resources.devices:
        return
    exist = sorted({f"{k}={v}" for d in of_type for k, v in d.labels})
    asked = ", ".join(f"{k}={v}" for k, v in wanted.items())
    raise HTTPException(
        status.HTTP_422_UNPROCESSABLE_CONTENT,
        f"resources.placement: {spec.resources.devices} {device_type} device(s) labelled {asked} asked for; "
        f"this server has {len(matching)}. Labels of its {device_type} devices: {', '.join(exist) or 'none'}",
    )


def _fill_price(spec: JobSpec | ScriptJobSpec, device_type: str, request: Request, key: ApiKey) -> None:
    """cost.usd_per_hour: what one device of the kind the job gets costs on this server (pricing.py:
    prices.yaml, else the catalog's price of its model), else nothing (0: no price set). A spec's own rate
    is kept for admin keys alone (docs/decisions.md): any other key's job costs what the server says,
    whatever its file says, and a budget cannot be escaped by declaring a rate of 0."""
    if key.admin and "usd_per_hour" in spec.cost.model_fields_set:
        return
    found = device_price(request, device_type)
    spec.cost.usd_per_hour = found[1] if found is not None else 0.0
    spec.cost.instance = found[0] if found is not None else None


def _earlier(where: Request | Session, key: ApiKey, idempotency_key: str) -> Job | None:
    """The job this key's submit with `idempotency_key` queued, if one did (with its spec loaded)."""
    query = (
        select(Job)
        .where(Job.owner_id == key.id, Job.idempotency_key == idempotency_key)
        .options(undefer(Job.spec_yaml))
    )
    if isinstance(where, Session):
        return where.scalar(query)
    with session(where.app.state.engine) as s:
        return s.scalar(query)


def _replayed(earlier: Job, asked: Job, response: Response) -> Job:
    """The job an earlier submit with this Idempotency-Key queued (200), when this one asks for the same
    job: the same resolved spec, name, priority and files; 409 when it asks for another."""
    fields = ("spec_yaml", "name", "priority", "files")
    if any(getattr(earlier, f) != getattr(asked, f) for f in fields):
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"Idempotency-Key {asked.idempotency_key!r}: already used for job {earlier.id}, which asked for "
            "another spec, name or priority; send a new key for a new job",
        )
    response.status_code = status.HTTP_200_OK
    return earlier


def wake_scheduler(request: Request) -> None:
    """Tick now: a job or a project changed (routes/projects.py too)."""
    scheduler = getattr(request.app.state, "scheduler", None)
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
    which = select(Job.id).where(readable(key, Job))
    if state:
        which = which.where(Job.state == state)
    if owner:
        which = which.where(Job.owner_id == select(ApiKey.id).where(ApiKey.name == owner).scalar_subquery())
    with session(request.app.state.engine) as s:
        response.headers["X-Total-Count"] = str(s.scalar(select(func.count()).select_from(which.subquery())))
        page = which.order_by(Job.id.desc()).limit(limit).offset(offset)
        return with_places(
            request, list(s.scalars(select(Job).where(Job.id.in_(page)).order_by(Job.id.desc())))
        )


def with_places(request: Request, jobs: list[Job]) -> list[Job]:
    """Each waiting job with its place in the queue as the scheduler's last tick ordered it."""
    scheduler = getattr(request.app.state, "scheduler", None)
    places = scheduler.queue_positions if scheduler is not None else {}
    for job in jobs:
        job.queue_position = places.get(job.id) if job.state in QUEUE_JOB_STATES else None
    return jobs


@router.get("/{job_id}", response_model=JobPublic)
async def get_job(job_id: JobId, request: Request, key: Key) -> Job:
    """One job."""
    with session(request.app.state.engine) as s:
        return with_places(request, [visible_job(s, key, job_id)])[0]


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(job_id: JobId, request: Request, key: Key) -> Job:
    """Cancel a job (its owner or an admin: 403 for a teammate's); a job already ended answers 409."""
    with session(request.app.state.engine) as s:
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
    with session(request.app.state.engine) as s:
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
    with session(request.app.state.engine) as s:
        visible_job(s, key, job_id)
        page = select(Event).where(Event.job_id == job_id, Event.seq > after)
        return list(s.scalars(page.order_by(Event.seq).limit(limit)))


@router.get("/{job_id}/metrics", response_model=list[dict[str, Any]])
def job_metrics(
    job_id: JobId,
    request: Request,
    key: Key,
    after_step: Annotated[int, Query(ge=-1, le=INT32, description="only steps after this one")] = -1,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[dict[str, Any]]:
    """The job's metrics records (DESIGN: metrics.jsonl), a page at a time, by step."""
    with session(request.app.state.engine) as s:
        run_dir = Path(visible_job(s, key, job_id).run_dir)
    return metrics_page(run_dir / "metrics.jsonl", after_step, limit)


@router.get("/{job_id}/summary", response_model=dict[str, Any])
def job_summary(job_id: JobId, request: Request, key: Key) -> dict[str, Any]:
    """The run's summary.json: written when the runner stops (finished, failed, cancelled, paused)."""
    with session(request.app.state.engine) as s:
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
    with session(request.app.state.engine) as s:
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
    with session(request.app.state.engine) as s:
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
    with session(request.app.state.engine) as s:
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
    with session(request.app.state.engine) as s:
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
    with session(request.app.state.engine) as s:
        run_dir = Path(visible_job(s, key, job_id).run_dir)
    report = read_report(run_dir)
    if report is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no compression report")
    return report


SSE = {200: {"content": {"text/event-stream": {}}, "description": "server-sent events"}}


def _stream(request: Request, key: Key, job_id: int, **what) -> StreamingResponse:
    """A job's live stream: at most max_streams_per_key open at once for a key (429 past it); it ends with
    its job, or as soon as its key is revoked."""
    engine, settings = request.app.state.engine, request.app.state.settings
    with session(engine) as s:
        run_dir = Path(visible_job(s, key, job_id).run_dir)
    streams = request.app.state.open_streams
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
            if s.scalar(select(ApiKey.revoked_at).where(ApiKey.id == key.id)) is not None:
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
