"""The cost ledger: what each running job and replica costs, minute by minute, charged to its key and
project as it runs (not recomputed later from summaries, which a killed run may never write).

Each scheduling tick calls `accrue`: for every job running and every deployment with replicas up, the time
since its mark (`accrued_at`) is cut at minute boundaries, added to one row per (subject, minute), and the
mark moved to now, all in the tick's transaction. A server killed at any moment either committed both or
neither: no second is counted twice, none lost while the job ran. The tick that sees a job's process
ended charges it to that tick's time, which is its finished_at, when this server saw it run at its last
tick (or launched it): however slow that tick was in coming, the job ran at some moment since. A process
found ended at a server's first look (it ended while no server watched, or its end was seen by a server
killed before it committed) is charged to its runner's last event, held between its mark and now: the
server cannot know when it died, and a job's clock can move that end only within the time no server
watched (scheduler/loop.py decides which jobs a tick charges, and to when).

A job's rate is Job.usd_per_hour, set at submit for all its devices (the spec's cost.usd_per_hour, one
device's price, filled from prices.yaml when the spec set none, times its devices); a deployment's is the
price of one replica's device times its replicas up. Device-seconds count every device held.

`spend` reads it back for `gpuforge costs` and the dashboard: sums per UTC day, key, project and subject.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

from gpuforge.store.models import Deployment, Job, LedgerEntry, utcnow

MAX_GAP = timedelta(days=31)  # a mark older than this (a store restored from long ago) is not charged
MINUTE = timedelta(minutes=1)

Span = tuple[datetime, datetime | None]  # a time a job ran: its start, and its end (None: it runs on)
Entries = dict[tuple[str, datetime], LedgerEntry]  # (subject, minute) -> its row, read or added this tick


@dataclass(frozen=True)
class Charge:
    subject: str  # "job:12" | "deployment:3"
    key_id: int | None
    project_id: int | None
    devices: float  # held: device-seconds count each (a fraction of one: that much of its seconds)
    usd_per_hour: float  # for all of them together


def minute_of(when: datetime) -> datetime:
    return when.astimezone(UTC).replace(second=0, microsecond=0)


def month_start(when: datetime) -> datetime:
    return when.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def _slices(since: datetime, until: datetime) -> Iterable[tuple[datetime, float]]:
    """(minute, seconds in it) from `since` to `until`."""
    at = since
    while at < until:
        minute = minute_of(at)
        end = min(until, minute + MINUTE)
        yield minute, (end - at).total_seconds()
        at = end


def charge(
    s: Session,
    row: Job | Deployment,
    what: Charge,
    now: datetime,
    entries: Entries | None = None,
    within: Sequence[Span] | None = None,
) -> float:
    """Add `row`'s time since its mark to the ledger and move its mark to `now`, in the caller's
    transaction; the dollars added. `entries`: the rows `accrue` read for the whole tick (else read here).
    `within`: only the time in these spans counts (an end None: still open)."""
    since = row.accrued_at
    row.accrued_at = now
    if since is None or since >= now or now - since > MAX_GAP:
        return 0.0  # its first tick sets the mark (and a clock stepped back counts nothing)
    if entries is None:
        entries = _read_entries(s, {what.subject: since})
    added = 0.0
    if within is None:
        spans = [(since, now)]
    else:  # each span cut to (since, now]; one that ended before `since` or begins after `now` adds nothing
        spans = [(max(since, a), now if b is None else min(now, b)) for a, b in within]
    for minute, seconds in (piece for start, end in spans for piece in _slices(start, end)):
        usd = seconds * what.usd_per_hour / 3600.0
        entry = entries.get((what.subject, minute))
        if entry is None:
            entry = LedgerEntry(
                subject=what.subject,
                minute=minute,
                key_id=what.key_id,
                project_id=what.project_id,
                device_seconds=0.0,
                usd=0.0,
                kwh=0.0,
                co2e_g=0.0,
            )
            s.add(entry)
            entries[(what.subject, minute)] = entry
        entry.device_seconds += seconds * what.devices
        entry.usd += usd
        added += usd
    if isinstance(row, Job):  # what the job's answers show as its cost: the ledger's, never its own files'
        row.cost_usd = (row.cost_usd or 0.0) + added
    return added


def _read_entries(s: Session, marks: dict[str, datetime]) -> Entries:
    """The rows already there for these subjects from their marks' minutes on: one query a tick, not one
    a job (a tick's time is the scheduler's latency)."""
    if not marks:
        return {}
    since = min(minute_of(mark) for mark in marks.values())
    rows = s.scalars(select(LedgerEntry).where(LedgerEntry.subject.in_(marks), LedgerEntry.minute >= since))
    return {(e.subject, minute_of(e.minute)): e for e in rows}


def _job_charge(job: Job) -> Charge:
    devices = len(job.devices.split(",")) if job.devices else job.devices_wanted
    if job.device_share is not None:
        devices = job.device_share
    return Charge(f"job:{job.id}", job.owner_id, job.project_id, devices, job.usd_per_hour or 0.0)


def charge_job(s: Session, job: Job, until: datetime, within: Sequence[Span] | None = None) -> float:
    """Charge one job from its mark to `until` (a job found ended after a server's restart, to the end
    the loop dated); the dollars added."""
    if job.accrued_at is None and job.run_started_at is not None:
        job.accrued_at = min(job.run_started_at, until)
    return charge(s, job, _job_charge(job), until, within=within)


def _deployment_charge(deployment: Deployment, up: int) -> Charge:
    rate = (deployment.usd_per_hour or 0.0) * up  # one replica's device (or fraction), times those up
    held = up * (deployment.device_share or 1.0)
    return Charge(f"deployment:{deployment.id}", deployment.owner_id, deployment.project_id, held, rate)


@dataclass(frozen=True)
class Energy:
    """What one job or deployment used since the last tick, as the server measured it (never a job's own
    figure): joules, the source (nvml, rapl, estimated) with its rule, and the grid's intensity there."""

    joules: float
    source: str  # "estimated: 65 W x 0.48 utilisation ... (watts: prices.yaml cpu)"
    gco2e_per_kwh: float | None = None


