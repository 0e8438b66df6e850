"""The server's tables: jobs, their events, devices, API keys, deployments, uploads (SQLAlchemy 2).

The run directory stays the truth of a run (DESIGN: the runner never talks to the database); the
store holds what the server needs to answer and schedule fast: each job's state and latest figures, the
events it ingested (numbered per job, so ingesting a file twice stores nothing twice), who owns what.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Index,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    select,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, column_property, mapped_column, relationship

MAX_IDEMPOTENCY_KEY = 200  # characters: a UUID is 36
# a key's or a project's name: it travels in URLs and command lines
NAME_PATTERN, MAX_NAME = r"^[A-Za-z0-9][A-Za-z0-9._@-]*$", 100


class _StoredState(str, enum.Enum):
    """A state as the store and the API spell it: a member equals, hashes and prints as its string."""

    def __str__(self) -> str:
        return self.value


class JobState(_StoredState):
    """Where a job is; store/states.py holds every move from one to another."""

    QUEUED = "queued"
    RUNNING = "running"
    PREEMPTED = "preempted"  # stopped at a checkpoint for a job of higher priority: back in the queue
    PAUSED = "paused"  # its cost budget (or its project's month) spent, or its max_time run: resumable
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PRUNED = "pruned"  # a search's trial its pruner stopped: its evaluations were not among the best


class SearchState(_StoredState):
    """Where a hyperparameter search is (scheduler/searches.py drives it; store/states.py moves it)."""

    RUNNING = "running"
    FINISHED = "finished"  # its trials all ended
    BUDGET_SPENT = "budget_spent"  # its budget in dollars or device-hours reached: no trial runs on
    STOPPED = "stopped"  # `gpuforge tune stop`
    FAILED = "failed"  # it could not go on (its study unreadable): the reason says why


class Role(_StoredState):
    """What a key may do in its project (server/permissions.py holds the table of who may do what); the
    server-wide admin is the key's `admin` flag, not a role."""

    VIEWER = "viewer"  # reads the project's jobs, metrics, logs, deployments, costs
    MEMBER = "member"  # and submits; changes its own jobs and deployments
    MAINTAINER = "maintainer"  # and changes anyone's in the project, deploys theirs, sets the members

    @property
    def rank(self) -> int:
        return list(Role).index(self)


class DeploymentState(_StoredState):
    """Where a deployment is; store/states.py holds every move from one to another."""

    STARTING = "starting"
    READY = "ready"  # every replica answers /readyz
    STOPPING = "stopping"  # undeployed: replicas finish what they hold
    FAILING = "failing"  # a replica cannot serve: replicas being stopped
    FAILED = "failed"
    STOPPED = "stopped"


QUEUE_JOB_STATES = (JobState.QUEUED, JobState.PREEMPTED)  # waiting for devices: the scheduler's queue
ACTIVE_JOB_STATES = (
    *QUEUE_JOB_STATES,
    JobState.RUNNING,
    JobState.PAUSED,
)  # not ended: max_queued counts them
ENDED_JOB_STATES = (JobState.FINISHED, JobState.FAILED, JobState.CANCELLED, JobState.PRUNED)  # for good


def state_lists(also_ended: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The states as the dashboard reads them (whoami's answer): every job state in order, and those that
    have ended for jobs and deployments; `also_ended`: ends of runs that have no job (`stopped`)."""
    return {
        "jobs": [*(s.value for s in JobState), *also_ended],
        "jobs_ended": [*(s.value for s in ENDED_JOB_STATES), *also_ended],
        "deployments_ended": [s.value for s in ENDED_DEPLOYMENT_STATES],
    }


LIVE_DEPLOYMENT_STATES = (
    DeploymentState.STARTING,
    DeploymentState.READY,
    DeploymentState.STOPPING,
    DeploymentState.FAILING,
)  # replicas may run: the loop keeps them, max_deployments counts them
ENDED_DEPLOYMENT_STATES = (DeploymentState.STOPPED, DeploymentState.FAILED)  # its name may be deployed again


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """Aware UTC datetimes on every backend: SQLite keeps no time zone and hands back naive values;
    PostgreSQL hands back its session's time zone (the server's TimeZone setting), converted here."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return value.astimezone(UTC) if value is not None and value.tzinfo else value

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class StateColumn(TypeDecorator):
    """A state column: the plain string in the store (the values never changed), its enum member in Python.
    A plain string binds as it is (a filter the API was sent: an unknown state matches nothing)."""

    impl = String(16)
    cache_ok = True

    def __init__(self, states: type[_StoredState]):
        super().__init__()
        self.states = states

    def process_bind_param(self, value, dialect):
        return value.value if isinstance(value, enum.Enum) else value

    def process_result_value(self, value, dialect):
        return None if value is None else self.states(value)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, datetime: UTCDateTime}


