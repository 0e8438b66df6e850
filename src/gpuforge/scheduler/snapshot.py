"""Phase 1 of the queue's pass (scheduler/loop.py: snapshot → plan → apply): what the pass reads of the
store, read in one function into one typed value. Phase 2 is queue.plan_starts on it (pure), phase 3 the
Scheduler's apply step, which writes what the plan decided.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuforge.scheduler import deployments
from gpuforge.scheduler.allocator import DeviceInfo
from gpuforge.scheduler.budgets import ProjectBudgets
from gpuforge.scheduler.executor import RunningRow
from gpuforge.scheduler.queue import Fairness, Labels, Limits, Plan, QueuedJob, RunningJob, plan_starts
from gpuforge.store.models import QUEUE_JOB_STATES, Job, JobState
from gpuforge.store.quotas import running_limits


@dataclass(frozen=True)
class QueueSnapshot:
    """The queue as one tick found it: plan_starts' whole input, and what each queued job shows now."""

    running: list[RunningJob]
    queued: list[QueuedJob]
    shown: Mapping[int, tuple[JobState, str | None]]  # queued job -> its state and the reason it shows
    free: Mapping[str, list[str]]  # device kind -> ids no running job or replica holds
    every: Mapping[str, list[str]]  # device kind -> all its ids
    limits: Limits
    fairness: Fairness | None  # None while one project (or key) alone waits: fair share changes nothing
    labels: Mapping[str, Labels]  # device id -> its labels, for placement
    shared: Mapping[str, float]  # device id -> the fraction of it fractions hold (jobs', replicas')

    def plan(self) -> Plan:
        free = {kind: list(ids) for kind, ids in self.free.items()}  # the plan hands them out of its copy
        every = {kind: list(ids) for kind, ids in self.every.items()}
        return plan_starts(
            self.queued, free, every, self.limits, self.fairness, self.running, self.labels, self.shared
        )


_RUNNING_COLUMNS = (
    Job.id,
    (Job.priority + Job.boost).label("priority"),
    Job.device_type,
    Job.devices,
    Job.owner_id,
    Job.project_id,
    Job.preemptible,
    Job.cancel_requested,
    Job.stop_requested,
    Job.max_time_s,
    Job.run_started_at,
    Job.device_share,
)
_QUEUED_COLUMNS = (
    Job.id,
    Job.priority + Job.boost,
    Job.device_type,
    Job.devices_wanted,
    Job.owner_id,
    Job.project_id,
    Job.max_time_s,  # what backfill trusts: the loop stops a job past it
    Job.placement,
    Job.state,
    Job.reason,
    Job.device_share,
)


def read_queue(
    s: Session,
    devices: list[DeviceInfo],
    budgets: ProjectBudgets,
    holds_devices_since: Callable[[RunningRow], datetime | None],
    usage: Callable[[], tuple[dict, dict]],
    now: datetime,
) -> QueueSnapshot:
    """The running and queued jobs, the devices replicas hold, the limits and (when two projects or keys
    wait) the usage fair share weighs, at `now`. `holds_devices_since` is the executor's (a running job's
    max_time counts from there); `usage` is asked only when fair share matters (it reads hours of ledger)."""
    running, owners, project_devices = [], Counter(), Counter()
    shared: Counter[str] = Counter()
    for row in s.execute(select(*_RUNNING_COLUMNS).where(Job.state == JobState.RUNNING)):
        ids = tuple(row.devices.split(",")) if row.devices else ()
        owners[row.owner_id] += 1  # max_running counts it
        project_devices[row.project_id] += row.device_share if row.device_share is not None else len(ids)
        if row.device_share is not None:
            shared.update({d: row.device_share for d in ids})
        ends = None  # unknown unless its max_time promises it (an ETA may run long: backfill would delay)
        began = holds_devices_since(row)  # from where the loop's _stop_for counts it
        if row.max_time_s is not None and began is not None:
            ends = max(0.0, row.max_time_s - (now - began).total_seconds())
        running.append(
            RunningJob(
                row.id,
                row.priority,
                row.device_type,
                ids,
                row.project_id,
                preemptible=row.preemptible,  # one preempted too often is lifted (boost), not shielded
                stopping=bool(row.cancel_requested or row.stop_requested),
                ends_in_s=ends,
                share=row.device_share,
            )
        )
    replicas = deployments.replica_holders(s)
    shared.update(deployments.replica_shares(s))
    held = {d for r in running for d in r.device_ids} | set(replicas)
    free: dict[str, list[str]] = {}
    every: dict[str, list[str]] = {}
    for d in devices:
        every.setdefault(d.kind, []).append(d.id)
        if d.id not in held:
            free.setdefault(d.kind, []).append(d.id)
    queued, shown = [], {}
    for row in s.execute(select(*_QUEUED_COLUMNS).where(Job.state.in_(QUEUE_JOB_STATES))):
        queued.append(QueuedJob(*row[:7], tuple(sorted((row[7] or {}).items())), row[10]))
        shown[row[0]] = (row[8], row[9])
    groups = {(j.project, None) if j.project is not None else (None, j.owner) for j in queued}
    fairness = None
    if len(groups) > 1:  # fair share matters once two projects (or keys) wait
        fairness = Fairness(*usage(), budgets.shares)
    limits = Limits(
        running=owners,
        max_running=running_limits(s, {j.owner for j in queued}),
        project_devices=project_devices,
        max_devices=budgets.caps,
        spent=budgets.spent,
        names=budgets.names,
        replicas=replicas,
    )
    labels = {d.id: d.labels for d in devices if d.labels}
    return QueueSnapshot(running, queued, shown, free, every, limits, fairness, labels, dict(shared))
