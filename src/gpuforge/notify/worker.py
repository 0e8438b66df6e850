"""The notifications' sender: a thread of the server, started beside the scheduler (server/app.py), that
sends the outbox's due deliveries and never holds up a scheduling tick (it shares nothing with it but
the store).

Each pass takes up to `batch` due deliveries and sends them on a few threads at once (one slow receiver
holds up no other): each is claimed first (store/deliveries.py: one UPDATE only one sender wins, so two
server processes on one store never send the same row), committed, sent, then marked delivered, or
tried again after a backoff that doubles (first_retry_s, 2x, 4x... up to max_retry_s), or `failed` once
max_attempts tries failed, with the last error kept. A server restarted finds its pending rows where it
left them; one it was sending when it died is taken again once its claim lapses (store/deliveries.LEASE).
"""

from __future__ import annotations

import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import Engine

from gpuforge.notify.messages import email_message, webhook_body
from gpuforge.notify.signing import SIGNATURE_HEADER, signature
from gpuforge.notify.transport import Limits, SendError, Smtp, post, send_mail
from gpuforge.store import deliveries
from gpuforge.store.db import session
from gpuforge.store.deliveries import Parcel
from gpuforge.store.models import DeliveryState, utcnow

log = logging.getLogger("gpuforge.notify")


@dataclass(frozen=True)
class NotifierOptions:
    smtp: Smtp | None = None  # None: email targets fail with a line that says what to set
    limits: Limits = field(default_factory=Limits)
    max_attempts: int = 8  # with the default backoff: tried for about 40 minutes
    first_retry_s: float = 10.0
    max_retry_s: float = 3600.0
    poll_s: float = 1.0  # how soon a new event is sent
    batch: int = 32  # deliveries taken a pass
    senders: int = 4  # sent at once


def retry_after_s(attempts: int, options: NotifierOptions) -> float:
    """How long after its `attempts`-th failed try a delivery is tried again."""
    return min(options.first_retry_s * 2 ** (attempts - 1), options.max_retry_s)


def headers(secret: str, body: bytes, parcel: Parcel) -> dict[str, str]:
    """A webhook's headers: what it is, which event (a receiver drops an id it has seen), the signature."""
    return {
        "Content-Type": "application/json",
        "User-Agent": "gpuforge-notify",
        "X-Gpuforge-Event": parcel.event.kind,
        "X-Gpuforge-Event-Id": str(parcel.event.id),
        "X-Gpuforge-Delivery": str(parcel.delivery.id),
        SIGNATURE_HEADER: signature(secret, body),
    }


def send(parcel: Parcel, options: NotifierOptions) -> None:
    """Send one claimed delivery to its target; SendError when it was not taken."""
    target, event = parcel.target, parcel.event
    if target.format == "email":
        if options.smtp is None:
            raise SendError("no SMTP server is set: GPUFORGE_SMTP_HOST and GPUFORGE_SMTP_FROM")
        send_mail(options.smtp, email_message(event, target.destination, options.smtp.sender))
        return
    body = webhook_body(target.format, event)
    post(target.destination, body, headers(target.secret, body, parcel), options.limits)


class Notifier:
    def __init__(self, engine: Engine, options: NotifierOptions | None = None):
        self.engine, self.options = engine, options or NotifierOptions()
        self.name = secrets.token_hex(8)  # this sender's claims (one per server process)
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    # --- the thread ---
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuforge-notify", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(self.options.limits.total_s + 5)  # a send under way ends within its bounds

    def wake(self) -> None:
        """Look for due deliveries now rather than at the next poll."""
        self._wake.set()

    def _run(self) -> None:
        with ThreadPoolExecutor(self.options.senders, thread_name_prefix="gpuforge-notify-send") as pool:
            while not self._stop.is_set():
                try:
                    sent = self.send_due(pool)
                except Exception:  # the store busy, say: the next pass tries again
                    log.exception("notifications: a pass failed")
                    sent = 0
                if not sent:
                    self._wake.wait(self.options.poll_s)
                    self._wake.clear()

    # --- one pass ---
    def send_due(self, pool: ThreadPoolExecutor | None = None) -> int:
        """Send the deliveries due now (on `pool`'s threads, else one by one); how many were due."""
        with session(self.engine) as s:
            due = deliveries.due(s, utcnow(), self.options.batch)
        if pool is None:
            for delivery_id in due:
                self.deliver(delivery_id)
        else:
            list(pool.map(self.deliver, due))
        return len(due)

    def deliver(self, delivery_id: int) -> DeliveryState | None:
        """Claim, send and mark one delivery: its state after this try, or None when another sender holds
        it or it is not due."""
        with session(self.engine) as s:
            parcel = deliveries.claim(s, delivery_id, self.name)  # committed before the send
        if parcel is None:
            return None
        try:
            send(parcel, self.options)
            error = None
        except SendError as err:
            error = str(err)
        except Exception as err:  # a bug of ours must not stop the others: kept like any failure
            error = f"{type(err).__name__}: could not be sent"
            log.exception("notification delivery %d: unexpected failure", delivery_id)
        attempts = parcel.delivery.attempts
        with session(self.engine) as s:
            if error is None:
                deliveries.delivered(s, delivery_id, self.name)
                return DeliveryState.DELIVERED
            if attempts >= self.options.max_attempts:
                deliveries.give_up(s, delivery_id, self.name, error)
                log.warning("notification delivery %d to target %d failed for good after %d tries: %s",
                            delivery_id, parcel.target.id, attempts, error)  # fmt: skip
                return DeliveryState.FAILED
            at = utcnow() + timedelta(seconds=retry_after_s(attempts, self.options))
            deliveries.retry(s, delivery_id, self.name, error, at)
            return DeliveryState.PENDING
