"""Spend read back from the cost ledger (store/ledger.py) for `GET /api/v1/costs` and the dashboard: the
period a request may ask for, the ledger's daily sums labelled with their key's and project's names and
summed again by day, key or project, and the jobs and deployments that ran with no price set.

Errors name what is wrong: ValueError for a period that cannot be answered, LookupError for a project the
key may not see (the route answers 422 and 404)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import Literal

from sqlalchemy import ColumnElement, or_, select
from sqlalchemy.orm import Session

from gpuforge.store import ledger
from gpuforge.store.models import ApiKey, Deployment, Job, LedgerEntry, Project
from gpuforge.store.projects import project_named

MAX_COST_DAYS = 366  # the costs answer for a year back at most (and for a period of a year at most)
CostBy = Literal["day", "key", "project"]
SUBJECTS = {"job": Job, "deployment": Deployment}  # the ledger's subjects, "job:12" | "deployment:3"


@dataclass(frozen=True)
class Period:
    """UTC days, both included."""

    since: date
    until: date

    @property
    def days(self) -> list[str]:
        return [
            (self.since + timedelta(days=i)).isoformat() for i in range((self.until - self.since).days + 1)
        ]

    @property
    def start(self) -> datetime:
        return datetime.combine(self.since, time.min, tzinfo=UTC)

    @property
    def end(self) -> datetime:  # excluded: the first moment after `until`
        return datetime.combine(self.until + timedelta(days=1), time.min, tzinfo=UTC)


def day_param(name: str, value: str | None) -> date | None:
    """A day a client sent as YYYY-MM-DD (None: not sent), or a ValueError that says what is wrong with it."""
    if value is None or value == "":
        return None
    try:
        return date.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"{name}: {value!r} is not a day; give YYYY-MM-DD") from None


def period(since: str | None, until: str | None, today: date) -> Period:
    """The days asked for: `until` defaults to today, `since` to 30 days before `until`; no further back
    than a year, no further ahead than a year, and a year long at most."""
    until_day = day_param("until", until) or today
    if until_day > today + timedelta(days=MAX_COST_DAYS):
        raise ValueError(f"until: {until_day} is more than a year ahead")
    since_day = day_param("since", since) or until_day - timedelta(days=29)
    earliest = today - timedelta(days=MAX_COST_DAYS - 1)
    if since_day < earliest:
        raise ValueError(f"since: {since_day} is more than a year back; the costs go back to {earliest}")
    if since_day > until_day or (until_day - since_day).days >= MAX_COST_DAYS:
        raise ValueError(
            f"since..until: {since_day}..{until_day} must be 1 to {MAX_COST_DAYS} days, since first"
        )
    return Period(since_day, until_day)


@dataclass(frozen=True)
class CostGroup:
    """Spend summed over one group: a day, a key, a project, or a day and a key (the others None)."""

    usd: float
    device_hours: float
    jobs: int  # that ran in it
    deployments: int  # whose replicas ran in it
    unpriced: int  # of those, how many ran with no price set
    day: str | None = None
    key: str | None = None
    project: str | None = None
    kwh: float = 0.0  # the energy the server measured (or estimated: each job says how)
    co2e_g: float = 0.0  # its kWh times the grid's intensity, where GPUFORGE_GRID_GCO2E_PER_KWH gives one


@dataclass(frozen=True)
class UnpricedSubject:
    """A job or deployment that ran in the period with no price set: the ledger charged its time at 0."""

    subject: str  # "job:12" | "deployment:3"
    kind: str
    id: int
    name: str | None
    device_type: str
    device_hours: float


@dataclass(frozen=True)
class Costs:
    groups: list[CostGroup]  # by the `by` asked for: days in order, else the biggest spender first
    rows: list[CostGroup]  # by day and key
    keys: list[str]  # the names of the keys that spent
    total_usd: float
    total_device_hours: float
    unpriced: list[UnpricedSubject] = field(default_factory=list)
    total_kwh: float = 0.0
    total_co2e_g: float = 0.0


def costs_for(s: Session, key: ApiKey, when: Period, by: CostBy, project: str | None = None) -> Costs:
    """What `key` may see was spent in `when`: its own and its project's, or everyone's for an admin key;
    `project`: that project's alone (LookupError where the key may not see it)."""
    where: list[ColumnElement[bool]] = []
    if not key.admin:  # its own spend, and its project's
        mine = (
            LedgerEntry.key_id == key.id if key.owned is None else LedgerEntry.key_id.in_(sorted(key.owned))
        )
        where.append(mine if key.project_id is None else or_(mine, LedgerEntry.project_id == key.project_id))
    if project is not None:
        try:
            found = project_named(s, project)
        except LookupError:
            raise LookupError(f"no project {project}") from None
        if not (key.admin or found.id == key.project_id):  # another team's does not exist for it
            raise LookupError(f"no project {project}")
        where.append(LedgerEntry.project_id == found.id)
    spent = ledger.spend(s, when.start, when.end, *where)
    key_names = _names(s, ApiKey, {r.key_id for r in spent})
    project_names = _names(s, Project, {r.project_id for r in spent})
    unpriced = _unpriced(s, spent)
    unpriced_subjects = {u.subject for u in unpriced}
    labelled = [
        ({"day": r.day, "key": key_names.get(r.key_id, "?"), "project": project_names.get(r.project_id)}, r)
        for r in spent
    ]
    groups = _sums(labelled, (by,), unpriced_subjects)
    if by != "day":
        groups.sort(key=lambda g: -g.usd)  # the biggest spender first; days stay in order
    rows = _sums(labelled, ("day", "key"), unpriced_subjects)
    return Costs(
        groups=groups,
        rows=rows,
        keys=sorted({r.key for r in rows if r.key is not None}),
        total_usd=sum(r.usd for r in spent),
        total_device_hours=sum(r.device_seconds for r in spent) / 3600.0,
        unpriced=unpriced,
        total_kwh=sum(r.kwh for r in spent),
        total_co2e_g=sum(r.co2e_g for r in spent),
    )


