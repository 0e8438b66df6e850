"""Which queued jobs start now, on which devices, and which running ones to preempt for them: one pure
function over plain values, so it is fast and easy to test (the loop reads the store into them).

Rules:
- Order: higher priority first (a job's own plus its boost: preempted too often, it gains). Within a
  priority, fair share: each project's queued jobs take turns (its 1st before anyone's 2nd), and within a
  turn the project that used the least device-time lately (decayed, over its share) goes first; inside a
  project its keys take turns the same way; then first submitted first (the job id). A key without a
  project is a project of its own. A project that queued 50 jobs delays another's single job by one.
- Gang: a job starts only when every device it asks for is free, all of its device type, all carrying
  the labels of its placement.
- No starvation: the first job that cannot start holds back the devices it could use (those of its type
  and placement): later jobs may not take them, so a stream of small jobs can never keep a large one
  waiting forever. Jobs that fit on other devices go on.
- Backfill: a later job may still take held-back devices when it is sure to end first: its planned time
  (max_time, else the plan's estimate) ends before the earliest moment the blocked job could start
  (when enough of the running jobs on its devices end, by their own planned ends). Unknown ends: none.
- Preemption: a blocked job that running jobs of lower priority stand in the way of preempts the fewest,
  lowest-priority of them that free enough devices with what is free (a job frees all its devices at
  once; if all of them together would not free enough, none is preempted); never a job marked not
  preemptible, nor one already stopping (its devices count as coming).
- Never: a job asking for more devices (of its type and placement) than exist is impossible, returned
  for the caller to fail with a clear reason instead of queueing it forever.
- Limits are not barriers: a job whose key runs its max_running jobs already, whose project holds its
  max_devices, or whose project's month budget is spent, holds no device and nobody back, keeps its
  place, and starts at its turn once the limit allows. It is returned as held, with why.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

HELD = "waiting"  # every reason the queue gives a waiting job starts so; cleared when it starts
Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs: hashable, cheap to compare


@dataclass(frozen=True)
class QueuedJob:
    id: int
    priority: int  # with its boost
    device_type: str  # "cpu" | "cuda"
    devices: int = 1
    owner: int | None = None  # the key that submitted it: its max_running applies
    project: int | None = None  # its project: max_devices, budget, share
    planned_s: float | None = None  # how long it should run (max_time, else the plan): for backfill
    placement: Labels = ()  # labels each of its devices must carry


@dataclass(frozen=True)
class RunningJob:
    id: int
    priority: int  # with its boost
    device_type: str
    device_ids: tuple[str, ...]
    project: int | None = None
    preemptible: bool = True
    stopping: bool = False  # asked to stop already (preempted, paused, cancelled): its devices are coming
    ends_in_s: float | None = None  # from now, by its planned time; None: unknown


@dataclass(frozen=True)
class Limits:
    """What holds a job back without it holding anything: per key and per project."""

    running: Mapping[int | None, int] = field(default_factory=dict)  # key -> its jobs running
    max_running: Mapping[int | None, int] = field(default_factory=dict)  # key -> its limit (absent: none)
    project_devices: Mapping[int | None, int] = field(default_factory=dict)  # project -> devices it holds
    max_devices: Mapping[int | None, int] = field(default_factory=dict)  # project -> its cap (absent: none)
    spent: Mapping[int | None, str] = field(default_factory=dict)  # project -> why its budget stops it
    names: Mapping[int | None, str] = field(default_factory=dict)  # project -> its name, for reasons


@dataclass(frozen=True)
class Fairness:
    usage: Mapping[int | None, float] = field(default_factory=dict)  # key -> device-seconds lately
    project_usage: Mapping[int | None, float] = field(default_factory=dict)  # project -> the same
    shares: Mapping[int | None, float] = field(default_factory=dict)  # project -> its weight (absent: 1)


@dataclass
class Plan:
    starts: list[tuple[int, list[str]]] = field(default_factory=list)  # (job id, device ids)
    preempt: dict[int, int] = field(default_factory=dict)  # running job id -> the job it makes room for
    blocked: dict[int, str] = field(default_factory=dict)  # job id -> why it waits for devices
    impossible: dict[int, str] = field(default_factory=dict)  # job id -> why it can never start
    held: dict[int, str] = field(default_factory=dict)  # job id -> the limit that keeps it queued for now
    order: list[int] = field(default_factory=list)  # every queued job id, first to start first
    backfilled: list[int] = field(default_factory=list)  # of starts: those that went ahead of a blocked job


def queue_order(jobs: Iterable[QueuedJob], fairness: Fairness | None = None) -> list[QueuedJob]:
    """The order jobs start in (see the module's rules)."""
    fair = fairness or Fairness()
    usage, project_usage, shares = fair.usage, fair.project_usage, fair.shares
    project_turns: dict[tuple[int, object], int] = {}
    key_turns: dict[tuple[int, object], int] = {}
    ranked = []
    for job in sorted(jobs, key=lambda j: (-j.priority, j.id)):
        # a key with no project is a project of its own (its usage is the project's)
        group = ("p", job.project) if job.project is not None else ("k", job.owner)
        share = shares.get(job.project, 1.0) if job.project is not None else 1.0
        used = project_usage.get(job.project, 0.0) if job.project is not None else usage.get(job.owner, 0.0)
        turn = project_turns.get((job.priority, group), 0)
        project_turns[(job.priority, group)] = turn + 1
        key_turn = key_turns.get((job.priority, job.owner), 0)
        key_turns[(job.priority, job.owner)] = key_turn + 1
        rank = (-job.priority, turn / share, used / share, key_turn, usage.get(job.owner, 0.0), job.id)
        ranked.append((rank, job))
    ranked.sort(key=lambda r: r[0])
    return [job for _, job in ranked]


def _fits(labels: Mapping[str, Labels], device_id: str, placement: Labels) -> bool:
    if not placement:
        return True
    have = labels.get(device_id, ())
    return all(pair in have for pair in placement)


class _Devices:
    """The devices of a pass: free ones by type (in hand-out order), held back ones, and who runs where."""

    def __init__(self, free, total, labels, running):
        self.free = {kind: list(ids) for kind, ids in free.items()}
        self.total, self.labels = total, labels
        self.all_ids = {kind: ids for kind, ids in total.items()}  # type -> every device id of it
        self.reserved: set[str] = set()  # held back for a blocked job
        self.shadow: dict[str, float] = {}  # reserved device -> when its blocked job could start
        self.running = running

    def matching(self, kind: str, placement: Labels) -> list[str]:
        return [d for d in self.all_ids.get(kind, ()) if _fits(self.labels, d, placement)]

    def free_for(self, job: QueuedJob) -> list[str]:
        return [d for d in self.free.get(job.device_type, ()) if _fits(self.labels, d, job.placement)]

    def take(self, kind: str, ids: list[str]) -> None:
        taken = set(ids)
        self.free[kind] = [d for d in self.free.get(kind, ()) if d not in taken]


def plan_starts(
    jobs: Iterable[QueuedJob],
    free: dict[str, list[str]],
    devices: dict[str, list[str]] | dict[str, int],
    limits: Limits | None = None,
    fairness: Fairness | None = None,
    running: Iterable[RunningJob] = (),
    labels: Mapping[str, Labels] | None = None,
) -> Plan:
    """`free`: device type -> free device ids (in the order to hand them out); `devices`: device type ->
    every device id of that type (or just how many, for a server without labels: ids are then only
    counted); `running`: the jobs holding devices now, for preemption and backfill; `labels`: device id
    -> its labels (absent: none)."""
    plan = Plan()
    limits, labels = limits or Limits(), labels or {}
    every = {
        kind: (list(ids) if not isinstance(ids, int) else [f"{kind}:{i}" for i in range(ids)])
        for kind, ids in devices.items()
    }
    pool = _Devices(free, every, labels, list(running))
    running_count = dict(limits.running)
    project_devices = dict(limits.project_devices)
    holders = {d: r for r in pool.running for d in r.device_ids}
    groups: dict[tuple[str, Labels], list[str]] = {}  # (type, placement) -> the devices that match
    closed: set[tuple[str, Labels]] = set()  # groups whose every device is held back for a blocked job
    for job in queue_order(jobs, fairness):
        plan.order.append(job.id)
        group = (job.device_type, job.placement)
        candidates = groups.get(group)
        if candidates is None:
            candidates = groups[group] = pool.matching(job.device_type, job.placement)
        if job.devices > len(candidates):
            plan.impossible[job.id] = _impossible(job, len(every.get(job.device_type, ())), len(candidates))
            continue
        if (why := _held(job, limits, running_count, project_devices)) is not None:
            plan.held[job.id] = why
            continue
        if group in closed and job.planned_s is None:
            continue  # waits its turn behind the blocked job (only a job sure to end first may pass)
        free_here = pool.free_for(job)
        usable = [d for d in free_here if d not in pool.reserved]
        if len(usable) >= job.devices:
            chosen = usable[: job.devices]
        else:
            backfill = [d for d in free_here if d in pool.reserved and _ends_first(job, pool.shadow[d])]
            chosen = (
                (usable + backfill)[: job.devices] if len(usable) + len(backfill) >= job.devices else None
            )
            if chosen is not None:
                plan.backfilled.append(job.id)
        if chosen is not None:
            plan.starts.append((job.id, chosen))
            pool.take(job.device_type, chosen)
            running_count[job.owner] = running_count.get(job.owner, 0) + 1
            project_devices[job.project] = project_devices.get(job.project, 0) + job.devices
            continue
        if group in closed or not set(candidates) - pool.reserved:
            closed.add(group)
            continue  # every device it could use is held for an earlier job: it waits its turn
        # the first job that cannot start here: hold its devices back, and preempt for it if it may
        victims = _victims(job, candidates, usable, holders)
        for victim in victims:
            plan.preempt[victim.id] = job.id
        plan.blocked[job.id] = _waiting_reason(job, candidates, usable, holders, victims, limits.names)
        shadow = _earliest_start(job, candidates, usable, holders, {v.id for v in victims})
        for d in candidates:
            if d not in pool.reserved:
                pool.reserved.add(d)
                pool.shadow[d] = shadow
        closed.add(group)
    return plan


def _impossible(job: QueuedJob, of_type: int, matching: int) -> str:
    if not job.placement:
        return f"asks for {job.devices} {job.device_type} device(s); this server has {of_type}"
    wanted = ", ".join(f"{k}={v}" for k, v in job.placement)
    return (
        f"asks for {job.devices} {job.device_type} device(s) labelled {wanted}; this server has {matching} "
        f"such (of {of_type} {job.device_type})"
    )


def _held(job: QueuedJob, limits: Limits, running: dict, project_devices: dict) -> str | None:
    if (spent := limits.spent.get(job.project)) is not None and job.project is not None:
        return f"{HELD}: {spent}"
    limit = limits.max_running.get(job.owner)
    if limit is not None and running.get(job.owner, 0) >= limit:
        return f"{HELD} for quota max_running: its key runs {running.get(job.owner, 0)} jobs, its limit"
    cap = limits.max_devices.get(job.project)
    held = project_devices.get(job.project, 0)
    if cap is not None and job.project is not None and held + job.devices > cap:
        name = limits.names.get(job.project, job.project)
        return (
            f"{HELD} for project {name}'s max_devices {cap}: it holds {held}, this job asks for {job.devices}"
        )
    return None


def _ends_first(job: QueuedJob, shadow: float) -> bool:
    return job.planned_s is not None and job.planned_s <= shadow


def _victims(
    job: QueuedJob, candidates: list[str], free_now: list[str], holders: Mapping[str, RunningJob]
) -> list[RunningJob]:
    """The fewest, lowest-priority running jobs to preempt so that `job` fits; [] when it cannot."""
    coming = {r.id: r for d in candidates if (r := holders.get(d)) is not None and r.stopping}
    have = len(free_now) + sum(sum(1 for d in r.device_ids if d in candidates) for r in coming.values())
    needed = job.devices - have
    if needed <= 0:
        return []  # enough is free or being freed already: wait for it
    seen: dict[int, RunningJob] = {}
    for d in candidates:
        r = holders.get(d)
        if r is not None and not r.stopping and r.preemptible and r.priority < job.priority:
            seen[r.id] = r
    # lowest priority first; among equals the one that frees most (fewest jobs), then the newest
    pool = sorted(seen.values(), key=lambda r: (r.priority, -_freed(r, candidates), -r.id))
    chosen, freed = [], 0
    for r in pool:
        if freed >= needed:
            break
        chosen.append(r)
        freed += _freed(r, candidates)
    if freed < needed:
        return []  # all of them would not free enough: preempting any would lose work for nothing
    for r in sorted(chosen, key=lambda r: (-r.priority, _freed(r, candidates))):  # drop the needless
        if freed - _freed(r, candidates) >= needed:
            chosen.remove(r)
            freed -= _freed(r, candidates)
    return chosen


def _freed(r: RunningJob, candidates: list[str]) -> int:
    return sum(1 for d in r.device_ids if d in candidates)


def _earliest_start(
    job: QueuedJob,
    candidates: list[str],
    free_now: list[str],
    holders: Mapping[str, RunningJob],
    victims: set[int],
) -> float:
    """Seconds from now until enough of `job`'s devices are free, by the running jobs' planned ends
    (preempted and stopping ones: now); infinity when an end it needs is unknown."""
    have = len(free_now)
    if have >= job.devices:
        return 0.0
    ends: dict[int, tuple[float, int]] = {}
    for d in candidates:
        r = holders.get(d)
        if r is None:
            continue
        end = (
            0.0 if (r.stopping or r.id in victims) else (r.ends_in_s if r.ends_in_s is not None else math.inf)
        )
        ends[r.id] = (end, ends.get(r.id, (end, 0))[1] + 1)
    for end, count in sorted(ends.values()):
        have += count
        if have >= job.devices:
            return end
    return math.inf


def _waiting_reason(
    job: QueuedJob,
    candidates: list[str],
    free_now: list[str],
    holders: Mapping[str, RunningJob],
    victims: list[RunningJob],
    names: Mapping[int | None, str],
) -> str:
    """Why a blocked job waits, naming who holds its devices: "waiting for 2 cuda devices (1 free); 1
    held by job 17 of project vision, not preemptible"."""
    where = "".join(f" {k}={v}" for k, v in job.placement)
    head = f"{HELD} for {job.devices} {job.device_type}{where} device(s) ({len(free_now)} free)"
    if victims:
        return head + "; preempting job(s) " + ", ".join(str(v.id) for v in victims)
    parts: dict[int, str] = {}
    for d in candidates:
        r = holders.get(d)
        if r is None or r.id in parts:
            continue
        of = f" of project {names.get(r.project, r.project)}" if r.project is not None else ""
        if r.stopping:
            note = "stopping"
        elif not r.preemptible:
            note = "not preemptible"
        elif r.priority >= job.priority:
            note = f"priority {r.priority}"
        else:
            note = "preemptible"
        held = sum(1 for x in r.device_ids if x in candidates)
        parts[r.id] = f"{held} held by job {r.id}{of}, {note}"
    shown = list(parts.values())[:3]
    more = f"; and {len(parts) - 3} more" if len(parts) > 3 else ""
    return head + ("; " + "; ".join(shown) if shown else "") + more