class Project(Base):
    """A team sharing the server: its keys' jobs and deployments are its own (members read each other's),
    its month's spend in the ledger stops at its budget, it holds at most max_devices at once, and its
    share weighs its turn in the queue (store/projects.py)."""

    __tablename__ = "projects"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    budget_usd_month: Mapped[float | None] = mapped_column(default=None)  # None: no budget
    max_devices: Mapped[int | None] = mapped_column(default=None)  # None: no cap
    share: Mapped[float] = mapped_column(default=1.0)  # fair share weight: 2 gets twice the device-time
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 of the key; the key is never stored
    admin: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)  # no longer opens anything
    # its quotas (store/quotas.py QUOTAS), as the admin set them: NULL is the default (none for an admin)
    max_queued: Mapped[int | None] = mapped_column(default=None)
    max_running: Mapped[int | None] = mapped_column(default=None)
    max_upload_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    max_deployments: Mapped[int | None] = mapped_column(default=None)
    max_priority: Mapped[int | None] = mapped_column(default=None)
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id"), default=None)  # admin: none
    role: Mapped[Role] = mapped_column(StateColumn(Role), default=Role.MEMBER)  # in its project (or its own)
    # a person's (single sign-on, store/users.py): the one they act through, a session's, or a personal key
    user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id"), default=None, index=True)
    kind: Mapped[str] = mapped_column(String(8), default="key")  # key | user | session | personal
    expires_at: Mapped[datetime | None] = mapped_column(default=None)  # a session's: opens nothing after
    owned = None  # not stored: the ids of its user's every key, set when a request's key is looked up


