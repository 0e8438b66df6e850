"""The deliveries of the notifications' outbox, as senders take them (notify/worker.py):

    pending --claim-->      pending, claimed_by a sender until claimed_until, one attempt more
    pending --delivered-->  delivered   (its sender's claim alone)
    pending --retry-->      pending at next_attempt_at, claim let go, last_error kept
    pending --give_up-->    failed      (its attempts spent), last_error kept

A claim is one UPDATE that holds only while the row is pending, due and unclaimed (or its claim lapsed):
two senders on one store (two server processes) never both send a row. A sender killed mid-send leaves a
claim that lapses after LEASE; the row is then taken again, so the receiver may see it twice (it carries
the same event id each time: receivers drop what they have seen). Nothing is committed here.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, or_, select, update
from sqlalchemy.orm import Session

from gpuforge.store.models import (
    DeliveryState,
    NotificationDelivery,
    NotificationEvent,
    NotificationTarget,
    utcnow,
)

LEASE = timedelta(minutes=2)  # longer than a send may take (notify/transport.py bounds it well under)
MAX_ERROR = 500  # characters of last_error kept


@dataclass(frozen=True)
class Parcel:
    """One claimed delivery and what it needs to be sent."""

    delivery: NotificationDelivery
    event: NotificationEvent
    target: NotificationTarget


def _unclaimed(now: datetime) -> ColumnElement[bool]:
    return or_(NotificationDelivery.claimed_until.is_(None), NotificationDelivery.claimed_until < now)


def due(s: Session, now: datetime, limit: int) -> list[int]:
    """Ids of the pending deliveries due by `now` that nobody holds, the longest waiting first."""
    query = (
        select(NotificationDelivery.id)
        .where(
            NotificationDelivery.state == DeliveryState.PENDING,
            NotificationDelivery.next_attempt_at <= now,
            _unclaimed(now),
        )
        .order_by(NotificationDelivery.next_attempt_at, NotificationDelivery.id)
        .limit(limit)
    )
    return list(s.scalars(query))


def _set(s: Session, delivery_id: int, where: Collection[ColumnElement[bool]], **values) -> bool:
    moved = s.execute(
        update(NotificationDelivery)
        .where(
            NotificationDelivery.id == delivery_id,
            NotificationDelivery.state == DeliveryState.PENDING,
            *where,
        )
        .values(**values)
        .execution_options(synchronize_session=False)  # the sender reads its parcel after the claim
    )
    return moved.rowcount == 1


def claim(s: Session, delivery_id: int, sender: str, now: datetime | None = None) -> Parcel | None:
    """Take a due delivery for `sender` (one attempt more), or None when another holds it or it is no
    longer due; the caller commits before it sends."""
    now = now or utcnow()
    due_now = (NotificationDelivery.next_attempt_at <= now, _unclaimed(now))
    values = {
        "claimed_by": sender,
        "claimed_until": now + LEASE,
        "attempts": NotificationDelivery.attempts + 1,
    }
    if not _set(s, delivery_id, due_now, **values):
        return None
    return parcel(s, delivery_id)


def parcel(s: Session, delivery_id: int) -> Parcel | None:
    row = s.execute(
        select(NotificationDelivery, NotificationEvent, NotificationTarget)
        .join(NotificationEvent, NotificationEvent.id == NotificationDelivery.event_id)
        .join(NotificationTarget, NotificationTarget.id == NotificationDelivery.target_id)
        .where(NotificationDelivery.id == delivery_id)
        .execution_options(populate_existing=True)
    ).one_or_none()
    return None if row is None else Parcel(*row)


def _mine(sender: str) -> tuple[ColumnElement[bool]]:
    return (NotificationDelivery.claimed_by == sender,)


def delivered(s: Session, delivery_id: int, sender: str) -> bool:
    """Sent: the receiver took it. False when `sender`'s claim was lost meanwhile (it lapsed, and another
    took the row)."""
    return _set(s, delivery_id, _mine(sender), state=DeliveryState.DELIVERED, delivered_at=utcnow(),
                claimed_by=None, claimed_until=None, last_error=None)  # fmt: skip


def retry(s: Session, delivery_id: int, sender: str, error: str, at: datetime) -> bool:
    """Not sent this time (`error`): tried again from `at`."""
    return _set(s, delivery_id, _mine(sender), next_attempt_at=at, claimed_by=None, claimed_until=None,
                last_error=error[:MAX_ERROR])  # fmt: skip


def give_up(s: Session, delivery_id: int, sender: str, error: str) -> bool:
    """Not sent, and no try is left: failed, with the last try's `error`."""
    return _set(s, delivery_id, _mine(sender), state=DeliveryState.FAILED, claimed_by=None,
                claimed_until=None, last_error=error[:MAX_ERROR])  # fmt: skip


# --- reads for the API ---
def listed(
    s: Session, manageable: ColumnElement[bool], state: str | None, limit: int
) -> list[tuple[NotificationDelivery, NotificationEvent]]:
    """The latest deliveries to the targets `manageable` lets the caller see (in `state`, if given), newest
    first, each with its event."""
    query = (
        select(NotificationDelivery, NotificationEvent)
        .join(NotificationEvent, NotificationEvent.id == NotificationDelivery.event_id)
        .join(NotificationTarget, NotificationTarget.id == NotificationDelivery.target_id)
        .where(manageable)
    )
    if state:
        query = query.where(NotificationDelivery.state == state)
    return [(d, e) for d, e in s.execute(query.order_by(NotificationDelivery.id.desc()).limit(limit))]
