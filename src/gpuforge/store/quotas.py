"""Quotas per API key: how much of the shared server one key may hold, so that no key starves the others.

The admin sets them (`gpuforge keys create NAME --max-queued N ...`, `gpuforge keys set NAME ...`); each is
a column of api_keys, NULL where the admin gave none: the key then has the default below (so a release that
changes a default changes it for those keys too). An admin key has no quotas at all.

    max_queued        its jobs not yet ended (queued, running or paused) at once: a submit past it is 429
    max_running       its jobs running at once: the scheduler leaves its other jobs queued (and starts
                      other keys' jobs meanwhile); nothing is refused
    max_upload_bytes  the bytes of the uploads it made the server store: an upload past it is 429, refused
                      before its body is read (by its Content-Length) or as soon as it passes, and nothing
                      is kept. Uploads are stored once by content, so a key is charged for a file the first
                      time the server stores it, by whoever sent it; content the server holds already is
                      answered at once and costs nothing (the client asks first, and does not even send it)
    max_deployments   its live deployments (starting, ready, stopping or failing): a deploy past it is 429
    max_priority      the highest priority its jobs may ask for (the body's or the spec's): above it, 422

The checks that count (submit, deploy, the end of an upload) first take the key's row for the rest of their
transaction, so a key's requests at the same moment pass one at a time: two cannot both take its last place.

The table is read by the API schema (server/schemas.py), the CLI options (cli/server.py) and the checks
here: a quota is added in QUOTAS, as a column of ApiKey, and in a migration. sqlalchemy and the models are
imported inside the functions that query: the CLI reads QUOTAS at every start and stays fast without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuforge.errors import GpuforgeError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from gpuforge.store.models import ApiKey

GiB = 2**30
INT32 = 2**31 - 1  # ids and counts past it fit no store's integer column (the API refuses them: 422)


@dataclass(frozen=True)
class Quota:
    name: str  # the api_keys column, the API field and, as --max-..., the CLI option
    default: int  # for a non-admin key the admin gave none
    help: str
    low: int = 0
    high: int = INT32
    per_request: bool = False  # bounds what one request asks (422), not what a key holds at once (429)

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    def show(self, value: int | None) -> str:
        """A value as people read it: whole GiB or MiB for bytes; `none` for no limit."""
        if value is None:
            return "none"
        if self.name.endswith("_bytes") and value:
            for unit, size in (("GiB", GiB), ("MiB", 2**20)):
                if value % size == 0:
                    return f"{value // size} {unit}"
        return str(value)


# The defaults suit a team sharing one machine of a few GPUs: enough for a sweep and a couple of served
# models each, not enough for one runaway script to fill the queue, the devices or the disk. Priorities up
# to 1000 stay the admin's, to jump the queue. 0 freezes a key (nothing new queued, started or stored).
QUOTAS = (
    Quota("max_queued", 100, "jobs not yet ended (queued, running or paused) at once"),
    Quota("max_running", 4, "jobs running at once; the others wait, queued"),
    Quota("max_upload_bytes", 10 * GiB, "bytes of uploaded files in all", high=2**62),
    Quota("max_deployments", 4, "live deployments (starting, ready, stopping or failing) at once"),
    Quota("max_priority", 100, "the highest priority its jobs may ask for", -1000, 1000, per_request=True),
)
BY_NAME = {q.name: q for q in QUOTAS}


class QuotaExceeded(GpuforgeError):
    """A request past one of its key's quotas; the message names the quota and how the admin raises it."""

    def __init__(self, quota: Quota, key_name: str, what: str):
        self.quota = quota
        super().__init__(
            f"quota {quota.name}: key {key_name!r} {what}; the admin can raise it: "
            f"gpuforge keys set {key_name} {quota.option} N"
        )


def limits(key: ApiKey) -> dict[str, int | None]:
    """The quotas in force for `key`: its own, else the defaults; None: no limit (an admin key)."""
    if key.admin:
        return dict.fromkeys(BY_NAME)
    return {q.name: q.default if getattr(key, q.name) is None else getattr(key, q.name) for q in QUOTAS}


def check_settable(key_name: str, admin: bool, quotas: dict[str, int | None]) -> None:
    """ValueError unless these are known quotas, in range, for a key that is not an admin key."""
    for name, value in quotas.items():
        quota = BY_NAME.get(name)
        if quota is None:
            raise ValueError(f"{name}: no such quota (known: {', '.join(BY_NAME)})")
        if value is not None and not quota.low <= value <= quota.high:
            raise ValueError(f"{name}: {value} is not in {quota.low}..{quota.high}")
    if admin and any(value is not None for value in quotas.values()):
        raise ValueError(f"{key_name!r} is an admin key: admin keys have no quotas")


def _locked(s: Session, key: ApiKey) -> ApiKey:
    """The row whose quotas hold for `key`, read fresh and held until the transaction ends: its
    quota-checked writes go one at a time. A signed-in person's keys (sessions, personal keys) share the
    quotas of the person's own key row (store/users.py): more keys are not more quota. A no-op UPDATE holds
    it on both stores (a row lock on PostgreSQL, where FOR UPDATE would do too; the database's write lock on
    SQLite, which ignores FOR UPDATE), for the few statements that follow."""
    from sqlalchemy import select, update

    from gpuforge.store.models import ApiKey

    holder = key.id
    if key.user_id is not None:
        person = ApiKey.user_id == key.user_id, ApiKey.kind == "user"
        holder = s.scalar(select(ApiKey.id).where(*person)) or key.id
    s.execute(
        update(ApiKey)
        .where(ApiKey.id == holder)
        .values(admin=ApiKey.admin)
        .execution_options(synchronize_session=False)
    )
    return s.get(ApiKey, holder, populate_existing=True)


