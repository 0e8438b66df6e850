"""People who sign in through single sign-on, what they may do, and the keys they act through.

A user is known by the issuer's `sub` (a name or an email may change). They act through one API key row of
their own (kind `user`, a digest nobody holds): it owns their jobs and deployments and carries their rights
in force, which each sign-in sets afresh from their memberships. Their memberships come from the server's
table (`projects member`) and from the groups claim, mapped by the admin's roles rule; the higher role of
the two holds in each project. A person in several projects acts in one at a time: the first by name.

The dashboard's sessions and a user's personal keys are further key rows of theirs (kinds `session` and
`personal`): a session expires; a personal key carries at most its user's rights, checked at each use.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from gpuforge.store.keys import PREFIX, digest
from gpuforge.store.models import MAX_NAME, ApiKey, Membership, Project, Role, User, utcnow
from gpuforge.store.quotas import QUOTAS

ADMIN = "admin"
SESSION_TTL = timedelta(hours=12)
# a role read from the groups claim holds for a personal key this long after its person's last sign-in:
# someone the provider has dropped stops acting through their keys within it
CLAIM_TRUST = timedelta(days=7)
MAX_PERSONAL_KEYS = 10  # live, a person
NAME_SAFE = re.compile(r"[^A-Za-z0-9._@-]")


@dataclass(frozen=True)
class RoleRule:
    """One rule of GPUFORGE_OIDC_ROLES: members of `group` get `role` in `project` (None: admin)."""

    group: str
    project: str | None
    role: Role | None


def parse_roles_rule(text: str) -> list[RoleRule]:
    """`GROUP=PROJECT:ROLE` or `GROUP=admin`, comma-separated; ValueError naming the part it cannot read."""
    rules = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        group, _, what = part.partition("=")
        if not group.strip() or not what.strip():
            raise ValueError(f"GPUFORGE_OIDC_ROLES: {part!r} is not GROUP=PROJECT:ROLE or GROUP=admin")
        if what.strip() == ADMIN:
            rules.append(RoleRule(group.strip(), None, None))
            continue
        project, _, role = what.strip().partition(":")
        if role not in {r.value for r in Role}:
            raise ValueError(
                f"GPUFORGE_OIDC_ROLES: {part!r}: the role must be one of viewer, member, maintainer"
            )
        rules.append(RoleRule(group.strip(), project, Role(role)))
    return rules


class Revoked(Exception):
    """The person's own key was revoked by an admin: they sign in to nothing."""


@dataclass(frozen=True)
class Person:
    """A verified sign-in: who, as the ID token says."""

    issuer: str
    subject: str
    name: str | None
    email: str | None
    groups: tuple[str, ...]


def sign_in(s: Session, person: Person, rules: list[RoleRule]) -> ApiKey:
    """The user of `person` (made at the first sign-in), their claimed memberships set from their groups,
    and the key row they act through, with the rights now in force. Unknown projects in a rule are
    skipped (a rule may name a project the admin has not made yet). Revoked: an admin revoked their key."""
    user = s.scalar(select(User).where(User.issuer == person.issuer, User.subject == person.subject))
    own = _user_key(s, user.id) if user is not None else None
    if own is not None and own.revoked_at is not None:
        raise Revoked(f"{own.name!r} is revoked: an admin revoked this person's access")
    if user is None:
        user = User(issuer=person.issuer, subject=person.subject)
        s.add(user)
        s.flush()
    user.name, user.email = person.name, person.email
    user.last_sign_in_at = utcnow()
    groups = set(person.groups)
    user.admin = any(r.role is None and r.group in groups for r in rules)
    s.execute(delete(Membership).where(Membership.user_id == user.id, Membership.source == "claim"))
    claimed: dict[int, Role] = {}
    names = {p.name: p.id for p in s.scalars(select(Project))}
    for rule in rules:
        if rule.role is not None and rule.group in groups and rule.project in names:
            project_id = names[rule.project]
            if project_id not in claimed or rule.role.rank > claimed[project_id].rank:
                claimed[project_id] = rule.role
    for project_id, role in claimed.items():
        s.add(Membership(user_id=user.id, project_id=project_id, role=role, source="claim"))
    s.flush()
    return refresh_user_key(s, user)


