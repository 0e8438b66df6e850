"""Every route but health needs an API key: `Authorization: Bearer <key>` or `X-API-Key: <key>`.

A request that presents a key the store does not hold (unknown, or revoked) is a failed sign-in: the audit
log keeps one row for it, at most one a source address a minute (the next says how many came between),
so that a flood of bad keys cannot fill the store.

The key is checked in the ASGI layer (RequireKey), before any route reads a byte of the body: a client
without a valid key is refused having sent nothing the server reads (FastAPI reads a body before it runs a
route's dependencies). The route's `Key` dependency then finds the key the gate looked up.

Keys found are remembered by key in this process for KEY_RECHECK_S, so a request costs no store round
trip for its key. A key revoked through this process is forgotten at once; one revoked through another
server process on the same store stops working here within KEY_RECHECK_S. An unknown key is looked up
each time (it may have been made since, by another server process).
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from gpuforge.access import DOCUMENT_PATHS, OPEN_PATHS, carries_body, is_page_path, presented_key
from gpuforge.server.oidc import OPEN_PATHS as SIGN_IN_PATHS
from gpuforge.server.services import services, services_of
from gpuforge.server.sso import SESSION_PATH, bearer_key
from gpuforge.store import audit
from gpuforge.store.db import session
from gpuforge.store.keys import PREFIX, find_key
from gpuforge.store.models import ApiKey, utcnow
from gpuforge.store.users import capped, owned_ids

KEY_RECHECK_S = 30.0
FAILED_SIGN_IN_EVERY_S = 60.0  # one audit row a source address in this long, at most
FAILED_SIGN_INS_A_MINUTE = 60  # and this many rows a minute from all sources together (many addresses)
MAX_SOURCES_KEPT = 10_000  # addresses remembered for that: past it, forgotten all at once
UNAUTHORIZED = "missing, unknown or revoked API key: send Authorization: Bearer <key>"


def lookup_key(app, key: str | None) -> ApiKey | None:
    """The live key `key` is, through this process's cache (see the module's docstring)."""
    state = services_of(app)
    known = state.known_keys
    cached = known.get(key) if key else None
    found = cached[0] if cached and time.monotonic() - cached[1] < KEY_RECHECK_S else None
    if found is not None and found.expires_at is not None and found.expires_at <= utcnow():
        found = None  # a session that ended while cached
    if found is None:
        with session(state.engine) as s:
            found = find_key(s, key)
            found = capped(s, found) if found is not None else None  # a session's end, a person's rights
            if found is not None and found.user_id is not None:
                found.owned = owned_ids(s, found)
        if found is not None and found.digest in state.revoked_keys:
            found = None  # read before a revoke here committed: it must not come back into the cache
        if found is not None:
            known[key] = (found, time.monotonic())
        elif key:
            known.pop(key, None)
    return found


class RequireKey:
    """401 for a request without a live key, before the app reads anything of it. A plain ASGI
    middleware, like RefuseLargeBodies (server/app.py)."""

    def __init__(self, app, fastapi_app, public_documents: bool):
        self.app, self.fastapi_app = app, fastapi_app
        self.open = (
            OPEN_PATHS
            | SIGN_IN_PATHS
            | {SESSION_PATH}
            | (DOCUMENT_PATHS if public_documents else frozenset())
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open or is_page_path(scope["path"]):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = presented_key(
            headers.get(b"authorization", b"").decode("latin-1") or None,
            headers.get(b"x-api-key", b"").decode("latin-1") or None,
        )
        client = scope.get("client")
        source = client[0] if client else "-"
        found, refused, why = None, 401, UNAUTHORIZED
        if given and not given.startswith(PREFIX):  # not a key: a signed-in user's ID token, perhaps
            found, code, told = await bearer_key(self.fastapi_app, given, source)
            refused, why = (code, told) if code else (refused, why)
        else:
            found = lookup_key(self.fastapi_app, given)
        if found is None and given and refused != 503:  # the store off the event loop: it may wait a lock
            await run_in_threadpool(failed_sign_in, self.fastapi_app, source, scope["path"], why)
        if found is None:
            closing = {"Connection": "close"} if carries_body(headers) else {}  # the body is never read
            response = JSONResponse(
                {"detail": why}, refused, headers={"WWW-Authenticate": "Bearer", **closing}
            )
            return await response(scope, receive, send)
        scope.setdefault("state", {})["api_key"] = found
        await self.app(scope, receive, send)


def failed_sign_in(app, source: str, path: str, why: str = UNAUTHORIZED) -> None:
    """An audit row for a key (or an ID token) refused from `source`, unless that source had one in the last
    minute (then it is counted, and the next row says how many)."""
    state = services_of(app)
    seen = state.failed_sign_ins
    now = time.monotonic()
    written, since = seen.get(source, (float("-inf"), 0))
    window, rows = seen.get("", (now, 0))  # all sources: the minute's window and the rows written in it
    if now - window >= FAILED_SIGN_IN_EVERY_S:
        window, rows = now, 0
    if now - written < FAILED_SIGN_IN_EVERY_S or rows >= FAILED_SIGN_INS_A_MINUTE:
        seen[source] = (written, since + 1)  # counted, told by this source's next row
        return
    if len(seen) >= MAX_SOURCES_KEPT:
        seen.clear()
    seen[""] = (window, rows + 1)
    seen[source] = (now, 0)
    detail = {"path": path[:200], "reason": why[:300], "refused_since_last_row": since}
    what = "api key" if why == UNAUTHORIZED else "id token"
    with session(state.engine) as s:
        audit.record(s, audit.Actor("-", None, source), "sign_in", what, after=detail, outcome="refused")


_bearer = HTTPBearer(auto_error=False, description="an API key: gpuforge keys create NAME")


async def current_key(  # async: no thread hop per request
    request: Request,
    _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],  # names the scheme in OpenAPI
) -> ApiKey:
    found = getattr(request.state, "api_key", None)  # RequireKey looked it up
    if found is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"}
        )
    return found


def forget_key(request: Request, digest: str, revoked: bool = False) -> None:
    """Drop a key from this process's cache (it is cached by the key itself, found by digest): a revoked
    one for good, a changed one to be read afresh."""
    if revoked:
        services(request).revoked_keys.add(digest)
    known = services(request).known_keys
    for key in [k for k, (found, _) in known.items() if found.digest == digest]:
        known.pop(key, None)


def forget_person(request: Request, user_id: int) -> None:
    """Drop every key of a signed-in person from this process's caches (their rights changed)."""
    state = services(request)
    for key in [k for k, (found, _) in state.known_keys.items() if found.user_id == user_id]:
        state.known_keys.pop(key, None)
    with state.sso.lock:
        for tag in [t for t, (found, *_) in state.sso.tokens.items() if found.user_id == user_id]:
            state.sso.tokens.pop(tag, None)


Key = Annotated[ApiKey, Depends(current_key)]