def accrue(
    s: Session,
    jobs: Iterable[Job],
    deployments: Iterable[Deployment],
    now: datetime | None = None,
    within: Mapping[int, Sequence[Span]] | None = None,
    energy: Mapping[str, Energy] | None = None,
) -> None:
    """Charge every job that runs (with a process) and every deployment with replicas up, to `now`; a job
    in `within` (id -> spans) for the time in those spans alone (a Slurm job: while its Slurm job ran).
    `energy`: subject -> what it used since the last tick, added to now's minute (and, for a job whose
    price gives usd_per_kwh, charged at that rate: its hourly rate then leaves the energy out)."""
    now = now or utcnow()
    due: list[tuple[Job | Deployment, Charge, Sequence[Span] | None]] = []
    for job in jobs:
        if job.pid is None:
            continue  # claimed, not started: nothing runs yet
        if job.accrued_at is None and job.run_started_at is not None:
            # from its process's start (states.start), not from the first tick that saw it: the half
            # second between them is run time too (claim cleared the last run's mark)
            job.accrued_at = min(job.run_started_at, now)
        due.append((job, _job_charge(job), within.get(job.id) if within is not None else None))
    for deployment in deployments:
        up = sum(1 for w in deployment.workers or () if w.get("pid"))
        if not up:
            deployment.accrued_at = None  # nothing runs: the next replica starts a new mark
            continue
        due.append((deployment, _deployment_charge(deployment, up), None))
    marks = {what.subject: row.accrued_at for row, what, _ in due if row.accrued_at is not None}
    entries = _read_entries(s, {k: v for k, v in marks.items() if v < now})
    for row, what, spans in due:
        charge(s, row, what, now, entries, spans)
        if energy and (used := energy.get(what.subject)) is not None:
            _add_energy(s, row, what, used, now, entries)


