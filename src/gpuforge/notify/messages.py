"""What each format sends for an event: the bytes of a webhook's body, or an email message.

generic JSON (`json`): {"id", "kind", "subject", "created_at", "text", and the event's details: "job",
"deployment" or "project"}; Slack-compatible (`slack`): {"text": "gpuforge: ..."}, what an incoming webhook
takes; `email`: the text as its subject line and first paragraph, the details as JSON below it.
"""

from __future__ import annotations

import json
from email.message import EmailMessage

from gpuforge.store.models import NotificationEvent

SUBJECT_CHARS = 150


def _details(event: NotificationEvent) -> dict:
    return {
        "id": event.id,
        "kind": event.kind,
        "subject": event.subject,
        "created_at": event.created_at.isoformat(),
        **event.data,
    }


def webhook_body(format: str, event: NotificationEvent) -> bytes:
    """The body POSTed to a `json` or `slack` target: the same bytes on every try (what is signed)."""
    if format == "slack":
        payload = {"text": f"gpuforge: {event.data.get('text', event.kind)}"}
    elif format == "json":
        payload = _details(event)
    else:
        raise ValueError(f"{format!r}: not a webhook format")
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def email_message(event: NotificationEvent, to: str, sender: str) -> EmailMessage:
    text = str(event.data.get("text", event.kind))
    message = EmailMessage()
    # one line: a reason with a newline in it must not start a header of its own
    subject = " ".join(text.split())
    message["Subject"] = "gpuforge: " + (
        subject if len(subject) <= SUBJECT_CHARS else subject[:SUBJECT_CHARS] + "..."
    )
    message["From"], message["To"] = sender, to
    message["X-Gpuforge-Event"], message["X-Gpuforge-Event-Id"] = event.kind, str(event.id)
    message.set_content(f"{text}\n\n{json.dumps(_details(event), indent=2, sort_keys=True)}\n")
    return message
