"""How long each device was busy, from one source: the cost ledger (store/ledger.py), which charges every
job and every replica minute by minute while its process runs.

A ledger row is one subject's (a job's, a deployment's) device-seconds in one minute, for all the devices
it held. They are shared out over the devices it holds (a job: Job.devices; a deployment: its replicas'
devices), evenly, as the ledger counted each device alike. A subject that moved (a job resumed on another
device) is counted on the devices it holds now, so two subjects can seem to share a device in the same
minute: the last hour's figure is cut at 60 s a device a minute, and the figure in all at the wall time
since the device's first charged minute. So neither exceeds the wall time, and the last hour's never
exceeds the figure in all (it is a part of the same rows, cut)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gpuforge.store.ledger import MINUTE, minute_of
from gpuforge.store.models import Deployment, Job, LedgerEntry, utcnow

HOUR_MINUTES = 60
CHUNK = 500  # ids a query asks for at once (SQLite's bound on a statement's parameters is far above)


@dataclass(frozen=True)
class Busy:
    last_hour_s: float  # in the last 60 minutes (this one included): at most 3600
    in_all_s: float  # since the ledger first charged time on the device


def device_busy(s: Session, now: datetime | None = None) -> dict[str, Busy]:
    """device id -> its busy time, for each device the ledger's subjects hold (others were never busy)."""
    now = now or utcnow()
    first_minute = minute_of(now) - (HOUR_MINUTES - 1) * MINUTE
    recent = s.execute(
        select(LedgerEntry.subject, LedgerEntry.minute, LedgerEntry.device_seconds).where(
            LedgerEntry.minute >= first_minute
        )
    ).all()
    totals = s.execute(
        select(
            LedgerEntry.subject, func.sum(LedgerEntry.device_seconds), func.min(LedgerEntry.minute)
        ).group_by(LedgerEntry.subject)
    ).all()
    held = _devices_held(s, {subject for subject, *_ in totals})

    per_minute: dict[tuple[str, datetime], float] = defaultdict(float)
    for subject, minute, seconds in recent:
        for device, share in _shares(held.get(subject, ()), seconds):
            per_minute[(device, minute_of(minute))] += share
    last_hour: dict[str, float] = defaultdict(float)
    for (device, _), seconds in per_minute.items():
        last_hour[device] += min(seconds, MINUTE.total_seconds())

    in_all: dict[str, float] = defaultdict(float)
    since: dict[str, datetime] = {}
    for subject, seconds, first in totals:
        for device, share in _shares(held.get(subject, ()), float(seconds or 0.0)):
            in_all[device] += share
            first = minute_of(first)
            since[device] = min(since.get(device, first), first)
    return {
        device: Busy(
            last_hour_s=last_hour.get(device, 0.0),
            in_all_s=min(seconds, max(0.0, (now - since[device]).total_seconds())),
        )
        for device, seconds in in_all.items()
    }


def _shares(devices: Iterable[str], seconds: float) -> list[tuple[str, float]]:
    devices = list(devices)
    return [(d, seconds / len(devices)) for d in devices] if devices else []


def _devices_held(s: Session, subjects: set[str]) -> dict[str, tuple[str, ...]]:
    """subject -> the devices it holds (or held last): a job's, a deployment's replicas'."""
    job_ids = sorted(int(x.split(":", 1)[1]) for x in subjects if x.startswith("job:"))
    deployment_ids = sorted(int(x.split(":", 1)[1]) for x in subjects if x.startswith("deployment:"))
    held: dict[str, tuple[str, ...]] = {}
    for chunk in _chunks(job_ids):
        for job_id, devices in s.execute(select(Job.id, Job.devices).where(Job.id.in_(chunk))):
            held[f"job:{job_id}"] = tuple(d for d in (devices or "").split(",") if d)
    for chunk in _chunks(deployment_ids):
        for deployment_id, workers in s.execute(
            select(Deployment.id, Deployment.workers).where(Deployment.id.in_(chunk))
        ):
            devices = dict.fromkeys(w["device"] for w in workers or () if w.get("device"))
            held[f"deployment:{deployment_id}"] = tuple(devices)
    return held


def _chunks(ids: list[int]) -> Iterable[list[int]]:
    return (ids[i : i + CHUNK] for i in range(0, len(ids), CHUNK))
