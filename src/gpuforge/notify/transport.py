"""The sends themselves, each bounded: a webhook's POST (http or https alone, a timeout on connecting and
on each read, a whole-request deadline, no redirect followed, at most a few KiB of the answer read) and an
SMTP delivery (a timeout on each operation, STARTTLS when set). A failure is a SendError whose message
never holds the destination (it is stored as last_error and logged; a webhook URL is a secret)."""

from __future__ import annotations

import smtplib
import ssl
import time
from dataclasses import dataclass
from email.message import EmailMessage
from urllib.parse import urlsplit

import httpx


class SendError(Exception):
    """A send that failed, said without its destination."""


@dataclass(frozen=True)
class Limits:
    connect_s: float = 5.0
    read_s: float = 10.0  # each read: an answer that stalls longer fails
    total_s: float = 20.0  # the whole request, its answer read included
    answer_bytes: int = 4096  # read of an answer at most (its status is what counts)


@dataclass(frozen=True)
class Smtp:
    """The server's SMTP settings (GPUFORGE_SMTP_HOST and the rest: server/settings.py)."""

    host: str
    sender: str
    port: int = 587
    user: str | None = None
    password: str | None = None
    starttls: bool = True
    timeout_s: float = 10.0

    def __repr__(self) -> str:  # a dataclass's own repr would print the password into any traceback
        return f"Smtp(host={self.host!r}, port={self.port}, sender={self.sender!r}, starttls={self.starttls})"


def _unsaid(text: str, secret: str) -> str:
    return text.replace(secret, "<destination>") if secret else text


def post(url: str, body: bytes, headers: dict[str, str], limits: Limits = Limits()) -> int:
    """POST `body` to `url`; its status when 2xx, else SendError (a redirect is an answer, not followed)."""
    if urlsplit(url).scheme not in ("http", "https"):
        raise SendError("only http and https URLs are sent to")
    deadline = time.monotonic() + limits.total_s
    timeout = httpx.Timeout(limits.read_s, connect=limits.connect_s)
    try:
        with (
            httpx.Client(timeout=timeout, follow_redirects=False) as client,
            client.stream("POST", url, content=body, headers=headers) as answer,
        ):
            read = 0
            for chunk in answer.iter_raw():  # its body read only to let the connection close cleanly
                read += len(chunk)
                if read >= limits.answer_bytes or time.monotonic() > deadline:
                    break
            status = answer.status_code
    except httpx.HTTPError as err:  # connect refused, timeouts, TLS, a broken answer
        raise SendError(_unsaid(f"{type(err).__name__}: {err}", url)) from None
    if time.monotonic() > deadline:
        raise SendError(f"no whole answer within {limits.total_s:g} s")
    if 300 <= status < 400:
        raise SendError(f"answered {status} (a redirect: not followed; give the URL it names)")
    if not 200 <= status < 300:
        raise SendError(f"answered {status}")
    return status


def send_mail(smtp: Smtp, message: EmailMessage) -> None:
    """Hand `message` to the SMTP server; SendError when it does not take it."""
    to = str(message["To"])
    try:
        with smtplib.SMTP(smtp.host, smtp.port, timeout=smtp.timeout_s) as client:
            if smtp.starttls:
                client.starttls(context=ssl.create_default_context())
            if smtp.user:
                client.login(smtp.user, smtp.password or "")
            client.send_message(message)
    except (smtplib.SMTPException, OSError) as err:
        raise SendError(_unsaid(f"{type(err).__name__}: {err}", to)) from None
