"""Scheduling passes: 1,000 queued jobs read from the store and planned; 10,000 planned with fair share,
preemption, backfill and placement on 64 devices.

    python benchmarks/scheduler.py [--jobs 1000] [--big-jobs 10000] [--devices 64] [--passes 50] [--db URL]

1. The store case (issue 5): `--jobs` jobs of mixed priorities (0-9), device types (3 in 4 ask for GPUs)
   and gang sizes (1, 2, 4 or 8 of 8 GPUs), in a migrated store (a temporary SQLite file unless --db names
   one). A pass is what the server does each time a job ends or arrives: select the queued jobs (the
   fields the plan needs, through the queue index), plan_starts() with 3 GPUs and the CPU slot free.
   Floor: one pass (store + plan, median) under 10 ms.
2. The sharing case (issue 15): plan_starts() alone over `--big-jobs` queued jobs and `--devices` GPUs,
   first plain (priority and gangs only, 8 GPUs free), then with each of the features the server adds:
   fair share (50 keys in 10 projects, with usage lately and unequal shares), preemption (the other 56
   held by running jobs, all preemptible, some of lower priority than the queue's head), backfill (queued
   jobs carry a planned time, running ones an end) and placement (a quarter of the devices labelled, one
   job in ten asks for them); then all of them together. Floor: all together, median, under 20 ms.
Prints the median and p99 of `--passes` passes and each one's ratio to the plain pass; exits 1 on FAIL.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sqlalchemy import select  # noqa: E402

from gpuforge.scheduler.queue import Fairness, Limits, QueuedJob, RunningJob, plan_starts  # noqa: E402
from gpuforge.store.db import connect, migrate, session  # noqa: E402
from gpuforge.store.models import Job  # noqa: E402

STORE_FLOOR_MS = 10.0  # issue 5: 1,000 jobs, store read + plan
SHARING_FLOOR_MS = 20.0  # issue 15: 10,000 jobs, 64 devices, every feature on, plan alone
FREE = {"cuda": ["cuda:1", "cuda:4", "cuda:6"], "cpu": ["cpu:0"]}
TOTAL = {"cuda": 8, "cpu": 1}
ONPREM = (("site", "onprem"),)


# --- 1. the store case ------------------------------------------------------------------------------------


def fill(engine, n: int) -> None:
    rng = random.Random(0)
    with session(engine) as s:
        for i in range(n):
            gpu = rng.random() < 0.75
            s.add(
                Job(
                    name=f"job-{i}",
                    priority=rng.randrange(10),
                    device_type="cuda" if gpu else "cpu",
                    devices_wanted=rng.choice([1, 1, 1, 2, 4, 8]) if gpu else 1,
                    spec_yaml="name: x\n",
                    run_dir=f"/tmp/runs/{i}",
                )
            )


def read_queue(engine) -> list[QueuedJob]:
    query = select(Job.id, Job.priority, Job.device_type, Job.devices_wanted).where(Job.state == "queued")
    with engine.connect() as conn:
        return [QueuedJob(*row) for row in conn.execute(query)]


# --- 2. the sharing case ----------------------------------------------------------------------------------


class Sharing:
    """One server's state for the sharing case, the same queue and devices for every pass, each feature
    switchable. 64 GPUs, the first quarter labelled site=onprem; 8 are free. Running jobs hold the rest,
    all preemptible, their ends known: low-priority (0-2) gangs on the on-premises ones, priority-9 gangs
    (as high as the queue's top but one) on the others. At the queue's head an urgent (10) 4-GPU job that
    must run on-premises (with placement): it preempts there, while the first priority-9 job that does not
    fit elsewhere preempts nobody, holds the rest back, and short jobs backfill in front of it."""

    def __init__(self, jobs: int, devices: int, seed: int = 0):
        rng = random.Random(seed)
        self.ids = [f"cuda:{i}" for i in range(devices)]
        onprem = devices // 4
        self.labels = {d: ONPREM for d in self.ids[:onprem]}
        self.keys = {key: key % 10 for key in range(50)}  # 50 keys in 10 projects
        self.fairness = Fairness(
            usage={key: rng.uniform(0, 36_000) for key in self.keys},
            project_usage={p: rng.uniform(0, 360_000) for p in range(10)},
            shares={p: rng.choice([0.5, 1.0, 1.0, 2.0, 4.0]) for p in range(10)},
        )
        self.running, at = [], 0
        while at < devices - 8:
            size = min(rng.choice([1, 2, 4]), (onprem if at < onprem else devices - 8) - at)
            self.running.append(
                RunningJob(
                    1_000_000 + at,
                    rng.randrange(3) if at < onprem else 9,
                    "cuda",
                    tuple(self.ids[at : at + size]),
                    project=rng.randrange(10),
                    ends_in_s=rng.uniform(600, 36_000),
                )
            )
            at += size
        self.free = {"cuda": self.ids[devices - 8 :]}
        self.queue = [
            dict(id=1, priority=10, devices=4, owner=0, project=0, planned_s=3600.0, placement=ONPREM)
        ]
        for i in range(2, jobs + 1):
            key = rng.randrange(50)
            self.queue.append(
                dict(
                    id=i,
                    priority=rng.choice([0] * 6 + [1, 2, 5, 9]),
                    devices=rng.choice([1, 1, 1, 2, 4, 8]),
                    owner=key,
                    project=self.keys[key],
                    planned_s=rng.choice([None, rng.uniform(60, 3_600), rng.uniform(3_600, 86_400)]),
                    placement=ONPREM if rng.random() < 0.1 else (),
                )
            )

    def inputs(self, fair=False, preempt=False, backfill=False, placement=False, limited=False):
        """(args, kwargs) of plan_starts() with the features asked for."""

        def job(spec: dict) -> QueuedJob:
            return QueuedJob(
                spec["id"],
                spec["priority"],
                "cuda",
                spec["devices"],
                spec["owner"] if fair else None,
                spec["project"] if fair else None,
                spec["planned_s"] if backfill else None,
                spec["placement"] if placement else (),
            )

        running = self.running if preempt or backfill else []
        if not preempt:  # backfill alone: the same ends, nobody preemptible
            running = [replace(r, preemptible=False) for r in running]
        if not backfill:  # preemption alone: no ends known
            running = [replace(r, ends_in_s=None) for r in running]
        args = ([job(spec) for spec in self.queue], self.free, {"cuda": self.ids})
        names = {p: f"project-{p}" for p in range(10)}
        limits = Limits(names=names)
        if limited:  # every key may run 4 jobs and runs 2; every project may hold 16 devices and holds 6
            keys = range(50) if fair else [None]
            limits = Limits(
                running={key: 2 for key in keys},
                max_running={key: 4 if fair else 64 for key in keys},
                project_devices={p: 6 for p in range(10)},
                max_devices={p: 16 for p in range(10)},
                names=names,
            )
        kwargs = dict(
            limits=limits,
            fairness=self.fairness if fair else None,
            running=running,
            labels=self.labels if placement else None,
        )
        return args, kwargs


def timed(fn, passes: int) -> tuple[float, float]:
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def store_case(args) -> bool:
    url = args.db or f"sqlite:///{Path(tempfile.mkdtemp()) / 'bench.db'}"
    engine = connect(url)
    migrate(engine)
    fill(engine, args.jobs)
    queue = read_queue(engine)
    assert len(queue) >= args.jobs
    plan = plan_starts(queue, FREE, TOTAL)
    print(f"## {len(queue)} queued jobs read from {engine.dialect.name}, 8 GPUs + 1 CPU slot")
    print(f"{len(plan.starts)} start, blocked {plan.blocked}")
    plan_ms = timed(lambda: plan_starts(queue, FREE, TOTAL), args.passes)
    pass_ms = timed(lambda: plan_starts(read_queue(engine), FREE, TOTAL), args.passes)
    for label, (median, p99) in (("plan alone", plan_ms), ("store read + plan", pass_ms)):
        print(f"{label:<20} median {median:7.3f} ms   p99 {p99:7.3f} ms")
    ok = pass_ms[0] < STORE_FLOOR_MS
    print(
        f"one scheduling pass (store + plan, median) {pass_ms[0]:.2f} ms   floor < {STORE_FLOOR_MS} ms   "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return ok


def sharing_case(args) -> bool:
    world = Sharing(args.big_jobs, args.devices)
    everything = dict(fair=True, preempt=True, backfill=True, placement=True)
    cases = [
        ("plain (priority, gangs)", {}),
        ("+ fair share", dict(fair=True)),
        ("+ preemption", dict(preempt=True)),
        ("+ backfill", dict(backfill=True)),
        ("+ placement", dict(placement=True)),
        ("+ limits (key and project caps)", dict(limited=True)),
        ("all together", everything),
        ("all together + limits", dict(everything, limited=True)),
    ]
    inputs = [world.inputs(**switches) for _, switches in cases]
    # interleaved: one pass of each case per round, so that a busy machine slows them alike
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(args.passes):
        for spent, (call_args, kwargs) in zip(times, inputs, strict=True):
            start = time.perf_counter()
            plan_starts(*call_args, **kwargs)
            spent.append(1000 * (time.perf_counter() - start))
    print(f"\n## {args.big_jobs} queued jobs, {args.devices} GPUs: plan_starts() alone, {args.passes} passes")
    print("| pass | starts | preempts | backfilled | blocked | held | median ms | p99 ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    medians = []
    for (label, _), (call_args, kwargs), spent in zip(cases, inputs, times, strict=True):
        plan = plan_starts(*call_args, **kwargs)
        spent.sort()
        median, p99 = statistics.median(spent), spent[min(len(spent) - 1, int(0.99 * len(spent)))]
        medians.append(median)
        print(
            f"| {label} | {len(plan.starts)} | {len(plan.preempt)} | {len(plan.backfilled)} | "
            f"{len(plan.blocked)} | {len(plan.held)} | {median:.2f} | {p99:.2f} | "
            f"{median / medians[0]:.2f}x |"
        )
    together = medians[-2]
    ok = together < SHARING_FLOOR_MS
    print(
        f"\none pass with fair share, preemption, backfill and placement (plan, median) {together:.2f} ms   "
        f"floor < {SHARING_FLOOR_MS} ms   {'PASS' if ok else 'FAIL'}"
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--big-jobs", type=int, default=10_000)
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--passes", type=int, default=50)
    parser.add_argument("--db", help="a store URL (default: a temporary SQLite file)")
    args = parser.parse_args()
    ok = store_case(args)
    ok = sharing_case(args) and ok
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
