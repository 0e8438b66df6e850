"""Which queued jobs start now, on which devices: one pure function, so it is fast and easy to test.

Rules:
- Order: higher priority first. Within a priority, fair share between keys: each key's queued jobs take
  turns (its 1st before anyone's 2nd), and within a turn the key that used the least device-time lately
  (decayed, `usage`, over its `share`) goes first; then first submitted first (the job id). A key that
  queued 50 jobs delays another key's single job by one job at most, not 50.
- Gang: a job starts only when every device it asks for is free, all of its device type.
- No starvation: the first job of a device type that cannot start holds back every job after it of the
  same type (the devices freed meanwhile wait for it), so a stream of small low-priority jobs can never
  keep a large high-priority job waiting forever. Jobs of other device types go on.
- A job asking for more devices than exist never starts; it is returned as impossible, for the caller
  to fail with a clear reason instead of queueing it forever.
- Quotas: a job whose owner runs its max_running jobs already (store/quotas.py) is skipped, not a barrier:
  it holds no device and nobody back, keeps its place in the order, and starts at its turn once one of its
  owner's jobs ends (or the admin raises the quota). It is returned as held, with why.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

HELD = "waiting for quota max_running"  # the reason a held job shows; cleared when it starts


@dataclass(frozen=True)
class QueuedJob:
    id: int
    priority: int
    device_type: str  # "cpu" | "cuda"
    devices: int = 1
    owner: int | None = None  # the key that submitted it: its max_running applies


@dataclass
class Plan:
    starts: list[tuple[int, list[str]]] = field(default_factory=list)  # (job id, device ids)
    blocked: dict[str, int] = field(default_factory=dict)  # device type -> the job holding the others back
    impossible: dict[int, str] = field(default_factory=dict)  # job id -> why it can never start
    held: dict[int, str] = field(default_factory=dict)  # job id -> the quota that keeps it queued for now


def queue_order(
    jobs: Iterable[QueuedJob],
    usage: dict[int | None, float] | None = None,
    shares: dict[int | None, float] | None = None,
) -> list[QueuedJob]:
    """The order jobs start in (see the module's rules). `usage`: owner -> its device-seconds lately
    (decayed); `shares`: owner -> its weight (default 1): twice the share, half the weight of its usage
    and twice the turns."""
    usage, shares = usage or {}, shares or {}
    turns: dict[tuple[int, int | None], int] = {}
    ranked = []
    for job in sorted(jobs, key=lambda j: (-j.priority, j.id)):
        share = shares.get(job.owner, 1.0)
        turn = turns.get((job.priority, job.owner), 0)
        turns[(job.priority, job.owner)] = turn + 1
        ranked.append(((-job.priority, turn / share, usage.get(job.owner, 0.0) / share, job.id), job))
    return [job for _, job in sorted(ranked, key=lambda r: r[0])]


def plan_starts(
    jobs: Iterable[QueuedJob],
    free: dict[str, list[str]],
    total: dict[str, int],
    running: dict[int | None, int] | None = None,
    max_running: dict[int | None, int] | None = None,
    usage: dict[int | None, float] | None = None,
) -> Plan:
    """`free`: device type -> free device ids (in the order to hand them out); `total`: how many exist;
    `running`: owner -> its jobs running now; `max_running`: owner -> how many it may run at once (an owner
    not in it: no limit); `usage`: owner -> its device-seconds lately, for fair share (queue_order)."""
    plan = Plan()
    free = {kind: list(ids) for kind, ids in free.items()}
    running, max_running = dict(running or {}), max_running or {}
    for job in queue_order(jobs, usage):
        if job.device_type in plan.blocked:
            continue
        if job.devices > total.get(job.device_type, 0):
            have = total.get(job.device_type, 0)
            plan.impossible[job.id] = (
                f"asks for {job.devices} {job.device_type} device(s); this server has {have}"
            )
            continue
        limit = max_running.get(job.owner)
        if limit is not None and running.get(job.owner, 0) >= limit:
            plan.held[job.id] = f"{HELD}: its key runs {running.get(job.owner, 0)} jobs, its limit"
            continue
        available = free.get(job.device_type, [])
        if len(available) >= job.devices:
            plan.starts.append((job.id, available[: job.devices]))
            free[job.device_type] = available[job.devices :]
            running[job.owner] = running.get(job.owner, 0) + 1
        else:
            plan.blocked[job.device_type] = job.id
    return plan
