"""Views across jobs, for the dashboard and scripts alike: who a key is, runs compared, the devices and
who holds them, and spend per key per day."""

from __future__ import annotations

from datetime import date, datetime, time, timedelta
from pathlib import Path
from typing import Annotated, Any

import yaml
from fastapi import APIRouter, HTTPException, Query, Request, status
from sqlalchemy import or_, select

from gpuforge.dashboard.compare import finals, parse_ids, spec_diff
from gpuforge.run_files import last_record
from gpuforge.runs import RunDir
from gpuforge.server.auth import Key
from gpuforge.server.schemas import Comparison, CostsPublic, DevicePublic, WhoAmI
from gpuforge.store.db import session
from gpuforge.store.models import LIVE_DEPLOYMENT_STATES, Deployment, Device, Job, utcnow

router = APIRouter(prefix="/api/v1", tags=["overview"])
HOUR = timedelta(hours=1)
MAX_COST_DAYS = 366
FIRST_DAY, LAST_DAY = date(2000, 1, 1), date(2999, 12, 31)  # dates a job can have run on


@router.get("/whoami", response_model=WhoAmI)
async def whoami(key: Key) -> WhoAmI:
    """The key's name and whether it is an admin's: the dashboard signs in with it."""
    return WhoAmI(name=key.name, admin=key.admin)


@router.get("/compare", response_model=Comparison)
def compare(
    request: Request,
    key: Key,
    ids: Annotated[str, Query(max_length=200, description="2 to 8 job ids: 3,5,8")],
) -> dict[str, Any]:
    """The spec keys that differ between the jobs (only those) and their final figures; a job the key
    may not see is a 404, as everywhere."""
    try:
        wanted = parse_ids(ids)
    except ValueError as err:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from None
    with session(request.app.state.engine) as s:
        jobs = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(wanted)))}
        for job_id in wanted:
            job = jobs.get(job_id)
            if job is None or not (key.admin or job.owner_id == key.id):
                raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
        rows = [jobs[i] for i in wanted]
        specs = [yaml.safe_load(j.spec_yaml) or {} for j in rows]
    return {
        "jobs": [{"id": j.id, "name": j.name, "state": j.state, "owner": j.owner} for j in rows],
        "spec_diff": spec_diff(specs),
        "finals": [finals(j.id, RunDir(j.run_dir).readable_summary(), _latest(j)) for j in rows],
    }


def _latest(job: Job) -> dict[str, Any]:
    figures = {"loss": job.loss, "samples_per_s": job.samples_per_s, "mfu": job.mfu, "cost_usd": job.cost_usd}
    if job.started_at is not None:
        figures["wall_s"] = ((job.finished_at or utcnow()) - job.started_at).total_seconds()
    return figures


@router.get("/devices", response_model=list[DevicePublic])
def devices(request: Request, key: Key) -> list[dict[str, Any]]:
    """Each device: the job or replica holding it (another key's job unnamed), the seconds jobs held it in
    the last hour (from their start and end times), and the memory its job peaked at where it reports it."""
    now = utcnow()
    with session(request.app.state.engine) as s:
        rows = list(s.scalars(select(Device).order_by(Device.kind.desc(), Device.id)))
        recent = s.scalars(
            select(Job).where(
                Job.devices.is_not(None),
                Job.started_at.is_not(None),
                or_(Job.finished_at.is_(None), Job.finished_at > now - HOUR),
            )
        ).all()
        replicas = {
            w["device"]: (d.name, w["index"], key.admin or d.owner_id == key.id)
            for d in s.scalars(select(Deployment).where(Deployment.state.in_(LIVE_DEPLOYMENT_STATES)))
            for w in d.workers or []
            if w.get("device")
        }
    busy: dict[str, float] = {}
    for job in recent:
        start, end = max(job.started_at, now - HOUR), job.finished_at or now
        for device_id in (job.devices or "").split(","):
            busy[device_id] = busy.get(device_id, 0.0) + max(0.0, (end - start).total_seconds())
    holders = {j.id: j for j in recent}
    answer = []
    for device in rows:
        entry = {
            "id": device.id,
            "kind": device.kind,
            "name": device.name,
            "memory_bytes": device.memory_bytes,
            "memory_used_bytes": None,
            "held_by": None,
            "job": None,
            "deployment": None,
            "busy_s_last_hour": min(busy.get(device.id, 0.0), HOUR.total_seconds()),
            "busy_seconds": device.busy_seconds or 0.0,
        }
        if device.job_id is not None:
            entry["held_by"] = "job"
            job = holders.get(device.job_id)
            if job is not None and (key.admin or job.owner_id == key.id):
                entry["job"] = {"id": job.id, "name": job.name, "owner": job.owner}
                latest = last_record(Path(job.run_dir) / "metrics.jsonl") or {}
                entry["memory_used_bytes"] = latest.get("peak_mem_bytes")
        elif device.id in replicas:
            name, index, visible = replicas[device.id]
            entry["held_by"] = "replica"
            entry["deployment"] = {"name": name, "replica": index} if visible else None
        answer.append(entry)
    return answer


