"""The cost ledger: what each running job and replica costs, minute by minute, charged to its key and
project as it runs (not recomputed later from summaries, which a killed run may never write).

Each scheduling tick calls `accrue`: for every job running and every deployment with replicas up, the time
since its mark (`accrued_at`) is cut at minute boundaries, added to one row per (subject, minute), and the
mark moved to now, all in the tick's transaction. A server killed at any moment either committed both or
neither: no second is counted twice, none lost while the job ran. (A job whose process died while the
server was down is charged up to the server's return: the ledger cannot know when it died; at most the
down time.)

A job's rate is its spec's cost.usd_per_hour (one device, filled from prices.yaml when the spec set none)
times its devices; a deployment's is the price of one replica's device times its replicas up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuforge.store.models import Deployment, Job, LedgerEntry, utcnow

MAX_GAP = timedelta(days=31)  # a mark older than this (a store restored from long ago) is not charged


@dataclass(frozen=True)
class Charge:
    subject: str  # "job:12" | "deployment:3"
    key_id: int | None
    project_id: int | None
    devices: int
    usd_per_hour: float


def minute_of(when: datetime) -> datetime:
    return when.replace(second=0, microsecond=0)


def month_start(when: datetime) -> datetime:
    return when.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def _slices(since: datetime, until: datetime) -> Iterable[tuple[datetime, float]]:
    """(minute, seconds in it) from `since` to `until`."""
    at = since
    while at < until:
        minute = minute_of(at)
        end = min(until, minute + timedelta(minutes=1))
        yield minute, (end - at).total_seconds()
        at = end


def charge(s: Session, row: Job | Deployment, what: Charge, now: datetime) -> float:
    """Add `row`'s time since its mark to the ledger and move its mark to `now`; the dollars added."""
    since = row.accrued_at
    row.accrued_at = now
    if since is None or since >= now or now - since > MAX_GAP:
        return 0.0  # its first tick sets the mark
    added = 0.0
    for minute, seconds in _slices(since, now):
        device_seconds = seconds * what.devices
        usd = device_seconds * what.usd_per_hour / 3600.0
        entry = s.scalar(
            select(LedgerEntry).where(LedgerEntry.subject == what.subject, LedgerEntry.minute == minute)
        )
        if entry is None:
            entry = LedgerEntry(
                subject=what.subject,
                minute=minute,
                key_id=what.key_id,
                project_id=what.project_id,
                device_seconds=0.0,
                usd=0.0,
            )
            s.add(entry)
        entry.device_seconds += device_seconds
        entry.usd += usd
        added += usd
    return added


def accrue(
    s: Session, jobs: Iterable[Job], deployments: Iterable[Deployment], now: datetime | None = None
) -> None:
    """Charge every job that runs (with a process) and every deployment with replicas up, to `now`."""
    now = now or utcnow()
    for job in jobs:
        if job.pid is None:
            continue  # claimed, not started: nothing runs yet
        rate = job.usd_per_hour or 0.0
        what = Charge(f"job:{job.id}", job.owner_id, job.project_id, job.devices_wanted, rate)
        charge(s, job, what, now)
    for deployment in deployments:
        up = sum(1 for w in deployment.workers or () if w.get("pid"))
        if not up:
            deployment.accrued_at = None  # nothing runs: the next replica starts a new mark
            continue
        rate = (deployment.usd_per_hour or 0.0) * up
        what = Charge(
            f"deployment:{deployment.id}", deployment.owner_id, deployment.project_id, up, rate / up
        )
        charge(s, deployment, what, now)


def month_spend(s: Session, now: datetime | None = None) -> dict[int, float]:
    """project id -> dollars charged to it since the start of this month (UTC)."""
    since = month_start(now or utcnow())
    rows = s.execute(
        select(LedgerEntry.project_id, func.sum(LedgerEntry.usd))
        .where(LedgerEntry.minute >= since, LedgerEntry.project_id.is_not(None))
        .group_by(LedgerEntry.project_id)
    )
    return {project: float(total or 0.0) for project, total in rows}
