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
- Fractions (resources.devices 0.5): a fraction of one device goes to the shared device it fills most
  (best fit), else opens the last whole free one (scheduler/sharing.py), never one held back for a blocked
  job. A whole-device job counts a shared device as held, by all the fractions on it: preempting for it
  frees such a device only when every fraction on it goes. A fraction that finds no room waits in order
  (later fractions of its kind wait behind it), preempts nobody and holds no whole device back. Quotas and
  fair share count a fraction as that much of a device.
- Never: a job asking for more devices (of its type and placement) than exist is impossible, returned
  for the caller to fail with a clear reason instead of queueing it forever.
- Limits are not barriers: a job whose key runs its max_running jobs already, whose project holds its
  max_devices, or whose project's month budget is spent, holds no device and nobody back, keeps its
  place, and starts at its turn once the limit allows. It is returned as held, with why.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter

from gpuforge.scheduler.sharing import best_fit, room

HELD = "waiting"  # every reason the queue gives a waiting job starts so; cleared when it starts
Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs: hashable, cheap to compare
# keys for sorts and groupings, in C: a pass orders up to 10,000 jobs
_ID, _GROUPING, _USED = attrgetter("id"), attrgetter("priority", "project", "owner"), itemgetter(1)


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
    share: float | None = None  # a fraction of one device (devices is 1); None: whole devices

    @property
    def amount(self) -> float:
        """How much of a device it counts as: quotas and the reasons."""
        return self.share if self.share is not None else float(self.devices)


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
    share: float | None = None  # a fraction of its one device; None: whole


@dataclass(frozen=True)
class Limits:
    """What holds a job back without it holding anything: per key and per project."""

    running: Mapping[int | None, int] = field(default_factory=dict)  # key -> its jobs running
    max_running: Mapping[int | None, int] = field(default_factory=dict)  # key -> its limit (absent: none)
    project_devices: Mapping[int | None, float] = field(default_factory=dict)  # project -> devices it holds
    max_devices: Mapping[int | None, int] = field(default_factory=dict)  # project -> its cap (absent: none)
    spent: Mapping[int | None, str] = field(default_factory=dict)  # project -> why its budget stops it
    names: Mapping[int | None, str] = field(default_factory=dict)  # project -> its name, for reasons
    replicas: Mapping[str, str] = field(default_factory=dict)  # device -> the replica holding it, for reasons


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


# what holds a device a replica holds: preempting for a job never frees it, and its end is unknown
_REPLICA = RunningJob(id=-1, priority=2**31, device_type="", device_ids=(), preemptible=False)


def queue_order(jobs: Iterable[QueuedJob], fairness: Fairness | None = None) -> list[QueuedJob]:
    """The order jobs start in (see the module's rules)."""
    fair = fairness or Fairness()
    usage, project_usage, shares = fair.usage, fair.project_usage, fair.shares
    # every key's jobs at each priority, first submitted first
    runs: defaultdict[tuple, list[QueuedJob]] = defaultdict(list)
    ordered_by_id = sorted(jobs, key=_ID)
    for key, job in zip(map(_GROUPING, ordered_by_id), ordered_by_id, strict=True):
        runs[key].append(job)
    # priority -> project (or ("key", id) for a key without one: a project of its own) -> its keys' runs
    levels: dict[int, dict[object, list[tuple[list[QueuedJob], float, float]]]] = {}
    for (priority, project, owner), run in runs.items():
        group = project if project is not None else ("key", owner)
        levels.setdefault(priority, {}).setdefault(group, []).append((run, usage.get(owner, 0.0), 1.0))
    ordered: list[QueuedJob] = []
    for priority in sorted(levels, reverse=True):
        projects = []
        for group, key_runs in levels[priority].items():
            if isinstance(group, tuple):
                share, used = 1.0, usage.get(group[1], 0.0)
            else:
                share, used = max(shares.get(group, 1.0), 1e-9), project_usage.get(group, 0.0)
            projects.append((_take_turns(key_runs), used / share, share))  # inside it, its keys take turns
        ordered.extend(_take_turns(projects))
    return ordered