class Search(Base):
    """A hyperparameter search: trials of one job (each a Job with search_id) with the values its Optuna
    study asks for; the study itself lives in Optuna's own tables (scheduler/searches.py says where)."""

    __tablename__ = "searches"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"))
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id"), default=None)
    state: Mapped[SearchState] = mapped_column(StateColumn(SearchState), default=SearchState.RUNNING)
    reason: Mapped[str | None] = mapped_column(Text)
    tune_yaml: Mapped[str] = mapped_column(Text)  # the tune section, as checked
    job_yaml: Mapped[str] = mapped_column(Text)  # the job each trial varies, as admitted (its price set)
    # the columns of each trial's Job, as admission computed them for the job (priority, devices, rate...)
    trial_job: Mapped[dict[str, Any]] = mapped_column(JSON)
    stop_requested: Mapped[bool] = mapped_column(default=False)  # `tune stop`: the loop ends it
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)

    owner: Mapped[str | None] = column_property(
        select(ApiKey.name).where(ApiKey.id == owner_id).correlate_except(ApiKey).scalar_subquery()
    )


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_queue", "state", "priority", "id"),
        Index("ix_jobs_project_id", "project_id"),  # a member's list: its own jobs or its project's
        # a submit retried with its Idempotency-Key finds its first job: never a second (routes/jobs.py)
        UniqueConstraint("owner_id", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
        UniqueConstraint("search_id", "trial", name="uq_jobs_search_trial"),  # a trial is one job
    )

    id: Mapped[int] = mapped_column(primary_key=True)  # also the FIFO order within a priority
    name: Mapped[str] = mapped_column(String(100))
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"))
    state: Mapped[JobState] = mapped_column(StateColumn(JobState), default=JobState.QUEUED)
    priority: Mapped[int] = mapped_column(default=0)
    device_type: Mapped[str] = mapped_column(String(8), default="cpu")  # what it asked for, resolved
    devices_wanted: Mapped[int] = mapped_column(default=1)
    devices: Mapped[str | None] = mapped_column(String(200))  # given, e.g. "cuda:0,cuda:1"
    device_share: Mapped[float | None] = mapped_column(default=None)  # a fraction of one device; None: whole
    # what its share of a device got, in words (scheduler/sharing.py): "cores 1 of 2 (pinned)", "memory cap
    # 40 GiB (PyTorch allocator; not enforced for other libraries)", "time-sliced, no cap"
    isolation: Mapped[str | None] = mapped_column(Text, default=None)
    spec_yaml: Mapped[str] = mapped_column(Text, deferred=True)  # read only to launch: not with every list
    run_dir: Mapped[str] = mapped_column(String(1000))
    pid: Mapped[int | None] = mapped_column()
    restarts: Mapped[int] = mapped_column(default=0)
    max_restarts: Mapped[int] = mapped_column(default=2)
    reason: Mapped[str | None] = mapped_column(Text)
    idempotency_key: Mapped[str | None] = mapped_column(String(MAX_IDEMPOTENCY_KEY))  # the submit's, if sent
    # {server path: the name the user's client knew it by}: its uploads, named the user's way in reasons
    files: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), default=None)
    cancel_requested: Mapped[bool] = mapped_column(default=False)  # the loop stops its process
    # the project of its key when it was submitted: its costs and devices count there
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id"), default=None)
    usd_per_hour: Mapped[float | None] = mapped_column(default=None)  # all its devices: the ledger's rate
    # what a kWh costs where its price gives it (an owned device: its hourly rate then leaves energy out)
    usd_per_kwh: Mapped[float | None] = mapped_column(default=None)
    energy_kwh: Mapped[float | None] = mapped_column(default=None)  # measured by the server (ledger's sum)
    energy_source: Mapped[str | None] = mapped_column(String(300), default=None)  # how: nvml, rapl, estimated
    co2e_g: Mapped[float | None] = mapped_column(default=None)  # its kWh times the grid's intensity
    preemptible: Mapped[bool] = mapped_column(default=True)  # resources.preemptible (false: admin keys only)
    preemptions: Mapped[int] = mapped_column(default=0)  # preempted in a row: past a limit it gains priority
    boost: Mapped[int] = mapped_column(default=0)  # added to its priority in the queue (never preempted)
    # a search's trial: its search and its trial number there (the Optuna study's)
    search_id: Mapped[int | None] = mapped_column(ForeignKey("searches.id"), default=None)
    trial: Mapped[int | None] = mapped_column(default=None)
    # the loop stops its process for a reason of the server's, not the user's: preempt | pause | timeout |
    # prune
    stop_requested: Mapped[str | None] = mapped_column(String(16), default=None)
    max_time_s: Mapped[float | None] = mapped_column(default=None)  # resources.max_time: stopped past it
    placement: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), default=None)
    accrued_at: Mapped[datetime | None] = mapped_column(default=None)  # the ledger holds its cost until then
    run_started_at: Mapped[datetime | None] = mapped_column(default=None)  # this run's process (max_time)
    # latest figures, copied from metrics as they are ingested (for listing without reading files)
    step: Mapped[int | None] = mapped_column()
    total_steps: Mapped[int | None] = mapped_column()
    loss: Mapped[float | None] = mapped_column()
    samples_per_s: Mapped[float | None] = mapped_column()
    cost_usd: Mapped[float | None] = mapped_column()
    mfu: Mapped[float | None] = mapped_column()
    eta_s: Mapped[float | None] = mapped_column()
    # how far the run directory's files were read (ingest.py): bytes and lines of each, and the events
    # stored so far (the next one's seq)
    events_offset: Mapped[int] = mapped_column(BigInteger, default=0)
    events_lines: Mapped[int] = mapped_column(BigInteger, default=0)
    events_read: Mapped[int] = mapped_column(default=0)
    metrics_offset: Mapped[int] = mapped_column(BigInteger, default=0)
    metrics_lines: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column()

    # the name of the key that submitted it, read with the job (a subquery: no second round trip a row)
    owner: Mapped[str | None] = column_property(
        select(ApiKey.name).where(ApiKey.id == owner_id).correlate_except(ApiKey).scalar_subquery()
    )
    project: Mapped[str | None] = column_property(
        select(Project.name).where(Project.id == project_id).correlate_except(Project).scalar_subquery()
    )

    events: Mapped[list[Event]] = relationship(
        back_populates="job", order_by="Event.seq", cascade="all, delete-orphan", passive_deletes=True
    )


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (UniqueConstraint("job_id", "seq"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column()  # the job's events in the order they were stored (ingest.py)
    ts: Mapped[float] = mapped_column()
    kind: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)

    job: Mapped[Job] = relationship(back_populates="events")


class Device(Base):
    __tablename__ = "devices"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # "cpu", "cuda:0", ...
    kind: Mapped[str] = mapped_column(String(8))
    name: Mapped[str] = mapped_column(String(200))
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    busy_seconds: Mapped[float] = mapped_column(default=0.0)


class Deployment(Base):
    """A trained model served by `replicas` worker processes (gpuforge serve) the server runs and restarts;
    the server's own address forwards to them (least loaded first)."""

    __tablename__ = "deployments"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"))
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    model_dir: Mapped[str] = mapped_column(String(1000))
    options: Mapped[dict[str, Any]] = mapped_column(default=dict)  # gpuforge serve options
    replicas: Mapped[int] = mapped_column(default=1)
    device_type: Mapped[str] = mapped_column(String(8), default="cpu")
    device_share: Mapped[float | None] = mapped_column(default=None)  # a replica's fraction of a device
    state: Mapped[DeploymentState] = mapped_column(
        StateColumn(DeploymentState), default=DeploymentState.STARTING
    )
    reason: Mapped[str | None] = mapped_column(Text)
    # the sha256 of the key its loopback replicas want (derived, never stored: scheduler/worker_keys.py)
    worker_key: Mapped[str] = mapped_column(String(64))
    # one entry a replica: {"index", "pid", "port", "device", "restarts", "ready"}
    workers: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    max_restarts: Mapped[int] = mapped_column(default=5)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    stopped_at: Mapped[datetime | None] = mapped_column()
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id"), default=None)
    usd_per_hour: Mapped[float | None] = mapped_column(
        default=None
    )  # one replica's device: the ledger's rate
    accrued_at: Mapped[datetime | None] = mapped_column(default=None)  # the ledger holds its cost until then
    version: Mapped[int] = mapped_column(default=1)  # the version serving (model_dir, job_id: its own)
    # autoscaling: `replicas` is how many it wants now, moved within [min, max] by the loop
    min_replicas: Mapped[int] = mapped_column(default=1)
    max_replicas: Mapped[int] = mapped_column(default=1)
    target_queue: Mapped[float] = mapped_column(default=4.0)  # requests in flight per ready replica
    scale_down_after_s: Mapped[float] = mapped_column(default=300.0)
    max_metric_drop: Mapped[float] = mapped_column(default=0.01)  # a new version's eval metric may fall by
    adapters: Mapped[dict[str, str] | None] = mapped_column(JSON, default=dict)  # name -> model/ added


class VersionState(_StoredState):
    """Where a deployment's version is (scheduler/deployments.py rolls them out)."""

    ROLLING = "rolling"  # being rolled out, replica by replica (first checked, unless a rollback)
    SERVING = "serving"
    RETIRED = "retired"  # served before; a rollback may roll it out again
    REFUSED = "refused"  # its eval metric fell more than max_metric_drop below the serving one's
    FAILED = "failed"  # its model would not load


class DeploymentVersion(Base):
    """One model a deployment served or was asked to: `gpuforge deploy JOB --name N` on a live N adds one."""

    __tablename__ = "deployment_versions"
    __table_args__ = (UniqueConstraint("deployment_id", "version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column()
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    model_dir: Mapped[str] = mapped_column(String(1000))
    state: Mapped[VersionState] = mapped_column(StateColumn(VersionState))
    reason: Mapped[str | None] = mapped_column(Text)
    metric: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # {"metric", "value", "examples"} at load
    checked: Mapped[bool] = mapped_column(default=True)  # its metric is compared before it rolls out
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column()


class DeploymentEvent(Base):
    """What happened to a deployment: versions rolled out or refused, replicas scaled, cold starts."""

    __tablename__ = "deployment_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"), index=True)
    ts: Mapped[float] = mapped_column()
    kind: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)


