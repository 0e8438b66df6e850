"""The API's read routes of jobs, in one copy: the job list, a job, its spec, events, metrics, series, logs,
summary, learning-rate range test, compression report, profile and trace, who the key is, and jobs
compared.

The server mounts them over its store (server/job_reader.py) and `gpuforge dashboard` over run directories
(dashboard/local.py): each gives a dependency that checks the request's key and answers a `JobReader`, the
jobs as that key may see them. What a job's run directory holds is read here, the same for both.
"""

# no `from __future__ import annotations`: FastAPI reads the routes' annotations, and `Reader` is local
import gzip
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response, status
from fastapi import Path as PathParam
from fastapi.responses import FileResponse

from gpuforge.dashboard.profiles import profile_answer, trace_answer
from gpuforge.dashboard.read_schemas import (
    Comparison,
    EventPublic,
    JobPublic,
    JobSpecPublic,
    LogTail,
    Series,
    WhoAmI,
)
from gpuforge.dashboard.run_diff import finals, parse_ids, spec_diff
from gpuforge.run_files import log_tail, metrics_page, read_lr_find, read_report, series
from gpuforge.runs import RunDir
from gpuforge.store.quotas import INT32

JobId = Annotated[int, PathParam(ge=1, le=INT32, description="the job's id")]
GZIP_MIN_BYTES = 8 * 2**10  # a chart's series past this is sent gzipped (numbers compress ~2.5x)
TRACE = {
    200: {"content": {"application/gzip": {}}, "description": "the trace: Chrome / Perfetto JSON, gzipped"}
}


@dataclass(frozen=True)
class ComparedJob:
    """One job of a comparison: who it is, its spec in the user's names, where it ran, its latest figures."""

    id: int
    name: str
    state: str
    owner: str | None
    spec: dict[str, Any]
    run_dir: Path
    latest: dict[str, Any]  # loss, samples_per_s, mfu, cost_usd, wall_s: what a run with no summary shows


class JobReader(Protocol):
    """The jobs one request's key may see. A job it may not see, or that does not exist, is an
    HTTPException 404 "no job N" from each method that takes an id."""

    def whoami(self) -> WhoAmI: ...

    def page(
        self, state: str | None, owner: str | None, limit: int, offset: int, search: int | None = None
    ) -> tuple[int, Sequence[Any]]:
        """(how many match, the page of them newest first), each with JobPublic's fields; `search`: only
        that search's trials."""
        ...

    def job(self, job_id: int) -> Any:
        """The job, with JobPublic's fields."""
        ...

    def run_dir(self, job_id: int) -> Path: ...

    def spec(self, job_id: int) -> JobSpecPublic: ...

    def events(self, job_id: int, after: int, limit: int) -> Sequence[Any]:
        """Its events after seq `after`, in order, each with EventPublic's fields."""
        ...

    def compared(self, ids: list[int]) -> list[ComparedJob]: ...