def _take_turns(runs: list[tuple[list[QueuedJob], float, float]]) -> list[QueuedJob]:
    """Merge (jobs, used, share) runs that take turns: a run's n-th job takes turn n / share; within a turn
    the run with the least `used` first, then the first submitted. Two stable sorts on plain keys at most,
    not one on tuples: at 10,000 jobs a pass takes a third of the time."""
    if len(runs) == 1:
        return runs[0][0]
    runs = sorted(runs, key=_USED)
    merged: list[QueuedJob] = []
    turns: list[float] = []
    for _, tied in itertools.groupby(runs, key=_USED):
        tied = list(tied)
        part = list(itertools.chain.from_iterable(run for run, _, _ in tied))
        part_turns = list(
            itertools.chain.from_iterable(map(share.__rtruediv__, range(len(run))) for run, _, share in tied)
        )
        if len(tied) > 1:  # equally used: at one turn, the first submitted first
            ids = list(map(_ID, part))
            at = sorted(range(len(part)), key=ids.__getitem__)
            part, part_turns = list(map(part.__getitem__, at)), list(map(part_turns.__getitem__, at))
        merged.extend(part)
        turns.extend(part_turns)
    at = sorted(range(len(merged)), key=turns.__getitem__)  # stable: keeps the order within a turn
    return list(map(merged.__getitem__, at))


def _fits(labels: Mapping[str, Labels], device_id: str, placement: Labels) -> bool:
    if not placement:
        return True
    have = labels.get(device_id, ())
    return all(pair in have for pair in placement)


class _Group:
    """The devices a (type, placement) could use, whether every one is held back for a blocked job, and
    what of them is free: cached until a start or a hold changes it (thousands of queued jobs ask, a few
    change it)."""

    __slots__ = ("kind", "placement", "candidates", "closed", "version", "free", "usable", "latest")

    def __init__(self, kind: str, placement: Labels, candidates: list[str]):
        self.kind, self.placement, self.candidates = kind, placement, candidates
        self.closed = False
        self.version = -1
        self.free: list[str] = []  # free ones
        self.usable: list[str] = []  # free ones no blocked job holds back
        self.latest = -math.inf  # the latest finite start of a blocked job holding back a free one


class _Devices:
    """The devices of a pass: free ones by type (in hand-out order) and the ones held back for blocked
    jobs."""

    def __init__(
        self, free: Mapping[str, list[str]], every: dict[str, list[str]], labels, shared: Mapping[str, float]
    ):
        self.free = {kind: list(ids) for kind, ids in free.items()}
        self.every, self.labels = every, labels
        self.shared = dict(shared)  # device -> the fraction of it fractions hold (not in `free`)
        self.reserved: set[str] = set()  # held back for a blocked job
        self.shadow: dict[str, float] = {}  # reserved device -> when its blocked job could start
        self.version = 0  # of `free` and `reserved`: a group's cache is good while it has the same

    def group(self, kind: str, placement: Labels) -> _Group:
        return _Group(
            kind, placement, [d for d in self.every.get(kind, ()) if _fits(self.labels, d, placement)]
        )

    def refresh(self, group: _Group) -> None:
        if group.version == self.version:
            return
        group.free = [d for d in self.free.get(group.kind, ()) if _fits(self.labels, d, group.placement)]
        group.usable = [d for d in group.free if d not in self.reserved]
        shadows = [self.shadow[d] for d in group.free if d in self.reserved]
        group.latest = max((s for s in shadows if math.isfinite(s)), default=-math.inf)
        group.version = self.version

    def take(self, kind: str, ids: list[str]) -> None:
        taken = set(ids)
        self.free[kind] = [d for d in self.free.get(kind, ()) if d not in taken]
        self.version += 1

    def take_share(self, kind: str, device: str, share: float) -> None:
        if device not in self.shared:
            self.take(kind, [device])  # a whole free one opened for fractions
        self.shared[device] = self.shared.get(device, 0.0) + share
        self.version += 1

    def reserve(self, ids: list[str], shadow: float) -> None:
        for d in ids:
            self.reserved.add(d)
            self.shadow[d] = shadow
        self.version += 1


