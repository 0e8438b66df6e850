"""How a webhook body is signed, and how a receiver checks it (docs/notifications.md shows the same in a
few lines of any language):

    X-Gpuforge-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>." + the body's bytes, keyed by the
                          target's secret>

The time is inside what is signed, so a body replayed later carries an old `t`: a receiver refuses a
signature more than TOLERANCE_S away from its clock, and compares in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import time

SIGNATURE_HEADER = "X-Gpuforge-Signature"
TOLERANCE_S = 300


def _mac(secret: str, at: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{at}.".encode() + body, hashlib.sha256).hexdigest()


def signature(secret: str, body: bytes, at: int | None = None) -> str:
    """The header's value for `body` sent at `at` (default: now)."""
    at = int(time.time()) if at is None else at
    return f"t={at},v1={_mac(secret, at, body)}"


def verify(
    secret: str, header: str, body: bytes, now: float | None = None, tolerance_s: float = TOLERANCE_S
) -> bool:
    """Whether `header` signs `body` with `secret` within `tolerance_s` of `now` (a receiver in Python)."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        at = int(fields["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - at) > tolerance_s:
        return False
    return hmac.compare_digest(fields.get("v1", ""), _mac(secret, at, body))
