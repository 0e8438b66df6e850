"""API keys: an admin key makes, lists, changes and revokes them (`gpuforge keys create NAME`), with their
quotas (store/quotas.py), project (store/projects.py) and role in it (server/permissions.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Request, status
from fastapi import Path as PathParam

from gpuforge.errors import GpuforgeError
from gpuforge.server.auth import Key, forget_key, forget_person
from gpuforge.server.permissions import audited, permit
from gpuforge.server.schemas import KeyCreate, KeyCreated, KeyPublic, KeyUpdate
from gpuforge.server.services import services
from gpuforge.store.db import session
from gpuforge.store.keys import (
    all_keys,
    create_key,
    key_named,
    revoke_key,
    set_key_project,
    set_key_role,
    set_quotas,
)
from gpuforge.store.models import ApiKey
from gpuforge.store.projects import project_names
from gpuforge.store.quotas import QUOTAS

router = APIRouter(prefix="/api/v1/keys", tags=["keys"])
Name = Annotated[str, PathParam(max_length=100, description="the key's name")]
SHOWN = ("admin", "project", "role", *(q.name for q in QUOTAS))  # what an audit row keeps of a key


@router.post(
    "", status_code=status.HTTP_201_CREATED, response_model=KeyCreated, dependencies=[permit("keys.create")]
)
def make_key(body: KeyCreate, request: Request, key: Key) -> KeyCreated:
    """A new key, with its quotas (those not given: the defaults), project and role; the answer is the only
    place it is ever shown."""
    quotas = {q.name: getattr(body, q.name) for q in QUOTAS if getattr(body, q.name) is not None}
    with session(services(request).engine) as s:
        try:
            secret = create_key(s, body.name, body.admin, quotas, body.project, body.role)
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from err
        except GpuforgeError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from err
        s.flush()
        made = _public(s, [key_named(s, body.name)])[0]
        audited(s, request, key, f"key {body.name}", made_in(s, made), after=_kept(made))
        return KeyCreated(**made.model_dump(), key=secret)


@router.patch("/{name}", response_model=KeyPublic, dependencies=[permit("keys.change")])
def change_key(name: Name, body: KeyUpdate, request: Request, key: Key) -> KeyPublic:
    """Change a key's quotas (those given, null back to the default), project (null: none) or role. They
    hold from its next request on; its jobs already made stay in the project they were made in."""
    asked = body.model_dump(exclude_unset=True)
    moved, project = "project" in asked, asked.pop("project", None)
    role = asked.pop("role", None)
    with session(services(request).engine) as s:
        found = key_named(s, name)
        before = _kept(_public(s, [found])[0]) if found is not None else None
        try:
            if moved:
                changed = set_key_project(s, name, project)
            if role is not None:
                changed = set_key_role(s, name, role)
            if asked or not (moved or role is not None):  # nothing at all: set_quotas says what may be given
                changed = set_quotas(s, name, asked)
        except LookupError as err:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from err
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from err
        s.flush()
        public = _public(s, [changed])[0]
        audited(s, request, key, f"key {name}", made_in(s, public), before, _kept(public))
    forget_key(request, changed.digest)  # after the commit: a request meanwhile would cache the old row again
    if changed.user_id is not None:
        forget_person(request, changed.user_id)
    return public


@router.delete("/{name}", response_model=KeyPublic, dependencies=[permit("keys.revoke")])
def revoke(name: str, request: Request, key: Key) -> KeyPublic:
    """Revoke a key by name: it opens nothing from now on (here at once; other server processes on the
    same store within KEY_RECHECK_S). Its jobs and deployments stay."""
    with session(services(request).engine) as s:
        try:
            revoked = revoke_key(s, name)
        except LookupError as err:
            raise HTTPException(status.HTTP_404_NOT_FOUND, str(err)) from err
        except GpuforgeError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from err
        s.flush()
        public = _public(s, [revoked])[0]
        audited(s, request, key, f"key {name}", revoked.project_id, {"revoked": False}, {"revoked": True})
    # after the commit, and for good: a lookup that read the store before it must not cache it again
    forget_key(request, revoked.digest, revoked=True)
    if revoked.user_id is not None:  # a person's: their sessions and ID tokens stop with it
        forget_person(request, revoked.user_id)
    return public


@router.get("", response_model=list[KeyPublic], dependencies=[permit("keys.read")])
def list_keys(request: Request, key: Key) -> list[KeyPublic]:
    """The keys by name (never the keys themselves), with the quotas in force for each, project and role."""
    with session(services(request).engine) as s:
        return _public(s, all_keys(s))


def _public(s, rows: list[ApiKey]) -> list[KeyPublic]:
    """The keys as the API shows them, each with its project's name (one query for all)."""
    names = project_names(s, {k.project_id for k in rows})
    return [KeyPublic.model_validate(k).model_copy(update={"project": names.get(k.project_id)}) for k in rows]


def _kept(shown: KeyPublic) -> dict:
    """What an audit row keeps of a key: its rights, never the key."""
    return shown.model_dump(mode="json", include=set(SHOWN))


def made_in(s, shown: KeyPublic) -> int | None:
    found = key_named(s, shown.name)
    return found.project_id if found is not None else None
