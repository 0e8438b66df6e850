"""One scheduling pass over 1,000 queued jobs: reading the queue from the store, then planning.

    python benchmarks/scheduler.py [--jobs 1000] [--passes 50] [--db sqlite:///...]

The queue: `--jobs` jobs of mixed priorities (0-9), device types (3 in 4 ask for GPUs) and gang sizes
(1, 2, 4 or 8 of 8 GPUs), in a migrated store (a temporary SQLite file unless --db names one). A pass
is what the server does each time a job ends or arrives: select the queued jobs (the fields the plan
needs, through the queue index), plan_starts() with 3 GPUs and the CPU slot free. Median and p99 of
`--passes` passes, plan alone and store + plan. Floor (issue 5): one pass under 10 ms.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sqlalchemy import select  # noqa: E402

from gpuforge.scheduler.queue import QueuedJob, plan_starts  # noqa: E402
from gpuforge.store.db import connect, migrate, session  # noqa: E402
from gpuforge.store.models import Job  # noqa: E402

FLOOR_MS = 10.0
FREE = {"cuda": ["cuda:1", "cuda:4", "cuda:6"], "cpu": ["cpu:0"]}
TOTAL = {"cuda": 8, "cpu": 1}


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


def timed(fn, passes: int) -> tuple[float, float]:
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--passes", type=int, default=50)
    parser.add_argument("--db", help="a store URL (default: a temporary SQLite file)")
    args = parser.parse_args()
    url = args.db or f"sqlite:///{Path(tempfile.mkdtemp()) / 'bench.db'}"
    engine = connect(url)
    migrate(engine)
    fill(engine, args.jobs)
    queue = read_queue(engine)
    assert len(queue) >= args.jobs
    plan = plan_starts(queue, FREE, TOTAL)
    print(
        f"{len(queue)} queued jobs on {engine.dialect.name}: {len(plan.starts)} start, blocked {plan.blocked}"
    )
    plan_ms = timed(lambda: plan_starts(queue, FREE, TOTAL), args.passes)
    pass_ms = timed(lambda: plan_starts(read_queue(engine), FREE, TOTAL), args.passes)
    for label, (median, p99) in (("plan alone", plan_ms), ("store read + plan", pass_ms)):
        print(f"{label:<20} median {median:7.3f} ms   p99 {p99:7.3f} ms")
    verdict = "PASS" if pass_ms[0] < FLOOR_MS else "BELOW"
    print(
        f"one scheduling pass (store + plan, median) {pass_ms[0]:.2f} ms   floor < {FLOOR_MS} ms   {verdict}"
    )


if __name__ == "__main__":
    main()