def plan_starts(
    jobs: Iterable[QueuedJob],
    free: dict[str, list[str]],
    devices: dict[str, list[str]] | dict[str, int],
    limits: Limits | None = None,
    fairness: Fairness | None = None,
    running: Iterable[RunningJob] = (),
    labels: Mapping[str, Labels] | None = None,
    shared: Mapping[str, float] | None = None,
) -> Plan:
    """`free`: device type -> free device ids (in the order to hand them out); `devices`: device type ->
    every device id of that type (or just how many, for a server without labels: ids are then only
    counted); `running`: the jobs holding devices now, for preemption and backfill; `labels`: device id
    -> its labels (absent: none); `shared`: device id -> the fraction of it that fractions (jobs and
    replicas) hold, for a device neither free nor held whole."""
    plan = Plan()
    limits, labels = limits or Limits(), labels or {}
    every = {
        kind: (list(ids) if not isinstance(ids, int) else [f"{kind}:{i}" for i in range(ids)])
        for kind, ids in devices.items()
    }
    pool = _Devices(free, every, labels, shared or {})
    running_count = dict(limits.running)
    project_devices = dict(limits.project_devices)
    limited = bool(limits.spent or limits.max_running or limits.max_devices)  # else nothing is ever held
    holders: dict[str, list[RunningJob]] = defaultdict(list)
    for r in running:
        for d in r.device_ids:
            holders[d].append(r)
    for d in limits.replicas:  # a replica (whole, or a fraction beside jobs') is never preempted
        holders[d].append(_REPLICA)
    groups: dict[tuple[str, Labels], _Group] = {}
    fractions_wait: set[tuple[str, Labels]] = set()  # a fraction found no room: later ones wait behind it
    ordered = queue_order(jobs, fairness)
    plan.order = [job.id for job in ordered]
    for job in ordered:
        group = groups.get((job.device_type, job.placement))
        if group is None:
            group = groups[(job.device_type, job.placement)] = pool.group(job.device_type, job.placement)
        candidates = group.candidates
        if job.devices > len(candidates):
            plan.impossible[job.id] = _impossible(job, len(every.get(job.device_type, ())), len(candidates))
            continue
        if limited and (why := _held(job, limits, running_count, project_devices)) is not None:
            plan.held[job.id] = why
            continue
        if job.share is not None:
            _place_share(job, group, pool, fractions_wait, plan, limits)
            if plan.starts and plan.starts[-1][0] == job.id:
                running_count[job.owner] = running_count.get(job.owner, 0) + 1
                project_devices[job.project] = project_devices.get(job.project, 0) + job.share
            continue
        if group.closed:  # it waits its turn behind the blocked job, unless it is sure to end first
            if job.planned_s is None:
                continue
            pool.refresh(group)
            if len(group.free) < job.devices or not _ends_first(job, group.latest):
                continue
        pool.refresh(group)
        free_here, usable = group.free, group.usable
        chosen = None
        if len(usable) >= job.devices:
            chosen = usable[: job.devices]
        elif len(free_here) >= job.devices and _ends_first(job, group.latest):
            backfill = [d for d in free_here if d in pool.reserved and _ends_first(job, pool.shadow[d])]
            if len(usable) + len(backfill) >= job.devices:
                chosen = (usable + backfill)[: job.devices]
                plan.backfilled.append(job.id)
        if chosen is not None:
            plan.starts.append((job.id, chosen))
            pool.take(job.device_type, chosen)
            running_count[job.owner] = running_count.get(job.owner, 0) + 1
            project_devices[job.project] = project_devices.get(job.project, 0) + job.devices
            continue
        if group.closed or not set(candidates) - pool.reserved:
            group.closed = True
            continue  # every device it could use is held for an earlier job: it waits its turn
        # the first job that cannot start here: hold its devices back, and preempt for it if it may. Only
        # devices no earlier blocked job holds back count: those go to that job first
        open_ = [d for d in candidates if d not in pool.reserved]
        victims = _victims(job, open_, usable, holders, set(plan.preempt))
        for victim in victims:
            plan.preempt[victim.id] = job.id
        plan.blocked[job.id] = _waiting_reason(job, candidates, usable, holders, victims, limits)
        pool.reserve(open_, _earliest_start(job, open_, usable, holders, set(plan.preempt)))
        group.closed = True
    return plan


