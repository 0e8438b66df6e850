"""Request and response bodies of the HTTP API (XCreate / XPublic)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    create_model,
    field_validator,
    model_validator,
)

from gpuforge.serve.adapters import NAME_MAX as ADAPTER_NAME_MAX
from gpuforge.serve.adapters import NAME_PATTERN as ADAPTER_NAME
from gpuforge.serve.options import deployment_options_model
from gpuforge.spec import MAX_SCRIPT_FILES
from gpuforge.store.models import MAX_NAME, NAME_PATTERN, Role
from gpuforge.store.projects import ProjectName, ProjectSettings
from gpuforge.store.quotas import QUOTAS, Quota, limits

FilePath = Annotated[str, StringConstraints(min_length=1, max_length=4096)]


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: str = Field(description="the job spec, YAML text")
    priority: int | None = Field(None, ge=-1000, le=1000, description="default: the spec's priority")
    name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100, description="default: the spec's name"
    )
    files: dict[FilePath, FilePath] | None = Field(
        None,
        max_length=16,
        description="{server path: the user's name for it} of the files the client uploaded: the job's "
        "errors name them the user's way",
    )
    script_files: dict[FilePath, FilePath] | None = Field(
        None,
        max_length=MAX_SCRIPT_FILES,
        description="a script job's working copy: {path inside it: the server path of an upload}",
    )


class SearchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: str = Field(description="the job spec, YAML text; its `tune:` section says what to search")
    tune: str | None = Field(None, description="the tune section, YAML text, when the spec has none")
    priority: int | None = Field(None, ge=-1000, le=1000, description="its trials'; default: the spec's")
    name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=100, description="default: the spec's name"
    )
    files: dict[FilePath, FilePath] | None = Field(None, max_length=16, description="as a job's submit")


class SearchPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    state: str
    reason: str | None
    owner: str | None
    created_at: datetime
    finished_at: datetime | None


class Health(BaseModel):
    status: str


class JobResume(BaseModel):
    model_config = ConfigDict(extra="forbid")

    budget_usd: float | None = Field(
        None,
        gt=0,
        description="a new cost.budget_usd above what the job has spent; null: no budget; left out: its own",
    )


def _quota_fields(describe: Callable[[Quota], str], bounded: bool = True) -> dict[str, Any]:
    """One optional field per quota of store/quotas.py QUOTAS (its name, bounds and text come from there)."""
    return {
        q.name: (
            int | None,
            Field(None, description=describe(q), **({"ge": q.low, "le": q.high} if bounded else {})),
        )
        for q in QUOTAS
    }


class _KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN, max_length=MAX_NAME)
    admin: bool = False
    project: str | None = Field(
        None, max_length=100, description="the project it belongs to, by name; an admin key belongs to none"
    )
    role: Role = Field(Role.MEMBER, description="its role in its project (server/permissions.py)")


KeyCreate = create_model(
    "KeyCreate",
    __base__=_KeyCreate,
    **_quota_fields(lambda q: f"{q.help}; default {q.show(q.default)} (an admin key has no quotas)"),
)
KeyUpdate = create_model(
    "KeyUpdate",
    __config__=ConfigDict(extra="forbid"),
    project=(str | None, Field(None, max_length=100, description="its project, by name; null: none")),
    role=(Role | None, Field(None, description="its role in its project")),
    **_quota_fields(lambda q: f"{q.help}; null: back to the default ({q.show(q.default)})"),
)


class _KeyPublic(BaseModel):
    id: int
    name: str
    admin: bool
    created_at: datetime
    revoked_at: datetime | None = None
    project: str | None = Field(None, description="the project it belongs to (none for an admin key)")
    role: Role = Field(description="its role in its project (an admin key: every right)")
    kind: str = Field("key", description="key; a signed-in person's: user, session (expires), personal")
    expires_at: datetime | None = Field(None, description="a session's end: it opens nothing after")

    @model_validator(mode="before")
    @classmethod
    def _quotas_in_force(cls, key: Any) -> Any:
        """A stored key (an ApiKey row): its quotas as they hold, the defaults where it stores NULL."""
        if isinstance(key, dict):
            return key
        fields = ("id", "name", "admin", "created_at", "revoked_at", "role", "kind", "expires_at")
        return {**{f: getattr(key, f) for f in fields}, **limits(key)}


KeyPublic = create_model(
    "KeyPublic",
    __base__=_KeyPublic,
    **_quota_fields(lambda q: f"{q.help}: its own or the default; null: no limit (an admin key)", False),
)


class KeyCreated(KeyPublic):
    key: str = Field(description="the key itself: shown this once, stored as a digest only")


class ProjectCreate(ProjectSettings):
    name: ProjectName


class ProjectUpdate(ProjectSettings):
    """Only the fields sent change; null: no budget, no cap."""


class ProjectPublic(BaseModel):
    id: int
    name: str
    budget_usd_month: float | None = Field(description="null: no budget")
    max_devices: int | None = Field(description="null: no cap")
    share: float
    created_at: datetime
    spend_usd_month: float = Field(description="charged to it this month (UTC), from the ledger")
    devices_held: float = Field(description="devices its running jobs hold now (a fraction: that much)")
    jobs_queued: int = Field(description="its jobs waiting for devices (queued or preempted)")
    jobs_running: int
    keys: list[str] = Field(description="its live keys, by name")
    roles: dict[str, Role] = Field(description="each live key's role in it, by name")


class MemberSet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role = Field(description="the key's role in the project")


class UploadPublic(BaseModel):
    sha256: str
    size: int
    path: str = Field(description="where the file lies on the server: name it in a spec")


# The options a deployment may set, of `gpuforge serve`'s (serve/options.py); unset: the worker's default
ServeOptions = deployment_options_model("ServeOptions")


DEPLOYMENT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class DeploymentCreate(BaseModel):
    """A new deployment; on the name of a live one (its owner's or an admin's key), that deployment's next
    version: the job's model, rolled out replica by replica with the deployment's own replicas and options
    (those given here are then refused)."""

    model_config = ConfigDict(extra="forbid")

    job_id: int = Field(ge=1, le=2**31 - 1, description="a finished job: its run's model/ is served")
    name: str = Field(pattern=DEPLOYMENT_NAME, max_length=100)
    model: str | None = Field(
        None,
        pattern=r"^compressed/[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$",
        description="a variant its compress: section made, served instead of model/: compressed/onnx-int8",
    )
    replicas: int | None = Field(None, ge=0, le=64, description="at the start (default: 1, within min..max)")
    devices: float = Field(
        1,
        gt=0,
        le=1,
        description="what each replica holds: a whole device (1), or a fraction of one (0.5, 0.25: a "
        "multiple of 0.05), packed beside jobs and other replicas (scheduler/sharing.py)",
    )
    min_replicas: int | None = Field(None, ge=0, le=64, description="autoscaling's floor; 0: scales to zero")
    max_replicas: int | None = Field(None, ge=1, le=64, description="autoscaling's ceiling")
    target_queue: float = Field(
        4.0, gt=0, le=10_000, description="requests in flight per ready replica above which one is added"
    )
    scale_down_after_s: float = Field(
        300.0, ge=0.5, le=7 * 86400, description="a replica is removed after this long with no request"
    )
    max_metric_drop: float = Field(
        0.01, ge=0, le=1, description="a new version's eval metric may fall by this much, no more"
    )
    options: ServeOptions = Field(default_factory=ServeOptions)


class AdapterAdd(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: int = Field(ge=1, le=2**31 - 1, description="a finished LoRA job on the deployment's base")
    name: str | None = Field(
        None, pattern=ADAPTER_NAME, max_length=ADAPTER_NAME_MAX, description="default: the job's name"
    )


class Rollback(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: int | None = Field(
        None, ge=1, le=2**31 - 1, description="a version it served (default: the one before)"
    )


class ReplicaPublic(BaseModel):
    index: int
    version: int | None = None
    pid: int | None = None
    port: int | None = None
    device: str | None = None
    ready: bool = False
    draining: bool = False
    restarts: int = Field(0, description="times its process was started again (0: not yet, or once)")
    adapters: list[str] = Field(default_factory=list)
    waiting: str | None = Field(None, description="why it has not started: no device free, who holds each")
    isolation: str | None = Field(None, description="on a fraction of a device: what it got (cores, a cap)")

    @field_validator("draining", mode="before")
    @classmethod
    def _since(cls, value: Any) -> bool:
        return value is not None and value is not False  # the loop keeps when it was drained

    @field_validator("restarts", mode="before")
    @classmethod
    def _started_again(cls, value: Any) -> int:
        return max(0, value or 0)  # the loop counts -1 for a replica never started yet


class DeploymentPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    job_id: int | None
    model_dir: str
    version: int = Field(description="the version serving")
    rolling_version: int | None = Field(None, description="the version being rolled out, if one is")
    replicas: int = Field(description="how many it wants now (autoscaling moves it within min..max)")
    min_replicas: int
    max_replicas: int
    target_queue: float
    scale_down_after_s: float
    max_metric_drop: float
    adapters: list[str] = Field(default_factory=list, description="adapters added to it (deploy --into)")
    device_type: str
    device_share: float | None = Field(None, description="each replica's fraction of a device; null: whole")
    state: str
    reason: str | None
    url: str = Field("", description="where clients send requests: POST {url}/predict")
    note: str | None = Field(None, description="at deploy: the queue loses every device of its kind")
    workers: list[ReplicaPublic]
    options: dict[str, Any]
    created_at: datetime
    stopped_at: datetime | None

    @field_validator("adapters", mode="before")
    @classmethod
    def _names(cls, value: Any) -> list[str]:
        return sorted(value or {})


class VersionPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    version: int
    job_id: int | None
    model_dir: str
    state: str
    reason: str | None
    metric: dict[str, Any] | None = Field(description="{metric, value, examples}: measured at load")
    checked: bool = Field(description="compared with the serving version before rolling out (not a rollback)")
    created_at: datetime
    ended_at: datetime | None


class DeploymentEventPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    ts: float
    kind: str
    data: dict[str, Any]


class ReplicaStats(BaseModel):
    index: int
    ready: bool
    requests_per_s: float | None = Field(
        None, description="over the last 10 s or so (null at the first look)"
    )
    p50_ms: float | None = None
    p99_ms: float | None = None
    refused: float | None = Field(None, description="requests refused in that window")
    in_flight: float | None = None


class DeploymentStats(BaseModel):
    name: str
    replicas: list[ReplicaStats]


class DevicePublic(BaseModel):
    id: str
    kind: str
    name: str
    memory_bytes: int | None
    memory_used_bytes: int | None = Field(description="the holding job's latest peak, where it reports it")
    held_by: str | None = Field(description="job, replica, or null when free")
    job: dict[str, Any] | None = Field(description="{id, name, owner} when the key may see that job")
    deployment: dict[str, Any] | None = Field(description="{name, replica} when the key may see it")
    busy_s_last_hour: float = Field(description="held by a job or a replica in the last 60 minutes")
    busy_seconds: float = Field(description="in all, since the ledger first charged time on it")
    usd_per_hour: float | None = Field(None, description="its price an hour; null: no price set")
    price_source: str | None = Field(None, description="where the price comes from: prices.yaml, the catalog")
    set_price: str | None = Field(None, description="when no price is set: the command that sets one")


class CostGroup(BaseModel):
    """Spend summed over one group of the ledger's rows (GET /api/v1/costs)."""

    day: str | None = None  # by=day, and in `rows`
    key: str | None = None  # by=key, and in `rows`
    project: str | None = None  # by=project (null: no project, as an admin's key)
    usd: float
    device_hours: float
    jobs: int = Field(description="jobs that ran in it")
    deployments: int = Field(description="deployments whose replicas ran in it")
    unpriced: int = Field(0, description="of those, how many ran with no price set (none of usd is theirs)")
    kwh: float = Field(0.0, description="energy the server measured or estimated (each job says how)")
    co2e_g: float = Field(0.0, description="its kWh x the grid's gCO2e/kWh (GPUFORGE_GRID_GCO2E_PER_KWH)")


