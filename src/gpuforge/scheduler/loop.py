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

import functools
import logging
import os
import re
import secrets
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from gpuforge.child_env import child_environment
from gpuforge.policy import Policy
from gpuforge.runs import RunDir
from gpuforge.runtime.host import is_alive
from gpuforge.scheduler import deployments
from gpuforge.scheduler.allocator import DeviceInfo, job_environment
from gpuforge.scheduler.autoscale import Autoscaler
from gpuforge.scheduler.budgets import ProjectBudgets
from gpuforge.scheduler.executor import BAD_INPUT_EXIT, Launched, launch
from gpuforge.scheduler.queue import HELD, Fairness, Limits, QueuedJob, RunningJob, plan_starts
from gpuforge.scheduler.seen_holding import SeenHolding, union
from gpuforge.scheduler.traffic import Traffic
from gpuforge.scheduler.usage import HALF_LIFE_S, recent_usage
from gpuforge.scheduler.worker_keys import replicas_key
from gpuforge.settings import as_environment, env_name
from gpuforge.store import ledger, states
from gpuforge.store.db import session
from gpuforge.store.ingest import bad_input_error, ingest
from gpuforge.store.models import (
    LIVE_DEPLOYMENT_STATES,
    QUEUE_JOB_STATES,
    ApiKey,
    Deployment,
    Device,
    Event,
    Job,
    JobState,
    utcnow,
)
from gpuforge.store.quotas import running_limits
from gpuforge.track import JOB_ID_VARIABLE

log = logging.getLogger("gpuforge.scheduler")
TICK_S = 0.5
USAGE_REFRESH_S = 10.0
TROUBLE_LOG_S = 60.0  # a job whose watch fails every tick is logged this often, not twice a second
DEVICES_REFRESH_S = 60.0  # a cluster's devices (a Slurm partition's nodes) read again this often
PREEMPTED_BY = re.compile(r"preempted by job \d+.*?\(priority -?\d+\)")  # the head of _preempt's reason


def _counted(devices: list[DeviceInfo]) -> str:
    kinds = Counter(d.kind for d in devices)
    return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) or "none"


def _after_preemption(state: JobState, reason: str | None, why: str) -> str:
    """Why a queued job waits; a preempted one keeps saying who preempted it, ahead of that."""
    found = PREEMPTED_BY.match(reason or "") if state == JobState.PREEMPTED else None
    return f"{found.group(0)}; {why}" if found else why


