"""The audit log (store/audit.py): every change made through the API, newest first. An admin key reads
every row; a maintainer its project's. Nothing here, or anywhere in the API, changes or deletes a row.

    GET /api/v1/audit?project=P&actor=A&action=jobs.cancel&since=2026-12-01T00:00:00Z&before=ID&limit=N
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, status
from pydantic import BaseModel, ConfigDict

from gpuforge.server.auth import Key
from gpuforge.server.permissions import permit
from gpuforge.server.services import services
from gpuforge.store import audit
from gpuforge.store.db import session
from gpuforge.store.projects import project_named, project_names

router = APIRouter(prefix="/api/v1/audit", tags=["audit"])


class AuditEntryPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    at: datetime
    actor: str
    source: str
    action: str
    target: str
    project: str | None = None
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    outcome: str


@router.get("", response_model=list[AuditEntryPublic], dependencies=[permit("audit.read")])
def read_audit(
    request: Request,
    key: Key,
    project: Annotated[str | None, Query(max_length=100, description="a project's rows")] = None,
    actor: Annotated[str | None, Query(max_length=100, description="a key's rows, by name")] = None,
    action: Annotated[str | None, Query(max_length=40, description="one action: jobs.cancel")] = None,
    since: Annotated[datetime | None, Query(description="rows at or after this time (ISO 8601)")] = None,
    before: Annotated[int | None, Query(ge=1, description="rows older than this id: the next page")] = None,
    limit: Annotated[int, Query(ge=1, le=audit.MAX_LISTED)] = 100,
) -> list[AuditEntryPublic]:
    """Rows newest first, filtered; an admin key reads all, a maintainer its project's."""
    with session(services(request).engine) as s:
        project_id = None
        if project is not None:
            try:
                project_id = project_named(s, project).id
            except LookupError:
                raise HTTPException(status.HTTP_404_NOT_FOUND, f"no project {project!r}") from None
            if not key.admin and project_id != key.project_id:
                raise HTTPException(status.HTTP_404_NOT_FOUND, f"no project {project!r}")
        reader_project = True if key.admin else key.project_id
        rows = audit.entries(s, reader_project, project_id, actor, action, since, before, limit)
        names = project_names(s, {r.project_id for r in rows})
        return [
            AuditEntryPublic.model_validate(r).model_copy(update={"project": names.get(r.project_id)})
            for r in rows
        ]