class UploadGrant(Base):
    """Who may name an upload (routes/uploads.py): the project of a key that sent its bytes, or that key
    where it has no project. The content is stored once; each project that sent it holds a grant, and
    another project's key is told the server has no such file (admins see all)."""

    __tablename__ = "upload_grants"
    __table_args__ = (UniqueConstraint("sha256", "suffix", "holder"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64))
    suffix: Mapped[str] = mapped_column(String(24), default="")
    holder: Mapped[str] = mapped_column(String(32))  # "project:3" | "key:7" (store/uploads.py)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Upload(Base):
    """A file under <home>/uploads (routes/uploads.py), charged to the key that made the server store it:
    its size counts against that key's max_upload_bytes (store/quotas.py). One row a stored file: the same
    content under another suffix is another file."""

    __tablename__ = "uploads"
    __table_args__ = (UniqueConstraint("sha256", "suffix"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64))
    suffix: Mapped[str] = mapped_column(String(24), default="")  # kept: readers pick the format by it
    key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id"), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class LedgerEntry(Base):
    """What one job or deployment cost in one minute (store/ledger.py): written as it runs, with the mark
    (its accrued_at) in the same transaction, so a server killed at any moment counts no second twice."""

    __tablename__ = "ledger"
    __table_args__ = (
        UniqueConstraint("subject", "minute"),
        Index("ix_ledger_project_minute", "project_id", "minute"),
        Index("ix_ledger_minute", "minute"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    subject: Mapped[str] = mapped_column(String(40))  # "job:12" | "deployment:3"
    minute: Mapped[datetime] = mapped_column()  # the minute's start, UTC
    key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"))
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id"))
    device_seconds: Mapped[float] = mapped_column(default=0.0)
    usd: Mapped[float] = mapped_column(default=0.0)
    kwh: Mapped[float] = mapped_column(default=0.0, server_default="0")  # measured or estimated: its source
    co2e_g: Mapped[float] = mapped_column(default=0.0, server_default="0")  # on the job or deployment row


class AuditEntry(Base):
    """One change made through the API (store/audit.py): who, from where, what, on what, before and after.
    Written in the transaction of the change it tells; never changed nor deleted (the migration's triggers
    refuse both)."""

    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_project_at", "project_id", "at"),)

    id: Mapped[int] = mapped_column(primary_key=True)  # also the order they happened in
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(100))  # a key's name, or "-" for a request without a key
    actor_key_id: Mapped[int | None] = mapped_column(default=None)  # no foreign key: a row outlives anything
    source: Mapped[str] = mapped_column(String(64))  # the client's address, as the server saw it
    action: Mapped[str] = mapped_column(String(40), index=True)  # server/permissions.py's name, "job.cancel"
    target: Mapped[str] = mapped_column(String(200))  # "job 12", "deployment web", "key alice"
    project_id: Mapped[int | None] = mapped_column(default=None)  # the target's project: maintainers read it
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), default=None)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), default=None)
    outcome: Mapped[str] = mapped_column(String(16), default="done")  # done | refused (failed sign-ins)


