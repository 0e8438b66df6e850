"""A signed-in person's own keys (single sign-on users, store/users.py): personal keys for scripts and CI,
each with its user's rights or fewer (checked again at each use: a key never outgrows its user).

    GET    /api/v1/me/keys                    their personal keys (never the keys themselves)
    POST   /api/v1/me/keys  {"name"?, "role"?}  a new one, shown once
    DELETE /api/v1/me/keys/{name}             revoke one
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Request, status
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field

from gpuforge.server.auth import Key, forget_key, forget_person
from gpuforge.server.permissions import audited, permit
from gpuforge.server.schemas import KeyCreated, KeyPublic
from gpuforge.server.services import services
from gpuforge.store.db import session
from gpuforge.store.keys import key_named, revoke_key
from gpuforge.store.models import MAX_NAME, NAME_PATTERN, ApiKey, Role
from gpuforge.store.projects import project_names
from gpuforge.store.users import new_user_key, personal_keys

router = APIRouter(prefix="/api/v1/me", tags=["keys"])
Name = Annotated[str, PathParam(max_length=100, description="the key's name")]


class PersonalKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, pattern=NAME_PATTERN, max_length=MAX_NAME, description="default: made up")
    role: Role | None = Field(None, description="at most the user's own; default: the user's")


def _person(key: ApiKey) -> None:
    if key.user_id is None:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"key {key.name!r} is no signed-in person's: personal keys are for single sign-on users (an "
            "admin makes keys with `gpuforge keys create`)",
        )


def _public(s, rows: list[ApiKey]) -> list[KeyPublic]:
    names = project_names(s, {k.project_id for k in rows})
    return [KeyPublic.model_validate(k).model_copy(update={"project": names.get(k.project_id)}) for k in rows]


@router.get("/keys", response_model=list[KeyPublic], dependencies=[permit("me.keys.read")])
def my_keys(request: Request, key: Key) -> list[KeyPublic]:
    """The signed-in person's personal keys, revoked ones too."""
    _person(key)
    with session(services(request).engine) as s:
        return _public(s, personal_keys(s, key.user_id))


@router.post(
    "/keys",
    status_code=status.HTTP_201_CREATED,
    response_model=KeyCreated,
    dependencies=[permit("me.keys.change")],
)
def make_my_key(body: PersonalKeyCreate, request: Request, key: Key) -> KeyCreated:
    """A personal key in the person's project, with their role or a lower one: shown this once."""
    _person(key)
    with session(services(request).engine) as s:
        try:
            secret, made = new_user_key(s, key, "personal", body.name, body.role)
        except ValueError as err:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(err)) from err
        except LookupError as err:
            raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from err
        s.flush()
        shown = _public(s, [made])[0]
        after = {"role": str(made.role), "kind": "personal"}
        audited(s, request, key, f"key {made.name}", made.project_id, after=after)
    forget_person(request, key.user_id)  # their keys' own rows now count this one's too
    return KeyCreated(**shown.model_dump(), key=secret)


@router.delete("/keys/{name}", response_model=KeyPublic, dependencies=[permit("me.keys.change")])
def revoke_my_key(name: Name, request: Request, key: Key) -> KeyPublic:
    """Revoke one of the person's personal keys."""
    _person(key)
    with session(services(request).engine) as s:
        found = key_named(s, name)
        if found is None or found.user_id != key.user_id or found.kind != "personal":
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no personal key {name!r}")
        if found.revoked_at is not None:
            raise HTTPException(status.HTTP_409_CONFLICT, f"the API key {name!r} is revoked already")
        revoke_key(s, name)
        s.flush()
        shown = _public(s, [found])[0]
        audited(s, request, key, f"key {name}", found.project_id, {"revoked": False}, {"revoked": True})
    forget_key(request, found.digest, revoked=True)
    forget_person(request, key.user_id)
    return shown