def _user_key(s: Session, user_id: int) -> ApiKey | None:
    return s.scalar(select(ApiKey).where(ApiKey.user_id == user_id, ApiKey.kind == "user"))


def roles_of(s: Session, user_id: int, claims_too: bool = True) -> dict[int, Role]:
    """project id -> the user's role there: the higher of the table's and (`claims_too`) the claim's."""
    held: dict[int, Role] = {}
    rows = select(Membership).where(Membership.user_id == user_id)
    if not claims_too:
        rows = rows.where(Membership.source == "table")
    for m in s.scalars(rows):
        if m.project_id not in held or Role(m.role).rank > held[m.project_id].rank:
            held[m.project_id] = Role(m.role)
    return held


def refresh_user_key(s: Session, user: User) -> ApiKey:
    """The user's own key row (made at their first sign-in), set to the rights in force: admin, or their
    current project if they are still in it, else the first of their projects by name, with its role
    (none: no project, a viewer of nothing). Another project taking them in does not move them."""
    key = _user_key(s, user.id)
    if key is None:
        key = ApiKey(
            name=_free_name(s, user),
            digest=digest(PREFIX + secrets.token_urlsafe(32)),
            user_id=user.id,
            kind="user",
        )  # fmt: skip  (the key itself is thrown away)
        s.add(key)
    held = roles_of(s, user.id)
    key.admin = user.admin
    if user.admin or not held:
        key.project_id, key.role = None, Role.VIEWER if not user.admin else Role.MEMBER
    else:
        names = dict(s.execute(select(Project.id, Project.name).where(Project.id.in_(held))).tuples().all())
        current = key.project_id if key.project_id in held else min(held, key=lambda p: names[p])
        key.project_id, key.role = current, held[current]
    for other in s.scalars(select(ApiKey).where(ApiKey.user_id == user.id, ApiKey.kind == "session")):
        other.admin, other.project_id, other.role = key.admin, key.project_id, key.role
    s.flush()
    return key


def set_table_role(s: Session, user_id: int, project_id: int, role: Role | None) -> None:
    """The server's table: `role` for the user in the project (None: out of it, as far as the table goes)."""
    s.execute(
        delete(Membership).where(
            Membership.user_id == user_id, Membership.project_id == project_id, Membership.source == "table"
        )
    )
    if role is not None:
        s.add(Membership(user_id=user_id, project_id=project_id, role=role, source="table"))
    s.flush()
    user = s.get(User, user_id)
    if user is not None:
        refresh_user_key(s, user)


def new_user_key(
    s: Session, user_key: ApiKey, kind: str, name: str | None, role: Role | None
) -> tuple[str, ApiKey]:
    """A session (kind `session`, SESSION_TTL) or a personal key of the user whose own key (or session) is
    `user_key`, with its rights or fewer (`role` at most theirs): the key itself, shown once, and its row.
    ValueError: a role above theirs; LookupError: the name is taken."""
    key = PREFIX + secrets.token_urlsafe(32)
    held = Role(user_key.role)
    if role is not None and role.rank > held.rank and not user_key.admin:
        raise ValueError(f"role: {role} is above the {held} {user_key.name!r} holds")
    tag = f"~{kind}-{secrets.token_hex(4)}"
    name = name or f"{user_key.name[: MAX_NAME - len(tag)]}{tag}"
    if s.scalar(select(ApiKey.id).where(ApiKey.name == name)) is not None:
        raise LookupError(f"an API key named {name!r} exists already")
    if kind == "personal" and len(personal_keys(s, user_key.user_id, live=True)) >= MAX_PERSONAL_KEYS:
        raise ValueError(f"a person holds {MAX_PERSONAL_KEYS} live personal keys at most: revoke one first")
    quotas = {q.name: getattr(user_key, q.name) for q in QUOTAS}  # counted as one person's (store/quotas.py)
    row = ApiKey(
        name=name, digest=digest(key), user_id=user_key.user_id, kind=kind,
        admin=user_key.admin if kind == "session" else False,
        project_id=user_key.project_id, role=role or held,
        expires_at=utcnow() + SESSION_TTL if kind == "session" else None, **quotas,
    )  # fmt: skip
    s.add(row)
    return key, row


