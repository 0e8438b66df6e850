"""A deployment's versions and events: every move of a version, one named function each, and the log of
what happened to a deployment (what `gpuforge deployments N --versions | --events` read).

    (deploy on a live name)   --> rolling   (checked: its eval metric is compared before it serves)
    retired --roll_out_again--> rolling     (a rollback: not checked, the user asked for it)
    rolling --rolled_out-->      serving    (the one serving before: retired)
    rolling --refuse-->          refused    (its metric fell more than max_metric_drop)
    rolling --fail_version-->    failed     (its model would not load, or its replicas kept dying)
    rolling --retire_again-->    retired    (a rollback's rollout, itself rolled back)

As in store/states.py, each move is one UPDATE that holds only from a state it may leave, and says whether
it happened; nothing is committed here.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gpuforge.store.models import Deployment, DeploymentEvent, DeploymentVersion, VersionState, utcnow


def record(s: Session, deployment_id: int, kind: str, **data: Any) -> None:
    """One event of a deployment (scaled, cold_start, rolling, rolled_out, refused, adapter_added...)."""
    s.add(DeploymentEvent(deployment_id=deployment_id, ts=time.time(), kind=kind, data=data))


def of_state(s: Session, deployment_id: int, state: VersionState) -> DeploymentVersion | None:
    """The deployment's version in `state` (one serves, at most one rolls out at a time)."""
    return s.scalar(
        select(DeploymentVersion)
        .where(DeploymentVersion.deployment_id == deployment_id, DeploymentVersion.state == state)
        .order_by(DeploymentVersion.version.desc())
        .limit(1)
        .execution_options(populate_existing=True)
    )


def add(
    s: Session, deployment: Deployment, job_id: int, model_dir: str, state: VersionState
) -> DeploymentVersion:
    """The deployment's next version number, for the job's model."""
    last = s.scalar(
        select(DeploymentVersion.version)
        .where(DeploymentVersion.deployment_id == deployment.id)
        .order_by(DeploymentVersion.version.desc())
        .limit(1)
    )
    version = DeploymentVersion(
        deployment_id=deployment.id, version=(last or 0) + 1, job_id=job_id, model_dir=model_dir, state=state
    )
    s.add(version)
    s.flush()
    return version


def _move(s: Session, version_id: int, sources: tuple[VersionState, ...], **values: Any) -> bool:
    moved = s.execute(
        update(DeploymentVersion)
        .where(DeploymentVersion.id == version_id, DeploymentVersion.state.in_(sources))
        .values(**values)
        .execution_options(synchronize_session="fetch")
    )
    return moved.rowcount == 1


def roll_out_again(s: Session, version_id: int) -> bool:
    """retired → rolling, unchecked (a rollback)."""
    return _move(s, version_id, (VersionState.RETIRED,), state=VersionState.ROLLING, checked=False,
                 reason=None, ended_at=None)  # fmt: skip


def rolled_out(s: Session, deployment: Deployment, version: DeploymentVersion) -> bool:
    """rolling → serving; the one serving before → retired; the deployment serves its model."""
    if not _move(s, version.id, (VersionState.ROLLING,), state=VersionState.SERVING):
        return False
    s.execute(
        update(DeploymentVersion)
        .where(
            DeploymentVersion.deployment_id == deployment.id,
            DeploymentVersion.state == VersionState.SERVING,
            DeploymentVersion.id != version.id,
        )
        .values(state=VersionState.RETIRED, ended_at=utcnow())
        .execution_options(synchronize_session="fetch")
    )
    s.execute(
        update(Deployment)
        .where(Deployment.id == deployment.id)
        .values(version=version.version, job_id=version.job_id, model_dir=version.model_dir)
        .execution_options(synchronize_session="fetch")
    )
    return True


def refuse(s: Session, version_id: int, reason: str) -> bool:
    """rolling → refused, for `reason`."""
    return _move(s, version_id, (VersionState.ROLLING,), state=VersionState.REFUSED, reason=reason,
                 ended_at=utcnow())  # fmt: skip


def fail_version(s: Session, version_id: int, reason: str) -> bool:
    """rolling → failed, for `reason`."""
    return _move(s, version_id, (VersionState.ROLLING,), state=VersionState.FAILED, reason=reason,
                 ended_at=utcnow())  # fmt: skip


def measured(s: Session, version_id: int, metric: dict[str, Any]) -> None:
    """Its eval metric, as its first replica measured it at load."""
    s.execute(update(DeploymentVersion).where(DeploymentVersion.id == version_id).values(metric=metric))


def retire_again(s: Session, version_id: int) -> bool:
    """rolling → retired: a version rolled out again by a rollback, stopped by another (it served well
    once; it may come back)."""
    return _move(s, version_id, (VersionState.ROLLING,), state=VersionState.RETIRED, ended_at=utcnow())


# --- reads for the API ---
def all_versions(s: Session, deployment_id: int) -> list[DeploymentVersion]:
    """Every version of the deployment, newest first."""
    query = select(DeploymentVersion).where(DeploymentVersion.deployment_id == deployment_id)
    return list(s.scalars(query.order_by(DeploymentVersion.version.desc())))


def numbered(s: Session, deployment_id: int, version: int) -> DeploymentVersion | None:
    return s.scalar(
        select(DeploymentVersion).where(
            DeploymentVersion.deployment_id == deployment_id, DeploymentVersion.version == version
        )
    )


def last_retired(s: Session, deployment_id: int) -> DeploymentVersion | None:
    """The version retired last (that served before the one serving), if any."""
    return s.scalar(
        select(DeploymentVersion)
        .where(DeploymentVersion.deployment_id == deployment_id)
        .where(DeploymentVersion.state == VersionState.RETIRED)
        .order_by(DeploymentVersion.ended_at.desc(), DeploymentVersion.version.desc())
        .limit(1)
    )


def latest_events(s: Session, deployment_id: int, limit: int) -> list[DeploymentEvent]:
    """The deployment's latest `limit` events, oldest first."""
    query = select(DeploymentEvent).where(DeploymentEvent.deployment_id == deployment_id)
    return list(reversed(list(s.scalars(query.order_by(DeploymentEvent.id.desc()).limit(limit)))))
