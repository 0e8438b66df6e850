"""A day of a synthetic team's jobs through the real scheduling code (plan_starts) in simulated time: FIFO
vs fair share vs fair share with backfill.

    python benchmarks/queue_sim.py [--seed 0] [--gpus 16] [--hours 24]

The team (a seeded generator): four projects of different sizes on one server of `--gpus` GPUs. vision
(4 keys) submits the most, with a burst of 30 jobs at 9:00,; nlp (2 keys) fewer but big gangs; speech
and research (1 key each) small jobs. Jobs ask for 1-8 GPUs and run minutes to hours; one in ten is
urgent (priority 5), the rest priority 0; half of them carry a max_time (their planned time: a promise,
they end before it). Arrivals are spread over `--hours` simulated hours; the run lasts until the last
job ends.

An event loop drives it: arrivals, ends, and the ends of preemptions. After each instant with events, one
scheduling pass: plan_starts() over the queue, the free GPUs and the running jobs, exactly as the
server's loop calls it; the jobs it starts run, those it preempts stop STOP_S later (checkpoint and
exit), lose the work since their last checkpoint (every CHECKPOINT_S of their run), and queue again with
their id (their place). As in the server, a job preempted MAX_PREEMPTIONS times is not preempted again.
Fair share reads each key's and project's device-time lately the way scheduler/usage.py does (a job's
device-seconds, halved every HALF_LIFE_S since it ended; a running job counts in full).

Policies: FIFO (priority, then first submitted: no project, no key, no fairness; no planned times),
fair share (projects and keys, usage, shares), fair share + backfill (the queued jobs' planned times and
the running jobs' ends given). Preemption is on in all three: it follows priority.

Reports per policy: GPU utilisation over the day and until the last job ended, GPU-hours lost to
preemption, preemptions, backfilled starts, when the last job ended, and per project the mean and p95 of
the time its jobs spent queued (all of its waits together, re-queued after a preemption included).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuforge.scheduler.queue import Fairness, QueuedJob, RunningJob, plan_starts  # noqa: E402

CHECKPOINT_S = 600.0  # a job checkpoints every 10 minutes of its run: preempted, it loses what came since
STOP_S = 30.0  # from the preemption to the devices being free (SIGTERM, exit)
MAX_PREEMPTIONS = 3  # then it is protected (the server's max_preemptions)
HALF_LIFE_S = 3600.0  # of fair share's usage, as scheduler/usage.py
HOUR = 3600.0


@dataclass(frozen=True)
class Team:
    name: str
    project: int
    keys: tuple[int, ...]
    jobs_per_day: int
    sizes: tuple[int, ...]  # drawn uniformly: repeats weigh
    minutes: tuple[float, float]  # log-uniform duration range
    share: float = 1.0


TEAMS = (
    Team("vision", 1, (11, 12, 13, 14), 60, (1, 1, 2, 2, 4, 8), (10, 180)),
    Team("nlp", 2, (21, 22), 12, (4, 8, 8), (30, 240)),
    Team("speech", 3, (31,), 40, (1, 1, 2), (5, 60)),
    Team("research", 4, (41,), 20, (1, 2), (10, 120), share=2.0),
)
BURST = ("vision", 9 * HOUR, 30)  # a project that queues many at once


@dataclass
class SimJob:
    id: int
    team: Team
    key: int
    arrival: float
    devices: int
    duration: float  # of work
    priority: int
    max_time: float | None  # the promise: duration <= max_time
    done: float = 0.0  # work saved by checkpoints (or finished)
    queued_since: float = 0.0
    waited: float = 0.0  # time spent queued, all of its waits together
    started: float | None = None  # of its current run
    device_ids: tuple[str, ...] = ()
    segment: int = 0  # bumps on every start: stale end events are ignored
    preemptions: int = 0
    stopping: bool = False
    end: float | None = None
    lost: float = 0.0  # device-seconds of work lost to preemption


def generate(seed: int, hours: float) -> list[SimJob]:
    rng = random.Random(seed)
    arrivals: list[tuple[float, Team]] = []
    for team in TEAMS:
        count = round(team.jobs_per_day * hours / 24)
        arrivals += [(rng.uniform(0, hours * HOUR), team) for _ in range(count)]
    name, at, count = BURST
    if at < hours * HOUR:
        team = next(t for t in TEAMS if t.name == name)
        arrivals += [(at + i, team) for i in range(count)]  # a second apart
    jobs = []
    for i, (arrival, team) in enumerate(sorted(arrivals, key=lambda a: a[0]), 1):
        low, high = team.minutes
        duration = 60 * math.exp(rng.uniform(math.log(low), math.log(high)))
        max_time = duration * rng.uniform(1.05, 1.5) if rng.random() < 0.5 else None
        jobs.append(
            SimJob(
                id=i,
                team=team,
                key=rng.choice(team.keys),
                arrival=arrival,
                devices=rng.choice(team.sizes),
                duration=duration,
                priority=5 if rng.random() < 0.1 else 0,
                max_time=max_time,
            )
        )
    return jobs


@dataclass
class Usage:
    """Device-time lately per key and project, the way scheduler/usage.py weighs it, kept incrementally:
    ended runs decay from their end; running ones count in full."""

    ended: dict[tuple[str, int], float] = field(default_factory=dict)
    at: float = 0.0

    def decay_to(self, now: float) -> None:
        factor = 0.5 ** ((now - self.at) / HALF_LIFE_S)
        self.ended = {k: v * factor for k, v in self.ended.items()}
        self.at = now

    def add_run(self, job: SimJob, seconds: float) -> None:
        for k in (("key", job.key), ("project", job.team.project)):
            self.ended[k] = self.ended.get(k, 0.0) + job.devices * seconds

    def fairness(self, now: float, running: list[SimJob]) -> Fairness:
        self.decay_to(now)
        keys = {who: v for (kind, who), v in self.ended.items() if kind == "key"}
        projects = {who: v for (kind, who), v in self.ended.items() if kind == "project"}
        for job in running:
            seconds = job.devices * (now - job.started)
            keys[job.key] = keys.get(job.key, 0.0) + seconds
            projects[job.team.project] = projects.get(job.team.project, 0.0) + seconds
        return Fairness(keys, projects, {t.project: t.share for t in TEAMS})


def simulate(jobs: list[SimJob], gpus: int, policy: str) -> dict:
    fair, backfill = policy != "fifo", policy == "fair+backfill"
    ids = [f"cuda:{i}" for i in range(gpus)]
    free = list(ids)
    by_id = {job.id: job for job in jobs}
    events: list[tuple[float, int, str, int, int]] = []  # (time, order, kind, job id, segment)
    order = 0
    for job in jobs:
        heapq.heappush(events, (job.arrival, order := order + 1, "arrive", job.id, 0))
    queued: dict[int, SimJob] = {}
    running: dict[int, SimJob] = {}
    usage = Usage()
    busy_in_day = busy = 0.0  # device-seconds held: within the day, in all
    day = max(j.arrival for j in jobs)
    preemptions = backfilled = passes = 0
    plan_s = 0.0

    def release(job: SimJob, now: float) -> None:
        nonlocal busy_in_day, busy
        busy_in_day += job.devices * max(0.0, min(now, day) - min(job.started, day))
        busy += job.devices * (now - job.started)
        usage.decay_to(now)
        usage.add_run(job, now - job.started)
        free.extend(job.device_ids)
        free.sort(key=lambda d: int(d.split(":")[1]))
        job.device_ids, job.started = (), None
        del running[job.id]

    now = 0.0
    while events:
        now = events[0][0]
        while events and events[0][0] == now:  # every event of this instant, then one pass
            _, _, kind, job_id, segment = heapq.heappop(events)
            job = by_id[job_id]
            if kind == "arrive":
                job.queued_since = now
                queued[job.id] = job
            elif kind == "end" and segment == job.segment and job.id in running:
                # it may end while stopping: then it is done, and its "stopped" finds it gone
                job.done, job.stopping = job.duration, False
                job.end = now
                release(job, now)
            elif kind == "stopped" and segment == job.segment and job.id in running:
                ran = now - STOP_S - job.started  # it worked until asked to stop
                saved = math.floor(ran / CHECKPOINT_S) * CHECKPOINT_S
                job.lost += job.devices * (ran - saved)
                job.done += saved
                job.stopping = False
                release(job, now)
                job.queued_since = now
                queued[job.id] = job
        if not queued:
            continue
        queue = [
            QueuedJob(
                j.id,
                j.priority,
                "cuda",
                j.devices,
                j.key if fair else None,
                j.team.project if fair else None,
                (j.max_time - j.done) if backfill and j.max_time is not None else None,
            )
            for j in queued.values()
        ]
        holders = [
            RunningJob(
                j.id,
                j.priority,
                "cuda",
                j.device_ids,
                j.team.project if fair else None,
                preemptible=j.preemptions < MAX_PREEMPTIONS,
                stopping=j.stopping,
                ends_in_s=(
                    max(0.0, j.max_time - j.done - (now - j.started))
                    if backfill and j.max_time is not None
                    else None
                ),
            )
            for j in running.values()
        ]
        fairness = usage.fairness(now, list(running.values())) if fair else None
        start = time.perf_counter()
        plan = plan_starts(queue, {"cuda": list(free)}, {"cuda": ids}, fairness=fairness, running=holders)
        plan_s += time.perf_counter() - start
        passes += 1
        for victim_id in plan.preempt:
            victim = running[victim_id]
            victim.stopping = True
            victim.preemptions += 1
            preemptions += 1
            heapq.heappush(events, (now + STOP_S, order := order + 1, "stopped", victim.id, victim.segment))
        backfilled += len(plan.backfilled)
        for job_id, device_ids in plan.starts:
            job = queued.pop(job_id)
            job.waited += now - job.queued_since
            job.device_ids, job.started = tuple(device_ids), now
            job.segment += 1
            running[job.id] = job
            taken = set(device_ids)
            free[:] = [d for d in free if d not in taken]
            end = now + job.duration - job.done
            heapq.heappush(events, (end, order := order + 1, "end", job.id, job.segment))
    assert not queued and not running and all(j.end is not None for j in jobs), "every job must end"
    waits: dict[str, list[float]] = {}
    for job in jobs:
        waits.setdefault(job.team.name, []).append(job.waited)
    return dict(
        utilisation=busy_in_day / (gpus * day),
        utilisation_all=busy / (gpus * max(j.end for j in jobs)),
        lost_gpu_h=sum(j.lost for j in jobs) / HOUR,
        preemptions=preemptions,
        backfilled=backfilled,
        last_end_h=max(j.end for j in jobs) / HOUR,
        waits=waits,
        passes=passes,
        plan_ms=1000 * plan_s / max(1, passes),
    )


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpus", type=int, default=16)
    parser.add_argument("--hours", type=float, default=24.0)
    args = parser.parse_args()
    began = time.perf_counter()
    jobs = generate(args.seed, args.hours)
    demand = sum(j.devices * j.duration for j in jobs) / HOUR
    capacity = args.gpus * args.hours
    print(
        f"seed {args.seed}: {len(jobs)} jobs over {args.hours:g} h on {args.gpus} GPUs; they ask for "
        f"{demand:.0f} GPU-hours, {demand / capacity:.0%} of the day's {capacity:.0f}"
    )
    for team in TEAMS:
        mine = [j for j in jobs if j.team is team]
        gpu_h = sum(j.devices * j.duration for j in mine) / HOUR
        print(f"  {team.name}: {len(mine)} jobs, {gpu_h:.0f} GPU-hours, share {team.share:g}")
    results = {}
    for policy in ("fifo", "fair", "fair+backfill"):
        results[policy] = simulate(generate(args.seed, args.hours), args.gpus, policy)
    names = [t.name for t in TEAMS]
    head = "| policy | GPU use: day / to the end | GPU-h lost | preemptions | backfilled | last end (h) | "
    head += " | ".join(f"{n} wait mean / p95 (min)" for n in names) + " |"
    print()
    print(head)
    print("|---" * (6 + len(names)) + "|")
    for policy, r in results.items():
        cells = [f"{statistics.mean(r['waits'][n]) / 60:.0f} / {p95(r['waits'][n]) / 60:.0f}" for n in names]
        print(
            f"| {policy} | {r['utilisation']:.1%} / {r['utilisation_all']:.1%} | {r['lost_gpu_h']:.1f} | "
            f"{r['preemptions']} | "
            f"{r['backfilled']} | {r['last_end_h']:.1f} | " + " | ".join(cells) + " |"
        )
    passes = sum(r["passes"] for r in results.values())
    plan_ms = max(r["plan_ms"] for r in results.values())
    print(
        f"\n{passes} scheduling passes in all (mean plan_starts() {plan_ms:.2f} ms at most); "
        f"{time.perf_counter() - began:.1f} s"
    )


if __name__ == "__main__":
    main()
