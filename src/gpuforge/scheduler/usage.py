"""Each key's and project's device-time lately, for fair share (queue.py): the device-seconds the ledger
(store/ledger.py) charged it, minute by minute, each minute's weighed down by half every half-life since
it ended, so that what a project used yesterday barely counts against it today. From the ledger, not from
jobs' start and end times: a job's time preempted or paused is no use, and what a paused job used still
counts."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuforge.store.models import LedgerEntry, utcnow

HALF_LIFE_S = 3600.0
HORIZON_HALF_LIVES = 6  # older than this weighs under 2 %: not read


def recent_usage(
    s: Session, now: datetime | None = None, half_life_s: float = HALF_LIFE_S
) -> tuple[dict[int | None, float], dict[int | None, float]]:
    """(key -> decayed device-seconds within the horizon, project -> the same)."""
    now = now or utcnow()
    since = now - timedelta(seconds=half_life_s * HORIZON_HALF_LIVES)
    rows = s.execute(
        select(
            LedgerEntry.key_id, LedgerEntry.project_id, LedgerEntry.minute, LedgerEntry.device_seconds
        ).where(LedgerEntry.minute >= since, LedgerEntry.device_seconds > 0)
    )
    usage: dict[int | None, float] = {}
    by_project: dict[int | None, float] = {}
    for key, project, minute, device_seconds in rows:
        ended = (now - minute).total_seconds() - 60.0  # the minute's end (the current one: now)
        used = device_seconds * 0.5 ** (max(0.0, ended) / half_life_s)
        usage[key] = usage.get(key, 0.0) + used
        if project is not None:
            by_project[project] = by_project.get(project, 0.0) + used
    return usage, by_project
