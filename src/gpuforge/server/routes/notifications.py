"""Notification targets and their deliveries (docs/notifications.md): a key makes, lists, tests and removes
its own targets; a project's targets are its maintainers' and an admin's (server/visibility.py's
may_manage_target decides every case). A target's URL and secret are never shown to another key; its
secret is shown once, when made."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi import Path as PathParam

from gpuforge.server.auth import Key
from gpuforge.server.notification_schemas import DeliveryPublic, TargetCreate, TargetCreated, TargetPublic
from gpuforge.server.permissions import audited, permit
from gpuforge.server.services import services
from gpuforge.server.visibility import manageable_targets, may_manage_target
from gpuforge.store import deliveries, outbox
from gpuforge.store.db import session
from gpuforge.store.deliveries import Parcel
from gpuforge.store.models import (
    ApiKey,
    DeliveryState,
    NotificationDelivery,
    NotificationEvent,
    NotificationTarget,
)
from gpuforge.store.notification_targets import create_target, delete_target, target, targets
from gpuforge.store.projects import project_named

router = APIRouter(prefix="/api/v1/notifications", tags=["notifications"])
TargetId = Annotated[int, PathParam(description="the target's id")]


def _public_delivery(d: NotificationDelivery, e: NotificationEvent) -> DeliveryPublic:
    pending = d.state == DeliveryState.PENDING
    return DeliveryPublic(
        id=d.id,
        target_id=d.target_id,
        event_id=e.id,
        kind=e.kind,
        subject=e.subject,
        text=e.data.get("text"),
        state=str(d.state),
        attempts=d.attempts,
        next_attempt_at=d.next_attempt_at if pending else None,
        last_error=d.last_error,
        delivered_at=d.delivered_at,
        created_at=d.created_at,
    )


def _public_target(t: NotificationTarget) -> TargetPublic:
    """A target as its owner (or an admin) sees it: the only keys any route shows it to."""
    return TargetPublic(id=t.id, format=t.format, url=t.destination, owner=t.owner, project=t.project,
                        events=t.events, created_at=t.created_at)  # fmt: skip


def _managed(s, key: ApiKey, target_id: int):
    """The target, if `key` may manage it: 404 otherwise, as if there were none."""
    found = target(s, target_id)
    if found is None or not may_manage_target(key, found.owner_id, found.project_id):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no notification target {target_id}")
    return found


@router.post(
    "/targets",
    status_code=status.HTTP_201_CREATED,
    response_model=TargetCreated,
    dependencies=[permit("notifications.change")],
)
def make_target(body: TargetCreate, request: Request, key: Key) -> TargetCreated:
    """A new target; the answer is the only place its signing secret is ever shown."""
    with session(services(request).engine) as s:
        project_id = None
        if body.project is not None:
            try:
                project_id = project_named(s, body.project).id
            except LookupError as err:
                raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from err
        if not may_manage_target(key, key.id, project_id):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN, f"key {key.name!r} may not make project {body.project}'s targets"
            )
        made, secret = create_target(s, key.id, body.format, body.url, project_id, body.events)
        s.flush()
        s.refresh(made)  # its owner's and project's names
        shown = _public_target(made)
        audited(s, request, key, f"notification target {made.id}", project_id, after=_kept(shown))
        return TargetCreated(**shown.model_dump(), secret=secret)


def _kept(shown: TargetPublic) -> dict:
    """What an audit row keeps of a target: never its URL or address (a secret to others)."""
    return shown.model_dump(mode="json", include={"format", "project", "events"})


@router.get("/targets", response_model=list[TargetPublic], dependencies=[permit("notifications.read")])
def list_targets(request: Request, key: Key) -> list[TargetPublic]:
    """The targets this key manages (an admin key: all), oldest first; never their secrets."""
    with session(services(request).engine) as s:
        return [_public_target(t) for t in targets(s, manageable_targets(key))]


@router.delete(
    "/targets/{target_id}", response_model=TargetPublic, dependencies=[permit("notifications.change")]
)
def remove_target(target_id: TargetId, request: Request, key: Key) -> TargetPublic:
    """Remove a target: nothing more is sent to it, and its deliveries go with it."""
    with session(services(request).engine) as s:
        found = _managed(s, key, target_id)
        shown = _public_target(found)
        delete_target(s, found)
        audited(s, request, key, f"notification target {target_id}", found.project_id, _kept(shown), None)
        return shown


@router.post(
    "/targets/{target_id}/test", response_model=DeliveryPublic, dependencies=[permit("notifications.test")]
)
def test_target(target_id: TargetId, request: Request, key: Key) -> DeliveryPublic:
    """Send a test event to a target now, whatever it subscribes to: the delivery as this try left it
    (delivered, or pending with the error and its next try, as any delivery)."""
    engine = services(request).engine
    with session(engine) as s:
        delivery_id = outbox.ping(s, _managed(s, key, target_id), key.name).id
    services(request).notifier.deliver(delivery_id)  # here, not at the sender's next pass: its answer
    with session(engine) as s:
        sent: Parcel | None = deliveries.parcel(s, delivery_id)
        if sent is None:  # the target was removed meanwhile
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no notification target {target_id}")
        return _public_delivery(sent.delivery, sent.event)


@router.get("/deliveries", response_model=list[DeliveryPublic], dependencies=[permit("notifications.read")])
def list_deliveries(
    request: Request,
    key: Key,
    state: Annotated[str | None, Query(description="pending | delivered | failed")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[DeliveryPublic]:
    """The latest deliveries to the targets this key manages, newest first, with their state."""
    with session(services(request).engine) as s:
        return [
            _public_delivery(d, e) for d, e in deliveries.listed(s, manageable_targets(key), state, limit)
        ]