class DeliveryState(_StoredState):
    """Where one event's delivery to one target is (store/deliveries.py moves it)."""

    PENDING = "pending"  # to be sent, at next_attempt_at (again, after a failed try)
    DELIVERED = "delivered"  # the receiver answered 2xx (an SMTP server took the message)
    FAILED = "failed"  # every try failed: last_error says how the last one did


class NotificationTarget(Base):
    """Where events are sent (store/notification_targets.py): a webhook, generic JSON or Slack's, or an
    email address. A person's (project_id None: the events of its owner key's jobs and deployments) or a
    project's (its jobs', deployments' and budget's). Its destination and secret are its owner's alone."""

    __tablename__ = "notification_targets"

    id: Mapped[int] = mapped_column(primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id"), index=True)  # the key that made it
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id"), index=True, default=None)
    format: Mapped[str] = mapped_column(String(8))  # json | slack | email
    destination: Mapped[str] = mapped_column(Text)  # the URL, or the email address: never shown to others
    events: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True), default=None)  # None: all
    secret: Mapped[str] = mapped_column(String(64))  # signs each body (HMAC-SHA256): shown once, at creation
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    owner: Mapped[str | None] = column_property(
        select(ApiKey.name).where(ApiKey.id == owner_id).correlate_except(ApiKey).scalar_subquery()
    )
    project: Mapped[str | None] = column_property(
        select(Project.name).where(Project.id == project_id).correlate_except(Project).scalar_subquery()
    )


