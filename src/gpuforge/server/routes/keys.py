"""API keys: an admin key makes, lists, changes and revokes them (`gpuforge keys create NAME`), with their
quotas (store/quotas.py) and project (store/projects.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Request, status
from fastapi import Path as PathParam

from gpuforge.errors import GpuforgeError
from gpuforge.server.auth import Key, forget_key
from gpuforge.server.schemas import KeyCreate, KeyCreated, KeyPublic, KeyUpdate
from gpuforge.server.services import services
from gpuforge.server.visibility import admin_only
from gpuforge.store.db import session
from gpuforge.store.keys import all_keys, create_key, key_named, revoke_key, set_key_project, set_quotas
from gpuforge.store.models import ApiKey
from gpuforge.store.projects import project_names
from gpuforge.store.quotas import QUOTAS

router = APIRouter(prefix="/api/v1/keys", tags=["keys"])
Name = Annotated[str, PathParam(max_length=100, description="the key's name")]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=KeyCreated)
def make_key(body: KeyCreate, request: Request, key: Key) -> KeyCreated:
    """A new key, with its quotas (those not given: the defaults) and project; the answer is the only
    place it is ever shown."""
    admin_only(key)
    quotas = {q.name: getattr(body, q.name) for q in QUOTAS if getattr(body, q.name) is not None}
    with session(services(request).engine) as s:
        try:
            secret = create_key(s, body.name, body.admin, quotas, body.project)
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from err
        except GpuforgeError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from err
        s.flush()
        made = key_named(s, body.name)
        return KeyCreated(**_public(s, [made])[0].model_dump(), key=secret)


@router.patch("/{name}", response_model=KeyPublic)
def change_key(name: Name, body: KeyUpdate, request: Request, key: Key) -> KeyPublic:
    """Change a key's quotas (those given, null back to the default) or project (null: none). They hold
    from its next request on; its jobs already made stay in the project they were made in."""
    admin_only(key)
    quotas = body.model_dump(exclude_unset=True)
    moved = "project" in quotas
    project = quotas.pop("project", None)
    with session(services(request).engine) as s:
        try:
            if moved:
                changed = set_key_project(s, name, project)
            if quotas or not moved:  # nothing at all: set_quotas says what may be given
                changed = set_quotas(s, name, quotas)
        except LookupError as err:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from err
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from err
        s.flush()
        public = _public(s, [changed])[0]
    forget_key(request, changed.digest)  # after the commit: a request meanwhile would cache the old row again
    return public


@router.delete("/{name}", response_model=KeyPublic)
def revoke(name: str, request: Request, key: Key) -> KeyPublic:
    """Revoke a key by name: it opens nothing from now on (here at once; other server processes on the
    same store within KEY_RECHECK_S). Its jobs and deployments stay."""
    admin_only(key)
    with session(services(request).engine) as s:
        try:
            revoked = revoke_key(s, name)
        except LookupError as err:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from err
        except GpuforgeError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from err
        s.flush()
        public = _public(s, [revoked])[0]
    # after the commit, and for good: a lookup that read the store before it must not cache it again
    forget_key(request, revoked.digest, revoked=True)
    return public


@router.get("", response_model=list[KeyPublic])
def list_keys(request: Request, key: Key) -> list[KeyPublic]:
    """The keys by name (never the keys themselves), with the quotas in force for each and its project."""
    admin_only(key)
    with session(services(request).engine) as s:
        return _public(s, all_keys(s))


def _public(s, rows: list[ApiKey]) -> list[KeyPublic]:
    """The keys as the API shows them, each with its project's name (one query for all)."""
    names = project_names(s, {k.project_id for k in rows})
    return [KeyPublic.model_validate(k).model_copy(update={"project": names.get(k.project_id)}) for k in rows]
