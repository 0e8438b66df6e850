"""The server's scheduling loop: one `tick()` every half second, in a thread of the server.

A tick, in one transaction:
1. every running job: ingest its run directory (store/ingest.py); a cancel asked for sends SIGTERM once
   (the runner checkpoints and exits); a process that is gone ends the job, by the last event it wrote:
   finished, failed, cancelled, paused (its cost budget spent), or, with no ending event: failed at once
   with the runner's one-line error when it refused its input (exit 2: it would refuse it again), else
   (killed, OOM-killed) queued again to resume from its last checkpoint while `restarts < max_restarts`;
2. deployments (scheduler/deployments.py): replicas started, restarted, checked, stopped;
3. the queue: plan_starts() on the devices no running job or deployment holds; each job to start gets its spec
   written beside its run directory and a runner process with its devices' environment.
The store is the truth the next tick reads, so a tick can fail (the store busy, a launch refused) and
the next one carries on. It is also what a restarted server starts from: a job the store says is running
is re-attached when its pid still runs its run directory, and otherwise ends or is re-queued as above,
so a server killed with SIGKILL loses nothing its jobs wrote. Each change of a job's state is a move of
store/states.py: it happens only while the job is still in the state it leaves (the API writes jobs too).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpuforge.child_env import child_environment
from gpuforge.policy import Policy
from gpuforge.runtime.host import is_alive
from gpuforge.scheduler import deployments
from gpuforge.scheduler.allocator import DeviceInfo, job_environment
from gpuforge.scheduler.executor import BAD_INPUT_EXIT, Launched, launch
from gpuforge.scheduler.queue import HELD, QueuedJob, plan_starts
from gpuforge.scheduler.usage import recent_usage
from gpuforge.scheduler.worker_keys import replicas_key
from gpuforge.settings import as_environment
from gpuforge.store import states
from gpuforge.store.db import session
from gpuforge.store.ingest import bad_input_error, ingest
from gpuforge.store.models import ApiKey, Deployment, Device, Event, Job, JobState
from gpuforge.store.quotas import running_limits

log = logging.getLogger("gpuforge.scheduler")
TICK_S = 0.5


class Scheduler:
    def __init__(
        self,
        engine,
        devices: list[DeviceInfo],
        deployments_dir: Path = Path("deployments"),
        policy_of: Callable[[ApiKey | None], Policy] = lambda key: Policy(user_code=False, roots=()),
        worker_secret: bytes | None = None,
        runner_env: Mapping[str, str] | None = None,
    ):
        self.engine, self.devices, self.deployments_dir = engine, devices, deployments_dir
        self.runner_env = dict(runner_env or {})  # where jobs' processes run (Settings.runner_environment)
        self.policy_of = policy_of  # what a key's jobs and replicas may do (server/settings.job_policy)
        # replicas' keys derive from it (scheduler/worker_keys.py); the server passes its kept one
        self.worker_secret = worker_secret or secrets.token_bytes(32)
        self.launched: dict[int, Launched] = {}  # this server's own children (others: re-attached by pid)
        self.signalled: set[int] = set()
        self.tick_seconds: list[float] = []  # recent tick durations, for /metrics (scheduling latency)
        self._last_tick: float | None = None
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    # --- the thread ---
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuforge-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)

    def wake(self) -> None:
        """Tick now rather than at the next half second (a job was submitted, resumed or cancelled)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # one bad tick must not end scheduling; the next one retries
                log.exception("scheduling tick failed")
            self._wake.wait(TICK_S)
            self._wake.clear()

    # --- one pass ---
    def tick(self) -> None:
        began = time.perf_counter()
        with session(self.engine) as s:
            running = list(s.scalars(select(Job).where(Job.state == JobState.RUNNING)))
            self._count_busy(s, running)
            for job in running:
                self._watch(s, job)
            jobs_hold = {
                d
                for job in running
                if job.state == JobState.RUNNING and job.devices
                for d in job.devices.split(",")
            }
            deployments.keep(s, self.devices, jobs_hold, self.deployments_dir, self.replica_env)
            self._start_queued(s)
        self.tick_seconds = [*self.tick_seconds[-999:], time.perf_counter() - began]

    def _count_busy(self, s: Session, running: list[Job]) -> None:
        """Add the time since the last tick to each device a running job holds (Device.busy_seconds)."""
        now = time.monotonic()
        elapsed, self._last_tick = (now - self._last_tick if self._last_tick else 0.0), now
        held = {
            d for job in running if job.devices for d in job.devices.split(",")
        } | deployments.held_devices(s)
        for device in self.devices:
            row = s.get(Device, device.id)
            if row is None:
                row = Device(id=device.id, kind=device.kind, name=device.name)
                row.memory_bytes = device.memory_bytes
                s.add(row)
            if device.id in held and elapsed:
                row.busy_seconds = (row.busy_seconds or 0.0) + elapsed

    def child_env(self, s: Session, owner_id: int | None, device_ids: list[str]) -> dict[str, str]:
        """The whole environment of a job's runner or a replica: the allow-listed part of the server's
        (child_env.py), its devices, its owner's policy (user code, data roots) and the server's executor."""
        by_id = {d.id: d for d in self.devices}
        owner = s.get(ApiKey, owner_id) if owner_id is not None else None
        policy = self.policy_of(owner)
        own = job_environment([by_id[d] for d in device_ids]) | policy.environment() | self.runner_env
        return child_environment(own)

    def replica_env(self, s: Session, deployment: Deployment, device: DeviceInfo) -> dict[str, str]:
        key = replicas_key(self.worker_secret, deployment)
        return self.child_env(s, deployment.owner_id, [device.id]) | as_environment(api_key=key)

    def _alive(self, job: Job) -> bool:
        own = self.launched.get(job.id)
        if own is not None and own.process is not None:
            return own.process.poll() is None  # reaps our child, keeping its exit code
        return is_alive(job.pid, job.run_dir)  # re-attached after a server restart: check it is ours

    def _watch(self, s: Session, job: Job) -> None:
        alive = self._alive(job)  # asked before reading: an ended process has written all it will
        ingest(s, job)
        # `alive` is False for a pid that no longer runs this job's directory: that pid is not signalled
        if job.cancel_requested and job.id not in self.signalled and job.pid and alive:
            try:
                os.kill(job.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            self.signalled.add(job.id)
        if alive:
            return
        last = s.scalar(  # the runner's last word on its run (a `compressed` event may follow `finished`)
            select(Event)
            .where(Event.job_id == job.id, Event.kind.in_(["started", *states.RUNNER_ENDINGS]))
            .order_by(Event.seq.desc())
            .limit(1)
        )
        own = self.launched.pop(job.id, None)
        exit_code = own.process.returncode if own is not None and own.process is not None else None
        self.signalled.discard(job.id)
        if last is not None and last.kind in states.RUNNER_ENDINGS:
            states.end(s, job.id, last.kind, last.data.get("reason"))
        elif (refused := self._refused_input(job, exit_code)) is not None:
            states.fail(s, job.id, refused)
        elif job.restarts < job.max_restarts:
            why = f"process ended without a word (restart {job.restarts + 1} of {job.max_restarts})"
            states.requeue(s, job.id, why)
        else:
            states.fail(s, job.id, f"process ended without a word {job.restarts + 1} times")
        if job.reason:
            log.info("job %d: %s (%s)", job.id, job.state, job.reason)
        else:
            log.info("job %d: %s", job.id, job.state)

    @staticmethod
    def _refused_input(job: Job, exit_code: int | None) -> str | None:
        """Why the runner refused its input (a spec or data error: exit 2), or None when it did not. Never
        retried: it would refuse it again. A process re-attached after a server restart has no exit code:
        a log that ends on the runner's error line says the same."""
        if exit_code == BAD_INPUT_EXIT:
            return bad_input_error(job.run_dir, job.files) or (
                f"the runner refused its input (exit {BAD_INPUT_EXIT}); see gpuforge logs {job.id}"
            )
        if exit_code is None:
            return bad_input_error(job.run_dir, job.files, last_line_only=True)
        return None

    def _start_queued(self, s: Session) -> None:
        running = s.execute(select(Job.devices, Job.owner_id).where(Job.state == JobState.RUNNING)).all()
        held = {d for devices, _ in running if devices for d in devices.split(",")}
        held |= deployments.held_devices(s)
        free: dict[str, list[str]] = {}
        total: dict[str, int] = {}
        for d in self.devices:
            total[d.kind] = total.get(d.kind, 0) + 1
            if d.id not in held:
                free.setdefault(d.kind, []).append(d.id)
        columns = (Job.id, Job.priority, Job.device_type, Job.devices_wanted, Job.owner_id)
        queued = [QueuedJob(*row) for row in s.execute(select(*columns).where(Job.state == JobState.QUEUED))]
        owners = Counter(owner for _, owner in running)  # owner -> its jobs running: max_running holds
        limits = running_limits(s, {j.owner for j in queued})
        usage = recent_usage(s) if len({j.owner for j in queued}) > 1 else None  # fair share: 2+ keys wait
        plan = plan_starts(queued, free, total, owners, limits, usage)
        for job_id, why in plan.impossible.items():
            states.reject(s, job_id, why)
        for job_id, why in plan.held.items():  # says why it waits (written once, not every tick)
            if s.get(Job, job_id).reason != why:
                states.hold(s, job_id, why)
        for job_id, device_ids in plan.starts:
            # Claim it first, only if it is still queued (a cancel may have landed since the read), and
            # commit: the store says `running` before the process exists, never the other way round. A
            # server that dies between the two finds a running job with no pid: restarted, as if killed.
            claimed = states.claim(s, job_id, device_ids, waiting_reason=HELD)
            s.commit()
            if not claimed:
                continue
            job = s.get(Job, job_id, populate_existing=True)
            run_dir = Path(job.run_dir)
            spec_path = run_dir.with_name(run_dir.name + ".yaml")
            spec_path.parent.mkdir(parents=True, exist_ok=True)
            spec_path.write_text(job.spec_yaml)
            launched = launch(spec_path, run_dir, self.child_env(s, job.owner_id, device_ids))
            self.launched[job.id] = launched
            states.start(s, job.id, launched.pid)
            s.commit()
            log.info("job %d started on %s (pid %d)", job.id, job.devices, launched.pid)
