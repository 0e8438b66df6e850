"""`gpuforge dashboard RUNS_DIR`: the dashboard's job, compare and report pages over local run directories,
read-only, with no server and no store, for a user who only runs `gpuforge train`.

It answers the same /api/v1 read routes as the server, for the runs it finds: RUNS_DIR itself when it is
a run directory, else each run directory in it or one level further down (a server home's runs/). Each run
gets an id by its start time, oldest first. It changes nothing, and reads nothing outside RUNS_DIR (a run
with a file linked outside is left out). It listens on loopback only, answers only requests addressed to a
loopback name (a web page that rebinds its own name to 127.0.0.1 gets nothing), and its API asks for a key
made at each start: other users of a shared machine reach loopback too.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from hmac import compare_digest
from pathlib import Path
from typing import Annotated, Any

import yaml
from fastapi import FastAPI, HTTPException, Query, Request, Response, status
from fastapi import Path as PathParam
from fastapi.middleware.trustedhost import TrustedHostMiddleware
from fastapi.responses import JSONResponse

from gpuforge.access import presented_key
from gpuforge.dashboard.pages import add_pages
from gpuforge.dashboard.profiles import profile_answer, trace_answer
from gpuforge.dashboard.run_diff import finals, parse_ids, spec_diff
from gpuforge.run_files import events_page, last_record, log_tail, metrics_page, read_report, series
from gpuforge.runs import RunDir
from gpuforge.store.models import ENDED_JOB_STATES, JobState, state_lists

RUN_FILES = ("spec.yaml", "events.jsonl", "metrics.jsonl")
READ = (*RUN_FILES, "summary.json", "logs", "logs/process.log", "compressed", "compressed/report.json")
LOOPBACK_NAMES = ["127.0.0.1", "localhost", "::1", "[::1]"]
# the events a runner ends on: the store's stopped states, read from the run's own events here
ENDED = {state.value for state in (*ENDED_JOB_STATES, JobState.PAUSED)}
QUIET_S = 600.0  # a run not written for this long, with no end recorded, is no longer said to run
MAX_RUNS = 10_000
INT32 = 2**31 - 1
UNAUTHORIZED = "missing or wrong key: the one `gpuforge dashboard` printed when it started"
JobId = Annotated[int, PathParam(ge=1, le=MAX_RUNS, description="a run's id")]


def find_runs(root: Path) -> list[Path]:
    """The run directories under `root` (itself, its folders, or theirs), oldest start first."""
    if _is_run(root):
        return [root] if _all_inside(root, root.resolve()) else []
    found: list[Path] = []
    for child in _folders(root):
        found += [child] if _is_run(child) else [g for g in _folders(child) if _is_run(g)]
        if len(found) >= MAX_RUNS:
            break
    inside = [run for run in found[:MAX_RUNS] if _all_inside(run, root.resolve())]
    return sorted(inside, key=lambda run: (_started(run), run.name))


def _all_inside(run: Path, root: Path) -> bool:
    """Whether every file the app reads of `run` lies inside `root` once links are followed."""
    for name in READ:
        path = run / name
        if (path.exists() or path.is_symlink()) and not path.resolve().is_relative_to(root):
            return False
    return True


def _folders(path: Path) -> list[Path]:
    """Its folders, symlinks left out (nothing outside RUNS_DIR is read through one)."""
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def _is_run(path: Path) -> bool:
    return any((path / name).is_file() for name in RUN_FILES)


def _started(run: Path) -> float:
    first = events_page(run / "events.jsonl", -1, 1)
    if first and first[0]["ts"]:
        return first[0]["ts"]
    try:
        return (run / "spec.yaml").stat().st_mtime
    except OSError:
        return run.stat().st_mtime


def _time(ts: float | None) -> datetime | None:
    return datetime.fromtimestamp(ts, UTC) if ts else None


def describe(job_id: int, run: Path) -> dict[str, Any]:
    """A run directory as the server's JobPublic: from its summary, its events and its last metrics."""
    events = events_page(run / "events.jsonl", -1, 100_000)
    started = next((e for e in events if e["kind"] == "started"), None)
    ended = next((e for e in reversed(events) if e["kind"] in ENDED), None)
    summary = RunDir(run).readable_summary() or {}
    latest = last_record(run / "metrics.jsonl") or {}
    state = summary.get("status") or (ended["kind"] if ended else None)
    if state is None:
        state = "running" if time.time() - _last_write(run) < QUIET_S else "stopped"
    spec = _spec(run)
    return {
        "id": job_id,
        "name": spec.get("name") or run.name,
        "owner": None,
        "state": state,
        "priority": 0,
        "device_type": summary.get("device_type") or "",
        "devices_wanted": 1,
        "devices": (started or {}).get("data", {}).get("device"),
        "step": latest.get("step", summary.get("steps")),
        "total_steps": summary.get("total_steps") or _said_total(events),
        "loss": latest.get("loss", summary.get("final_loss")),  # a script's last line may be its eval alone
        "samples_per_s": latest.get("samples_per_s"),
        "mfu": latest.get("mfu"),
        "eta_s": latest.get("eta_s") if state == "running" else None,
        "cost_usd": summary.get("cost_usd", latest.get("cost_usd")),
        "restarts": sum(e["kind"] == "restarted" for e in events),
        "max_restarts": 0,
        "reason": summary.get("reason") or ((ended or {}).get("data", {}).get("reason")),
        "run_dir": str(run),
        "created_at": _time(events[0]["ts"] if events else None) or _time(_started(run)),
        "started_at": _time(started["ts"] if started else None),
        "finished_at": _time(ended["ts"] if ended else None),
        "wall_s": summary.get("wall_s"),
    }


