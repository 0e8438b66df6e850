"""Every route but health needs an API key: `Authorization: Bearer <key>` or `X-API-Key: <key>`.

Keys found are remembered by digest in this process (keys are never changed or removed once made), so a
request costs no store round trip for its key; an unknown key is looked up each time (it may have been
made since, by another server process on the same store)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request, status

from gpuforge.server.access import presented_key
from gpuforge.store.db import session
from gpuforge.store.keys import find_key
from gpuforge.store.models import ApiKey


async def current_key(  # async: no thread hop per request (see routes/jobs.py list_jobs)
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> ApiKey:
    key = presented_key(authorization, x_api_key)
    known = request.app.state.known_keys
    found = known.get(key) if key else None
    if found is None:
        with session(request.app.state.engine) as s:
            found = find_key(s, key)
        if found is not None:
            known[key] = found
    if found is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or unknown API key: send Authorization: Bearer <key>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return found


Key = Annotated[ApiKey, Depends(current_key)]
