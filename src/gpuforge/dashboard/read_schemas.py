"""The bodies the read routes answer (dashboard/read_routes.py), the server's and `gpuforge dashboard`'s
alike: a job, its events, spec, series and log tail, who the key is, and runs compared."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gpuforge.store.models import state_lists


class JobPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    owner: str | None = Field(description="the name of the key that submitted it")
    project: str | None = Field(None, description="the project of its key when it was submitted")
    state: str
    priority: int
    queue_position: int | None = Field(
        None, description="queued or preempted: its place in the queue (1 starts next), at the last tick"
    )
    preemptions: int = Field(0, description="times it was preempted in a row")
    preemptible: bool = True
    device_type: str
    devices_wanted: int
    devices: str | None
    device_share: float | None = Field(None, description="a fraction of one device (resources.devices < 1)")
    isolation: str | None = Field(
        None, description="what its fraction of a device got: cores pinned, a memory cap, MPS, time-sliced"
    )
    step: int | None
    total_steps: int | None
    loss: float | None = Field(description="as the job reports it at its latest logged step")
    samples_per_s: float | None = Field(description="as the job reports it (range-checked)")
    mfu: float | None = Field(description="model FLOPs utilisation, as the job reports it (in [0, 1])")
    eta_s: float | None = Field(description="seconds left, as the job reports it (>= 0)")
    cost_usd: float | None = Field(description="what the server's ledger charged it (never the job's word)")
    usd_per_hour: float | None = Field(
        None, description="what the server charges it an hour, all its devices together (the ledger's rate)"
    )
    energy_kwh: float | None = Field(None, description="the energy the server measured or estimated for it")
    energy_source: str | None = Field(None, description="how: nvml, rapl or estimated, with the rule used")
    co2e_g: float | None = Field(None, description="its kWh x the grid's gCO2e/kWh, where one is set")
    search_id: int | None = Field(None, description="a search's trial: its search (gpuforge tune show ID)")
    trial: int | None = Field(None, description="a search's trial: its number there")
    restarts: int = Field(description="times its process was started again after dying")
    max_restarts: int
    reason: str | None
    run_dir: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class EventPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    seq: int
    ts: float
    kind: str
    data: dict[str, Any]


class JobSpecPublic(BaseModel):
    yaml: str = Field(description="the resolved spec, as the run directory stores it")
    spec: dict[str, Any]
    files: dict[str, str] = Field(
        default_factory=dict,
        description="{server path: the user's name for it} of the uploads the spec names: a page shows the "
        "name, not the upload's hash",
    )


class Series(BaseModel):
    records: int = Field(description="metrics records the run wrote")
    metrics: dict[str, dict[str, list[int | float]]] = Field(
        description="{metric: {step: [...], value: [...]}}, each at most max_points long (min and max of "
        "each bucket of steps past that)"
    )


class WhoAmI(BaseModel):
    name: str
    admin: bool
    project: str | None = Field(None, description="its project (none: only its own rows)")
    role: str | None = Field(
        None, description="viewer, member, maintainer (in its project, or over its own rows), or admin"
    )
    read_only: bool = Field(False, description="true under `gpuforge dashboard`: nothing can be changed")
    states: dict[str, list[str]] = Field(
        default_factory=state_lists, description="every job state, and the job and deployment states ended"
    )


class LogTail(BaseModel):
    lines: list[str]
    offset: int = Field(description="byte offset past the last line: follow the log from there")


class Comparison(BaseModel):
    jobs: list[dict[str, Any]] = Field(description="{id, name, state, owner} of each, in the order asked")
    spec_diff: list[dict[str, Any]] = Field(description="{key, values}: only the keys that differ")
    finals: list[dict[str, Any]] = Field(description="{id, status, eval, final_loss, samples_per_s, ...}")