def _place_share(
    job: QueuedJob,
    group: _Group,
    pool: _Devices,
    waiting: set[tuple[str, Labels]],
    plan: Plan,
    limits: Limits,
) -> None:
    """Start a fraction on the device best fit picks (none held back for a blocked job), or say why it
    waits; a fraction that waits makes the later ones of its kind and placement wait behind it."""
    where = (job.device_type, job.placement)
    head = f"{HELD} for {job.share:g} of a {job.device_type} device"
    if where in waiting:
        plan.blocked[job.id] = f"{head}: behind an earlier fraction that waits for room"
        return
    free = set(pool.free.get(job.device_type, ()))
    open_ = [d for d in group.candidates if d not in pool.reserved and (d in pool.shared or d in free)]
    chosen = best_fit(open_, pool.shared, job.share)
    if chosen is not None:
        plan.starts.append((job.id, [chosen]))
        pool.take_share(job.device_type, chosen, job.share)
        return
    waiting.add(where)
    said = [
        f"{d} held back for an earlier job"
        if d in pool.reserved
        else f"{d} has {room(pool.shared, d):g} left"
        for d in group.candidates
        if d in pool.shared or d in pool.reserved
    ][:3]
    said += [f"{d} held by {limits.replicas[d]}" for d in group.candidates if d in limits.replicas][:2]
    plan.blocked[job.id] = f"{head}: none has room" + (f" ({'; '.join(said)})" if said else "")


def _impossible(job: QueuedJob, of_type: int, matching: int) -> str:
    if job.share is not None:
        return f"asks for {job.share:g} of a {job.device_type} device; this server has none of that kind"
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
    if cap is not None and job.project is not None and held + job.amount > cap + 1e-6:
        name = limits.names.get(job.project, job.project)
        return (
            f"{HELD} for project {name}'s max_devices {cap}: it holds {held:g}, this job asks for "
            f"{job.amount:g}"
        )
    return None


def _ends_first(job: QueuedJob, shadow: float) -> bool:
    # an unknown start (infinity) is no licence: the blocked job's devices may free any moment
    return job.planned_s is not None and math.isfinite(shadow) and job.planned_s <= shadow