def _owners(key: ApiKey, row: ApiKey) -> list[int]:
    """The key rows whose jobs, deployments and uploads count against `row`'s quotas."""
    return sorted(key.owned or {row.id})


def check_job(s: Session, key: ApiKey, priority: int) -> None:
    """Before a job of `key` is queued, in the transaction that queues it: max_priority, max_queued."""
    from sqlalchemy import func, select

    from gpuforge.store.models import ACTIVE_JOB_STATES, Job

    row = _locked(s, key)
    limit = limits(row)
    if limit["max_priority"] is not None and priority > limit["max_priority"]:
        what = f"may ask for priority {limit['max_priority']} at most, not {priority}"
        raise QuotaExceeded(BY_NAME["max_priority"], row.name, what)
    if limit["max_queued"] is not None:
        owners = Job.owner_id.in_(_owners(key, row))
        active = select(func.count()).where(owners, Job.state.in_(ACTIVE_JOB_STATES))
        count = s.scalar(active)
        if count >= limit["max_queued"]:
            what = f"has {count} jobs not ended (queued, running or paused), its limit"
            raise QuotaExceeded(BY_NAME["max_queued"], row.name, what)


def check_deployment(s: Session, key: ApiKey) -> None:
    """Before a deployment of `key` is made, in the transaction that makes it: max_deployments."""
    from sqlalchemy import func, select

    from gpuforge.store.models import LIVE_DEPLOYMENT_STATES, Deployment

    row = _locked(s, key)
    limit = limits(row)["max_deployments"]
    if limit is None:
        return
    owned = Deployment.owner_id.in_(_owners(key, row))
    live = s.scalar(select(func.count()).where(owned, Deployment.state.in_(LIVE_DEPLOYMENT_STATES)))
    if live >= limit:
        what = f"has {live} live deployments (starting, ready, stopping or failing), its limit"
        raise QuotaExceeded(BY_NAME["max_deployments"], row.name, what)


@dataclass(frozen=True)
class UploadAllowance:
    """What a key may still upload, read once before a body: checked by its Content-Length, then as it
    is read (charge_upload checks again, exactly, before the file is kept)."""

    key_name: str
    used: int
    limit: int | None

    def check(self, size: int, partial: bool = False) -> None:
        if self.limit is not None and self.used + size > self.limit:
            this = f"{size} bytes or more" if partial else f"{size} bytes"
            what = f"has {self.used} bytes of uploads stored; this one of {this} would pass its {self.limit}"
            raise QuotaExceeded(BY_NAME["max_upload_bytes"], self.key_name, what)


def _uploaded(s: Session, key_ids: list[int]) -> int:
    from sqlalchemy import func, select

    from gpuforge.store.models import Upload

    return s.scalar(select(func.coalesce(func.sum(Upload.size), 0)).where(Upload.key_id.in_(key_ids)))


def upload_allowance(s: Session, key: ApiKey) -> UploadAllowance:
    """What `key` may still upload (read fresh: the admin may have changed it since the key was cached)."""
    from sqlalchemy import select

    from gpuforge.store.models import ApiKey

    row = s.get(ApiKey, key.id, populate_existing=True)
    if key.user_id is not None:  # a person's keys share their own key's quota
        person = ApiKey.user_id == key.user_id, ApiKey.kind == "user"
        row = s.scalar(select(ApiKey).where(*person)) or row
    return UploadAllowance(row.name, _uploaded(s, _owners(key, row)), limits(row)["max_upload_bytes"])


def charge_upload(s: Session, key: ApiKey, sha256: str, suffix: str, size: int) -> None:
    """Charge a file the server is about to keep to `key`, in the transaction that records it: nothing if
    the server has it already (another key stored it since); QuotaExceeded past its max_upload_bytes."""
    from sqlalchemy import select

    from gpuforge.store.models import Upload

    row = _locked(s, key)
    if s.scalar(select(Upload.id).where(Upload.sha256 == sha256, Upload.suffix == suffix)) is not None:
        return
    UploadAllowance(row.name, _uploaded(s, _owners(key, row)), limits(row)["max_upload_bytes"]).check(size)
    s.add(Upload(sha256=sha256, suffix=suffix, key_id=row.id, size=size))


def running_limits(s: Session, owner_ids: set[int | None]) -> dict[int, int]:
    """max_running of each of these keys that has one (an admin key, or a job with no owner, has none)."""
    from sqlalchemy import select

    from gpuforge.store.models import ApiKey

    wanted = {i for i in owner_ids if i is not None}
    if not wanted:
        return {}
    found = {}
    for row in s.scalars(select(ApiKey).where(ApiKey.id.in_(wanted))):
        limit = limits(row)["max_running"]
        if limit is not None:
            found[row.id] = limit
    return found