class NotificationEvent(Base):
    """What happened that someone may want to hear of (store/outbox.py): written in the transaction of the
    change that caused it, with one delivery per target that wants it."""

    __tablename__ = "notification_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))  # outbox.EVENT_KINDS
    subject: Mapped[str] = mapped_column(String(40))  # "job:12" | "deployment:3" | "project:2" | "target:5"
    owner_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"), default=None)  # its subject's
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id"), default=None)
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)  # what the message says: `text` and details
    # set for an event that happens once, whatever the ticks that see it ("budget.80:project:2:2026-01")
    once: Mapped[str | None] = mapped_column(String(100), unique=True, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class NotificationDelivery(Base):
    """One event sent to one target: claimed by one sender at a time (claimed_by until claimed_until),
    tried again later after a failure, `failed` after the last try."""

    __tablename__ = "notification_deliveries"
    __table_args__ = (
        UniqueConstraint("event_id", "target_id"),  # an event reaches a target once
        Index("ix_notification_deliveries_due", "state", "next_attempt_at"),  # the sender's poll
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    event_id: Mapped[int] = mapped_column(ForeignKey("notification_events.id", ondelete="CASCADE"))
    target_id: Mapped[int] = mapped_column(
        ForeignKey("notification_targets.id", ondelete="CASCADE"), index=True
    )
    state: Mapped[DeliveryState] = mapped_column(StateColumn(DeliveryState), default=DeliveryState.PENDING)
    attempts: Mapped[int] = mapped_column(default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    claimed_by: Mapped[str | None] = mapped_column(String(32), default=None)  # the sender sending it now
    claimed_until: Mapped[datetime | None] = mapped_column(default=None)  # past it, another may take it
    last_error: Mapped[str | None] = mapped_column(Text, default=None)  # never holds the destination
    delivered_at: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class User(Base):
    """A person signed in through single sign-on (store/users.py), known by the issuer's `sub`; they act
    through an API key row of their own (kind `user`), which owns what they make."""

    __tablename__ = "users"
    __table_args__ = (UniqueConstraint("issuer", "subject"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    issuer: Mapped[str] = mapped_column(String(500))
    subject: Mapped[str] = mapped_column(String(255))
    name: Mapped[str | None] = mapped_column(String(200), default=None)
    email: Mapped[str | None] = mapped_column(String(320), default=None)
    admin: Mapped[bool] = mapped_column(default=False)  # from the roles rule (GROUP=admin), at each sign-in
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_sign_in_at: Mapped[datetime | None] = mapped_column(default=None)


class Membership(Base):
    """A user's role in a project: set in the server's table (`projects member`), or read from the groups
    claim by the roles rule at each sign-in (`source` claim). The higher of the two holds."""

    __tablename__ = "memberships"
    __table_args__ = (UniqueConstraint("user_id", "project_id", "source"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    role: Mapped[Role] = mapped_column(StateColumn(Role))
    source: Mapped[str] = mapped_column(String(8))  # table | claim