def _victims(
    job: QueuedJob,
    candidates: list[str],
    free_now: list[str],
    holders: Mapping[str, list[RunningJob]],
    preempted: set[int],
) -> list[RunningJob]:
    """The fewest, lowest-priority running jobs to preempt so that `job` fits; [] when it cannot. Those
    stopping, or preempted in this pass for an earlier job, free their devices already. A device that
    fractions share is freed by all of them going: they are one block, as low as the highest of them."""
    coming = {r.id for d in candidates for r in holders.get(d, ()) if r.stopping or r.id in preempted}
    freed_already = sum(1 for d in candidates if holders.get(d) and all(r.id in coming for r in holders[d]))
    needed = job.devices - len(free_now) - freed_already
    if needed <= 0:
        return []  # enough is free or being freed already: wait for it
    # blocks: the jobs that must all go to free some devices (one whole job; or every fraction on one device)
    blocks: dict[tuple[int, ...], int] = {}
    for d in candidates:
        on_it = [r for r in holders.get(d, ()) if r.id not in coming]
        if not on_it or not all(r.preemptible and r.priority < job.priority for r in on_it):
            continue
        ids = tuple(sorted(r.id for r in on_it))
        blocks[ids] = blocks.get(ids, 0) + 1
    by_id = {r.id: r for d in candidates for r in holders.get(d, ())}

    def rank(block: tuple[int, ...]) -> tuple:
        top = max(by_id[i].priority for i in block)
        return top, len(block), -blocks[block], -max(block)  # lowest first; then fewest jobs, most freed

    chosen, freed = [], 0
    for block in sorted(blocks, key=rank):
        if freed >= needed:
            break
        chosen.append(block)
        freed += blocks[block]
    if freed < needed:
        return []  # all of them would not free enough: preempting any would lose work for nothing
    for block in sorted(chosen, key=rank, reverse=True):  # drop the needless
        if freed - blocks[block] >= needed:
            chosen.remove(block)
            freed -= blocks[block]
    return [by_id[i] for block in chosen for i in sorted(block, reverse=True)]


def _earliest_start(
    job: QueuedJob,
    candidates: list[str],
    free_now: list[str],
    holders: Mapping[str, list[RunningJob]],
    victims: set[int],
) -> float:
    """Seconds from now until enough of `job`'s devices are free, by the running jobs' planned ends
    (preempted and stopping ones: now; a shared device: when the last fraction on it ends); infinity when
    an end it needs is unknown."""
    have = len(free_now)
    if have >= job.devices:
        return 0.0
    ends = []
    for d in candidates:
        on_it = holders.get(d, ())
        if not on_it:
            continue
        ends.append(max(_end(r, victims) for r in on_it))
    for end in sorted(ends):
        have += 1
        if have >= job.devices:
            return end
    return math.inf


def _end(r: RunningJob, victims: set[int]) -> float:
    if r.stopping or r.id in victims:
        return 0.0
    return r.ends_in_s if r.ends_in_s is not None else math.inf


def _waiting_reason(
    job: QueuedJob,
    candidates: list[str],
    free_now: list[str],
    holders: Mapping[str, list[RunningJob]],
    victims: list[RunningJob],
    limits: Limits,
) -> str:
    """Why a blocked job waits, naming who holds its devices: "waiting for 2 cuda devices (1 free); 1
    held by job 17 of project vision, not preemptible; cuda:1 held by replica 0 (v2) of deployment
    topics (gpuforge undeploy topics frees it)"."""
    names = limits.names
    where = "".join(f" {k}={v}" for k, v in job.placement)
    head = f"{HELD} for {job.devices} {job.device_type}{where} device(s) ({len(free_now)} free)"
    if victims:
        return head + "; preempting job(s) " + ", ".join(str(v.id) for v in victims)
    parts: dict[int | str, str] = {}  # job id or deployment name -> what it holds
    for r in (r for d in candidates for r in holders.get(d, ())):
        if r.id in parts or r is _REPLICA:
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
        held = (
            f"{r.share:g} of {r.device_ids[0]}"
            if r.share is not None
            else sum(1 for x in r.device_ids if x in candidates)
        )
        parts[r.id] = f"{held} held by job {r.id}{of}, {note}"
    by_replicas: dict[str, list[str]] = {}  # deployment -> what its replicas hold here
    for d in candidates:
        if d in limits.replicas:
            replica, name = limits.replicas[d].rsplit(" of deployment ", 1)
            by_replicas.setdefault(name, []).append(f"{d} held by {replica} of deployment {name}")
    for name, held in by_replicas.items():
        parts[name] = "; ".join(held) + f" (`gpuforge undeploy {name}` frees it)"
    shown = list(parts.values())[:3]
    more = f"; and {len(parts) - 3} more" if len(parts) > 3 else ""
    return head + ("; " + "; ".join(shown) if shown else "") + more
