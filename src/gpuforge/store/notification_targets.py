"""Notification targets: where a key's or a project's events are sent (store/outbox.py decides which events
each hears of). A destination is checked here, once, when the target is made: a webhook is an http or
https URL, an email target one plain address. Its secret, which signs every body sent to it, is made here
and shown once, by the answer that made it."""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from urllib.parse import urlsplit

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from gpuforge.store.models import NotificationTarget, utcnow
from gpuforge.store.outbox import EVENT_KINDS

FORMATS = ("json", "slack", "email")
MAX_URL = 2000  # characters: a Slack incoming webhook's is about 80
SECRET_PREFIX = "gfs_"
# one plain address: nothing a header could be split on (CR, LF, comma, angle brackets), nothing quoted
ADDRESS = re.compile(r"^[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]+@[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")


def check_destination(format: str, destination: str) -> str:
    """The destination as stored, or a ValueError that says what is wrong with it (never the URL itself:
    errors are logged and shown, and a webhook's URL is its owner's secret)."""
    if format not in FORMATS:
        raise ValueError(f"format {format!r}: give one of {', '.join(FORMATS)}")
    if format == "email":
        address = destination.removeprefix("mailto:")
        if len(address) > 254 or not ADDRESS.match(address):
            raise ValueError(
                "an email target's url is one address, e.g. alice@example.com or mailto:alice@..."
            )
        return address
    if len(destination) > MAX_URL:
        raise ValueError(f"the url is over {MAX_URL} characters")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in destination):
        raise ValueError("the url holds spaces or control characters")
    try:
        parts = urlsplit(destination)
        port = parts.port  # a port out of range raises here
    except ValueError:
        raise ValueError("the url cannot be read as a URL") from None
    if parts.scheme not in ("http", "https"):
        shown = f"{parts.scheme}:" if parts.scheme else "no scheme"
        raise ValueError(f"only http and https URLs are sent to, not {shown}")
    if not parts.hostname or port == 0:
        raise ValueError("the url names no host (http(s)://HOST[:PORT]/PATH)")
    return destination


def check_events(events: Sequence[str] | None) -> list[str] | None:
    """The kinds a target subscribes to (None: all of them, those added later too)."""
    if events is None:
        return None
    unknown = sorted(set(events) - set(EVENT_KINDS))
    if unknown or not events:
        raise ValueError(
            f"events: give some of {', '.join(EVENT_KINDS)} (not {', '.join(unknown) or 'none'})"
        )
    return [kind for kind in EVENT_KINDS if kind in events]  # in one order, each once


def create_target(
    s: Session,
    owner_id: int,
    format: str,
    destination: str,
    project_id: int | None = None,
    events: Sequence[str] | None = None,
) -> tuple[NotificationTarget, str]:
    """A new target of key `owner_id`'s (of its project `project_id`'s, if given), and its secret."""
    destination, events = check_destination(format, destination), check_events(events)
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    target = NotificationTarget(
        owner_id=owner_id, project_id=project_id, format=format, destination=destination, events=events,
        secret=secret, created_at=utcnow(),
    )  # fmt: skip
    s.add(target)
    s.flush()
    return target, secret


def targets(s: Session, manageable: ColumnElement[bool]) -> list[NotificationTarget]:
    """The targets `manageable` (server/visibility.py) lets the caller see, oldest first."""
    return list(s.scalars(select(NotificationTarget).where(manageable).order_by(NotificationTarget.id)))


def target(s: Session, target_id: int) -> NotificationTarget | None:
    return s.get(NotificationTarget, target_id)


def delete_target(s: Session, found: NotificationTarget) -> None:
    """Remove a target; its deliveries go with it (one being sent this moment is not marked)."""
    s.delete(found)
    s.flush()
