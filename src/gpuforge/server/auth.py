"""Every route but health needs an API key: `Authorization: Bearer <key>` or `X-API-Key: <key>`.

Keys found are remembered by key in this process for KEY_RECHECK_S, so a request costs no store round
trip for its key. A key revoked through this process is forgotten at once; one revoked through another
server process on the same store stops working here within KEY_RECHECK_S. An unknown key is looked up
each time (it may have been made since, by another server process)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request, status

from gpuforge.server.access import presented_key
from gpuforge.store.db import session
from gpuforge.store.keys import find_key
from gpuforge.store.models import ApiKey

KEY_RECHECK_S = 30.0


async def current_key(  # async: no thread hop per request (see routes/jobs.py list_jobs)
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> ApiKey:
    key = presented_key(authorization, x_api_key)
    known = request.app.state.known_keys
    cached = known.get(key) if key else None
    found = cached[0] if cached and time.monotonic() - cached[1] < KEY_RECHECK_S else None
    if found is None:
        with session(request.app.state.engine) as s:
            found = find_key(s, key)
        if found is not None:
            known[key] = (found, time.monotonic())
        elif key:
            known.pop(key, None)
    if found is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing, unknown or revoked API key: send Authorization: Bearer <key>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return found


def forget_key(request: Request, digest: str) -> None:
    """Drop a revoked key from this process's cache (it is cached by the key itself, found by digest)."""
    known = request.app.state.known_keys
    for key in [k for k, (found, _) in known.items() if found.digest == digest]:
        known.pop(key, None)


Key = Annotated[ApiKey, Depends(current_key)]
