"""Request and response bodies of the notifications' routes (routes/notifications.py), beside schemas.py."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from gpuforge.store.notification_targets import MAX_URL, check_destination, check_events
from gpuforge.store.outbox import EVENT_KINDS
from gpuforge.store.projects import ProjectName

Format = Literal["json", "slack", "email"]


class TargetCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Format = Field("json", description="json: generic JSON POST; slack: an incoming webhook's "
                           "{\"text\"}; email: through the server's SMTP settings")  # fmt: skip
    url: str = Field(
        max_length=MAX_URL,
        description="an http(s) URL the events are POSTed to; for email, the address (or mailto:ADDRESS)",
    )
    project: ProjectName | None = Field(
        None, description="a project's target (admin key); else the key's own"
    )
    events: list[str] | None = Field(
        None, min_length=1, max_length=len(EVENT_KINDS), description=f"of {', '.join(EVENT_KINDS)}; null: all"
    )

    @field_validator("url")
    @classmethod
    def _destination(cls, url: str, info: ValidationInfo) -> str:
        return check_destination(info.data.get("format", "json"), url)

    @field_validator("events")
    @classmethod
    def _kinds(cls, events: list[str] | None) -> list[str] | None:
        return check_events(events)


class TargetPublic(BaseModel):
    id: int
    format: str
    url: str = Field(description="shown to its owner and admin keys alone")
    owner: str | None = Field(description="the key that made it")
    project: str | None = Field(description="a project's target: its events; null: its owner key's")
    events: list[str] | None = Field(description="null: all kinds")
    created_at: datetime


class TargetCreated(TargetPublic):
    secret: str = Field(
        description="signs each body (X-Gpuforge-Signature, docs/notifications.md): shown this once"
    )


class DeliveryPublic(BaseModel):
    id: int
    target_id: int
    event_id: int
    kind: str
    subject: str
    text: str | None
    state: str = Field(description="pending | delivered | failed")
    attempts: int
    next_attempt_at: datetime | None = Field(description="when a pending one is tried next")
    last_error: str | None
    delivered_at: datetime | None
    created_at: datetime
