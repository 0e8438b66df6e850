"""Who may do what: one table (RULES), one check every route goes through (`permit`), and the audit row each
change writes (`audited`).

Every route but the open ones (access.py) names its action in its decorator, `dependencies=[permit(A)]`:
the check runs before the route, refuses a key whose role is below the action's (403 naming the role it
needs), and remembers the action for the audit row. A rule on one job or deployment (a teammate's) is the
row check's, in server/visibility.py, read from the same table. A test walks every route of the app with
every role and compares the answers with RULES; a route without an action fails it.

Roles (store/models.py Role), each with the rights of the one before: `viewer` reads its project's jobs,
metrics, logs, deployments and costs; `member` also submits and changes its own jobs and deployments;
`maintainer` also changes anyone's in its project, deploys a teammate's model and sets the project's
members; `admin` (the key's flag) does everything, on every project. A key in no project has only its own
rows: its role says what it may do with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy.orm import Session

from gpuforge.server.auth import Key
from gpuforge.store import audit
from gpuforge.store.models import ApiKey, Role
from gpuforge.store.users import person_name

ADMIN = "admin"  # not a role: the key's admin flag


@dataclass(frozen=True)
class Rule:
    """`least`: the least role that may use the action at all (ADMIN: an admin key alone); `others`: the
    least role that may do it to a teammate's job or deployment (None: the action has no such row);
    `audited`: a change, written to the audit log."""

    least: Role | str
    others: Role | str | None
    audited: bool
    what: str


V, M, MT = Role.VIEWER, Role.MEMBER, Role.MAINTAINER
RULES: dict[str, Rule] = {
    "whoami": Rule(V, None, False, "who the key is: its name, project and role"),
    # reads: a viewer sees its project's (others: what a teammate's row needs to be read)
    "jobs.read": Rule(V, V, False, "list and read jobs: spec, events, metrics, logs, summary, reports"),
    "searches.read": Rule(V, V, False, "list and read hyperparameter searches"),
    "deployments.read": Rule(V, V, False, "list and read deployments: versions, events, stats"),
    "deployments.predict": Rule(V, None, False, "ask a deployment for predictions"),
    "overview.read": Rule(V, None, False, "devices, prices, costs (its own and its project's)"),
    "projects.read": Rule(V, None, False, "its project's settings, spend and members"),
    "uploads.read": Rule(V, None, False, "find an upload its project holds"),
    "audit.read": Rule(MT, None, False, "the audit log: its project's rows (an admin: every row)"),
    # changes
    "jobs.submit": Rule(M, None, True, "submit a job"),
    "jobs.cancel": Rule(M, MT, True, "cancel a job"),
    "jobs.resume": Rule(M, MT, True, "resume a paused or cancelled job"),
    "jobs.profile": Rule(M, MT, True, "profile a running job"),
    "searches.create": Rule(M, None, True, "start a hyperparameter search"),
    "searches.stop": Rule(M, MT, True, "stop a search"),
    "uploads.write": Rule(M, None, True, "upload a file for its jobs"),
    "deployments.deploy": Rule(
        M,
        MT,
        True,
        "deploy a finished model, or a new version (a teammate's model or deployment: maintainer)",
    ),  # noqa: E501
    "deployments.undeploy": Rule(M, MT, True, "undeploy"),
    "deployments.rollback": Rule(M, MT, True, "roll a deployment back"),
    "deployments.adapters": Rule(M, MT, True, "add or remove a deployment's adapters"),
    "projects.members": Rule(MT, None, True, "set who is in its project, and their roles"),
    "notifications.read": Rule(V, None, False, "its notification targets and their deliveries"),
    "notifications.change": Rule(
        V, None, True, "add or remove its notification targets (a project's: a maintainer)"
    ),
    "notifications.test": Rule(V, None, False, "send a test event to one of its targets"),
    "me.keys.read": Rule(V, None, False, "a signed-in person's own personal keys"),
    "me.keys.change": Rule(V, None, True, "make or revoke a personal key (its user's rights or fewer)"),
    # the admin's alone
    "keys.read": Rule(ADMIN, None, False, "list keys"),
    "keys.create": Rule(ADMIN, None, True, "make a key"),
    "keys.change": Rule(ADMIN, None, True, "change a key's quotas, project, role"),
    "keys.revoke": Rule(ADMIN, None, True, "revoke a key"),
    "projects.create": Rule(ADMIN, None, True, "make a project"),
    "projects.change": Rule(ADMIN, None, True, "change a project's budget, device cap, share"),
}


def has(key: ApiKey, least: Role | str | None) -> bool:
    """Whether `key` holds `least` (an admin key holds everything; None: nobody but an admin)."""
    if key.admin:
        return True
    if least is None or least == ADMIN:
        return False
    return Role(key.role).rank >= Role(least).rank


class Permit:
    """The route-level check of one action: a FastAPI dependency (`permit(action)` makes it)."""

    def __init__(self, action: str):
        self.action, self.rule = action, RULES[action]  # a KeyError at import: an action not in the table

    async def __call__(self, request: Request, key: Key) -> ApiKey:  # async: no thread hop per request
        request.state.action = self.action
        if not has(key, self.rule.least):
            raise HTTPException(status.HTTP_403_FORBIDDEN, refusal(key, self.action, self.rule.least))
        return key


def permit(action: str) -> Any:
    return Depends(Permit(action))


def refusal(key: ApiKey, action: str, needed: Role | str) -> str:
    """Why `key` may not do `action`: what it is, and what would."""
    what = RULES[action].what
    if needed == ADMIN:
        return f"{action}: key {key.name!r} is not an admin key; {what}: an admin key's alone"
    return f"{action}: key {key.name!r} is {_a(key.role)}; {what}: {_a(needed)} or more"


def _a(role: Role | str) -> str:
    return f"an {role}" if str(role)[0] in "aeiou" else f"a {role}"


def actor(request: Request, key: ApiKey | None) -> audit.Actor:
    """Who sent `request`, for its audit row."""
    source = request.client.host if request.client else "-"
    return audit.Actor(person_name(key) if key else "-", key.id if key else None, source)


def audited(
    s: Session,
    request: Request,
    key: ApiKey,
    target: str,
    project_id: int | None = None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> None:
    """The audit row of the change this request makes, added to `s`, the change's own session: committed
    with it or not at all. The action is the one its route's permit named."""
    action = request.state.action
    if not RULES[action].audited:
        raise RuntimeError(f"{action} is not an audited action (server/permissions.py RULES)")
    audit.record(s, actor(request, key), action, target, project_id, before, after)


def rules_table() -> str:
    """RULES as the markdown table docs/security.md holds (a test keeps the two the same)."""
    lines = [
        "| action | what | least role | on a teammate's | audited |",
        "|---|---|---|---|---|",
    ]
    for name, rule in RULES.items():
        others = "-" if rule.others is None else str(rule.others)
        lines.append(
            f"| `{name}` | {rule.what} | {rule.least} | {others} | {'yes' if rule.audited else 'no'} |"
        )
    return "\n".join(lines)