def personal_keys(s: Session, user_id: int, live: bool = False) -> list[ApiKey]:
    kinds = ApiKey.user_id == user_id, ApiKey.kind == "personal"
    if live:
        kinds = (*kinds, ApiKey.revoked_at.is_(None))
    return list(s.scalars(select(ApiKey).where(*kinds).order_by(ApiKey.id)))


def capped(s: Session, key: ApiKey, now: datetime | None = None) -> ApiKey | None:
    """`key` as it may act now: None for an expired session, or any key of a person whose own key an admin
    revoked; a personal key's rights lowered to its user's in force (never an admin's, out of a project its
    user has left; roles from the groups claim only within CLAIM_TRUST of their last sign-in). Other keys
    as they are. What is lowered is this request's view, set as if loaded: nothing to write back."""
    now = now or utcnow()
    if key.expires_at is not None and key.expires_at <= now:
        return None
    if key.user_id is None or key.kind == "user":
        return key
    own = _user_key(s, key.user_id)
    if own is None or own.revoked_at is not None:
        return None
    if key.kind != "personal":
        return key
    user = s.get(User, key.user_id)
    trusted = (
        user is not None and user.last_sign_in_at is not None and now - user.last_sign_in_at < CLAIM_TRUST
    )
    held = roles_of(s, key.user_id, claims_too=trusted).get(key.project_id) if key.project_id else None
    s.expunge(key)
    set_committed_value(key, "admin", False)
    if key.project_id is not None and held is None:
        set_committed_value(key, "project_id", None)
        set_committed_value(key, "role", Role.VIEWER)
    elif held is not None and held.rank < Role(key.role).rank:
        set_committed_value(key, "role", held)
    return key


def person_name(key: ApiKey) -> str:
    """Who a key is, as a person reads it: a session's user (its name is the user's and a tag), else its
    own name."""
    return key.name.rpartition("~session-")[0] if key.kind == "session" else key.name


def owned_ids(s: Session, key: ApiKey) -> frozenset[int]:
    """The key rows whose jobs and deployments are `key`'s own: its user's every key (the one they act
    through, their sessions and personal keys), or the key alone."""
    if key.user_id is None:
        return frozenset({key.id})
    return frozenset(s.scalars(select(ApiKey.id).where(ApiKey.user_id == key.user_id)))


def user_of(s: Session, member: str) -> User | None:
    """The user a members route names: by the name of the key they act through, else by an email that one
    user alone has (LookupError when several have it: name their key instead)."""
    key = s.scalar(select(ApiKey).where(ApiKey.name == member))
    if key is not None:
        return s.get(User, key.user_id) if key.kind == "user" else None
    found = list(s.scalars(select(User).where(User.email == member).limit(2)))
    if len(found) > 1:
        raise LookupError(f"{member!r} is the email of several users: name the key they act through")
    return found[0] if found else None


def _free_name(s: Session, user: User) -> str:
    """A key name for the user: their email (or name), else their subject's digest, unique."""
    base = NAME_SAFE.sub("-", user.email or user.name or "")[: MAX_NAME - 9].strip("-.") or (
        "user-" + hashlib.sha256(user.subject.encode()).hexdigest()[:12]
    )
    name, n = base, 1
    while s.scalar(select(ApiKey.id).where(ApiKey.name == name)) is not None:
        n += 1
        name = f"{base}-{n}"
    return name
