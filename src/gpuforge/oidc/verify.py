"""Verifying an OpenID Connect ID token (OpenID Connect Core 1.0, 3.1.3.7), each refusal with its reason.

    verifier = IdTokenVerifier(Issuer(url), audiences=("gpuforge",))
    claims = verifier.verify_id_token(token, nonce=flow.nonce)   # Claims, or TokenRefused(reason)

Checked, in this order: the token is a signed JWT (three parts); its `alg` is one the provider advertises
among RS256/PS256/ES256 (never `none`, never HS*: an HMAC "signed" with a public key anyone can fetch);
the signature, with the provider's key of the token's `kid`; `iss` is the issuer exactly; `aud` holds one
of our client ids, and with several audiences `azp` is ours; `exp`, `iat` (and `nbf` when present) hold,
with LEEWAY_S of clock skew; and, when a nonce is given, the token carries it and it was never used
before (a replayed sign-in is refused; used nonces are kept until their tokens expire).
"""

from __future__ import annotations

import base64
import hmac
import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from joserfc import jwt
from joserfc.errors import BadSignatureError, JoseError

from gpuforge.errors import GpuforgeError
from gpuforge.oidc.issuer import Issuer, UnknownKey

LEEWAY_S = 60  # clock skew between the provider and this machine
MAX_TOKEN_CHARS = 16 * 1024  # a real ID token is 1-2 KiB; a header is no place for megabytes


class TokenRefused(GpuforgeError):
    """An ID token gpuforge does not accept. `reason` is one word a caller (or a test) can test:
    malformed, algorithm, key, signature, issuer, audience, expired, not_yet_valid, nonce, replayed."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"ID token refused: {reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Claims:
    """Who a verified ID token says signed in: what the server maps to a user."""

    subject: str  # `sub`: stable for the user at this issuer, unlike a name or an email
    issuer: str
    name: str | None
    email: str | None
    groups: tuple[str, ...]
    expires_at: int  # `exp`, seconds since the epoch
    raw: Mapping[str, Any] = field(repr=False, compare=False)


class NonceLedger:
    """The nonces of tokens accepted so far, each until its token expires: a token whose nonce is here is
    a replay. In this process only, like the sign-ins it guards (server/oidc.py)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}

    def use(self, nonce: str, until: float) -> bool:
        """Record `nonce` as used until `until` (epoch seconds); False if it was used already."""
        now = time.time()
        with self._lock:
            for old in [n for n, t in self._until.items() if t < now]:
                del self._until[old]
            if nonce in self._until:
                return False
            self._until[nonce] = until
            return True


class IdTokenVerifier:
    """Verifies ID tokens of one issuer for one or more of our client ids (the dashboard's, the CLI's)."""

    def __init__(
        self,
        issuer: Issuer,
        audiences: tuple[str, ...],
        groups_claim: str = "groups",
        leeway_s: int = LEEWAY_S,
        nonces: NonceLedger | None = None,
    ):
        if not audiences:
            raise ValueError("an ID token verifier needs at least one client id")
        self.issuer, self.audiences, self.groups_claim = issuer, audiences, groups_claim
        self.leeway_s = leeway_s
        self.nonces = nonces or NonceLedger()

    def verify_id_token(self, token: str, nonce: str | None = None) -> Claims:
        """The claims of `token` once every check of the module's docstring holds; TokenRefused if one
        does not, ProviderError if the provider's keys cannot be had."""
        header = _header(token)
        alg = header.get("alg")
        allowed = self.issuer.discovery().signing_algorithms
        if alg not in allowed:
            raise TokenRefused(
                "algorithm", f"signed with {alg!r}; this provider signs with {', '.join(allowed)}"
            )
        kid = header.get("kid")
        try:
            key = self.issuer.key_for(kid if isinstance(kid, str) else None, alg)
        except UnknownKey as err:
            raise TokenRefused("key", str(err)) from None
        try:
            claims = jwt.decode(token, key, algorithms=[alg]).claims
        except BadSignatureError:
            raise TokenRefused("signature", f"not signed by the provider's key {kid!r}") from None
        except JoseError as err:
            raise TokenRefused("malformed", f"{type(err).__name__}: {err}") from None
        self._check_claims(claims, nonce)
        return Claims(
            subject=claims["sub"],
            issuer=claims["iss"],
            name=_text(claims.get("name")) or _text(claims.get("preferred_username")),
            email=_text(claims.get("email")),
            groups=_groups(claims.get(self.groups_claim)),
            expires_at=int(claims["exp"]),
            raw=claims,
        )

    def _check_claims(self, claims: dict[str, Any], nonce: str | None) -> None:
        if claims.get("iss") != self.issuer.issuer:
            raise TokenRefused("issuer", f"issued by {claims.get('iss')!r}, not {self.issuer.issuer!r}")
        if not isinstance(claims.get("sub"), str) or not claims["sub"]:
            raise TokenRefused("malformed", "no subject (sub)")
        aud = claims.get("aud")
        audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
        if not any(a in self.audiences for a in audiences):
            raise TokenRefused("audience", f"issued for {aud!r}, not for {' or '.join(self.audiences)}")
        azp = claims.get("azp")
        if (len(audiences) > 1 or azp is not None) and azp not in self.audiences:
            raise TokenRefused("audience", f"authorized party (azp) {azp!r} is not one of our client ids")
        now = time.time()
        exp, iat, nbf = (claims.get(name) for name in ("exp", "iat", "nbf"))
        if not _is_time(exp) or not _is_time(iat) or (nbf is not None and not _is_time(nbf)):
            raise TokenRefused("malformed", "exp and iat must be numbers (nbf too, when present)")
        if exp + self.leeway_s < now:
            raise TokenRefused("expired", f"expired {int(now - exp)} s ago")
        if iat - self.leeway_s > now or (nbf is not None and nbf - self.leeway_s > now):
            raise TokenRefused("not_yet_valid", "issued (or valid from) a time still to come")
        if nonce is not None:
            given = claims.get("nonce")
            if not isinstance(given, str) or not hmac.compare_digest(given.encode(), nonce.encode()):
                raise TokenRefused("nonce", "its nonce is not the one this sign-in sent")
            if not self.nonces.use(nonce, exp + self.leeway_s):
                raise TokenRefused("replayed", "its nonce was used already: a sign-in is accepted once")


def _header(token: str) -> dict[str, Any]:
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        raise TokenRefused("malformed", "not a token, or over 16 KiB")
    parts = token.split(".")
    if len(parts) != 3:  # five parts: an encrypted token (JWE), which gpuforge does not ask for
        raise TokenRefused("malformed", "not a signed JWT (header.payload.signature)")
    try:
        header = json.loads(base64.urlsafe_b64decode(parts[0] + "=" * (-len(parts[0]) % 4)))
    except ValueError:
        raise TokenRefused("malformed", "its header is not base64url JSON") from None
    if not isinstance(header, dict):
        raise TokenRefused("malformed", "its header is not a JSON object")
    return header


def _is_time(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _groups(value: Any) -> tuple[str, ...]:
    """The groups claim as a tuple of names: a list of strings, or one string (some providers send one
    group so); anything else is no groups."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, str))
    return ()
