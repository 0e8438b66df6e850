"""Reads of deployments for the API: by name, the list, with the version each rolls out, and the devices
their replicas hold. Their changes of state are store/states.py's; their versions and events,
store/versions.py's."""

from __future__ import annotations

from sqlalchemy import ColumnElement, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased
from sqlalchemy.orm.exc import StaleDataError

from gpuforge.store.models import LIVE_DEPLOYMENT_STATES, Deployment, DeploymentVersion, VersionState


def named(s: Session, name: str) -> Deployment | None:
    return s.scalar(select(Deployment).where(Deployment.name == name))


def add_named(s: Session, deployment: Deployment) -> bool:
    """Add a new deployment, written now; False where another of its name was written at the same moment
    (the session is then good only for rolling back)."""
    s.add(deployment)
    try:
        s.flush()
    except (IntegrityError, StaleDataError):
        return False
    return True


def listed(s: Session, readable: ColumnElement[bool], every: bool = False) -> list[Deployment]:
    """The deployments `readable` lets the caller see, newest first: the live ones, or `every` one."""
    query = select(Deployment).order_by(Deployment.id.desc())
    if not every:
        query = query.where(Deployment.state.in_(LIVE_DEPLOYMENT_STATES))
    return list(s.scalars(query.where(readable)))


def with_rolling_version(s: Session, deployment_id: int) -> tuple[Deployment, int | None]:
    """The deployment, read again, and the version it is rolling out (None: none): both in one statement,
    so a rollout that ends between two reads never shows as neither rolling nor served."""
    rolling, ROLLING = aliased(DeploymentVersion), VersionState.ROLLING  # noqa: N806
    row = s.execute(
        select(Deployment, rolling.version)
        .outerjoin(rolling, (rolling.deployment_id == Deployment.id) & (rolling.state == ROLLING))
        .where(Deployment.id == deployment_id)
        .order_by(rolling.version.desc())
        .limit(1)
        .execution_options(populate_existing=True)
    ).one()
    return row[0], row[1]


def replica_devices(s: Session) -> dict[str, tuple[Deployment, int]]:
    """device id -> (the live deployment, the index of its replica) holding it."""
    live = s.scalars(select(Deployment).where(Deployment.state.in_(LIVE_DEPLOYMENT_STATES)))
    return {w["device"]: (d, w["index"]) for d in live for w in d.workers or [] if w.get("device")}
