"""Single sign-on wired into the server: who a verified ID token is (store/users.py), the dashboard's
session after a sign-in, and a CLI's bearer token at the key gate.

- The dashboard: /auth/oidc/callback (server/oidc.py) signs the user in, makes a session key (12 h) and
  sends the browser to its page with a one-time code in the URL's fragment (never sent to a server, gone
  from the address bar at once); the page trades the code for the key (POST /auth/oidc/session, within a
  minute, once) and keeps it as it keeps a typed key.
- The CLI: `gpuforge login` sends its ID token as the bearer; the gate (server/auth.py) verifies it here,
  signs the user in at the first sight of each token, and remembers it until it expires.

Sign-ins and refused tokens are audit rows (`sign_in`), refused ones at most one a source a minute.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass, field

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import RedirectResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from gpuforge.errors import GpuforgeError
from gpuforge.oidc.http import ProviderError
from gpuforge.oidc.verify import Claims, TokenRefused
from gpuforge.server.oidc import OidcSignIn, oidc_settings
from gpuforge.server.services import services, services_of
from gpuforge.store import audit
from gpuforge.store.db import session
from gpuforge.store.models import ApiKey
from gpuforge.store.users import Person, RoleRule, new_user_key, owned_ids, parse_roles_rule, sign_in

SESSION_PATH = "/auth/oidc/session"
CODE_TTL_S = 60.0
MAX_CODES = 10_000  # codes waiting at once: the callback is open, so this memory is bounded
MAX_TOKENS = 10_000  # verified bearer tokens remembered


@dataclass
class SingleSignOn:
    """The server's single sign-on: the protocol (OidcSignIn), the roles rule, and what it remembers."""

    oidc: OidcSignIn | None = None
    rules: list[RoleRule] = field(default_factory=list)
    codes: dict[str, tuple[str, float]] = field(default_factory=dict)  # one-time code -> (session key, until)
    tokens: dict[str, tuple[ApiKey, float]] = field(default_factory=dict)  # token digest -> (its key, exp)
    lock: threading.Lock = field(default_factory=threading.Lock)


def single_sign_on(settings) -> SingleSignOn:
    """What the settings ask for (no issuer: nothing but keys); a GpuforgeError for settings it cannot use."""
    config = oidc_settings(settings)
    if config is None:
        return SingleSignOn()
    try:
        rules = parse_roles_rule(settings.oidc_roles)
    except ValueError as err:
        raise GpuforgeError(str(err)) from None
    sso = SingleSignOn(rules=rules)
    sso.oidc = OidcSignIn(
        config, lambda request, claims, next_path: _signed_in(sso, request, claims, next_path)
    )
    return sso


def _person(claims: Claims) -> Person:
    return Person(claims.issuer, claims.subject, claims.name, claims.email, tuple(claims.groups))


def _signed_in(sso: SingleSignOn, request: Request, claims: Claims, next_path: str) -> RedirectResponse:
    """The dashboard's sign-in went through: the user signed in, a session made, the page sent a code."""
    with session(services(request).engine) as s:
        key = sign_in(s, _person(claims), sso.rules)
        secret, _ = new_user_key(s, key, "session", None, None)
        _record(s, request.client.host if request.client else "-", key, "dashboard")
    code = secrets.token_urlsafe(24)
    now = time.monotonic()
    with sso.lock:
        for old in [c for c, (_, until) in sso.codes.items() if until < now]:
            del sso.codes[old]
        if len(sso.codes) >= MAX_CODES:
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "too many sign-ins under way")
        sso.codes[code] = (secret, now + CODE_TTL_S)
    return RedirectResponse(
        f"{next_path}#sso={code}", status.HTTP_303_SEE_OTHER, headers={"Cache-Control": "no-store"}
    )


def _record(s, source: str, key: ApiKey, through: str) -> None:
    after = {"through": through, "project_id": key.project_id, "role": str(key.role), "admin": key.admin}
    audit.record(s, audit.Actor(key.name, key.id, source), "sign_in", f"user {key.name}", key.project_id,
                 after=after)  # fmt: skip


class SessionAsk(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(max_length=100)


class SessionKey(BaseModel):
    key: str = Field(description="the session's API key (12 h): send it as a key is sent")


def session_router() -> APIRouter:
    """POST /auth/oidc/session: the one-time code of a sign-in for its session key (open: it is how the
    dashboard gets one)."""
    router = APIRouter(tags=["single sign-on"])

    @router.post(SESSION_PATH, response_model=SessionKey)
    def trade_code(body: SessionAsk, request: Request) -> SessionKey:
        sso = services(request).sso
        with sso.lock:
            found = sso.codes.pop(body.code, None)
        if found is None or found[1] < time.monotonic():
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED, "sign-in code unknown, used or expired: sign in again"
            )
        return SessionKey(key=found[0])

    return router


async def bearer_key(app, token: str, source: str) -> tuple[ApiKey | None, int, str]:
    """The key a bearer ID token acts as: (key, 0, "") or (None, status, why). Verified once per token
    (off the event loop: the first verification may fetch the provider's keys), then remembered until
    it expires."""
    state = services_of(app)
    sso = state.sso
    if sso.oidc is None:
        return None, 0, ""
    tag = hashlib.sha256(token.encode()).hexdigest()
    now = time.time()
    with sso.lock:
        known = sso.tokens.get(tag)
    if known is not None and known[1] > now:
        return known[0], 0, ""
    try:
        claims = await run_in_threadpool(sso.oidc.verify_bearer, token)
    except TokenRefused as err:
        return None, status.HTTP_401_UNAUTHORIZED, f"ID token refused: {err}"
    except ProviderError as err:
        return None, status.HTTP_503_SERVICE_UNAVAILABLE, f"cannot check the ID token: {err}"
    key = await run_in_threadpool(_bearer_sign_in, state.engine, sso, claims, source)
    with sso.lock:
        if len(sso.tokens) >= MAX_TOKENS:
            sso.tokens.clear()
        sso.tokens[tag] = (key, float(claims.expires_at))
    return key, 0, ""


def _bearer_sign_in(engine, sso: SingleSignOn, claims: Claims, source: str) -> ApiKey:
    with session(engine) as s:
        key = sign_in(s, _person(claims), sso.rules)
        key.owned = owned_ids(s, key)
        _record(s, source, key, "cli")
        s.flush()
        s.expunge(key)
        return key