def read_routes(reader: Callable[..., Any], guard: Callable[[str], Any] | None = None) -> APIRouter:
    """The read routes over the JobReader that the dependency `reader` answers for a request; `guard(action)`:
    the dependency that checks a request's right to the action (the server's permit; none locally)."""
    Reader = Annotated[JobReader, Depends(reader)]
    router = APIRouter(prefix="/api/v1")

    def guarded(action: str) -> list[Any]:
        return [guard(action)] if guard is not None else []

    @router.get("/whoami", response_model=WhoAmI, dependencies=guarded("whoami"), tags=["overview"])
    async def whoami(jobs: Reader) -> WhoAmI:  # async, as the two hot reads below
        """The key's name and whether it is an admin's: the dashboard signs in with it."""
        return jobs.whoami()

    # The two hot reads are `async def` with their (sub-millisecond, never-blocking WAL) store read inline:
    # the thread-pool hop of a plain `def` route cost 2.4x in throughput (402 against 968 requests/s,
    # benchmarks/api_load.py). The rest stay plain `def`, in the pool: they read files.
    @router.get("/jobs", response_model=list[JobPublic], dependencies=guarded("jobs.read"), tags=["jobs"])
    async def list_jobs(
        response: Response,
        jobs: Reader,
        state: Annotated[str | None, Query(description="only jobs in this state", max_length=20)] = None,
        owner: Annotated[
            str | None, Query(description="only this key's jobs (its name)", max_length=100)
        ] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        offset: Annotated[int, Query(ge=0, le=INT32)] = 0,
        search: Annotated[int | None, Query(ge=1, le=INT32, description="only this search's trials")] = None,
    ) -> Sequence[Any]:
        """Jobs, newest first: your own and your project's, or everyone's with an admin key. X-Total-Count:
        how many match."""
        total, page = jobs.page(state, owner, limit, offset, search)
        response.headers["X-Total-Count"] = str(total)
        return page

    @router.get("/jobs/{job_id}", response_model=JobPublic, dependencies=guarded("jobs.read"), tags=["jobs"])
    async def get_job(job_id: JobId, jobs: Reader) -> Any:
        """One job."""
        return jobs.job(job_id)

    @router.get(
        "/jobs/{job_id}/spec", response_model=JobSpecPublic, dependencies=guarded("jobs.read"), tags=["jobs"]
    )
    def job_spec(job_id: JobId, jobs: Reader) -> JobSpecPublic:
        """The resolved spec the job runs (defaults filled in, paths absolute)."""
        return jobs.spec(job_id)

    @router.get(
        "/jobs/{job_id}/events",
        response_model=list[EventPublic],
        dependencies=guarded("jobs.read"),
        tags=["jobs"],
    )
    def job_events(
        job_id: JobId,
        jobs: Reader,
        after: Annotated[int, Query(ge=-1, le=INT32, description="only events after this seq")] = -1,
        limit: Annotated[
            int, Query(ge=1, le=10_000, description="at most this many (next page: after)")
        ] = 1000,
    ) -> Sequence[Any]:
        """The job's events, in order, a page at a time."""
        return jobs.events(job_id, after, limit)

    @router.get(
        "/jobs/{job_id}/metrics",
        response_model=list[dict[str, Any]],
        dependencies=guarded("jobs.read"),
        tags=["jobs"],
    )
    def job_metrics(
        job_id: JobId,
        jobs: Reader,
        after_step: Annotated[int, Query(ge=-1, le=INT32, description="only steps after this one")] = -1,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> list[dict[str, Any]]:
        """The job's metrics records (DESIGN: metrics.jsonl), a page at a time, by step."""
        return metrics_page(jobs.run_dir(job_id) / "metrics.jsonl", after_step, limit)

    @router.get(
        "/jobs/{job_id}/summary",
        response_model=dict[str, Any],
        dependencies=guarded("jobs.read"),
        tags=["jobs"],
    )
    def job_summary(job_id: JobId, jobs: Reader) -> dict[str, Any]:
        """The run's summary.json: written when the runner stops (finished, failed, cancelled, paused)."""
        summary = RunDir(jobs.run_dir(job_id)).readable_summary()  # torn, or not a summary: as good as none
        if summary is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no summary yet")
        return summary

    @router.get(
        "/jobs/{job_id}/logs", response_model=LogTail, dependencies=guarded("jobs.read"), tags=["jobs"]
    )
    def job_logs(
        job_id: JobId,
        jobs: Reader,
        tail: Annotated[int, Query(ge=0, le=100_000, description="the last N lines")] = 200,
    ) -> LogTail:
        """The end of the job's process log (its runner's output, all restarts appended)."""
        lines, offset = log_tail(jobs.run_dir(job_id) / "logs" / "process.log", tail)
        return LogTail(lines=lines, offset=offset)

    @router.get(
        "/jobs/{job_id}/series",
        response_model=Series,
        responses={304: {"description": "unchanged"}},
        dependencies=guarded("jobs.read"),
        tags=["jobs"],
    )
    def job_series(
        job_id: JobId,
        request: Request,
        jobs: Reader,
        max_points: Annotated[int, Query(ge=10, le=20_000, description="points a metric at most")] = 1000,
    ) -> Response:
        """The job's metrics as one series a metric, for charts: a long run is downsampled here (the min
        and max of each bucket of steps), never sent whole. With an ETag: a page polling a run that has
        logged nothing new gets 304 and no body."""
        return _series_answer(jobs.run_dir(job_id) / "metrics.jsonl", max_points, request)

    @router.get(
        "/jobs/{job_id}/report",
        response_model=dict[str, Any],
        dependencies=guarded("jobs.read"),
        tags=["jobs"],
    )
    def job_report(job_id: JobId, jobs: Reader) -> dict[str, Any]:
        """The compression report of the run (compressed/report.json), where it has one."""
        report = read_report(jobs.run_dir(job_id))
        if report is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no compression report")
        return report

    @router.get(
        "/jobs/{job_id}/lr_find",
        response_model=dict[str, Any],
        dependencies=guarded("jobs.read"),
        tags=["jobs"],
    )
    def job_lr_find(job_id: JobId, jobs: Reader) -> dict[str, Any]:
        """train.lr auto: the range test's curve ([lr, loss] points), the rate it picked and why (as the
        job's lr_find.json says, range-checked)."""
        found = read_lr_find(jobs.run_dir(job_id))
        if found is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no learning-rate range test")
        return found

    @router.get(
        "/jobs/{job_id}/profile",
        response_model=dict[str, Any],
        dependencies=guarded("jobs.read"),
        tags=["jobs"],
    )
    def job_profile(job_id: JobId, jobs: Reader) -> dict[str, Any]:
        """The run's profile: the mean step's breakdown, the top operators, memory, advice, and the slowest
        rank's breakdown beside rank 0's."""
        return profile_answer(jobs.run_dir(job_id), job_id)

    @router.get(
        "/jobs/{job_id}/profile/trace",
        response_class=FileResponse,
        responses=TRACE,
        dependencies=guarded("jobs.read"),
        tags=["jobs"],
    )
    def job_profile_trace(
        job_id: JobId,
        jobs: Reader,
        rank: Annotated[
            int, Query(ge=0, le=4096, description="the process whose trace (0: the main one)")
        ] = 0,
    ) -> FileResponse:
        """A rank's trace (Chrome / Perfetto JSON, gzipped): open it in Perfetto or chrome://tracing."""
        return trace_answer(jobs.run_dir(job_id), job_id, rank)

    @router.get("/compare", response_model=Comparison, dependencies=guarded("jobs.read"), tags=["overview"])
    def compare(
        jobs: Reader,
        ids: Annotated[str, Query(max_length=200, description="2 to 8 job ids: 3,5,8")],
    ) -> dict[str, Any]:
        """The spec keys that differ between the jobs (only those) and their final figures; a job the key
        may not see is a 404, as everywhere."""
        try:
            wanted = parse_ids(ids)
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from None
        found = jobs.compared(wanted)
        return {
            "jobs": [{"id": j.id, "name": j.name, "state": j.state, "owner": j.owner} for j in found],
            "spec_diff": spec_diff([j.spec for j in found]),
            "finals": [finals(j.id, RunDir(j.run_dir).readable_summary(), j.latest) for j in found],
        }

    return router


def _series_answer(path: Path, max_points: int, request: Request) -> Response:
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
