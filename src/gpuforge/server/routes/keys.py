"""API keys: an admin key makes and lists them (`gpuforge keys create NAME`)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, status
from sqlalchemy import select

from gpuforge.errors import GpuforgeError
from gpuforge.server.auth import Key, forget_key
from gpuforge.server.schemas import KeyCreate, KeyCreated, KeyPublic
from gpuforge.store.db import session
from gpuforge.store.keys import create_key, revoke_key
from gpuforge.store.models import ApiKey

router = APIRouter(prefix="/api/v1/keys", tags=["keys"])


def _admin_only(key: ApiKey) -> None:
    if not key.admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"key {key.name!r} is not an admin key")


@router.post("", status_code=status.HTTP_201_CREATED, response_model=KeyCreated)
def make_key(body: KeyCreate, request: Request, key: Key) -> KeyCreated:
    """A new key; the answer is the only place it is ever shown."""
    _admin_only(key)
    with session(request.app.state.engine) as s:
        try:
            secret = create_key(s, body.name, body.admin)
        except GpuforgeError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from err
        s.flush()
        made = s.scalar(select(ApiKey).where(ApiKey.name == body.name))
        return KeyCreated(**KeyPublic.model_validate(made).model_dump(), key=secret)


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
        forget_key(request, revoked.digest)
        return revoked


@router.get("", response_model=list[KeyPublic])
def list_keys(request: Request, key: Key) -> list[ApiKey]:
    """The keys by name (never the keys themselves)."""
    _admin_only(key)
    with session(request.app.state.engine) as s:
        return list(s.scalars(select(ApiKey).order_by(ApiKey.id)))
