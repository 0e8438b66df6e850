"""Request and response bodies of the HTTP API (XCreate / XPublic)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: str = Field(description="the job spec, YAML text")
    priority: int | None = Field(None, description="default: the spec's priority")
    name: str | None = Field(None, description="default: the spec's name")


class JobPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    state: str
    priority: int
    device_type: str
    devices_wanted: int
    devices: str | None
    step: int | None
    total_steps: int | None
    loss: float | None
    samples_per_s: float | None
    cost_usd: float | None
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


class Health(BaseModel):
    status: str