def _unpriced(s: Session, spent: list[ledger.Spent]) -> list[UnpricedSubject]:
    """The subjects that ran (device time) and were charged nothing, with their name and device type."""
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
            UnpricedSubject(subject, kind, int(subject_id), name, device_type, seconds[subject] / 3600.0)
        )
    return answer


def _names(s: Session, table: type[ApiKey | Project], ids: set[int | None]) -> dict[int, str]:
    """id -> name of the keys or projects the ledger's rows name."""
    wanted = [i for i in ids if i is not None]
    rows = s.execute(select(table.id, table.name).where(table.id.in_(wanted))) if wanted else ()
    return {row_id: name for row_id, name in rows}


def _sums(
    labelled: list[tuple[dict[str, str | None], ledger.Spent]], fields: tuple[str, ...], unpriced: set[str]
) -> list[CostGroup]:
    """The ledger's daily sums summed again over `fields` (day, key, project), in their order; a job or a
    deployment counts once in a group however many days it ran; `unpriced`: those that ran unpriced, counted
    apart (their time is in device_hours, nothing in usd)."""
    sums: dict[tuple, tuple[list[float], set[str]]] = {}
    for labels, r in labelled:
        figures, subjects = sums.setdefault(tuple(labels[f] for f in fields), ([0.0] * 4, set()))
        figures[0] += r.usd
        figures[1] += r.device_seconds
        figures[2] += r.kwh
        figures[3] += r.co2e_g
        subjects.add(r.subject)
    ordered = sorted(sums.items(), key=lambda item: ["" if v is None else v for v in item[0]])
    return [
        CostGroup(
            usd=usd,
            device_hours=seconds / 3600.0,
            jobs=sum(1 for x in subjects if x.startswith("job:")),
            deployments=sum(1 for x in subjects if x.startswith("deployment:")),
            unpriced=len(subjects & unpriced),
            **dict(zip(fields, group, strict=True)),
            kwh=kwh,
            co2e_g=co2e,
        )
        for group, ((usd, seconds, kwh, co2e), subjects) in ordered
    ]
