"""A job's profile: ask a running job to profile its next steps, read the report, fetch a rank's trace.

The request is a file in the job's run directory (profile_files.py), which the runner's main process
takes at its next step (a look a second at most): the server needs no channel to the runner, and a
runner re-attached after a server restart takes it all the same.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from fastapi import APIRouter, HTTPException, Request, status
from pydantic import BaseModel, ConfigDict, Field

from gpuforge.dashboard.read_routes import JobId
from gpuforge.profile_files import REQUEST_FILE, ask
from gpuforge.server.auth import Key
from gpuforge.server.permissions import audited, permit
from gpuforge.server.services import services
from gpuforge.server.visibility import changeable_job
from gpuforge.spec import MAX_PROFILE_STEPS
from gpuforge.store.db import session
from gpuforge.store.models import JobState

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])


class ProfileAsk(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(
        5, ge=1, le=MAX_PROFILE_STEPS, description="steps to record, from the runner's next one on"
    )


class ProfileAsked(BaseModel):
    job_id: int
    steps: int
    note: str


@router.post(
    "/{job_id}/profile",
    response_model=ProfileAsked,
    status_code=status.HTTP_202_ACCEPTED,
    dependencies=[permit("jobs.profile")],
)
def ask_profile(job_id: JobId, body: ProfileAsk, request: Request, key: Key) -> ProfileAsked:
    """Profile a running job's next `steps` steps (its owner or an admin). The report replaces the run's
    earlier one; `GET .../profile` reads it once the `profiled` event came."""
    with session(services(request).engine) as s:
        job = changeable_job(s, key, job_id, "jobs.profile")
        project_id = job.project_id
        if (yaml.safe_load(job.spec_yaml) or {}).get("kind") == "script":
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"job {job_id} is a script job: it runs its own loop, which gpuforge does not profile",
            )
        if job.state != JobState.RUNNING:
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {job.state}, not running")
        run_dir = Path(job.run_dir)
    try:
        ask(run_dir, body.steps)
    except OSError as err:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, f"job {job_id}: {REQUEST_FILE} not written ({err.strerror})"
        ) from None
    note = "the runner takes the request at its next step and profiles the steps after it"
    with session(services(request).engine) as s:  # the change is the request file: its row follows it
        audited(s, request, key, f"job {job_id}", project_id, after={"profile_steps": body.steps})
    return ProfileAsked(job_id=job_id, steps=body.steps, note=note)