class Scheduler:
    def __init__(
        self,
        engine,
        devices: list[DeviceInfo],
        deployments_dir: Path = Path("deployments"),
        policy_of: Callable[[ApiKey | None], Policy] = lambda key: Policy(user_code=False, roots=()),
        worker_secret: bytes | None = None,
        runner_env: Mapping[str, str] | None = None,
        half_life_s: float = HALF_LIFE_S,
        max_preemptions: int = 3,
        runs_dir: Path | None = None,
        devices_source: Callable[[], list[DeviceInfo]] | None = None,
        holding_source: Callable[[], set[str] | None] | None = None,
        replica_ports: range | None = None,
    ):
        self.engine, self.devices, self.deployments_dir = engine, devices, deployments_dir
        self.runner_env = dict(runner_env or {})  # where jobs' processes run (Settings.runner_environment)
        # a Slurm job may wait in Slurm's queue after its runner starts: its max_time counts from when its
        # runner first sees it run (_holds_devices_since), and it is charged only while it runs (tick)
        self.queued_elsewhere = self.runner_env.get(env_name("executor")) == "slurm"
        self.slurm_runs: dict[int, list[ledger.Span]] = {}  # running job -> its Slurm runs, read this tick
        # and those the server saw itself (squeue), which a job that rewrote its runner's marks cannot hide
        self.seen_holding = SeenHolding(holding_source) if holding_source is not None else None
        self.policy_of = policy_of  # what a key's jobs and replicas may do (server/settings.job_policy)
        # replicas' keys derive from it (scheduler/worker_keys.py); the server passes its kept one
        self.worker_secret = worker_secret or secrets.token_bytes(32)
        self.launched: dict[int, Launched] = {}  # this server's own children (others: re-attached by pid)
        self.told_unreadable: dict[int, float] = {}  # job -> when its unreadable lines were last logged
        self.troubled: dict[int, float] = {}  # job -> when its last failed watch was logged (_job_trouble)
        self.seen_alive: set[int] = set()  # running jobs whose process this server saw alive at its last tick
        self.signalled: set[int] = set()
        self.tick_seconds: list[float] = []  # recent tick durations, for /metrics (scheduling latency)
        self.half_life_s, self.max_preemptions = half_life_s, max_preemptions
        self.queue_positions: dict[int, int] = {}  # queued job id -> its place (1: next), at the last tick
        self.preempted_for: dict[
            int, tuple[int, int]
        ] = {}  # victim -> (the job it made room for, its priority)
        self.budgets = ProjectBudgets()
        self.traffic = Traffic()  # the forwarder's counts: the autoscaler's load
        self.keeper = deployments.Keeper(
            devices, deployments_dir, self.replica_env,
            replica_key=lambda d: replicas_key(self.worker_secret, d),
            adapters_root=runs_dir or deployments_dir.parent / "runs",  # where jobs' models lie
            autoscaler=Autoscaler(self.traffic), ports=replica_ports,
        )  # fmt: skip
        self._usage_read: tuple[float, tuple[dict, dict]] | None = None
        self._last_tick: float | None = None
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        # a cluster's devices, read again in a thread of their own (a slow sinfo must not hold a tick up)
        self.devices_source, self._read_devices = devices_source, None
        self._devices_lock = threading.Lock()  # the read handed from its thread to the tick's

    # --- the thread ---
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpuforge-scheduler", daemon=True)
        self._thread.start()
        if self.devices_source is not None:
            threading.Thread(target=self._reread_devices, name="gpuforge-devices", daemon=True).start()
        if self.seen_holding is not None:
            watch = functools.partial(self.seen_holding.run_forever, self._stop)
            threading.Thread(target=watch, name="gpuforge-slurm-holding", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)

    def wake(self) -> None:
        """Tick now rather than at the next half second (a job was submitted, resumed or cancelled, a
        project changed: its budget is read again)."""
        self.budgets.read_again()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # one bad tick must not end scheduling; the next one retries
                log.exception("scheduling tick failed")
            self._wake.wait(TICK_S)
            self._wake.clear()

    def _reread_devices(self) -> None:
        while not self._stop.wait(DEVICES_REFRESH_S):
            try:
                read = self.devices_source()
                with self._devices_lock:
                    self._read_devices = read
            except Exception as err:  # Slurm unanswered: the devices known stay, the next read retries
                log.warning("devices not read again: %s", err)

    def _take_devices(self) -> None:
        """The devices read last, in place of those known (one list: the keeper and the routes share it)."""
        with self._devices_lock:
            read, self._read_devices = self._read_devices, None
        if read is None or read == self.devices:
            return
        log.info("devices now: %s (were %s)", _counted(read), _counted(self.devices))
        self.devices[:] = read

    # --- one pass ---
    def tick(self) -> None:
        began = time.perf_counter()
        self._take_devices()
        with session(self.engine) as s:
            running = list(s.scalars(select(Job).where(Job.state == JobState.RUNNING)))
            self._count_busy(s, running)
            live = s.scalars(select(Deployment).where(Deployment.state.in_(LIVE_DEPLOYMENT_STATES)))
            now = utcnow()  # what the ledger charges to, and an ending seen this tick is dated
            alive = {j.id: self._alive(j) for j in running}  # asked before reading its files (_watch)
            charged = [j for j in running if self._ran_since_last_look(j, alive[j.id])]
            self.seen_alive = {job_id for job_id, yes in alive.items() if yes}
            if self.queued_elsewhere:
                self.slurm_runs = {j.id: runs for j in running if (runs := self._slurm_runs(j))}
                if self.seen_holding is not None:
                    self.seen_holding.keep_only(_logs_folder(j) for j in running)
                within = {j.id: self.slurm_runs.get(j.id, []) for j in charged}
                ledger.accrue(s, charged, live, now, within=within)
            else:
                ledger.accrue(s, charged, live, now)
            self.budgets.refresh(s)
            watched = {j.id for j in charged}  # the others were found ended at this server's first look
            for job in running:
                try:
                    self._watch(s, job, alive[job.id], now, dated=job.id in watched)
                except Exception:  # one job's trouble stops no other job's tick: the ledger, cancels, starts
                    self._job_trouble(job)
            for said in (self.troubled, self.told_unreadable):  # of running jobs alone: no table grows
                for job_id in said.keys() - alive.keys():
                    del said[job_id]
            jobs_hold = {
                d: f"job {job.id}"
                for job in running
                if job.state == JobState.RUNNING and job.devices
                for d in job.devices.split(",")
            }
            deployments.keep(s, jobs_hold, self.keeper)
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

    def _ran_since_last_look(self, job: Job, alive: bool) -> bool:
        """Whether `job` ran at some moment since this server's last tick, so that its time up to this
        tick is charged: it runs now, or this server saw it run at its last tick or launched it (it ended
        since: charged to the tick that sees it ended, its finished_at, however long that tick was in
        coming). A process found ended at a server's first look may have died at any moment no server
        watched: _unwatched_end dates and charges it."""
        if job.run_started_at is None:
            return False  # claimed, its process not started yet
        return alive or job.id in self.seen_alive or job.id in self.launched

    def _watch(
        self, s: Session, job: Job, alive: bool | None = None, now: datetime | None = None, dated: bool = True
    ) -> None:
        """One running job this tick: `alive` was asked before its files are read (an ended process has
        written all it will; asked here when not given). An ending is dated `now` (default: now), the time
        the ledger charged it to; or, where this server never saw it run (`dated` False: it ended while no
        server watched), by _unwatched_end."""
        alive = self._alive(job) if alive is None else alive
        now = now or utcnow()
        if unreadable := sum(1 for e in ingest(s, job) if e.kind == "unreadable"):
            self._say_unreadable(job, unreadable)
        # `alive` is False for a pid that no longer runs this job's directory: that pid is not signalled
        if alive and (why := self._stop_for(job, self._holds_devices_since(job))) is not None:
            if states.request_stop(s, job.id, *why):
                s.commit()
        if (job.cancel_requested or job.stop_requested) and alive:
            self._signal(job)
        if alive:
            return
        # the runner's last word on its run (a `compressed` event may follow `finished`); the server's
        # `preempted` closes the run before: its `cancelled` must not end a resumed runner that died unheard
        last = s.scalar(
            select(Event)
            .where(Event.job_id == job.id, Event.kind.in_(["started", "preempted", *states.RUNNER_ENDINGS]))
            .order_by(Event.seq.desc())
            .limit(1)
        )
        if not dated:
            now = self._unwatched_end(s, job, now)
        own = self.launched.pop(job.id, None)
        exit_code = own.process.returncode if own is not None and own.process is not None else None
        self.signalled.discard(job.id)
        server_stop = job.stop_requested and not job.cancel_requested
        if server_stop and (last is None or last.kind in ("started", "cancelled", "preempted")):
            self._stopped_by_server(s, job)  # it checkpointed on our SIGTERM (or died on the way)
        elif last is not None and last.kind in states.RUNNER_ENDINGS:
            states.end(s, job.id, last.kind, last.data.get("reason"), at=now)
        elif (refused := self._refused_input(job, exit_code)) is not None:
            states.fail(s, job.id, refused, at=now)
        elif job.restarts < job.max_restarts:
            why = f"process ended without a word (restart {job.restarts + 1} of {job.max_restarts})"
            states.requeue(s, job.id, why)
        else:
            states.fail(s, job.id, f"process ended without a word {job.restarts + 1} times", at=now)
        if job.reason:
            log.info("job %d: %s (%s)", job.id, job.state, job.reason)
        else:
            log.info("job %d: %s", job.id, job.state)

    def _unwatched_end(self, s: Session, job: Job, now: datetime) -> datetime:
        """When a job found ended at this server's first look ended, charged to it: its runner's last event
        (its own clock: a hint, not a measure), held between what was charged already and now. A job
        that wrote a wrong time can move it within the time no server watched, and no further."""
        said = s.scalar(
            select(Event.ts)
            .where(Event.job_id == job.id, Event.kind != "unreadable")  # those are dated by the server
            .order_by(Event.seq.desc())
            .limit(1)
        )
        charged = job.accrued_at or job.run_started_at or now
        ended = now if said is None else min(now, max(charged, _utc(said)))
        within = self.slurm_runs.get(job.id, []) if self.queued_elsewhere else None  # as accrue's
        ledger.charge_job(s, job, ended, within=within)
        return ended

    def _say_unreadable(self, job: Job, count: int) -> None:
        """Log that a job's files held lines it could not read (each an `unreadable` event), once a minute
        a job at most: a job writing garbage fills no log."""
        last = self.told_unreadable.get(job.id)
        if last is not None and time.monotonic() - last < TROUBLE_LOG_S:
            return
        log.warning("job %d: %d unreadable line(s) in its run files skipped (gpuforge job %d: its events)",
                    job.id, count, job.id)  # fmt: skip
        self.told_unreadable[job.id] = time.monotonic()

    def _job_trouble(self, job: Job) -> None:
        """Log a failure to watch `job` (its traceback the first time, then once a minute at most): the
        job keeps its state, and the next tick tries it again."""
        last = self.troubled.get(job.id)
        if last is not None and time.monotonic() - last < TROUBLE_LOG_S:
            return
        log.warning("job %d: not watched this tick", job.id, exc_info=last is None)
        self.troubled[job.id] = time.monotonic()

    def _usage(self, s: Session) -> tuple[dict, dict]:
        """Device-time lately by key and by project (usage.py), read again every USAGE_REFRESH_S: it moves
        by a minute's worth at most meanwhile, and a read covers hours of the ledger."""
        if self._usage_read is None or time.monotonic() - self._usage_read[0] > USAGE_REFRESH_S:
            self._usage_read = (time.monotonic(), recent_usage(s, half_life_s=self.half_life_s))
        return self._usage_read[1]

    def _preempt(self, s: Session, victim_id: int, for_job: Job) -> None:
        """Stop a running job at its next checkpoint for `for_job`; it goes back to the queue once stopped."""
        of = f" of project {for_job.project}" if for_job.project else ""
        reason = f"preempted by job {for_job.id}{of} (priority {for_job.priority + for_job.boost})"
        if states.request_stop(s, victim_id, "preempt", reason):
            s.commit()
            self.preempted_for[victim_id] = (for_job.id, for_job.priority + for_job.boost)
            victim = s.get(Job, victim_id)
            if victim is not None and victim.pid and self._alive(victim):
                self._signal(victim)
            log.info("job %d: %s", victim_id, reason)

    def _signal(self, job: Job) -> None:
        """SIGTERM once to a job's runner: it checkpoints at its next step and exits."""
        if job.id in self.signalled or not job.pid:
            return
        try:
            os.kill(job.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.signalled.add(job.id)

    def _holds_devices_since(self, job: Job | Row) -> datetime | None:
        """When this run began to hold its devices, for its max_time: its runner's start, or (executor
        slurm) when its runner first saw its Slurm job run (read this tick), None before that."""
        if not self.queued_elsewhere or job.run_started_at is None:
            return job.run_started_at
        runs = self.slurm_runs.get(job.id)
        return runs[0][0] if runs else None

    def _slurm_runs(self, job: Job) -> list[ledger.Span]:
        """When this job's Slurm jobs ran this attempt: as its runner wrote (_read_slurm_runs), and as this
        server saw (seen_holding), together."""
        seen = []  # from this attempt's start: an attempt before it, in the same run directory, is not it
        if self.seen_holding is not None:
            seen = self.seen_holding.spans(_logs_folder(job), since=job.run_started_at)
        return union(self._read_slurm_runs(job) or [], seen)

    def _read_slurm_runs(self, job: Job) -> list[ledger.Span] | None:
        """When this job's Slurm jobs ran, as its runner saw them (runs.SlurmRuns), on this machine's clock;
        None before the first run, or for a file another runner wrote (not the job's pid)."""
        ran = RunDir(Path(job.run_dir)).slurm_runs()
        if ran is None or ran.runner_pid != job.pid:
            return None
        now = utcnow()
        try:
            return [(min(_utc(a), now), None if b is None else min(_utc(b), now)) for a, b in ran.runs]
        except (OverflowError, ValueError, OSError):  # a time past what datetime holds: not the runner's
            return None

    def _stop_for(self, job: Job, began: datetime | None) -> tuple[str, str] | None:
        """Why the server stops a running job now, when nobody asked yet: its project's budget is spent,
        or it ran past its resources.max_time since `began` (_holds_devices_since). (Preemption is decided
        by the queue: _start_queued.)"""
        if job.stop_requested or job.cancel_requested or job.pid is None:
            return None
        if (spent := self.budgets.spent.get(job.project_id)) is not None:
            return "pause", f"paused: {spent}"
        if job.max_time_s and began is not None:
            ran = (utcnow() - began).total_seconds()
            if ran > job.max_time_s:
                return "timeout", f"paused: resources.max_time ({job.max_time_s:g} s) run"
        return None

    def _stopped_by_server(self, s: Session, job: Job) -> None:
        """A job the server stopped has ended its process: preempted back into the queue, or paused."""
        if job.stop_requested != "preempt":
            if not states.pause(s, job.id, job.reason or "paused by the server"):
                states.end(s, job.id, "cancelled", None)  # a cancel landed meanwhile: its reason stays
            return
        by, priority = self.preempted_for.pop(job.id, (None, None))
        boost = None
        if job.preemptions + 1 >= self.max_preemptions and priority is not None:
            boost = max(0, priority - job.priority)  # preempted too often: it queues beside its preemptor
        if not states.preempt(s, job.id, job.reason or "preempted", boost):
            states.end(s, job.id, "cancelled", None)  # a cancel landed meanwhile: its reason stays
            return
        RunDir(Path(job.run_dir)).event("preempted", by_job=by, reason=job.reason)
        ingest(s, job)  # into the store now: only a running job's directory is read otherwise

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
        now = utcnow()
        running_columns = (
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
        )
        running_jobs, owners, project_devices = [], Counter(), Counter()
        for row in s.execute(select(*running_columns).where(Job.state == JobState.RUNNING)):
            ids = tuple(row.devices.split(",")) if row.devices else ()
            owners[row.owner_id] += 1  # max_running counts it
            project_devices[row.project_id] += len(ids)
            ends = None  # unknown unless its max_time promises it (an ETA may run long: backfill would delay)
            began = self._holds_devices_since(row)  # from where _stop_for counts it
            if row.max_time_s is not None and began is not None:
                ends = max(0.0, row.max_time_s - (now - began).total_seconds())
            running_jobs.append(
                RunningJob(
                    row.id,
                    row.priority,
                    row.device_type,
                    ids,
                    row.project_id,
                    preemptible=row.preemptible,  # one preempted too often is lifted (boost), not shielded
                    stopping=bool(row.cancel_requested or row.stop_requested),
                    ends_in_s=ends,
                )
            )
        replicas = deployments.replica_holders(s)
        held = {d for r in running_jobs for d in r.device_ids} | set(replicas)
        free: dict[str, list[str]] = {}
        every: dict[str, list[str]] = {}
        for d in self.devices:
            every.setdefault(d.kind, []).append(d.id)
            if d.id not in held:
                free.setdefault(d.kind, []).append(d.id)
        columns = (
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
        )
        queued, said = [], {}
        for row in s.execute(select(*columns).where(Job.state.in_(QUEUE_JOB_STATES))):
            queued.append(QueuedJob(*row[:7], tuple(sorted((row[7] or {}).items()))))
            said[row[0]] = (row[8], row[9])  # its state and the reason it shows now
        groups = {(j.project, None) if j.project is not None else (None, j.owner) for j in queued}
        fairness = None
        if len(groups) > 1:  # fair share matters once two projects (or keys) wait
            fairness = Fairness(*self._usage(s), self.budgets.shares)
        limits = Limits(
            running=owners,
            max_running=running_limits(s, {j.owner for j in queued}),
            project_devices=project_devices,
            max_devices=self.budgets.caps,
            spent=self.budgets.spent,
            names=self.budgets.names,
            replicas=replicas,
        )
        labels = {d.id: d.labels for d in self.devices if d.labels}
        plan = plan_starts(queued, free, every, limits, fairness, running_jobs, labels)
        started = {job_id for job_id, _ in plan.starts}
        self.queue_positions = {
            job_id: place for place, job_id in enumerate((i for i in plan.order if i not in started), 1)
        }
        for job_id, why in plan.impossible.items():
            states.reject(s, job_id, why)
        waits = plan.held | plan.blocked
        for job_id, why in waits.items():  # says why it waits (written when it changes)
            state, reason = said[job_id]
            why = _after_preemption(state, reason, why)
            if reason != why:
                states.hold(s, job_id, why)
        for job_id, (_, reason) in said.items():  # a wait that no longer holds: its place says it
            if reason and reason.startswith(HELD) and job_id not in waits and job_id not in started:
                states.hold(s, job_id, None)
        for victim_id, for_job in plan.preempt.items():
            self._preempt(s, victim_id, s.get(Job, for_job))
        for job_id, device_ids in plan.starts:
            # Claim it first, only if it is still queued (a cancel may have landed since the read), and
            # commit: the store says `running` before the process exists, never the other way round. A
            # server that dies between the two finds a running job with no pid: restarted, as if killed.
            claimed = states.claim(s, job_id, device_ids, waiting_reason=HELD)
            if job_id in plan.backfilled:
                log.info("job %d backfilled: it should end before the blocked job could start", job_id)
            s.commit()
            if not claimed:
                continue
            job = s.get(Job, job_id, populate_existing=True)
            run_dir = Path(job.run_dir)
            spec_path = run_dir.with_name(run_dir.name + ".yaml")
            spec_path.parent.mkdir(parents=True, exist_ok=True)
            spec_path.write_text(job.spec_yaml)
            env = self.child_env(s, job.owner_id, device_ids) | {JOB_ID_VARIABLE: str(job.id)}  # its id
            launched = launch(spec_path, run_dir, env)
            self.launched[job.id] = launched
            states.start(s, job.id, launched.pid)
            s.commit()
            log.info("job %d started on %s (pid %d)", job.id, job.devices, launched.pid)


def _logs_folder(job: Job) -> str:
    return str(RunDir(Path(job.run_dir)).logs_dir)


def _utc(unix_time: float) -> datetime:
    return datetime.fromtimestamp(unix_time, UTC)