@router.get("/costs", response_model=CostsPublic)
def costs(
    request: Request,
    key: Key,
    since: Annotated[
        date | None, Query(ge=FIRST_DAY, le=LAST_DAY, description="first day (UTC); default: 30 days ago")
    ] = None,
    until: Annotated[
        date | None, Query(ge=FIRST_DAY, le=LAST_DAY, description="last day (UTC), included; default: today")
    ] = None,
) -> dict[str, Any]:
    """Spend per key per day: your own, or every key's with an admin key. A job's cost is spread over the
    days it ran in proportion to its time in each (its figures, not a ledger: paused time counts as run)."""
    until = until or utcnow().date()
    since = since or until - timedelta(days=29)
    if since > until or (until - since).days >= MAX_COST_DAYS:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"since..until: {since}..{until} must be a period of 1 to {MAX_COST_DAYS} days, since first",
        )
    start = datetime.combine(since, time.min, tzinfo=utcnow().tzinfo)
    end = datetime.combine(until + timedelta(days=1), time.min, tzinfo=start.tzinfo)
    query = select(Job).where(
        Job.cost_usd > 0,
        Job.started_at.is_not(None),
        Job.started_at < end,
        or_(Job.finished_at.is_(None), Job.finished_at >= start),
    )
    if not key.admin:
        query = query.where(Job.owner_id == key.id)
    now = utcnow()
    cells: dict[tuple[str, str], list] = {}
    with session(request.app.state.engine) as s:
        for job in s.scalars(query):
            ran_from, ran_to = job.started_at, max(job.finished_at or now, job.started_at)
            length = (ran_to - ran_from).total_seconds()
            for day, seconds in _days(ran_from, ran_to, start, end):
                share = seconds / length if length > 0 else 1.0
                cell = cells.setdefault((day, job.owner or "?"), [0.0, 0])
                cell[0] += job.cost_usd * share
                cell[1] += 1
    rows = [{"day": d, "key": k, "usd": usd, "jobs": n} for (d, k), (usd, n) in sorted(cells.items())]
    return {
        "since": since.isoformat(),
        "until": until.isoformat(),
        "days": [(since + timedelta(days=i)).isoformat() for i in range((until - since).days + 1)],
        "keys": sorted({r["key"] for r in rows}),
        "rows": rows,
        "total_usd": sum(r["usd"] for r in rows),
    }


def _days(ran_from: datetime, ran_to: datetime, start: datetime, end: datetime):
    """(day, seconds) for each UTC day of [ran_from, ran_to] within [start, end); a run of no length
    counts once, on its day."""
    if ran_to <= ran_from:
        if start <= ran_from < end:
            yield ran_from.date().isoformat(), 0.0
        return
    day = datetime.combine(max(ran_from, start).date(), time.min, tzinfo=start.tzinfo)
    while day < min(ran_to, end):
        following = day + timedelta(days=1)
        seconds = (min(ran_to, following) - max(ran_from, day)).total_seconds()
        if seconds > 0:
            yield day.date().isoformat(), seconds
        day = following
