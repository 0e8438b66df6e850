"""Views across jobs, for the dashboard and scripts alike: who a key is, runs compared, the devices and
who holds them, and spend from the cost ledger."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from fastapi import APIRouter, HTTPException, Query, Request, status
from sqlalchemy import or_, select

from gpuforge.dashboard.compare import finals, in_users_spec, parse_ids, spec_diff
from gpuforge.run_files import last_record
from gpuforge.runs import RunDir
from gpuforge.server.auth import Key
from gpuforge.server.pricing import prices_of, server_prices, set_price_command, shown_price
from gpuforge.server.schemas import Comparison, CostsPublic, DevicePublic, PricesPublic, WhoAmI
from gpuforge.server.visibility import may_read
from gpuforge.store import ledger
from gpuforge.store.db import session
from gpuforge.store.device_busy import device_busy
from gpuforge.store.models import (
    LIVE_DEPLOYMENT_STATES,
    ApiKey,
    Deployment,
    Device,
    Job,
    LedgerEntry,
    Project,
    utcnow,
)

router = APIRouter(prefix="/api/v1", tags=["overview"])
MAX_COST_DAYS = 366  # the costs answer for a year back at most (and for a period of a year at most)
CostBy = Literal["day", "key", "project"]
SUBJECTS = {"job": Job, "deployment": Deployment}  # the ledger's subjects, "job:12" | "deployment:3"


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
            if job is None or not may_read(key, job):
                raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id}")
        rows = [jobs[i] for i in wanted]
        specs = [in_users_spec(yaml.safe_load(j.spec_yaml) or {}, j.files) for j in rows]  # names, not hashes
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
    """Each device this server has now: the job or replica holding it (named where the key may read it),
    how long it was busy in the last hour and in all (store/device_busy.py: from the cost ledger, which
    charges jobs and replicas alike), its price an hour or null with the command that sets one, and the
    memory its job peaked at where it reports it."""
    inventory = list(request.app.state.devices)
    prices = prices_of(request.app.state.settings.home, inventory)
    with session(request.app.state.engine) as s:
        holding = dict(s.execute(select(Device.id, Device.job_id).where(Device.job_id.is_not(None))).all())
        holders = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(set(holding.values()))))}
        replicas = {
            w["device"]: (d.name, w["index"], may_read(key, d))
            for d in s.scalars(select(Deployment).where(Deployment.state.in_(LIVE_DEPLOYMENT_STATES)))
            for w in d.workers or []
            if w.get("device")
        }
        busy = device_busy(s)
    answer = []
    for device in inventory:
        usd, source, set_price = shown_price(prices.get(device.id), device.kind)
        spent = busy.get(device.id)
        entry = {
            "id": device.id,
            "kind": device.kind,
            "name": device.name,
            "memory_bytes": device.memory_bytes,
            "memory_used_bytes": None,
            "held_by": None,
            "job": None,
            "deployment": None,
            "busy_s_last_hour": spent.last_hour_s if spent else 0.0,
            "busy_seconds": spent.in_all_s if spent else 0.0,
            "usd_per_hour": usd,
            "price_source": source,
            "set_price": set_price,
        }
        job = holders.get(holding.get(device.id))
        if job is not None:
            entry["held_by"] = "job"
            if may_read(key, job):
                entry["job"] = {"id": job.id, "name": job.name, "owner": job.owner}
                latest = last_record(Path(job.run_dir) / "metrics.jsonl") or {}
                entry["memory_used_bytes"] = latest.get("peak_mem_bytes")
        elif device.id in replicas:
            name, index, visible = replicas[device.id]
            entry["held_by"] = "replica"
            entry["deployment"] = {"name": name, "replica": index} if visible else None
        answer.append(entry)
    return answer


@router.get("/prices", response_model=PricesPublic)
def prices(request: Request, key: Key) -> dict[str, Any]:
    """The server's prices (`gpuforge prices list` against a server): each device's price an hour and
    where it comes from, or null with the command that sets one; and, for an admin key, the entries of
    the server's prices.yaml with their parts (what an owned device was bought for is the admin's)."""
    home = request.app.state.settings.home
    inventory = list(request.app.state.devices)
    found = prices_of(home, inventory)
    entries = None
    if key.admin:
        entries = {
            name: {"usd_per_hour": p.hourly(), "parts": p.parts(), **p.model_dump(exclude_none=True)}
            for name, p in server_prices(home).items()
        }
    shown = []
    for d in inventory:
        usd, source, set_price = shown_price(found[d.id], d.kind)
        shown.append({"id": d.id, "kind": d.kind, "name": d.name, "usd_per_hour": usd, "source": source,
                      "set_price": set_price})  # fmt: skip
    return {"devices": shown, "entries": entries}


@router.get("/costs", response_model=CostsPublic)
def costs(
    request: Request,
    key: Key,
    since: Annotated[
        str | None, Query(max_length=40, description="first day, YYYY-MM-DD (UTC); default: 30 days ago")
    ] = None,
    until: Annotated[
        str | None, Query(max_length=40, description="last day, YYYY-MM-DD (UTC), included; default: today")
    ] = None,
    by: Annotated[CostBy, Query(description="what `groups` sums over")] = "day",
    project: Annotated[str | None, Query(max_length=100, description="only this project's spend")] = None,
) -> dict[str, Any]:
    """Spend from the cost ledger (store/ledger.py: charged minute by minute as jobs and replicas run),
    summed by day, key or project, in dollars and device-hours: your own and your project's, or everyone's
    with an admin key. At most a year back."""
    today = utcnow().date()
    until_day = _day_param("until", until) or today
    if until_day > today + timedelta(days=MAX_COST_DAYS):
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"until: {until_day} is more than a year ahead"
        )
    since_day = _day_param("since", since) or until_day - timedelta(days=29)
    earliest = today - timedelta(days=MAX_COST_DAYS - 1)
    if since_day < earliest:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"since: {since_day} is more than a year back; the costs go back to {earliest}",
        )
    if since_day > until_day or (until_day - since_day).days >= MAX_COST_DAYS:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"since..until: {since_day}..{until_day} must be 1 to {MAX_COST_DAYS} days, since first",
        )
    start = datetime.combine(since_day, time.min, tzinfo=UTC)
    end = datetime.combine(until_day + timedelta(days=1), time.min, tzinfo=UTC)
    where = []
    with session(request.app.state.engine) as s:
        if not key.admin:  # its own spend, and its project's
            mine = LedgerEntry.key_id == key.id
            where.append(
                mine if key.project_id is None else or_(mine, LedgerEntry.project_id == key.project_id)
            )
        if project is not None:
            found = s.scalar(select(Project).where(Project.name == project))
            if found is None or not (key.admin or found.id == key.project_id):
                raise HTTPException(status.HTTP_404_NOT_FOUND, f"no project {project}")
            where.append(LedgerEntry.project_id == found.id)
        spent = ledger.spend(s, start, end, *where)
        key_names = _names(s, ApiKey, {r.key_id for r in spent})
        project_names = _names(s, Project, {r.project_id for r in spent})
        unpriced = _unpriced(s, spent)

    labelled = [
        ({"day": r.day, "key": key_names.get(r.key_id, "?"), "project": project_names.get(r.project_id)}, r)
        for r in spent
    ]
    groups = _sums(labelled, (by,), {u["subject"] for u in unpriced})
    if by != "day":
        groups.sort(key=lambda g: -g["usd"])  # the biggest spender first; days stay in order
    rows = _sums(labelled, ("day", "key"), {u["subject"] for u in unpriced})
    return {
        "since": since_day.isoformat(),
        "until": until_day.isoformat(),
        "by": by,
        "project": project,
        "days": [
            (since_day + timedelta(days=i)).isoformat() for i in range((until_day - since_day).days + 1)
        ],
        "keys": sorted({r["key"] for r in rows}),
        "groups": groups,
        "rows": rows,
        "total_usd": sum(r.usd for r in spent),
        "total_device_hours": sum(r.device_seconds for r in spent) / 3600.0,
        "unpriced": unpriced,
        "set_price": sorted({u["set_price"] for u in unpriced}),
    }


def _unpriced(s, spent: list[ledger.Spent]) -> list[dict[str, Any]]:
    """The jobs and deployments that ran in the period with no price set (the ledger charged their time at
    a rate of 0: pricing.py), each with its device-hours and the command that prices its kind of device."""
    usd: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for r in spent:
        usd[r.subject] = usd.get(r.subject, 0.0) + r.usd
        seconds[r.subject] = seconds.get(r.subject, 0.0) + r.device_seconds
    wanted = sorted(x for x, spent_usd in usd.items() if spent_usd == 0 and seconds[x] > 0)
    ids = {kind: [int(x.split(":", 1)[1]) for x in wanted if x.startswith(f"{kind}:")] for kind in SUBJECTS}
    found = {}
    for kind, table in SUBJECTS.items():
        if ids[kind]:
            query = select(table.id, table.name, table.device_type).where(table.id.in_(ids[kind]))
            found |= {f"{kind}:{i}": (name, device_type) for i, name, device_type in s.execute(query)}
    answer = []
    for subject in wanted:
        name, device_type = found.get(subject, (None, "cpu"))
        kind, subject_id = subject.split(":", 1)
        answer.append(
            {
                "subject": subject,
                "kind": kind,
                "id": int(subject_id),
                "name": name,
                "device_type": device_type,
                "device_hours": seconds[subject] / 3600.0,
                "set_price": set_price_command(device_type),
            }
        )
    return answer


def _day_param(name: str, value: str | None) -> date | None:
    """A day the client sent, or a 422 that says what is wrong with it (not pydantic's list of errors)."""
    if value is None or value == "":
        return None
    try:
        return date.fromisoformat(value.strip())
    except ValueError:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT, f"{name}: {value!r} is not a day; give YYYY-MM-DD"
        ) from None


