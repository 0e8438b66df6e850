"""Issue 35: a job's own files are untrusted input. Whatever bytes or JSON values a live job appends to its
events.jsonl and metrics.jsonl (Hypothesis makes them up), every tick completes: the job is charged, the
queue starts the next job, each look reads a bounded number of bytes, and nothing a job wrote is taken
for a figure out of its range."""

import json
import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from gpuforge.executors.local import LocalExecutor
from gpuforge.store.ingest import READ_LIMIT

pytestmark = pytest.mark.slow  # every test here is slow (docs/testing.md)

KEYS = ["ts", "event", "reason", "total_steps", "step", "loss", "mfu", "eta_s", "samples_per_s", "cost_usd"]
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
objects = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), values, max_size=6)
lines = st.one_of(
    st.binary(max_size=200),  # anything at all, newlines included
    values.map(lambda v: json.dumps(v).encode()),  # any JSON value, NaN and Infinity as Python writes them
    objects.map(lambda v: json.dumps(v).encode()),  # objects with the keys the server reads, of any type
    st.integers(min_value=4301, max_value=6000).map(lambda n: b'{"step": ' + b"7" * n + b"}"),
    st.integers(min_value=1000, max_value=3000).map(lambda n: b"[" * n + b"]" * n),
)


@pytest.fixture
def loop(tmp_path, monkeypatch):
    """A scheduler on 3 CPU slots whose launches start nothing (their jobs end at the next tick), and a
    live job on one of them: a real process whose command line names its run directory."""
    from gpuforge.scheduler import loop as loop_module
    from gpuforge.scheduler.allocator import DeviceInfo
    from gpuforge.scheduler.executor import Launched
    from gpuforge.store.db import connect, migrate, session
    from gpuforge.store.models import Job, utcnow

    launched = []

    def fake_launch(spec_path, run_dir, env):
        launched.append(run_dir.name)
        return Launched(pid=4_000_000 + len(launched), process=None)

    executor = LocalExecutor()
    monkeypatch.setattr(executor, "start_runner", fake_launch)
    engine = connect(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(engine)
    run = tmp_path / "live"
    run.mkdir()
    runner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(run)])
    with session(engine) as s:
        s.add(Job(name="live", state="running", pid=runner.pid, run_dir=str(run), spec_yaml="",
                  devices="cpu:0", usd_per_hour=3600.0, run_started_at=utcnow(), max_restarts=0))  # fmt: skip
    slots = [DeviceInfo(f"cpu:{i}", "cpu", "a CPU slot", threads=1) for i in range(3)]
    try:
        yield loop_module.Scheduler(engine, slots, executor), run, launched
    finally:
        runner.kill()
        runner.wait()
        engine.dispose()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=st.lists(lines, max_size=8), metrics=st.lists(lines, max_size=8))
def test_no_line_a_live_job_writes_stops_the_loop(loop, tmp_path, events, metrics):
    from gpuforge.store.db import session
    from gpuforge.store.models import Job, LedgerEntry

    scheduler, run, launched = loop
    with (run / "events.jsonl").open("ab") as f:
        f.write(b"".join(line + b"\n" for line in events))
    with (run / "metrics.jsonl").open("ab") as f:
        f.write(b"".join(line + b"\n" for line in metrics))
    with session(scheduler.engine) as s:
        live = s.scalar(select(Job).where(Job.name == "live"))
        offsets = (live.events_offset, live.metrics_offset)
        charged = s.scalar(select(func.sum(LedgerEntry.usd)).where(LedgerEntry.subject == f"job:{live.id}"))
        waiting = Job(name="next", state="queued", spec_yaml="name: next\n", run_dir="", max_restarts=0)
        s.add(waiting)
        s.flush()
        waiting.run_dir = str(tmp_path / "runs" / f"job-{waiting.id}")
    scheduler.tick()
    with session(scheduler.engine) as s:
        live = s.scalar(select(Job).where(Job.name == "live"))
        assert live.state == "running"  # a live process is never ended by what it writes
        assert (
            live.events_offset - offsets[0] <= READ_LIMIT and live.metrics_offset - offsets[1] <= READ_LIMIT
        )
        assert s.get(Job, waiting.id).state == "running"  # the queue went on: the next job started
        now_charged = s.scalar(
            select(func.sum(LedgerEntry.usd)).where(LedgerEntry.subject == f"job:{live.id}")
        )
        assert now_charged is not None and now_charged > (charged or 0.0)  # and the live job is charged
        assert live.mfu is None or 0 <= live.mfu <= 1
        assert live.eta_s is None or (live.eta_s >= 0 and math.isfinite(live.eta_s))
        assert live.step is None or 0 <= live.step < 2**31
        assert live.loss is None or math.isfinite(live.loss)
    assert launched[-1] == f"job-{waiting.id}"
