"""The audit log: one row for each change made through the API, written by the route in the transaction
of the change itself (so a change that rolls back leaves no row, and none is made without one), and read
back newest first. Rows are never changed nor deleted: nothing here does, and the store's triggers refuse
it (migration 0011)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import false, select
from sqlalchemy.orm import Session

from gpuforge.store.models import AuditEntry, utcnow

MAX_LISTED = 1000  # rows a read returns at most: a page; `before` asks for the next one


@dataclass(frozen=True)
class Actor:
    """Who made a change, and from where: a key's name and id (none for a request without a valid key)."""

    name: str
    key_id: int | None
    source: str


def record(
    s: Session,
    actor: Actor,
    action: str,
    target: str,
    project_id: int | None = None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    outcome: str = "done",
) -> AuditEntry:
    """Add the row to `s`: it is committed with the change, or not at all."""
    entry = AuditEntry(
        at=utcnow(), actor=actor.name[:100], actor_key_id=actor.key_id, source=actor.source[:64],
        action=action, target=target[:200], project_id=project_id, before=before, after=after,
        outcome=outcome,
    )  # fmt: skip
    s.add(entry)
    return entry


def entries(
    s: Session,
    reader_project: int | None | bool = True,
    project_id: int | None = None,
    actor: str | None = None,
    action: str | None = None,
    since: datetime | None = None,
    before_id: int | None = None,
    limit: int = 100,
) -> list[AuditEntry]:
    """Rows newest first, filtered: every row for `reader_project` True (an admin), else that project's
    (None: no row, a reader in no project has none to read)."""
    query = select(AuditEntry)
    if reader_project is not True:
        query = query.where(
            AuditEntry.project_id == reader_project if reader_project is not None else false()
        )
    if project_id is not None:
        query = query.where(AuditEntry.project_id == project_id)
    if actor is not None:
        query = query.where(AuditEntry.actor == actor)
    if action is not None:
        query = query.where(AuditEntry.action == action)
    if since is not None:
        query = query.where(AuditEntry.at >= since)
    if before_id is not None:
        query = query.where(AuditEntry.id < before_id)
    query = query.order_by(AuditEntry.id.desc()).limit(min(max(limit, 1), MAX_LISTED))
    return list(s.scalars(query))
