"""API keys: an admin key makes, lists, changes and revokes them (`gpuforge keys create NAME`), with their
quotas (store/quotas.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Request, status
from fastapi import Path as PathParam
from sqlalchemy import select

from gpuforge.errors import GpuforgeError
from gpuforge.server.auth import Key, forget_key
from gpuforge.server.schemas import KeyCreate, KeyCreated, KeyPublic, KeyUpdate
from gpuforge.store.db import session
from gpuforge.store.keys import create_key, revoke_key, set_quotas
from gpuforge.store.models import ApiKey
from gpuforge.store.quotas import QUOTAS

router = APIRouter(prefix="/api/v1/keys", tags=["keys"])
Name = Annotated[str, PathParam(max_length=100, description="the key's name")]


def _admin_only(key: ApiKey) -> None:
    if not key.admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"key {key.name!r} is not an admin key")


@router.post("", status_code=status.HTTP_201_CREATED, response_model=KeyCreated)
def make_key(body: KeyCreate, request: Request, key: Key) -> KeyCreated:
    """A new key, with its quotas (those not given: the defaults); the answer is the only place it is
    ever shown."""
    _admin_only(key)
    quotas = {q.name: getattr(body, q.name) for q in QUOTAS if getattr(body, q.name) is not None}
    with session(request.app.state.engine) as s:
        try:
            secret = create_key(s, body.name, body.admin, quotas)
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from err
        except GpuforgeError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from err
        s.flush()
        made = s.scalar(select(ApiKey).where(ApiKey.name == body.name))
        return KeyCreated(**KeyPublic.model_validate(made).model_dump(), key=secret)


@router.patch("/{name}", response_model=KeyPublic)
def change_key(name: Name, body: KeyUpdate, request: Request, key: Key) -> ApiKey:
    """Change a key's quotas: those given, null back to the default. They hold from its next request on."""
    _admin_only(key)
    with session(request.app.state.engine) as s:
        try:
            changed = set_quotas(s, name, body.model_dump(exclude_unset=True))
        except LookupError as err:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from err
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from err
        s.flush()
    forget_key(request, changed.digest)  # after the commit: a request meanwhile would cache the old row again
    return changed


@router.delete("/{name}", response_model=KeyPublic)
def revoke(name: str, request: Request, key: Key) -> ApiKey:
    """Revoke a key by name: it opens nothing from now on (here at once; other server processes on the
    same store within KEY_RECHECK_S). Its jobs and deployments stay."""
    _admin_only(key)
    with session(request.app.state.engine) as s:
        try:
            revoked = revoke_key(s, name)
        except LookupError as err:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from err
        except GpuforgeError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from err
        s.flush()
    # after the commit, and for good: a lookup that read the store before it must not cache it again
    forget_key(request, revoked.digest, revoked=True)
    return revoked


@router.get("", response_model=list[KeyPublic])
def list_keys(request: Request, key: Key) -> list[ApiKey]:
    """The keys by name (never the keys themselves), with the quotas in force for each."""
    _admin_only(key)
    with session(request.app.state.engine) as s:
        return list(s.scalars(select(ApiKey).order_by(ApiKey.id)))