def _said_total(events: list[dict]) -> int | None:
    """The total the runner's `started` or a script's track.total_steps() said last."""
    said = [e["data"].get("total_steps") for e in events if e["kind"] in ("started", "total_steps")]
    return next((total for total in reversed(said) if isinstance(total, int) and total > 0), None)


def _last_write(run: Path) -> float:
    times = [(run / name).stat().st_mtime for name in RUN_FILES if (run / name).exists()]
    return max(times, default=0.0)


def _spec(run: Path) -> dict[str, Any]:
    try:
        spec = yaml.safe_load((run / "spec.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return spec if isinstance(spec, dict) else {}


def create_local_app(root: Path, key: str | None = None) -> FastAPI:
    """The read-only dashboard over the runs under `root` (found again at each request); with `key`, its
    API answers only requests that present it (`Authorization: Bearer`), as the server's does."""
    root = Path(root).resolve()
    app = FastAPI(title="gpuforge dashboard", version="0.1.0", docs_url=None, redoc_url=None)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=LOOPBACK_NAMES)
    if key is not None:

        @app.middleware("http")
        async def require_key(request: Request, call_next):
            given = presented_key(request.headers.get("authorization"), request.headers.get("x-api-key"))
            if request.url.path.startswith("/api/") and not (given and compare_digest(given, key)):
                return JSONResponse({"detail": UNAUTHORIZED}, 401, headers={"WWW-Authenticate": "Bearer"})
            return await call_next(request)

    def runs() -> list[Path]:
        return find_runs(root)

    def run_of(job_id: int) -> Path:
        found = runs()
        if not 1 <= job_id <= len(found):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
        return found[job_id - 1]

    @app.get("/api/v1/whoami")
    def whoami() -> dict[str, Any]:
        return {"name": "local", "admin": True, "read_only": True, "states": state_lists(("stopped",))}

    @app.get("/api/v1/jobs")
    def list_jobs(
        response: Response,
        state: Annotated[str | None, Query(max_length=20)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        offset: Annotated[int, Query(ge=0, le=MAX_RUNS)] = 0,
    ) -> list[dict[str, Any]]:
        newest_first = list(reversed(list(enumerate(runs(), start=1))))
        if not state:  # only the page's runs are read
            response.headers["X-Total-Count"] = str(len(newest_first))
            return [describe(i, run) for i, run in newest_first[offset : offset + limit]]
        jobs = [j for j in (describe(i, run) for i, run in newest_first) if j["state"] == state]
        response.headers["X-Total-Count"] = str(len(jobs))
        return jobs[offset : offset + limit]

    @app.get("/api/v1/jobs/{job_id}")
    def get_job(job_id: JobId) -> dict[str, Any]:
        return describe(job_id, run_of(job_id))

    @app.get("/api/v1/jobs/{job_id}/spec")
    def job_spec(job_id: JobId) -> dict[str, Any]:
        run = run_of(job_id)
        text = (run / "spec.yaml").read_text() if (run / "spec.yaml").is_file() else ""
        return {"yaml": text, "spec": _spec(run)}

    @app.get("/api/v1/jobs/{job_id}/series")
    def job_series(job_id: JobId, max_points: Annotated[int, Query(ge=10, le=20_000)] = 1000) -> dict:
        return series(run_of(job_id) / "metrics.jsonl", max_points)

    @app.get("/api/v1/jobs/{job_id}/metrics")
    def job_metrics(
        job_id: JobId,
        after_step: Annotated[int, Query(ge=-1, le=INT32)] = -1,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> list[dict[str, Any]]:
        return metrics_page(run_of(job_id) / "metrics.jsonl", after_step, limit)

    @app.get("/api/v1/jobs/{job_id}/events")
    def job_events(
        job_id: JobId,
        after: Annotated[int, Query(ge=-1, le=INT32)] = -1,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> list[dict[str, Any]]:
        return events_page(run_of(job_id) / "events.jsonl", after, limit)

    @app.get("/api/v1/jobs/{job_id}/logs")
    def job_logs(job_id: JobId, tail: Annotated[int, Query(ge=0, le=100_000)] = 200) -> dict[str, Any]:
        lines, offset = log_tail(run_of(job_id) / "logs" / "process.log", tail)
        return {"lines": lines, "offset": offset}

    @app.get("/api/v1/jobs/{job_id}/summary")
    def job_summary(job_id: JobId) -> dict[str, Any]:
        summary = RunDir(run_of(job_id)).readable_summary()
        if summary is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no summary yet")
        return summary

    @app.get("/api/v1/jobs/{job_id}/report")
    def job_report(job_id: JobId) -> dict[str, Any]:
        report = read_report(run_of(job_id))
        if report is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no compression report")
        return report

    @app.get("/api/v1/jobs/{job_id}/profile")
    def job_profile(job_id: JobId) -> dict[str, Any]:
        return profile_answer(run_of(job_id), job_id)

    @app.get("/api/v1/jobs/{job_id}/profile/trace")
    def job_profile_trace(job_id: JobId, rank: Annotated[int, Query(ge=0, le=4096)] = 0) -> Response:
        return trace_answer(run_of(job_id), job_id, rank)

    @app.get("/api/v1/compare")
    def compare(ids: Annotated[str, Query(max_length=200)]) -> dict[str, Any]:
        try:
            wanted = parse_ids(ids)
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from None
        found = [(i, run_of(i)) for i in wanted]
        jobs = [describe(i, run) for i, run in found]
        return {
            "jobs": [{k: j[k] for k in ("id", "name", "state", "owner")} for j in jobs],
            "spec_diff": spec_diff([_spec(run) for _, run in found]),
            "finals": [
                finals(j["id"], RunDir(run).readable_summary(), j)
                for j, (_, run) in zip(jobs, found, strict=True)
            ],
        }

    add_pages(app)
    return app
