"""API keys: made once, shown once, stored as a SHA-256 digest only.

On its first start the server makes an admin key and writes it to $GPUFORGE_HOME/admin.key, readable by
its owner alone; `gpuforge keys create NAME` makes the others, with their quotas (store/quotas.py;
`gpuforge keys set NAME` changes them) and project (store/projects.py). A key is looked up by its digest,
so a stolen database does not hand out working keys.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuforge.errors import GpuforgeError
from gpuforge.store.models import ApiKey, Role, utcnow
from gpuforge.store.projects import project_named
from gpuforge.store.quotas import BY_NAME, check_settable

PREFIX = "gf_"
log = logging.getLogger("gpuforge.server")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(
    s: Session,
    name: str,
    admin: bool = False,
    quotas: dict[str, int | None] | None = None,
    project: str | None = None,
    role: Role = Role.MEMBER,
) -> str:
    """A new key named `name` (unique), with the quotas given (the others: the defaults; an admin key has
    none, store/quotas.py), in `project` (by name; an admin key in none); returns the key itself, which is
    not kept anywhere. ValueError for quotas or a project it cannot have."""
    check_settable(name, admin, quotas or {})
    project_id = _project_id(s, name, admin, project)
    if s.scalar(select(ApiKey.id).where(ApiKey.name == name)) is not None:
        raise GpuforgeError(f"an API key named {name!r} exists already")
    key = PREFIX + secrets.token_urlsafe(32)
    s.add(
        ApiKey(name=name, digest=digest(key), admin=admin, project_id=project_id, role=role, **(quotas or {}))
    )
    return key


def set_key_role(s: Session, name: str, role: Role) -> ApiKey:
    """Give the key named `name` `role` in its project (or over its own rows, in none). LookupError: no
    such key; ValueError: an admin key (it has every right already)."""
    key = s.scalar(select(ApiKey).where(ApiKey.name == name))
    if key is None:
        raise LookupError(f"no API key named {name!r}")
    if key.admin:
        raise ValueError(f"role: {name!r} is an admin key: it holds every right, in every project")
    key.role = role
    return key


def set_key_project(s: Session, name: str, project: str | None) -> ApiKey:
    """Put the key named `name` in `project` (by name; None: in none). Its jobs and deployments stay where
    they were made (their costs counted there); its new ones go to the new project. LookupError: no such
    key; ValueError: no such project, or an admin key."""
    key = s.scalar(select(ApiKey).where(ApiKey.name == name))
    if key is None:
        raise LookupError(f"no API key named {name!r}")
    key.project_id = _project_id(s, name, key.admin, project)
    return key


def _project_id(s: Session, key_name: str, admin: bool, project: str | None) -> int | None:
    if project is None:
        return None
    if admin:  # it sees and changes every project's jobs already; its own would count nowhere's budget
        raise ValueError(f"project: {key_name!r} is an admin key: admin keys belong to no project")
    try:
        return project_named(s, project).id
    except LookupError as err:
        raise ValueError(f"project: {err}") from None


def set_quotas(s: Session, name: str, quotas: dict[str, int | None]) -> ApiKey:
    """Change the quotas of the key named `name`: each given one to its value, None back to the default.
    They hold from the next request or scheduling pass on (the checks read them from the store).
    LookupError: no such key; ValueError: quotas it cannot have."""
    key = s.scalar(select(ApiKey).where(ApiKey.name == name))
    if key is None:
        raise LookupError(f"no API key named {name!r}")
    if not quotas:
        raise ValueError(f"nothing to change: give project or one of {', '.join(BY_NAME)}")
    check_settable(name, key.admin, quotas)
    for quota, value in quotas.items():
        setattr(key, quota, value)
    return key


def find_key(s: Session, key: str | None) -> ApiKey | None:
    """The live (not revoked) key whose digest this is."""
    if not key or not key.startswith(PREFIX):
        return None
    return s.scalar(select(ApiKey).where(ApiKey.digest == digest(key), ApiKey.revoked_at.is_(None)))


def has_admin_key(s: Session) -> bool:
    live_admin = ApiKey.admin.is_(True) & ApiKey.revoked_at.is_(None)
    return s.scalar(select(ApiKey.id).where(live_admin).limit(1)) is not None


def revoke_key(s: Session, name: str) -> ApiKey:
    """Revoke the key named `name`: it opens nothing from now on; its jobs and deployments stay. The last
    live admin key cannot go (nobody could make keys again)."""
    key = s.scalar(select(ApiKey).where(ApiKey.name == name))
    if key is None:
        raise LookupError(f"no API key named {name!r}")
    if key.revoked_at is not None:
        raise GpuforgeError(f"the API key {name!r} is revoked already")
    if key.admin:
        others = select(ApiKey.id).where(
            ApiKey.admin.is_(True), ApiKey.revoked_at.is_(None), ApiKey.id != key.id
        )
        if s.scalar(others.limit(1)) is None:
            raise GpuforgeError(f"{name!r} is the last admin key: make another admin key before revoking it")
    key.revoked_at = utcnow()
    return key


def ensure_admin_key(s: Session, home: Path, configured: str | None = None) -> str | None:
    """On a store with no admin key: take the `configured` one (GPUFORGE_ADMIN_KEY, written nowhere), or
    make one, write it to home/admin.key (mode 0600) and return it (to print once). Otherwise None."""
    if has_admin_key(s):
        if configured and find_key(s, configured) is None:  # said once at start, not a 401 puzzle later
            log.warning("GPUFORGE_ADMIN_KEY is not used: this store has an admin key already (admin.key)")
        return None
    if configured:
        if not configured.startswith(PREFIX) or len(configured) < 32:
            raise GpuforgeError(f"GPUFORGE_ADMIN_KEY: must start with {PREFIX} and be 32+ characters long")
        s.add(ApiKey(name="admin", digest=digest(configured), admin=True))
        return None
    key = create_key(s, "admin", admin=True)
    home.mkdir(parents=True, exist_ok=True)
    path = home / "admin.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never world-readable, not even briefly
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.chmod(path, 0o600)
    return key


# --- reads for the API ---
def key_named(s: Session, name: str) -> ApiKey | None:
    return s.scalar(select(ApiKey).where(ApiKey.name == name))


def all_keys(s: Session) -> list[ApiKey]:
    """Every key, revoked ones too, in the order they were made."""
    return list(s.scalars(select(ApiKey).order_by(ApiKey.id)))


def key_name(s: Session, key_id: int) -> str | None:
    return s.scalar(select(ApiKey.name).where(ApiKey.id == key_id))


def is_revoked(s: Session, key_id: int) -> bool:
    """Read from the store each time: a key revoked by another server process shows at once."""
    return s.scalar(select(ApiKey.revoked_at).where(ApiKey.id == key_id)) is not None
