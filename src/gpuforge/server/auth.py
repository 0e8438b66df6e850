"""Every route but health needs an API key: `Authorization: Bearer <key>` or `X-API-Key: <key>`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request, status

from gpuforge.store.db import session
from gpuforge.store.keys import find_key
from gpuforge.store.models import ApiKey


def current_key(
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> ApiKey:
    key = x_api_key
    if authorization and authorization.lower().startswith("bearer "):
        key = authorization[7:].strip()
    with session(request.app.state.engine) as s:
        found = find_key(s, key)
    if found is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing or unknown API key: send Authorization: Bearer <key>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return found


Key = Annotated[ApiKey, Depends(current_key)]