def _add_energy(
    s: Session, row: Job | Deployment, what: Charge, used: Energy, now: datetime, entries
) -> None:
    kwh = used.joules / 3.6e6
    co2e = kwh * used.gco2e_per_kwh if used.gco2e_per_kwh is not None else 0.0
    usd = kwh * (row.usd_per_kwh or 0.0) if isinstance(row, Job) else 0.0
    minute = minute_of(now)
    entry = entries.get((what.subject, minute))
    if entry is None:  # written by an earlier run of the job in this minute, perhaps: never a second row
        entry = s.scalar(
            select(LedgerEntry).where(LedgerEntry.subject == what.subject, LedgerEntry.minute == minute)
        )
    if entry is None:
        entry = LedgerEntry(
            subject=what.subject, minute=minute, key_id=what.key_id, project_id=what.project_id,
            device_seconds=0.0, usd=0.0, kwh=0.0, co2e_g=0.0,
        )  # fmt: skip
        s.add(entry)
        entries[(what.subject, minute)] = entry
    entry.kwh = (entry.kwh or 0.0) + kwh
    entry.co2e_g = (entry.co2e_g or 0.0) + co2e
    entry.usd += usd
    if isinstance(row, Job):
        row.energy_kwh = (row.energy_kwh or 0.0) + kwh
        row.energy_source = used.source[:300]
        if used.gco2e_per_kwh is not None:
            row.co2e_g = (row.co2e_g or 0.0) + co2e
        row.cost_usd = (row.cost_usd or 0.0) + usd


def month_spend(s: Session, now: datetime | None = None) -> dict[int, float]:
    """project id -> dollars charged to it in the month (UTC) of `now` (default: this one)."""
    since = month_start(now or utcnow())
    until = month_start(since + timedelta(days=32))
    rows = s.execute(
        select(LedgerEntry.project_id, func.sum(LedgerEntry.usd))
        .where(LedgerEntry.minute >= since, LedgerEntry.minute < until, LedgerEntry.project_id.is_not(None))
        .group_by(LedgerEntry.project_id)
    )
    return {project: float(total or 0.0) for project, total in rows}


# --- reading it back ---
@dataclass(frozen=True)
class Spent:
    """One subject's spend on one UTC day."""

    day: str  # YYYY-MM-DD
    key_id: int | None
    project_id: int | None
    subject: str
    usd: float
    device_seconds: float
    kwh: float = 0.0
    co2e_g: float = 0.0


def _day(s: Session) -> ColumnElement[str]:
    """The UTC day of a ledger row's minute, as YYYY-MM-DD, in the store's own SQL (grouped there: a year
    of minutes is millions of rows)."""
    if s.get_bind().dialect.name == "postgresql":
        return func.to_char(func.timezone("UTC", LedgerEntry.minute), "YYYY-MM-DD")
    return func.strftime("%Y-%m-%d", LedgerEntry.minute)  # SQLite keeps UTC as text


def spend(s: Session, since: datetime, until: datetime, *where: ColumnElement[bool]) -> list[Spent]:
    """What was charged in [since, until) where `where` holds, summed per day, key, project and subject."""
    day = _day(s).label("day")
    columns = (day, LedgerEntry.key_id, LedgerEntry.project_id, LedgerEntry.subject)
    query = (
        select(
            *columns,
            func.sum(LedgerEntry.usd),
            func.sum(LedgerEntry.device_seconds),
            func.sum(LedgerEntry.kwh),
            func.sum(LedgerEntry.co2e_g),
        )
        .where(LedgerEntry.minute >= since, LedgerEntry.minute < until, *where)
        .group_by(*columns)
    )
    return [
        Spent(d, k, p, subject, float(usd or 0.0), float(ds or 0.0), float(kwh or 0.0), float(co2 or 0.0))
        for d, k, p, subject, usd, ds, kwh, co2 in s.execute(query)
    ]
