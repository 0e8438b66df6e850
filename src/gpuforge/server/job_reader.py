"""The read routes' jobs (dashboard/read_routes.py) as the server's store holds them, as one request's key
may see them: its own and its project's, or all with an admin key; a waiting job with its place in the queue
as the scheduler's last tick ordered it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from fastapi import Request

from gpuforge.dashboard.read_routes import ComparedJob
from gpuforge.dashboard.read_schemas import JobSpecPublic, WhoAmI
from gpuforge.dashboard.run_diff import in_users_spec
from gpuforge.server.auth import Key
from gpuforge.server.services import Services, services
from gpuforge.server.visibility import readable, visible_job
from gpuforge.store import jobs
from gpuforge.store.db import session
from gpuforge.store.models import QUEUE_JOB_STATES, ApiKey, Event, Job, utcnow
from gpuforge.store.projects import project_names
from gpuforge.store.users import person_name


class StoreJobReader:
    def __init__(self, served: Services, key: ApiKey) -> None:
        self.served, self.key = served, key

    def whoami(self) -> WhoAmI:
        project = None
        if self.key.project_id is not None:
            with session(self.served.engine) as s:
                project = project_names(s, {self.key.project_id}).get(self.key.project_id)
        return WhoAmI(
            name=person_name(self.key),
            admin=self.key.admin,
            project=project,
            role="admin" if self.key.admin else str(self.key.role),
        )

    def page(
        self, state: str | None, owner: str | None, limit: int, offset: int, search: int | None = None
    ) -> tuple[int, list[Job]]:
        with session(self.served.engine) as s:
            total, rows = jobs.page(s, readable(self.key, Job), state, owner, limit, offset, search)
            return total, self._with_places(rows)

    def job(self, job_id: int) -> Job:
        with session(self.served.engine) as s:
            return self._with_places([visible_job(s, self.key, job_id)])[0]

    def run_dir(self, job_id: int) -> Path:
        with session(self.served.engine) as s:
            return Path(visible_job(s, self.key, job_id).run_dir)

    def spec(self, job_id: int) -> JobSpecPublic:
        with session(self.served.engine) as s:
            job = visible_job(s, self.key, job_id)
            text, files = job.spec_yaml, job.files or {}
        return JobSpecPublic(yaml=text, spec=yaml.safe_load(text) or {}, files=files)

    def events(self, job_id: int, after: int, limit: int) -> Sequence[Event]:
        with session(self.served.engine) as s:
            visible_job(s, self.key, job_id)
            return jobs.events(s, job_id, after, limit)

    def compared(self, ids: list[int]) -> list[ComparedJob]:
        with session(self.served.engine) as s:
            rows = [visible_job(s, self.key, job_id) for job_id in ids]  # 8 at most (run_diff.MAX_COMPARED)
            return [
                ComparedJob(
                    id=j.id,
                    name=j.name,
                    state=j.state,
                    owner=j.owner,
                    spec=in_users_spec(yaml.safe_load(j.spec_yaml) or {}, j.files),  # names, not hashes
                    run_dir=Path(j.run_dir),
                    latest=_latest(j),
                )
                for j in rows
            ]

    def _with_places(self, rows: list[Job]) -> list[Job]:
        scheduler = self.served.scheduler
        places = scheduler.queue_positions if scheduler is not None else {}
        for job in rows:
            job.queue_position = places.get(job.id) if job.state in QUEUE_JOB_STATES else None
        return rows


def _latest(job: Job) -> dict[str, Any]:
    figures = {"loss": job.loss, "samples_per_s": job.samples_per_s, "mfu": job.mfu, "cost_usd": job.cost_usd}
    if job.started_at is not None:
        figures["wall_s"] = ((job.finished_at or utcnow()) - job.started_at).total_seconds()
    return figures


async def store_reader(request: Request, key: Key) -> StoreJobReader:
    """The read routes' dependency: the key checked (server/auth.py), then the jobs it may see. Async: no
    thread hop before the hot reads."""
    return StoreJobReader(services(request), key)
