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
import hmac
import secrets
import threading
import time
from dataclasses import dataclass, field

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool

from gpuforge.errors import GpuforgeError
from gpuforge.oidc.http import ProviderError
from gpuforge.oidc.verify import Claims, TokenRefused
from gpuforge.server.oidc import OidcSignIn, oidc_settings
from gpuforge.server.services import services, services_of
from gpuforge.store import audit
from gpuforge.store.db import session
from gpuforge.store.models import ApiKey
from gpuforge.store.users import (
    Person,
    Revoked,
    RoleRule,
    new_user_key,
    owned_ids,
    parse_roles_rule,
    sign_in,
)

SESSION_PATH = "/auth/oidc/session"
BINDER_COOKIE = "gpuforge_sso_code"  # ties a sign-in's code to the browser that signed in
CODE_TTL_S = 60.0
RECHECK_S = 30.0  # a remembered token's rights are read again from the store this often
MAX_CODES = 10_000  # codes waiting at once: the callback is open, so this memory is bounded
MAX_TOKENS = 10_000  # verified bearer tokens remembered


@dataclass
class SingleSignOn:
    """The server's single sign-on: the protocol (OidcSignIn), the roles rule, and what it remembers."""

    oidc: OidcSignIn | None = None
    rules: list[RoleRule] = field(default_factory=list)
    # one-time code -> (session key, the browser's binder, until)
    codes: dict[str, tuple[str, str, float]] = field(default_factory=dict)
    # token digest -> (its key, its claims, exp, when read): read again from the store every RECHECK_S
    tokens: dict[str, tuple[ApiKey, Claims, float, float]] = field(default_factory=dict)
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


def _signed_in(sso: SingleSignOn, request: Request, claims: Claims, next_path: str) -> Response:
    """The dashboard's sign-in went through: the user signed in, a session made, the page sent a code that
    only this browser can trade (an HttpOnly cookie beside it: a code sent to someone else signs nobody
    in as its maker)."""
    source = request.client.host if request.client else "-"

    def made(s):
        key = sign_in(s, _person(claims), sso.rules)
        secret, _ = new_user_key(s, key, "session", None, None)
        _record(s, source, key, "dashboard")
        return secret

    try:
        secret = _retried(services(request).engine, made)
    except Revoked as err:
        return JSONResponse({"detail": str(err)}, status.HTTP_403_FORBIDDEN)
    code, binder = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    now = time.monotonic()
    with sso.lock:
        for old in [c for c, (_, _, until) in sso.codes.items() if until < now]:
            del sso.codes[old]
        if len(sso.codes) >= MAX_CODES:
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "too many sign-ins under way")
        sso.codes[code] = (secret, binder, now + CODE_TTL_S)
    response = RedirectResponse(
        f"{next_path}#sso={code}", status.HTTP_303_SEE_OTHER, headers={"Cache-Control": "no-store"}
    )
    https = (sso.oidc.config.redirect_uri or str(request.url)).startswith("https://")
    response.set_cookie(BINDER_COOKIE, binder, max_age=int(CODE_TTL_S), path=SESSION_PATH, httponly=True,
                        samesite="lax", secure=https)  # fmt: skip
    return response


def _retried(engine, work):
    """`work(s)` in a transaction, once more if a sign-in at the same moment made the same rows first."""
    try:
        with session(engine) as s:
            return work(s)
    except IntegrityError:
        with session(engine) as s:
            return work(s)


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
    def trade_code(body: SessionAsk, request: Request) -> JSONResponse:
        sso = services(request).sso
        with sso.lock:
            found = sso.codes.pop(body.code, None)
        binder = request.cookies.get(BINDER_COOKIE, "")
        if found is None or found[2] < time.monotonic() or not hmac.compare_digest(found[1], binder):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "sign-in code unknown, used, expired, or not this browser's: sign in again",
            )
        response = JSONResponse(SessionKey(key=found[0]).model_dump(), headers={"Cache-Control": "no-store"})
        response.delete_cookie(BINDER_COOKIE, path=SESSION_PATH)
        return response

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
    if known is not None and known[2] <= now:
        known = None
    if known is not None and now - known[3] < RECHECK_S:
        return known[0], 0, ""
    if known is not None:  # verified already: its rights read again (a role, a revoke, another server's)
        claims, first = known[1], False
    else:
        try:
            claims, first = await run_in_threadpool(sso.oidc.verify_bearer, token), True
        except TokenRefused as err:
            return None, status.HTTP_401_UNAUTHORIZED, f"ID token refused: {err}"
        except ProviderError as err:
            return None, status.HTTP_503_SERVICE_UNAVAILABLE, f"cannot check the ID token: {err}"
    try:
        key = await run_in_threadpool(_bearer_sign_in, state.engine, sso, claims, source, first)
    except Revoked as err:
        return None, status.HTTP_401_UNAUTHORIZED, str(err)
    with sso.lock:
        if len(sso.tokens) >= MAX_TOKENS:
            sso.tokens.clear()
        sso.tokens[tag] = (key, claims, float(claims.expires_at), now)
    return key, 0, ""


def _bearer_sign_in(engine, sso: SingleSignOn, claims: Claims, source: str, first: bool) -> ApiKey:
    def signed(s):
        key = sign_in(s, _person(claims), sso.rules)
        key.owned = owned_ids(s, key)
        if first:  # a sign-in once a token, not at each look at its rights
            _record(s, source, key, "cli")
        s.flush()
        s.expunge(key)
        return key

    return _retried(engine, signed)