class UnpricedSubject(BaseModel):
    """A job or deployment that ran with no price set: its time is in the ledger, at a rate of 0."""

    subject: str = Field(description="job:12 | deployment:3")
    kind: str
    id: int
    name: str | None
    device_type: str
    device_hours: float
    set_price: str = Field(description="the command that prices its kind of device")


class CostsPublic(BaseModel):
    since: str
    until: str
    by: str = Field(description="day, key or project: what `groups` sums over")
    project: str | None = Field(description="only this project's spend, when asked")
    days: list[str]
    keys: list[str]
    groups: list[CostGroup] = Field(description="one a day, key or project that spent (by)")
    rows: list[CostGroup] = Field(description="one a day and key that spent (the dashboard's table)")
    total_usd: float
    total_device_hours: float
    total_kwh: float = 0.0
    total_co2e_g: float = 0.0
    unpriced: list[UnpricedSubject] = Field(
        default_factory=list, description="jobs and deployments that ran with no price set: not $0, unknown"
    )
    set_price: list[str] = Field(default_factory=list, description="the commands that would price them")


class DevicePricePublic(BaseModel):
    id: str
    kind: str
    name: str
    usd_per_hour: float | None = Field(description="null: no price set")
    source: str | None = Field(description="prices.yaml's entry or the device catalog's model")
    set_price: str | None = Field(description="when no price is set: the command that sets one")


class PricesPublic(BaseModel):
    """The server's prices (GET /api/v1/prices)."""

    devices: list[DevicePricePublic]
    entries: dict[str, dict[str, Any]] | None = Field(
        description="the server's prices.yaml with each entry's parts; for an admin key alone"
    )
