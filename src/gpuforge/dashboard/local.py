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
from typing import Any

import yaml
from fastapi import FastAPI, HTTPException, Request, status
from fastapi.middleware.trustedhost import TrustedHostMiddleware
from fastapi.responses import JSONResponse

from gpuforge.access import presented_key
from gpuforge.dashboard.pages import add_pages
from gpuforge.dashboard.read_routes import ComparedJob, read_routes
from gpuforge.dashboard.read_schemas import JobSpecPublic, WhoAmI
from gpuforge.run_files import events_page, last_record
from gpuforge.runs import RunDir
from gpuforge.store.models import ENDED_JOB_STATES, JobState, state_lists

RUN_FILES = ("spec.yaml", "events.jsonl", "metrics.jsonl")
READ = (
    *RUN_FILES,
    "summary.json",
    "lr_find.json",
    "logs",
    "logs/process.log",
    "compressed",
    "compressed/report.json",
)
LOOPBACK_NAMES = ["127.0.0.1", "localhost", "::1", "[::1]"]
# the events a runner ends on: the store's stopped states, read from the run's own events here
ENDED = {state.value for state in (*ENDED_JOB_STATES, JobState.PAUSED)}
QUIET_S = 600.0  # a run not written for this long, with no end recorded, is no longer said to run
MAX_RUNS = 10_000
UNAUTHORIZED = "missing or wrong key: the one `gpuforge dashboard` printed when it started"


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


class LocalJobReader:
    """The read routes' jobs (dashboard/read_routes.py) as the run directories under a root show them,
    found again for each request; a run's id is its place by start time."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: list[Path] | None = None

    def runs(self) -> list[Path]:
        if self._runs is None:
            self._runs = find_runs(self.root)
        return self._runs

    def whoami(self) -> WhoAmI:
        return WhoAmI(name="local", admin=True, read_only=True, states=state_lists(("stopped",)))

    def page(
        self, state: str | None, owner: str | None, limit: int, offset: int, search: int | None = None
    ) -> tuple[int, list[dict]]:
        if search is not None:
            return 0, []  # run directories belong to no server's search
        newest_first = list(reversed(list(enumerate(self.runs(), start=1))))
        if not state and not owner:  # only the page's runs are read
            return len(newest_first), [describe(i, run) for i, run in newest_first[offset : offset + limit]]
        jobs = [describe(i, run) for i, run in newest_first]
        jobs = [j for j in jobs if (not state or j["state"] == state) and (not owner or j["owner"] == owner)]
        return len(jobs), jobs[offset : offset + limit]

    def job(self, job_id: int) -> dict[str, Any]:
        return describe(job_id, self.run_dir(job_id))

    def run_dir(self, job_id: int) -> Path:
        found = self.runs()
        if not 1 <= job_id <= len(found):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
        return found[job_id - 1]

    def spec(self, job_id: int) -> JobSpecPublic:
        run = self.run_dir(job_id)
        text = (run / "spec.yaml").read_text() if (run / "spec.yaml").is_file() else ""
        return JobSpecPublic(yaml=text, spec=_spec(run))

    def events(self, job_id: int, after: int, limit: int) -> list[dict[str, Any]]:
        return events_page(self.run_dir(job_id) / "events.jsonl", after, limit)

    def compared(self, ids: list[int]) -> list[ComparedJob]:
        found = [(job_id, self.run_dir(job_id)) for job_id in ids]
        described = [(describe(job_id, run), run) for job_id, run in found]
        return [
            ComparedJob(j["id"], j["name"], j["state"], j["owner"], _spec(run), run, latest=j)
            for j, run in described
        ]


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

    async def local_reader() -> LocalJobReader:  # the key was checked by the middleware above
        return LocalJobReader(root)

    app.include_router(read_routes(local_reader))  # the server's own read routes, over run directories
    add_pages(app)
    return app
