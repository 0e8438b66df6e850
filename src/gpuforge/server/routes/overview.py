"""Views across jobs, for the dashboard and scripts alike: who a key is, runs compared, the devices and
who holds them, and spend from the cost ledger."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, status

from gpuforge.run_files import last_record
from gpuforge.server.auth import Key
from gpuforge.server.permissions import permit
from gpuforge.server.pricing import prices_of, server_prices, set_price_command, shown_price
from gpuforge.server.schemas import CostsPublic, DevicePublic, PricesPublic
from gpuforge.server.services import services
from gpuforge.server.visibility import may_read
from gpuforge.store.costs import CostBy, costs_for, period
from gpuforge.store.db import session
from gpuforge.store.deployments import replica_devices
from gpuforge.store.device_busy import device_busy
from gpuforge.store.jobs import device_holders
from gpuforge.store.models import utcnow

router = APIRouter(prefix="/api/v1", tags=["overview"])


@router.get("/devices", response_model=list[DevicePublic], dependencies=[permit("overview.read")])
def devices(request: Request, key: Key) -> list[dict[str, Any]]:
    """Each device this server has now: the job or replica holding it (named where the key may read it),
    how long it was busy in the last hour and in all (store/device_busy.py: from the cost ledger, which
    charges jobs and replicas alike), its price an hour or null with the command that sets one, and the
    memory its job peaked at where it reports it."""
    inventory = list(services(request).devices)
    prices = prices_of(services(request).settings.home, inventory)
    with session(services(request).engine) as s:
        holders = device_holders(s)
        replicas = {
            device: (d.name, index, may_read(key, d)) for device, (d, index) in replica_devices(s).items()
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
        job = holders.get(device.id)
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


@router.get("/prices", response_model=PricesPublic, dependencies=[permit("overview.read")])
def prices(request: Request, key: Key) -> dict[str, Any]:
    """The server's prices (`gpuforge prices list` against a server): each device's price an hour and
    where it comes from, or null with the command that sets one; and, for an admin key, the entries of
    the server's prices.yaml with their parts (what an owned device was bought for is the admin's)."""
    home = services(request).settings.home
    inventory = list(services(request).devices)
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


@router.get("/costs", response_model=CostsPublic, dependencies=[permit("overview.read")])
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
    try:
        when = period(since, until, utcnow().date())
    except ValueError as err:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from None
    with session(services(request).engine) as s:
        try:
            spent = costs_for(s, key, when, by, project)
        except LookupError as err:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from None
    unpriced = [asdict(u) | {"set_price": set_price_command(u.device_type)} for u in spent.unpriced]
    return {
        "since": when.since.isoformat(),
        "until": when.until.isoformat(),
        "by": by,
        "project": project,
        "days": when.days,
        "keys": spent.keys,
        "groups": [asdict(g) for g in spent.groups],
        "rows": [asdict(r) for r in spent.rows],
        "total_usd": spent.total_usd,
        "total_device_hours": spent.total_device_hours,
        "total_kwh": spent.total_kwh,
        "total_co2e_g": spent.total_co2e_g,
        "unpriced": unpriced,
        "set_price": sorted({u["set_price"] for u in unpriced}),
    }
