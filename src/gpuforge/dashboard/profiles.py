"""A run's profile over HTTP, for the server's routes and `gpuforge dashboard` alike: the report (rank 0's,
with the slowest rank beside it) and a rank's trace, gzipped as written. Nothing is read through a link
that leaves the run directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import HTTPException, status
from fastapi.responses import FileResponse

from gpuforge.profile_files import PROFILE_DIR, ProfileError, read_profile, trace_path


def profile_answer(run_dir: Path, job_id: int) -> dict[str, Any]:
    """The run's profile report; 404 where it has none, 422 where it is not one gpuforge wrote."""
    _check_inside(run_dir, Path(run_dir) / PROFILE_DIR, job_id)
    try:
        report = read_profile(run_dir)
    except ProfileError as err:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"job {job_id}: {err}") from None
    if report is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no profile")
    return report


def trace_answer(run_dir: Path, job_id: int, rank: int) -> FileResponse:
    """A rank's trace (Chrome / Perfetto JSON, gzipped), as a file to save; 404 where there is none."""
    path = trace_path(run_dir, rank)
    _check_inside(run_dir, path, job_id)
    if not path.is_file():
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no profile trace of rank {rank}")
    name = f"job-{job_id}-{path.name}"
    return FileResponse(path, media_type="application/gzip", filename=name)


def _check_inside(run_dir: Path, path: Path, job_id: int) -> None:
    """A profile file linked outside its run directory is none: nothing outside is served."""
    if (path.exists() or path.is_symlink()) and not path.resolve().is_relative_to(Path(run_dir).resolve()):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no profile")
