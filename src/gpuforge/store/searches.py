"""The reads of searches the API and the loop make: who may see one, its trials (jobs), what each cost."""

from __future__ import annotations

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from gpuforge.store.models import ApiKey, Job, LedgerEntry, Search, SearchState


def visible(key: ApiKey):
    """The searches `key` may read: its own and its project's; an admin's, all."""
    if key.admin:
        return True
    mine = Search.owner_id == key.id if key.owned is None else Search.owner_id.in_(sorted(key.owned))
    return or_(mine, Search.project_id == key.project_id) if key.project_id is not None else mine


def visible_search(s: Session, key: ApiKey, search_id: int) -> Search | None:
    """The search, where `key` may read it."""
    return s.scalar(select(Search).where(Search.id == search_id, visible(key)))


def searches_of(s: Session, key: ApiKey, limit: int = 100) -> list[Search]:
    return list(s.scalars(select(Search).where(visible(key)).order_by(Search.id.desc()).limit(limit)))


def running_searches(s: Session) -> list[Search]:
    return list(s.scalars(select(Search).where(Search.state == SearchState.RUNNING).order_by(Search.id)))


def trials_of(s: Session, search_id: int) -> list[Job]:
    return list(s.scalars(select(Job).where(Job.search_id == search_id).order_by(Job.trial)))


def spend_by_job(s: Session, job_ids: list[int]) -> dict[int, tuple[float, float]]:
    """(dollars, device-seconds) the ledger holds for each job (a job it holds nothing for: absent)."""
    if not job_ids:
        return {}
    subjects = {f"job:{i}": i for i in job_ids}
    rows = s.execute(
        select(LedgerEntry.subject, func.sum(LedgerEntry.usd), func.sum(LedgerEntry.device_seconds))
        .where(LedgerEntry.subject.in_(subjects))
        .group_by(LedgerEntry.subject)
    )
    return {subjects[subject]: (float(usd or 0.0), float(seconds or 0.0)) for subject, usd, seconds in rows}