def _names(s, table: type[ApiKey | Project], ids: set[int | None]) -> dict[int, str]:
    """id -> name of the keys or projects the ledger's rows name."""
    wanted = [i for i in ids if i is not None]
    rows = s.execute(select(table.id, table.name).where(table.id.in_(wanted))) if wanted else ()
    return {row_id: name for row_id, name in rows}


def _sums(
    labelled: list[tuple[dict[str, str | None], ledger.Spent]], fields: tuple[str, ...], unpriced: set[str]
) -> list[dict]:
    """The ledger's daily sums summed again over `fields` (day, key, project), in their order; a job or a
    deployment counts once in a group however many days it ran; `unpriced`: those that ran unpriced, counted
    apart (their time is in device_hours, nothing in usd)."""
    sums: dict[tuple, tuple[list[float], set[str]]] = {}
    for labels, r in labelled:
        figures, subjects = sums.setdefault(tuple(labels[f] for f in fields), ([0.0, 0.0], set()))
        figures[0] += r.usd
        figures[1] += r.device_seconds
        subjects.add(r.subject)
    ordered = sorted(sums.items(), key=lambda item: ["" if v is None else v for v in item[0]])
    return [
        dict(zip(fields, group, strict=True))
        | {
            "usd": usd,
            "device_hours": seconds / 3600.0,
            "jobs": sum(1 for x in subjects if x.startswith("job:")),
            "deployments": sum(1 for x in subjects if x.startswith("deployment:")),
            "unpriced": len(subjects & unpriced),
        }
        for group, ((usd, seconds), subjects) in ordered
    ]
